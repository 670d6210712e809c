"""A careless or hostile client of the OpenAI-compatible API (after test_server_hostile*.py):
requests the ``openai`` client lets through that the server answered with a 500, a
dropped connection or a response the client's types contradict. Each is now served in
the shape the client parses, or refused with a 4xx naming the field."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import msgspec
import openai
import pytest

from plait.runtime.server import launch

from http_helpers import wait_idle

MODEL = "tiny"
ASK = [{"role": "user", "content": "yo"}]
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add", "parameters": ADD}}]
SURROGATE = "\\ud800"  # a JSON escape of a lone surrogate: valid JSON, not valid Unicode


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                served_model_name=MODEL, echo_logs=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


# -- usage ----------------------------------------------------------------------------------------
def test_cached_tokens_never_exceed_the_prompt_after_a_forced_tool_call(client):
    """A forced call's opening text (``<tool_call>\\n{"name": "add", ...``) is written as
    output before the request is first admitted; the prefix cache then matched the
    prompt *and* that text, and usage reported 224 cached of a 220-token prompt."""
    usages = []
    for _ in range(2):  # the second finds the first's prompt and forced text in the cache
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=40, temperature=0)
        assert r.choices[0].message.tool_calls, r
        usages.append(r.usage)
    for u in usages:
        assert u.prompt_tokens_details.cached_tokens <= u.prompt_tokens, u
    assert usages[1].prompt_tokens_details.cached_tokens > 0  # the prompt itself was a hit
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                            max_tokens=40, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, n=2)
    last = list(stream)[-1]
    assert last.usage.prompt_tokens_details.cached_tokens <= last.usage.prompt_tokens, last.usage


# -- lone surrogates ------------------------------------------------------------------------------
def _raw(path: str, body: str) -> tuple[str, str]:
    return path, body.replace("@", SURROGATE)


@pytest.mark.parametrize("path,body,param", [
    # each ran into the engine message's UTF-8 encoding: a 500, then a dropped connection
    _raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": '
         '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["a@"]}}}}') + ("response_format",),
    _raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": '
         '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": '
         '{"k@": {"type": "string"}}, "required": ["k@"]}}}}') + ("response_format",),
    _raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "regex": "a@"}')
    + ("regex",),
    _raw("/v1/responses", '{"input": "x", "max_output_tokens": 2, "text": {"format": {"type": "json_schema", '
         '"name": "x", "schema": {"enum": ["a@"]}}}}') + ("text.format",),
    _raw("/generate", '{"text": "x", "sampling_params": {"max_new_tokens": 2, "json_schema": '
         '"{\\"enum\\": [\\"a\\\\ud800\\"]}"}}') + ("json_schema",),
    _raw("/generate", '{"text": "x", "sampling_params": {"max_new_tokens": 2, "ebnf": "root ::= \\"a@\\""}}')
    + ("ebnf",),
    _raw("/generate", '{"text": "x", "sampling_params": {"max_new_tokens": 2, "stop": ["a@"]}}') + ("stop",),
    # refused before, but blamed on the messages (the tools are rendered into the prompt)
    _raw("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "tools": '
         '[{"type": "function", "function": {"name": "f", "description": "d@"}}]}') + ("tools",),
    _raw("/v1/responses", '{"input": "x", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", '
         '"parameters": {"type": "object", "properties": {"k@": {"type": "string"}}}}]}') + ("tools",),
    # the Responses API has no field 'messages'
    _raw("/v1/responses", '{"input": [{"role": "user", "content": "a@"}], "max_output_tokens": 2}') + ("input",),
    _raw("/v1/responses", '{"input": [{"role": "user", "content": "x"}, {"type": "function_call_output", '
         '"call_id": "c", "output": "a@"}], "max_output_tokens": 2}') + ("input",),
])
def test_a_lone_surrogate_anywhere_is_a_400_naming_its_field(http, path, body, param):
    assert SURROGATE in body
    r = http.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "lone surrogate" in err["message"], err
    # the connection still serves (an internal error made the server drop it)
    ok = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    assert wait_idle(http)["live_requests"] == 0


# -- internal errors ------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [{"type": "json_schema"}, ["date"]])
def test_a_schema_a_translator_trips_on_is_a_400_not_a_500(client, http, fmt):
    """``format`` holding an object or array (OpenAI's ``text.format`` pasted into a
    schema) raised TypeError in the regex translator: a 500."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": fmt}}})
    assert e.value.body["param"] == "response_format", e.value.body
    assert wait_idle(http)["live_requests"] == 0


def test_an_answered_internal_error_keeps_the_connection(monkeypatch):
    """Starlette re-raises an exception after its handler has sent the 500; uvicorn then
    closed the keep-alive connection and the client's next request on it was reset."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from plait.runtime.server import http_api
    from plait.runtime.server import openai_api as oa

    def parse(front: Any, body: dict[str, Any]) -> Any:
        raise KeyError("a bug")

    monkeypatch.setattr(oa, "parse_chat", parse)
    app = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key=None)))
    with TestClient(app) as tc:  # raises what the app lets out to the server
        r = tc.post("/v1/chat/completions", json={"messages": ASK})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and "KeyError" in err["message"], err


# -- messages -------------------------------------------------------------------------------------
@pytest.mark.parametrize("part,kind", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "'image_url'"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "'input_audio'"),
    ({"type": "file", "file": {"file_id": "f"}}, "'file'"),
])
def test_a_non_text_part_is_a_400_naming_the_part_and_its_type(client, part, kind):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}])
    assert e.value.body["param"] == "messages"
    assert "messages[0].content[1]" in e.value.body["message"] and kind in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, max_output_tokens=1, input=[
            {"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert e.value.body["param"] == "input" and "'input_image'" in e.value.body["message"], e.value.body


def test_an_assistant_refusal_part_is_replayed_as_its_text(client, http):
    """OpenAI's assistant content may hold ``refusal`` parts; they were a 400."""
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
               {"role": "user", "content": "ok"}]
    r = client.chat.completions.create(model=MODEL, max_tokens=1, messages=history)
    assert r.choices[0].finish_reason == "length"
    as_text = [*history[:1], {"role": "assistant", "content": "I can't help with that."}, history[2]]
    same = client.chat.completions.create(model=MODEL, max_tokens=1, messages=as_text)
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError):  # a user's refusal part is not text
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])


def test_a_legacy_function_call_in_history_is_refused_not_dropped(client):
    """The call was silently dropped from the prompt (content null became ''), so the
    model saw a conversation with an empty assistant turn; ``function_call: null``, as
    ``message.model_dump()`` writes it, stays fine."""
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{\"a\": 1}"}}])
    assert "messages[1].function_call" in e.value.body["message"] and "tool_calls" in e.value.body["message"]
    r = client.chat.completions.create(model=MODEL, max_tokens=40, temperature=0, messages=ASK, tools=TOOLS,
                                       tool_choice="required")
    dumped = r.choices[0].message.model_dump()
    assert "function_call" in dumped and dumped["function_call"] is None
    replay = [*ASK, dumped, {"role": "tool", "tool_call_id": dumped["tool_calls"][0]["id"], "content": "5"}]
    again = client.chat.completions.create(model=MODEL, max_tokens=1, messages=replay, tools=TOOLS)
    assert again.choices[0].message.role == "assistant"


# -- logprobs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_logprob_bytes_are_the_tokens_raw_bytes(client, stream):
    """OpenAI's ``bytes`` exist for tokens that are pieces of a character; they were the
    UTF-8 of the piece's text "\\ufffd", so joining an emoji's bytes gave garbage."""
    text = "😀🎉é!"
    r = client.chat.completions.create(model=MODEL, messages=ASK, logprobs=True, top_logprobs=2, max_tokens=12,
                                       temperature=0, stream=stream, extra_body={"regex": text})
    if stream:
        entries = [t for ch in r if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    else:
        assert r.choices[0].message.content == text
        entries = r.choices[0].logprobs.content
    assert any(t.token == "\ufffd" for t in entries)  # the emoji's tokens are pieces of it
    assert bytes(b for t in entries for b in t.bytes) == text.encode()
    for t in entries:
        for alt in t.top_logprobs:
            assert alt.bytes == list(alt.token.encode()) or alt.token == "\ufffd"


# -- one huge request -----------------------------------------------------------------------------
def test_a_huge_step_reaches_the_front_in_bounded_messages():
    """5000 prompts x n=128, dropped by the client: the engine aborted 636k sequences in
    one step and sent one message the front decoded and dispatched in one go, on its
    event loop (/health took 11 s for everyone). A step's outputs are now sent in
    messages of at most OUTPUTS_PER_MESSAGE items, in order."""
    from types import SimpleNamespace

    from plait import protocol as P
    from plait.runtime.server import engine_proc

    sent: list[bytes] = []
    loop = engine_proc.EngineLoop.__new__(engine_proc.EngineLoop)
    loop.push = SimpleNamespace(send=sent.append)
    k = engine_proc.OUTPUTS_PER_MESSAGE
    chunks = [P.StreamChunk(f"c{i}", 0, "x", [1], {}) for i in range(k + 5)]
    results = [P.GenerateResult(f"r{i}", 0, "", [], {}) for i in range(2 * k + 1)]
    stats = P.EngineStats()
    loop._send_outputs(P.EngineOutputs(chunks=chunks, results=results, stats=stats))
    decoder = msgspec.msgpack.Decoder(P.EngineMessage)
    msgs = [decoder.decode(m) for m in sent]
    assert len(msgs) == 5 and all(len(m.chunks) + len(m.results) + len(m.errors) <= k for m in msgs)
    assert [c.rid for m in msgs for c in m.chunks] == [c.rid for c in chunks]  # chunks first, in order
    assert [r.rid for m in msgs for r in m.results] == [r.rid for r in results]
    assert msgs[0].stats is not None and all(m.stats is None for m in msgs[1:])
    sent.clear()
    loop._send_outputs(P.EngineOutputs(results=results[:3], stats=stats))  # a usual step: one message
    assert len(sent) == 1


def test_the_front_lets_others_run_between_engine_messages():
    """A recv that finds a message waiting does not yield to the event loop, so a burst
    of engine messages was dispatched back to back while every client waited."""
    import asyncio
    from types import SimpleNamespace

    from plait import protocol as P
    from plait.runtime.server.front import Front

    data = P.encode(P.EngineOutputs(results=[P.GenerateResult("r", 0, "", [], {})]))
    seen: list[str] = []

    class Pull:
        def __init__(self) -> None:
            self.left = 5

        async def recv(self) -> bytes:  # already there: returns without yielding
            if not self.left:
                raise asyncio.CancelledError
            self.left -= 1
            return data

    fake = SimpleNamespace(_engine_decoder=msgspec.msgpack.Decoder(P.EngineMessage),
                           on_outputs=lambda out, replica: seen.append("message"))

    async def main() -> None:
        async def bystander() -> None:
            while True:
                seen.append("other")
                await asyncio.sleep(0)

        other = asyncio.ensure_future(bystander())
        await asyncio.sleep(0)
        with pytest.raises(asyncio.CancelledError):
            await Front.engine_reader(fake, SimpleNamespace(rank=0), Pull())
        other.cancel()

    asyncio.run(main())
    first, last = seen.index("message"), len(seen) - 1 - seen[::-1].index("message")
    assert seen.count("message") == 5 and seen[first:last].count("other") >= 4, seen


def test_the_refused_requests_do_not_disturb_a_concurrent_stream(client, http):
    """Each request above, sent many times while another client streams: the stream's
    greedy text is the one it gets alone, and the server ends idle."""
    import threading

    kw = dict(model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=24, temperature=0)
    alone = client.chat.completions.create(**kw).choices[0].message.content
    bad = [
        ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
         '{"name": "x", "schema": {"enum": ["a' + SURROGATE + '"]}}}}'),
        ('{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", "json_schema": '
         '{"name": "x", "schema": {"type": "string", "format": {"type": "x"}}}}}'),
        '{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
    ]
    codes: list[int] = []

    def hostile() -> None:
        with httpx.Client(base_url=http.base_url, timeout=60) as h:
            for _ in range(5):
                for body in bad:
                    codes.append(h.post("/v1/chat/completions", content=body.encode(),
                                        headers={"Content-Type": "application/json"}).status_code)

    threads = [threading.Thread(target=hostile) for _ in range(2)]
    for t in threads:
        t.start()
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(**kw, stream=True)
                       if ch.choices)
    for t in threads:
        t.join()
    assert streamed == alone
    assert codes == [400] * len(codes) and len(codes) == 30, codes
    assert wait_idle(http)["live_requests"] == 0


# -- browsers -------------------------------------------------------------------------------------
def test_cors_is_off_by_default_and_answers_preflights_when_origins_are_allowed():
    """A web page's preflight OPTIONS was a 405 (vLLM and SGLang answer it); with
    --allowed-origins it is answered before the API key check (a preflight carries no
    Authorization) and responses are readable by those origins; by default nothing changes."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from plait.runtime.server import http_api
    from plait.runtime.server.args import ServerArgs

    pre = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    off = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key="k")))
    with TestClient(off) as tc:
        r = tc.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers  # BrowserOriginGuard
    args = ServerArgs(api_key="k", allowed_origins="http://ui.example, https://other.example")
    assert args.origins == ["http://ui.example", "https://other.example"]
    assert ServerArgs(allowed_origins='["*"]').origins == ["*"]  # vLLM's JSON form
    on = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key="k", origins=args.origins)))
    with TestClient(on) as tc:
        r = tc.options("/v1/chat/completions", headers=pre)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example", r.headers
        r = tc.get("/v1/models", headers={"Origin": "http://ui.example"})  # no key: refused, but readable
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = tc.options("/v1/chat/completions", headers={**pre, "Origin": "http://evil.example"})
        assert r.headers.get("access-control-allow-origin") != "http://evil.example"
    for bad in ("ui.example", "", "[1]", "[nope"):
        with pytest.raises(ValueError, match="allowed_origins"):
            ServerArgs(allowed_origins=bad)


def test_a_web_page_of_another_origin_cannot_drive_the_server():
    """CORS hides answers from a foreign page, but a "simple" request (a form post, a
    text/plain fetch, an <img>) still ran: any site the user visited could generate on,
    abort every request of, or flush a keyless local server. Such requests are a 403
    unless --allowed-origins allows the origin; clients outside browsers are untouched."""
    from types import SimpleNamespace

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from plait.runtime.server import http_api

    hit: list[str] = []

    async def flush(request: Any) -> Any:
        hit.append(request.url.path)
        return JSONResponse({"ok": True})

    def app(origins: list[str]) -> Any:
        return http_api.BrowserOriginGuard(Starlette(routes=[Route("/flush_cache", flush, methods=["GET", "POST"])]),
                                           origins)

    with TestClient(app([])) as tc:
        assert tc.post("/flush_cache", content=b"{}", headers={"Origin": "https://evil.example",
                                                                "Content-Type": "text/plain"}).status_code == 403
        assert tc.get("/flush_cache", headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403  # an <img>
        assert tc.post("/flush_cache", headers={"Origin": "null"}).status_code == 403
        assert hit == []
        r = tc.post("/flush_cache")  # curl, python, node: no Origin
        assert r.status_code == 200 and hit == ["/flush_cache"]
        assert tc.get("/flush_cache", headers={"Sec-Fetch-Site": "none"}).status_code == 200  # typed in the bar
    with TestClient(app(["http://ui.example"])) as tc:
        assert tc.post("/flush_cache", headers={"Origin": "http://ui.example"}).status_code == 200
        r = tc.post("/flush_cache", headers={"Origin": "https://evil.example"})
        assert r.status_code == 403 and "--allowed-origins" in r.json()["error"]["message"]
    with TestClient(app(["*"])) as tc:
        assert tc.post("/flush_cache", headers={"Origin": "https://any.example"}).status_code == 200
    # wired in front of every route
    full = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key=None)))
    with TestClient(full) as tc:
        assert tc.post("/flush_cache", headers={"Origin": "https://evil.example"}).status_code == 403
