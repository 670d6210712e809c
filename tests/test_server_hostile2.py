"""More careless and hostile clients (after test_server_hostile.py): transport quirks
(chunked, compressed and BOM-prefixed bodies), batches that are large or repeat a rid,
a rid reused while its request runs, responses too large to build on the event loop,
fields the OpenAI routes accepted unchecked, what OpenAI and vLLM clients send that was
refused (models.retrieve, continue_final_message), streamed echo with logprobs, and
streams dropped with n > 1. Each is served, or refused with a 4xx naming the problem,
and never slows or harms other clients."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.server import launch

from http_helpers import wait_idle

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                echo_logs=False, served_model_name=["tiny", "tiny-alias"]) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def _on_loop() -> bool:
    """Whether the caller runs on an event loop's thread (else in a worker)."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:  # no loop in this thread: a worker
        return False


# -- transport ------------------------------------------------------------------------------------
def test_a_chunked_body_is_parsed_off_the_loop_like_a_sized_one(monkeypatch):
    """A large OpenAI body is rendered and tokenized in a worker thread. That was decided
    from Content-Length alone, so the same body sent chunked (no Content-Length) was
    parsed on the event loop (1M short messages stalled every stream for 2 s)."""
    from starlette.testclient import TestClient

    from plait.runtime.server import http_api
    from plait.runtime.server import openai_api as oa

    on_loop: list[bool] = []

    def parse(front: Any, body: dict[str, Any]) -> Any:
        on_loop.append(_on_loop())
        raise RequestError("parsed", None)

    monkeypatch.setattr(oa, "parse_chat", parse)
    app = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key=None)))  # parse is all the route reaches
    body = json.dumps({"messages": [{"role": "user", "content": "x"}] * 2000}).encode()
    assert len(body) > http_api.COSTLY_TEXT_CHARS
    with TestClient(app) as client:
        sized = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        chunked = client.post("/v1/chat/completions", content=iter([body[:1000], body[1000:]]),
                              headers={"Content-Type": "application/json"})
        small = client.post("/v1/chat/completions", json={"messages": CHAT})
    assert "content-length" not in chunked.request.headers  # really sent chunked
    assert [r.json()["error"]["message"] for r in (sized, chunked, small)] == ["parsed"] * 3
    assert on_loop == [False, False, True]  # a small body stays on the loop (a thread hop costs more)


def test_a_compressed_body_is_a_415_naming_the_encoding(http):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    r = http.post("/v1/completions", content=gzip.compress(body),
                  headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415, r.text  # it was a 400 'not valid UTF-8 (byte 1)'
    assert "Content-Encoding 'gzip'" in r.json()["error"]["message"] and "identity" in r.json()["error"]["message"]
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json",
                                                            "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_leading_byte_order_mark_is_ignored(http):
    """RFC 8259 lets a parser ignore a BOM; Windows tools (PowerShell's UTF8) write one."""
    body = b"\xef\xbb\xbf" + json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 2}}).encode()
    r = http.post("/generate", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text


# -- batches --------------------------------------------------------------------------------------
def test_a_rid_repeated_within_a_batch_is_refused_by_name(http):
    """It was submitted once, then refused as 'already in use' by its own twin."""
    r = http.post("/generate", json={"text": ["a", "b", "c"], "rid": ["x1", "x2", "x1"],
                                     "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    assert "more than one prompt" in r.json()["error"]["message"], r.text
    assert wait_idle(http)["live_requests"] == 0


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"prompt": "b", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}),
    ("/generate", {"text": "b", "sampling_params": {"max_new_tokens": 2, "json_schema": {"type": "object"}}}),
])
def test_a_rid_in_use_is_refused_and_its_owner_runs_on(server, http, path, body):
    """A second client reusing a running request's rid (any route; a constraint makes
    the second one prepared in a worker thread) gets a 400; the first stream is not
    aborted or mixed with the other's output."""
    rid = f"shared-{path.count('/')}-{len(body)}"
    want = http.post("/generate", json={"text": "a", "sampling_params": {**GREEDY, "max_new_tokens": 300}}).json()
    with httpx.stream("POST", server.url + "/generate", timeout=60, json={
            "text": "a", "rid": rid, "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 300}}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        other = http.post(path, json={**body, "rid": rid})
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert other.status_code == 400 and other.json()["error"]["param"] == "rid", other.text
    assert "already in use" in other.json()["error"]["message"]
    assert events[-1]["output_ids"] == want["output_ids"] and events[-1]["meta_info"]["id"] == rid
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_a_large_batch_lets_the_loop_run_between_its_requests():
    """Submitting the prompts of one request never awaited anything, so a batch of 20000
    short prompts held the front's loop for seconds (no other client was served)."""
    from plait.runtime.server.http_api import SUBMIT_BATCH, Submission

    seen: list[str] = []

    class Front:
        async def submit(self, req: P.GenerateRequest, sink: Any, prompt_param: str | None = None) -> Any:
            seen.append("submit")
            return SimpleNamespace(rid=req.rid, n=1, done=set())

    async def bystander() -> None:
        while True:
            seen.append("other")
            await asyncio.sleep(0)

    async def main() -> None:
        other = asyncio.ensure_future(bystander())
        await asyncio.sleep(0)
        await Submission(Front()).submit([P.GenerateRequest(f"r{i}", input_ids=[1]) for i in range(4 * SUBMIT_BATCH)])
        other.cancel()

    asyncio.run(main())
    first, last = seen.index("submit"), len(seen) - 1 - seen[::-1].index("submit")
    assert seen.count("submit") == 4 * SUBMIT_BATCH
    assert seen[first:last].count("other") >= 3  # between the slices


def test_submit_and_abort_do_not_scan_every_live_request(tiny_model_factory):
    """The engine checked a new rid and found an aborted rid's sequences by scanning all
    live requests: quadratic in a batch (20000 prompts: 20 s of submits in the engine,
    a bystander's stream stalled as long). Both now look up the rid's own sequences."""
    from plait.runtime.engine import Engine
    from plait.runtime.validation import validate_generate

    with Engine(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096) as engine:
        def inp(rid: str, n: int = 1) -> Any:
            return validate_generate(rid, [1, 2], {"max_new_tokens": 1, "n": n, **GREEDY}, engine.limits)

        for i in range(50):
            engine.submit(inp(f"r{i}", 1 + i % 3))

        class NoScan(dict):
            def __iter__(self):
                raise AssertionError("scanned every live request")

            def values(self):
                raise AssertionError("scanned every live request")

        engine._reqs = NoScan(engine._reqs)
        engine.submit(inp("late", 2))
        with pytest.raises(RequestError, match="already in use"):
            engine.submit(inp("r4"))
        assert engine.abort("r5") and engine.abort("late") and not engine.abort("nope")
        assert engine.live_rids() == {f"r{i}" for i in range(50)} | {"late"}
        engine._reqs = dict(engine._reqs)
        results: dict[str, list[Any]] = {}
        while engine.has_work():
            for o in engine.step():
                if o.finished:
                    results.setdefault(o.group, []).append(o.finish_reason.type)
        assert results["r5"] == ["abort"] * 3 and results["late"] == ["abort"] * 2
        assert all(len(results[f"r{i}"]) == 1 + i % 3 for i in range(50))
        assert engine.live_rids() == set() and engine._groups == {}
        engine.submit(inp("r5"))  # finished rids are free again


def test_a_large_response_is_built_off_the_loop(monkeypatch):
    """A non-streamed response is built (logprob rows formatted, JSON encoded) in a
    worker thread when it is large: n=32 choices of 500 tokens with 20 top logprobs (a
    28 MB chat response) held the front's loop for 2.7 s; n=128 of 1000 tokens would
    hold it for 20 s."""
    from starlette.testclient import TestClient

    from plait.runtime.server import http_api
    from plait.runtime.server import openai_api as oa
    from plait.runtime.server.front import ReqState

    class Front:  # what the routes reach: submit answers at once with a result of `tokens` tokens
        args = SimpleNamespace(api_key=None)
        tokens = 0

        async def submit(self, req: P.GenerateRequest, sink: Any, owner: Any = None,
                         prompt_param: str | None = None) -> ReqState:
            sink(P.GenerateResult(req.rid, 0, "x", [1] * self.tokens, {"completion_tokens": self.tokens}))
            return ReqState(req.rid, 1, False, sink, None, 1)

        def abort(self, rid: str) -> bool:
            return False

    built: list[bool] = []
    native_out = http_api._native_out
    monkeypatch.setattr(http_api, "_native_out", lambda r: (built.append(_on_loop()), native_out(r))[1])
    monkeypatch.setattr(oa, "parse_completion", lambda front, body: oa.Job(
        False, "cmpl-1", "m", 0, [P.GenerateRequest("c1", input_ids=[1])], 1, False))
    monkeypatch.setattr(oa, "response", lambda front, job, results: (built.append(_on_loop()), {"id": job.id})[1])
    front = Front()
    with TestClient(http_api.build_app(front)) as client:
        for tokens in (http_api.LARGE_RESPONSE_ENTRIES + 1, 10):
            front.tokens = tokens
            r = client.post("/generate", json={"input_ids": [1, 2], "rid": f"g{tokens}"})
            assert r.status_code == 200 and len(r.json()["output_ids"]) == tokens, r.text[:200]
            r = client.post("/v1/completions", json={})
            assert r.status_code == 200 and r.json() == {"id": "cmpl-1"}, r.text[:200]
    assert built == [False, False, True, True]  # large: in a worker; small: on the loop


# -- fields ---------------------------------------------------------------------------------------
BAD = [  # (route, body, the param the 400 names)
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": {"type": "object"}, "whitespace_pattern": 5}},
     "whitespace_pattern"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": {"type": "object"}, "whitespace_pattern": "\\s*"}},
     "whitespace_pattern"),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"messages": CHAT, "modalities": "text"}, "modalities"),
    ("/v1/chat/completions", {"messages": CHAT, "reasoning_effort": 5}, "reasoning_effort"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "max_tokens": "ten"}, "max_tokens"),
    # accepted and ignored, but not whatever their type (the Responses API echoed metadata: "x" back)
    ("/v1/completions", {"prompt": "hi", "user": 5}, "user"),
    ("/v1/chat/completions", {"messages": CHAT, "metadata": "x"}, "metadata"),
    ("/v1/chat/completions", {"messages": CHAT, "store": "yes"}, "store"),
    ("/v1/responses", {"input": "hi", "metadata": "x"}, "metadata"),
    ("/v1/responses", {"input": "hi", "include": "x"}, "include"),
    ("/v1/responses", {"input": "hi", "reasoning": "high"}, "reasoning"),
    ("/v1/responses", {"input": "hi", "max_tool_calls": "x"}, "max_tool_calls"),
    ("/v1/responses", {"input": "hi", "truncation": "middle"}, "truncation"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=lambda v: str(v)[:40])
def test_fields_once_unchecked_are_400s_naming_them(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert err["message"].count(param) <= 2, err  # one message, not one per grammar backend


def test_accepted_forms_of_those_fields(http):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "modalities": ["text"], "reasoning_effort": "low",
                                                "max_completion_tokens": 3, "max_tokens": 1, **GREEDY})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3  # max_completion_tokens wins (as in vLLM)
    r = http.post("/generate", json={"text": "hi", "sampling_params": {
        "json_schema": {"type": "object"}, "whitespace_pattern": "[ ]?", "max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "include": [], "truncation": "auto",
                                         "reasoning": {"effort": "low"}, "metadata": {"k": "v"}, "user": "u",
                                         "store": False, "max_tool_calls": 1})
    assert r.status_code == 200 and r.json()["metadata"] == {"k": "v"}, r.text


def test_the_openai_client_retrieves_the_model(server, http):
    """client.models.retrieve() (LangChain and others call it to check a model) was a
    404 'Not Found' for the route itself."""
    import openai

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    # vLLM's --served-model-name tiny tiny-alias: both listed, either taken, the first reported
    assert [m.id for m in oai.models.list().data] == ["tiny", "tiny-alias"]
    name = "tiny"
    for asked in (name, "default"):
        got = oai.models.retrieve(asked)
        assert got.id == name and got.object == "model"
    assert oai.models.retrieve("tiny-alias").id == "tiny-alias"
    assert oai.completions.create(model="tiny-alias", prompt="hi", max_tokens=2).model == "tiny"
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("org/other-model")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


@pytest.mark.parametrize("field,value", [("suffix", " end.")])
def test_unsupported_features_name_the_value_and_what_is_allowed(http, field, value):
    r = http.post("/v1/completions", json={"prompt": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    message = r.json()["error"]["message"]
    assert repr(value) in message and "allowed: null" in message, message


def test_logit_bias_over_http_as_the_openai_client_sends_it(server, http):
    # it was a 400 ("not supported"); OpenAI's shape: token ids as decimal text
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    out = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, temperature=0,
                                         logit_bias={"1234": 100})
    assert out.choices[0].message.content == client.completions.create(
        model="tiny", prompt=[1234, 1234, 1234], max_tokens=0, echo=True).choices[0].text
    r = http.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"50256": -100}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
    assert "outside the vocabulary" in r.json()["error"]["message"]


PREFILL = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]


@pytest.mark.parametrize("turn", [{"continue_final_message": True}, {"add_generation_prompt": False},
                                  {"continue_final_message": True, "add_generation_prompt": False}, {}])
def test_chat_turn_options_render_the_prompt_as_asked(http, tiny_model_factory, turn):
    """vLLM's add_generation_prompt and continue_final_message (an assistant prefill the
    model continues) were refused as unrecognized; without them a chat ending in an
    assistant message still gets a new assistant turn (vLLM's and SGLang's default)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_factory("llama"))
    kwargs = {"add_generation_prompt": True, **turn} if "continue_final_message" not in turn else turn
    text = tok.apply_chat_template(PREFILL, tokenize=False, **kwargs)
    assert text.endswith("My answer is") == bool(turn.get("continue_final_message"))
    chat = http.post("/v1/chat/completions", json={"messages": PREFILL, "max_tokens": 6, **GREEDY, **turn})
    assert chat.status_code == 200, chat.text
    plain = http.post("/v1/completions", json={"prompt": text, "max_tokens": 6, **GREEDY}).json()
    assert chat.json()["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert chat.json()["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


def test_continue_final_message_with_a_generation_prompt_is_a_400(http):
    r = http.post("/v1/chat/completions", json={"messages": PREFILL, "continue_final_message": True,
                                                "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


@pytest.mark.parametrize("n", [1, 2])
def test_a_streamed_echo_with_logprobs_is_the_non_streamed_one(http, n):
    """Streamed with echo and logprobs, the echoed prompt came without its logprobs
    (the non-streamed choice has them) and the output's text_offset started at 0, as if
    the prompt were not part of the choice's text."""
    body = {"prompt": "The sky is", "echo": True, "logprobs": 2, "max_tokens": 4, "n": n, **GREEDY}
    whole = http.post("/v1/completions", json=body).json()["choices"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:])["choices"][0] for line in r.iter_lines() if line.startswith("data: {")]
    for i, choice in enumerate(whole):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["text"] == "The sky is" and "".join(c["text"] for c in mine) == choice["text"]
        streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in mine:
            for key in streamed:
                streamed[key] += c["logprobs"][key] if c["logprobs"] else []
        want = choice["logprobs"]
        assert streamed["tokens"] == want["tokens"] and streamed["text_offset"] == want["text_offset"], streamed
        assert [list(t or {}) for t in streamed["top_logprobs"]] == [list(t or {}) for t in want["top_logprobs"]]
        assert streamed["token_logprobs"][0] is None and want["token_logprobs"][0] is None
        assert streamed["token_logprobs"][1:] == pytest.approx(want["token_logprobs"][1:], abs=1e-4)
        assert want["text_offset"][len(want["text_offset"]) - 4] == len("The sky is")


# -- dropped streams ------------------------------------------------------------------------------
def test_dropped_n_streams_free_everything_and_others_are_served(server, http):
    """Clients hang up on n > 1 streams (after a few chunks, or before any) on every
    route: all sequences are aborted, memory returns, and the next request is served."""
    long = {"max_tokens": 600, **GREEDY}
    for path, body in [("/v1/chat/completions", {"messages": CHAT, "n": 3, "stream": True, **long}),
                       ("/v1/completions", {"prompt": ["a", "b"], "n": 2, "stream": True, **long}),
                       ("/generate", {"text": ["a", "b"], "stream": True,
                                      "sampling_params": {"n": 2, "max_new_tokens": 600, **GREEDY}})]:
        with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
    host, port = server.url.removeprefix("http://").split(":")
    for i in range(16):
        raw = json.dumps({"prompt": f"p{i}", "n": 2, "stream": True, **long})
        with socket.create_connection((host, int(port))) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(raw)}\r\n\r\n{raw}".encode())
            if i % 2:
                s.recv(64)
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3, **GREEDY})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    info = wait_idle(http)
    assert info["invariant_ok"] and info["pool"]["locked"] == 0, info
