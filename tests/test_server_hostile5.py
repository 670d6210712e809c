"""Careless and hostile clients, fifth round (after test_server_hostile4.py). What the
probe found, each now fixed:

- Usage's reasoning tokens: with a reasoning parser on, the Responses API reported
  ``output_tokens_details.reasoning_tokens`` 0 whatever the model thought, and chat
  completions had no ``completion_tokens_details``. Both now count the output tokens up
  to the one that completes ``</think>`` (all of them when the section never closed;
  none when there is none), streamed or not.
- A streamed request the engine refused at admission (a constraint that cannot
  compile) was a 200 stream ending in an error event whenever something went out before
  the engine answered: a completion's ``echo``, the Responses API's
  ``response.created``/``response.in_progress``. It is now a 400 naming the field, as
  other streams are. A Responses stream that fails later ends with OpenAI's ``error``
  event (``type``, ``code``, ``message``, ``param``, ``sequence_number``) carrying the
  ``error`` object too, which the openai client raises.
- The response store was bounded in count only: 256 responses, each of which may hold
  up to a 64 MiB body the prompt never shows (a reasoning item's ``encrypted_content``,
  a schema's annotations), could hold ~16 GiB (8 such requests of 30 MB grew the front
  by 330 MB). It is now bounded in bytes too, a continuation counting the response it
  continues (whose input items it keeps).
- The store was read by requests parsed in worker threads (large bodies, schemas) while
  the loop wrote it: an entry evicted between a lookup and its ``move_to_end`` was a
  ``KeyError``, a 500. Its methods now hold a lock.
- A large non-streamed Responses response (logprobs) was built and encoded on the event
  loop (900 tokens with 20 top logprobs held every other client ~0.4 s; a 32K-token
  output, seconds), as were a stream's final events (each repeats every token's
  logprobs: 8 MB for that output) and a stored one retrieved with ``GET``, and the
  stream's last text formatted the whole output's logprobs again. Now off the loop when
  large, as chat's.
- ``POST /v1/responses/{id}/cancel`` (the openai client's ``responses.cancel``) was a
  bare "Not Found"; it is a 404 naming ``response_id`` for an id not held, and a 400
  saying that only background responses can be cancelled (this server runs none).
- Messages that misnamed what the client sent: a ``function_call_output``'s ``output``
  part was called ``content[k]``; an unknown field named ``""`` read "unrecognized
  request argument(s): " (names that are no identifiers are quoted now); an integer
  literal of 5000 digits told the client to call ``sys.set_int_max_str_digits()``.

Found and not fixed here (outside the server): on CPU, seeds that differ by a multiple
of 2**32 sample the same tokens (torch's CPU generator keeps 32 bits of the seed).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from plait import protocol as P
from plait.errors import RequestError
from plait.reasoning import get_reasoning_parser
from plait.runtime.server import launch
from plait.runtime.server import openai_api as oa
from plait.runtime.server import responses_api as ra

from http_helpers import wait_idle

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
END = b"</think>"
FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL, echo_logs=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def thinking(tiny_model_factory):
    """The same model served with ``--reasoning-parser deepseek-r1`` (the output starts
    inside the reasoning section)."""
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL, reasoning_parser="deepseek-r1", echo_logs=False) as rt:
        yield openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


# -- reasoning tokens -------------------------------------------------------------------------------
def _section_tokens(token_bytes: list[bytes]) -> int:
    """The tokens up to the one whose bytes complete ``</think>`` (all: never closed)."""
    for k in range(1, len(token_bytes) + 1):
        if END in b"".join(token_bytes[:k]):
            return k
    return len(token_bytes)


def test_reasoning_tokens_count_the_tokens_of_the_section():
    pieces = {1: b"<th", 2: b"ink>ab", 3: b"\xc3", 4: b"\xa9</", 5: b"think>", 6: b"\n\n{", 7: b"}"}
    qwen3 = oa.ChatOutput(get_reasoning_parser("qwen3"), token_bytes=pieces.__getitem__)
    assert qwen3.reasoning_tokens([1, 2, 3, 4, 5, 6, 7]) == 5  # the section ends inside token 5
    assert qwen3.reasoning_tokens([6, 7]) == 0  # no section: qwen3's output may have none
    assert qwen3.reasoning_tokens([1, 2, 3]) == 3  # never closed: all of it
    forced = oa.ChatOutput(get_reasoning_parser("deepseek-r1"), token_bytes=pieces.__getitem__)
    assert forced.reasoning_tokens([3, 4, 5, 6, 7]) == 3  # starts inside the section
    assert forced.reasoning_tokens([6, 7]) == 2
    assert oa.ChatOutput(None, token_bytes=pieces.__getitem__).reasoning_tokens([1, 2, 5]) == 0  # no parser


def test_usage_counts_reasoning_tokens_on_both_apis(thinking):
    # a bounded section, then JSON (the constraint closes the section); logprobs on every
    # call, so that each writes the same tokens (no jump-forward)
    extra = {"max_reasoning_chars": 16}
    lps = ["message.output_text.logprobs"]
    fmt = {"type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}
    r = thinking.chat.completions.create(model=MODEL, messages=HI, response_format=fmt,
                                         max_completion_tokens=60, temperature=0, logprobs=True, extra_body=extra)
    expected = _section_tokens([bytes(t.bytes) for t in r.choices[0].logprobs.content])
    assert r.choices[0].finish_reason == "stop" and json.loads(r.choices[0].message.content) in ({"ok": True},
                                                                                                {"ok": False}), r
    assert r.choices[0].message.reasoning_content and 0 < expected < r.usage.completion_tokens, r
    assert r.usage.completion_tokens_details.reasoning_tokens == expected
    stream = thinking.chat.completions.create(model=MODEL, messages=HI, response_format=fmt,
                                              max_completion_tokens=60, temperature=0, n=2, stream=True, logprobs=True,
                                              stream_options={"include_usage": True}, extra_body=extra)
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens_details.reasoning_tokens == 2 * expected, usage
    text = {"format": {"type": "json_schema", "name": "flag", "schema": FLAG}}
    got = thinking.responses.create(model=MODEL, input="hi", text=text, max_output_tokens=60, temperature=0,
                                    include=lps, extra_body=extra)
    assert got.status == "completed" and [item.type for item in got.output] == ["reasoning", "message"]
    assert got.usage.output_tokens_details.reasoning_tokens == expected
    events = list(thinking.responses.create(model=MODEL, input="hi", text=text, max_output_tokens=60, temperature=0,
                                            include=lps, stream=True, extra_body=extra))
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == expected
    assert thinking.responses.retrieve(got.id).usage.output_tokens_details.reasoning_tokens == expected
    # a section the length limit cut: every token is reasoning
    r = thinking.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=5, temperature=0,
                                         logprobs=True)
    assert _section_tokens([bytes(t.bytes) for t in r.choices[0].logprobs.content]) == 5
    assert r.usage.completion_tokens_details.reasoning_tokens == 5 and r.choices[0].message.content == ""


def test_no_reasoning_parser_reports_no_reasoning_tokens(oai):
    r = oai.chat.completions.create(model=MODEL, messages=HI, max_completion_tokens=3)
    assert r.usage.completion_tokens_details is None
    got = oai.responses.create(model=MODEL, input="hi", max_output_tokens=3)
    assert got.usage.output_tokens_details.reasoning_tokens == 0


# -- streams the engine refuses ---------------------------------------------------------------------
UNCOMPILABLE = "a{1000000}"  # admitted, then refused when its grammar is built


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "echo": True, "regex": UNCOMPILABLE}, "regex"),
    ("/v1/completions", {"prompt": ["hi", "ho"], "n": 2, "echo": True, "logprobs": 1, "regex": UNCOMPILABLE,
                         "stream_options": {"include_usage": True}}, "regex"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "string", "pattern": f"^{UNCOMPILABLE}$"}}}}, "text.format"),
])
def test_a_stream_the_engine_refuses_is_a_400_even_when_it_writes_first(http, path, body, param):
    # it was a 200 stream: the echo (response.created) went out, then an error event
    key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    r = http.post(path, json={**body, key: 8, "stream": True})
    assert r.status_code == 400, (r.status_code, r.text[:400])
    err = r.json()["error"]
    assert err["param"] == param and "cannot be followed" in err["message"], err
    wait_idle(http)
    # the same requests that compile still stream their echo / their first events
    ok = {**body, key: 3, "stream": True}
    ok.pop("regex", None)
    ok.pop("text", None)
    r = http.post(path, json=ok)
    assert r.status_code == 200 and (b"[DONE]" in r.content or b"response.incomplete" in r.content), r.text[:300]
    if path == "/v1/completions":
        first = json.loads(r.text.split("\n\n")[0].removeprefix("data: "))
        assert first["choices"][0]["text"] in ("hi", "ho")


def _job(stream: bool, constraint_field: str | None = None) -> oa.Job:
    return oa.Job(True, "resp_x", MODEL, 0, [], 1, stream, output=oa.ChatOutput(), constraint_field=constraint_field)


def test_a_responses_stream_that_fails_later_ends_with_openais_error_event():
    from openai.types.responses import ResponseErrorEvent

    async def events():
        yield P.StreamChunk(rid="x", text="Hello")
        raise RequestError("json_schema cannot be followed after 3 output tokens", "json_schema")

    async def run() -> list[dict[str, Any]]:
        rj = ra.ResponseJob(_job(True, "text.format"), [], {}, False, [], None)
        return [e async for e in ra.stream(ra.ResponseStore(), rj, events())]

    out = asyncio.run(run())
    assert [e["type"] for e in out[:3]] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    last = out[-1]
    assert last["type"] == "error" and last["param"] == "text.format" and "after 3 output tokens" in last["message"]
    ResponseErrorEvent.model_validate(last)  # OpenAI's shape ...
    assert last["error"]["message"] == last["message"]  # ... and the object the openai client raises

    async def refused():  # refused before anything was written: raised, for the route's 400
        raise RequestError("regex cannot be followed after 0 output tokens", "regex")
        yield

    async def run_refused() -> None:
        rj = ra.ResponseJob(_job(True), [], {}, False, [], None)
        async for _ in ra.stream(ra.ResponseStore(), rj, refused()):
            pass

    with pytest.raises(RequestError, match="after 0 output tokens"):
        asyncio.run(run_refused())


# -- the response store ------------------------------------------------------------------------------
def test_the_response_store_is_bounded_in_bytes():
    store = ra.ResponseStore(capacity=8, max_bytes=100)
    for rid in ("a", "b", "c"):
        store.put(rid, [], {"id": rid}, [], 40)
    assert store.get("a") is None and store.get("b") is not None and store.held_bytes == 80
    store.put("huge", [], {"id": "huge"}, [], 101)  # alone past the budget: not held, the others stay
    assert store.get("huge") is None and store.get("b") is not None and store.get("c") is not None
    assert store.held_bytes == 80 and len(store) == 2
    store.put("b", [], {"id": "b"}, [], 10)  # stored again: counted once
    assert store.held_bytes == 50 and store.size("b") == 10
    assert store.delete("c") and store.held_bytes == 10 and store.size("c") == 0
    assert "stored responses" in ra.not_held(store, "c").message and "MiB" in ra.not_held(store, "c").message


def test_the_response_store_is_safe_to_read_from_worker_threads():
    store = ra.ResponseStore(capacity=4, max_bytes=1000)
    errors: list[str] = []
    stop = threading.Event()

    def reader() -> None:  # what a request parsed off the loop does (previous_response_id)
        while not stop.is_set():
            try:
                for rid in "abcdef":
                    store.get(rid)
                    store.context_items(rid)
                    store.size(rid)
            except Exception as e:  # noqa: BLE001
                errors.append(repr(e))
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(30_000):
            store.put("abcdef"[i % 6], [], None, [], 1)
            if i % 3 == 0:
                store.delete("abcdef"[(i + 1) % 6])
            if errors:
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert errors == []
    assert store.held_bytes == len(store) <= 4


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_a_large_responses_reply_is_built_off_the_loop_and_stored_on_it(monkeypatch):
    """As chat's (test_server_hostile2.py): built and encoded in a worker when it carries
    many token entries, then stored on the loop (the store's one writer); retrieved
    later, encoded in a worker too; a stream's events that repeat the whole output too."""
    from starlette.testclient import TestClient

    from plait.runtime.server import http_api
    from plait.runtime.server.front import ReqState

    class Front:  # what the route reaches: submit answers at once with a result of `tokens` tokens
        args = SimpleNamespace(api_key=None)
        tokens = 0

        async def submit(self, req: P.GenerateRequest, sink: Any, owner: Any = None,
                         prompt_param: str | None = None) -> ReqState:
            sink(P.GenerateResult(req.rid, 0, "x", [1] * self.tokens, {
                "completion_tokens": self.tokens, "output_token_logprobs": [[-0.5, 1]] * self.tokens}))
            return ReqState(req.rid, 1, False, sink, None, 1)

        def abort(self, rid: str) -> bool:
            return False

        def token_bytes(self, tid: int) -> bytes:
            return b"x"

        def token_text(self, tid: int) -> str:
            return "x"

    front = Front()
    sizes: list[int] = []
    where: list[tuple[str, bool]] = []

    def parse(front_: Any, store: ra.ResponseStore, body: dict[str, Any], size: int = 0) -> ra.ResponseJob:
        sizes.append(size)
        job = _job(bool(body.get("stream")))
        job.id, job.reqs = f"resp_{len(sizes)}", [P.GenerateRequest(f"r{len(sizes)}", input_ids=[1])]
        job.logprobs = 0
        return ra.ResponseJob(job, [], body, True, [], oa.LogprobFormatter(front), size)

    build, keep, sse, encoder = ra.build_response, ra.keep, http_api.sse, http_api._json
    monkeypatch.setattr(ra, "parse_response_request", parse)
    monkeypatch.setattr(ra, "build_response", lambda *a: (where.append(("build", _on_loop())), build(*a))[1])
    monkeypatch.setattr(ra, "keep", lambda *a: (where.append(("keep", _on_loop())), keep(*a))[1])

    def spy_sse(obj: Any) -> bytes:
        if isinstance(obj, dict) and obj.get("type") in ra.WHOLE_OUTPUT_EVENTS:
            where.append((obj["type"], _on_loop()))
        return sse(obj)

    monkeypatch.setattr(http_api, "sse", spy_sse)

    def spy_encode(obj: Any) -> bytes:
        if isinstance(obj, dict) and obj.get("object") == "response":
            where.append(("encode", _on_loop()))
        return encoder.encode(obj)

    monkeypatch.setattr(http_api, "_json", SimpleNamespace(encode=spy_encode))
    body = json.dumps({"input": "hi", "pad": "p" * 1000}).encode()
    with TestClient(http_api.build_app(front)) as client:
        ids = []
        for tokens in (http_api.LARGE_RESPONSE_ENTRIES + 1, 10):
            front.tokens = tokens
            r = client.post("/v1/responses", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 200 and r.json()["status"] == "completed", r.text[:300]
            assert len(r.json()["output"][0]["content"][0]["logprobs"]) == tokens
            ids.append(r.json()["id"])
        assert where == [("build", False), ("keep", True), ("encode", False),
                         ("build", True), ("keep", True), ("encode", True)]
        assert sizes == [len(body), len(body)]  # the body's size reaches the store's count
        where.clear()
        for rid in ids:  # retrieving a stored one: encoded off the loop when large too
            assert client.get(f"/v1/responses/{rid}").json()["id"] == rid
        assert where == [("encode", False), ("encode", True)], where
        where.clear()
        r = client.post("/v1/responses", json={"input": "hi", "stream": True})
        assert r.status_code == 200 and "response.completed" in r.text
    # the events that repeat the whole output (and its logprobs) are encoded in a worker
    assert where and all(not on for kind, on in where if kind != "keep"), where
    assert ("keep", True) in where


# -- routes and messages -----------------------------------------------------------------------------
def test_cancelling_a_response_says_why_it_cannot_be(oai, http):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.cancel("resp_nope")
    assert e.value.body["param"] == "response_id" and "resp_nope" in e.value.body["message"]
    done = oai.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.cancel(done.id)
    assert e.value.body["param"] == "response_id" and "background" in e.value.body["message"]
    assert oai.responses.retrieve(done.id).id == done.id  # untouched
    assert http.get(f"/v1/responses/{done.id}/cancel").status_code == 405


def test_error_messages_name_what_was_sent(http):
    call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
    image = {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "x"}]}
    r = http.post("/v1/responses", json={"input": [call, image], "max_output_tokens": 2})
    assert r.status_code == 400 and "input[1].output[0] is a 'input_image' part" in r.json()["error"]["message"], r.text
    r = http.post("/v1/responses", json={"input": [{**image, "output": 5}], "max_output_tokens": 2})
    assert r.status_code == 400 and "output (a string or an array" in r.json()["error"]["message"], r.text
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "": 1, "max tokens": 2})
    err = r.json()["error"]
    assert r.status_code == 400 and err["message"] == "unrecognized request argument(s): '', 'max tokens'", err
    r = http.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}",
                  headers={"Content-Type": "application/json"})
    msg = r.json()["error"]["message"]
    assert r.status_code == 400 and "more than 4300 digits" in msg and "sys." not in msg, msg
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
