"""Careless and hostile clients, third round (a new user's probe of 2026-12-04): values
the Responses API echoes back that JSON cannot carry, constraints that fail after
admission, a Responses request aborted while it runs, a client that hangs up while
sending its body. Each is served, or refused with a 4xx naming the problem; none is a
500 or a 200 that reads as a success."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest

from test_server_hostile import http, server  # noqa: F401  (the same server, one per module)

CHAT = [{"role": "user", "content": "hi"}]


# JSON reads 1e400 as inf; a raw body can hold a lone surrogate escape and NaN
ECHOED = [
    ('{"input": "hi", "max_output_tokens": 2, "metadata": {"a": 1e400}}', "metadata"),
    ('{"input": "hi", "max_output_tokens": 2, "metadata": {"a": 1}}', "metadata"),
    ('{"input": "hi", "max_output_tokens": 2, "metadata": {"a": "\\ud800"}}', "metadata"),
    ('{"input": "hi", "max_output_tokens": 2, "metadata": {"\\ud800": "x"}}', "metadata"),
    ('{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_schema", "name": "x", '
     '"schema": {"type": "object"}, "strict": NaN}}}', "text.format"),
    ('{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_schema", "name": "\\ud800", '
     '"schema": {"type": "object"}}}}', "text.format"),
    ('{"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", "strict": 1e400, '
     '"parameters": {"type": "object"}}]}', "tools"),
]


@pytest.mark.parametrize("raw,param", ECHOED, ids=[p + str(i) for i, (_, p) in enumerate(ECHOED)])
@pytest.mark.parametrize("stream", [False, True])
def test_echoed_values_json_cannot_carry_are_400s_naming_the_field(http, raw, param, stream):
    # they were 500s after the whole generation (and, streamed, a stored response whose
    # GET was a 500 ever after)
    body = raw[:-1] + ', "stream": true}' if stream else raw
    r = http.post("/v1/responses", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == param, r.text
    ok = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "metadata": {"user": "u1"}})
    assert ok.status_code == 200 and ok.json()["metadata"] == {"user": "u1"}
    assert http.get(f"/v1/responses/{ok.json()['id']}").status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": CHAT, "regex": "a{1000000}"}, "regex"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "^a{1000000}$"}}}}, "response_format"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "string", "pattern": "^a{1000000}$"}}}}, "text.format"),
])
def test_a_constraint_that_fails_after_admission_is_a_400_not_an_empty_success(http, path, body, param):
    # it was a 200 with empty content and finish_reason "abort" (Responses: "completed",
    # no output), and nothing in the log
    key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    r = http.post(path, json={**body, key: 8})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and "cannot be followed" in err["message"] and "llguidance" in err["message"], err
    assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).status_code == 200


def test_an_aborted_response_is_cancelled_not_completed(server, http):
    # it was "completed" (stored so, and continued by previous_response_id as a whole turn)
    import json

    events = []
    with httpx.Client(base_url=server.url, timeout=120) as c, \
            c.stream("POST", "/v1/responses", json={"input": "count", "max_output_tokens": 960, "temperature": 0,
                                                    "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(json.loads(line[6:]))
            if events[-1]["type"] == "response.output_text.delta" and len(events) == 5:
                assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    last = events[-1]
    assert last["type"] == "response.incomplete" and last["response"]["status"] == "cancelled", last
    assert last["response"]["usage"]["output_tokens"] < 960
    assert http.get(f"/v1/responses/{last['response']['id']}").json()["status"] == "cancelled"


def test_a_client_gone_while_sending_its_body_is_not_an_internal_error(caplog):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from plait.runtime.server.http_api import EXCEPTION_HANDLERS

    async def route(request: Request) -> Response:
        await request.body()
        return Response("unreachable")

    app = Starlette(routes=[Route("/x", route, methods=["POST"])], exception_handlers=EXCEPTION_HANDLERS)
    sent: list[dict] = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/x", "raw_path": b"/x", "root_path": "", "scheme": "http",
             "query_string": b"", "headers": [(b"content-length", b"100")], "client": ("t", 1), "server": ("s", 80),
             "http_version": "1.1", "asgi": {"version": "3.0"}}
    with caplog.at_level(logging.INFO):
        asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 499
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert "client disconnected" in caplog.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ["x"] * 2049}, "prompt"),
    ("/v1/completions", {"prompt": [[1]] * 2049}, "prompt"),
    ("/generate", {"text": ["x"] * 2049}, "text"),
    ("/generate", {"input_ids": [[1]] * 2049}, "input_ids"),
])
def test_a_batch_past_the_prompt_limit_is_a_400_before_any_work(http, path, body, param):
    # 20,000 one-token prompts in one body were accepted and held a later client's chat
    # for 54 s (requests are admitted in order)
    key = "sampling_params" if path == "/generate" else None
    extra = {key: {"max_new_tokens": 1}} if key else {"max_tokens": 1}
    r = http.post(path, json={**body, **extra})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and "2049 prompts" in err["message"] and "2048" in err["message"], err
    if body != {"prompt": ["x"] * 2049}:
        return
    ok = {k: v[:2048] for k, v in body.items()}  # the limit itself is served
    r = http.post(path, json={**ok, **extra})
    assert r.status_code == 200, r.text[:300]
    assert len(r.json() if path == "/generate" else r.json()["choices"]) == 2048


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": ["x"] * 2048, "n": 128, "max_tokens": 1}, "n"),
    ("/v1/completions", {"prompt": ["x"] * 17, "n": 121, "max_tokens": 1}, "n"),
    ("/generate", {"text": ["x"] * 2048, "sampling_params": {"n": 2, "max_new_tokens": 1}}, "sampling_params.n"),
    ("/generate", {"text": ["x"] * 20, "sampling_params": [{"n": 128, "max_new_tokens": 1}] * 16
                   + [{"n": 1, "max_new_tokens": 1}] * 4}, "sampling_params.n"),
])
def test_prompts_times_n_past_the_limit_is_a_400_before_any_work(http, path, body, param):
    """n multiplied the 2048-prompt limit: 2048 prompts with n=128 queued 262,144
    sequences ahead of every later client (~30 min on this CPU)."""
    r = http.post(path, json=body)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and "sequences" in err["message"] and "2048" in err["message"], err
    if body.get("n") != 128:
        return
    # the limit itself is served; an n past n's own limit keeps its own error
    r = http.post("/v1/completions", json={"prompt": ["x"] * 16, "n": 128, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2048
    r = http.post("/v1/completions", json={"prompt": ["x"] * 16, "n": 129, "max_tokens": 1})
    assert r.status_code == 400 and "128" in r.json()["error"]["message"]


def test_chat_template_kwargs_reach_the_template(tokenizer_dir):
    # vLLM's and SGLang's extra ({"enable_thinking": false} for Qwen3) was an
    # "unrecognized request argument"
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from plait.errors import RequestError
    from plait.runtime.server.openai_api import chat_turn, render_chat

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}[no think]{% endif %}"
                         "{% if add_generation_prompt %}>{% endif %}")
    front = SimpleNamespace(tokenizer=tok)
    render = lambda body: render_chat(front, CHAT, None, "hermes", chat_turn(body))  # noqa: E731
    assert render({}) == "hi>"
    assert render({"chat_template_kwargs": {"enable_thinking": False}}) == "hi[no think]>"
    assert render({"chat_template_kwargs": {"enable_thinking": True}}) == "hi>"
    for bad in ({"add_generation_prompt": False}, {"tokenize": True}, {"not a name": 1}, {"x": float("nan")}, []):
        with pytest.raises(RequestError) as e:
            chat_turn({"chat_template_kwargs": bad})
        assert e.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("extra,status,param", [
    ({"audio": None, "prediction": None, "web_search_options": None, "verbosity": "low"}, 200, None),
    ({"audio": {"voice": "alloy", "format": "wav"}}, 400, "audio"),
    ({"prediction": {"type": "content", "content": "x"}}, 400, "prediction"),
    ({"verbosity": "loud"}, 400, "verbosity"),
    ({"seed": -7}, 200, None),
])
def test_openai_chat_fields_at_their_null_are_accepted(http, extra, status, param):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **extra})
    assert r.status_code == status, r.text[:300]
    if param:
        assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "no_stop_trim"])
def test_the_stop_string_can_stay_in_the_output(http, field):
    # vLLM's include_stop_str_in_output and SGLang's no_stop_trim were unrecognized
    body = {"prompt": "The weather today is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = http.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
    kept = http.post("/v1/completions", json={**body, "stop": stop, field: True}).json()["choices"][0]
    assert cut["text"] == text[: text.index(stop)] and kept["text"] == text[: text.index(stop) + len(stop)]
    assert kept["finish_reason"] == "stop"


def test_error_messages_name_what_the_client_sent(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "min_tokens": 5})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "min_tokens", err
    assert "max_tokens (2)" in err["message"] and "new_tokens" not in err["message"], err
    msgs = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": 7, "content": "x"}]
    err = http.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()["error"]
    assert "tool_call_id=7 is invalid" in err["message"], err


@pytest.mark.parametrize("body,param", [
    ({"service_tier": "bogus"}, "service_tier"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes", "parameters": {"type": "object"}}}]},
     "tools[0].function.strict"),
])
def test_values_openai_refuses_are_refused_by_name(http, body, param):
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = {"service_tier": "auto"} if "service_tier" in body else {"tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object"}}}]}
    assert http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, **ok}).status_code == 200


@pytest.mark.parametrize("path,raw", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "\\ud800": 1}'),
    ("/v1/completions", '{"prompt": "a", "max_tokens": 2, "\\ud800": 1}'),
    ("/v1/responses", '{"input": "x", "max_output_tokens": 2, "\\ud800": 1}'),
    ("/generate", '{"text": "x", "\\ud800": 1}'),
    ("/flush_cache", '{"\\ud800": 1}'),
])
def test_an_unknown_field_named_with_a_lone_surrogate_is_a_400(http, path, raw):
    # the error named the field as sent, which UTF-8 cannot encode: a 500 from the error path
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == "\\ud800" and "\\ud800" in r.json()["error"]["message"], r.text


def test_a_stream_stops_writing_soon_after_its_client_is_gone():
    """Events already queued were written in one run of the loop: the client's
    disconnect was seen after all of them, and asyncio logged each write to the dead
    socket past the fifth (505 warnings for one large stream's disconnect)."""
    from types import SimpleNamespace

    from starlette.requests import Request
    from starlette.responses import StreamingResponse

    from plait.runtime.server.http_api import _first_then

    gone = asyncio.Event()
    writes = []

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            writes.append(message)
            if len(writes) == 10:  # the socket dies here; the server learns it on its next loop turn
                asyncio.get_running_loop().call_soon(gone.set)

    async def queued():  # every event already there: no await that yields to the loop
        for i in range(1000):
            yield b"data: %d\n\n" % i

    aborted = []
    scope = {"type": "http", "method": "POST", "path": "/generate", "headers": [], "query_string": b""}
    sub = SimpleNamespace(abort=lambda: aborted.append(True))

    async def run():
        stream = await _first_then(Request(scope, receive), sub, queued())
        await StreamingResponse(stream, media_type="text/event-stream")(scope, receive, send)

    asyncio.run(run())
    assert 10 <= len(writes) <= 13 and aborted, len(writes)
