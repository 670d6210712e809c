"""Careless and hostile clients, fourth round: storms of streams dropped at every stage
(before the answer, mid-stream, during a constraint's compile, with n > 1), a client
that never reads its stream, pathological but valid parameters together, HTTP-level
oddities, admin endpoints under load, a body that stops arriving, and constraints of
requests whose clients left. Each request is served or refused with a 4xx naming the
problem; afterwards the KV pool is whole (``free + evictable + locked == total``,
nothing locked) and the next request's output is what it was before."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from plait.errors import RequestError
from plait.runtime.server import http_api, launch

from http_helpers import wait_idle

GREEDY = {"temperature": 0.0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                echo_logs=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def pool_is_whole(http: httpx.Client) -> dict[str, Any]:
    info = wait_idle(http)
    pool = info["pool"]
    assert info["invariant_ok"], info["invariant_error"]
    assert pool["locked"] == 0 and pool["free"] + pool["evictable"] + pool["locked"] == pool["total"], pool
    return info


def raw_request(server, path: str, body: dict[str, Any]) -> socket.socket:
    host, port = server.url.removeprefix("http://").split(":")
    data = json.dumps(body)
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


# -- many streams, dropped at every stage ----------------------------------------------------------
SCHEMA = {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{3,9}$"} for i in range(12)},
          "required": ["k0"]}


def storm_bodies(i: int) -> list[tuple[str, dict[str, Any]]]:
    long = {"max_tokens": 120, **GREEDY}
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], f"u{i}": {"type": "integer"}}}  # a compile each
    return [
        ("/v1/completions", {"prompt": f"p{i} shared prefix " * 5, "stream": True, **long}),
        ("/v1/completions", {"prompt": [f"a{i}", f"b{i}"], "n": 3, "best_of": 3, "stream": True, "logprobs": 5,
                             "echo": True, **long}),
        ("/v1/chat/completions", {"messages": CHAT, "n": 4, "stream": True, "logprobs": True, "top_logprobs": 20,
                                  **long}),
        ("/v1/chat/completions", {"messages": CHAT, "stream": True, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **long}),
        ("/generate", {"text": f"g{i}", "stream": True, "sampling_params": {
            "max_new_tokens": 120, **GREEDY, "regex": f"(ab|cd{i}){{1,200}}"}}),
        ("/v1/completions", {"prompt": f"not streamed {i}", **long}),
        ("/v1/responses", {"input": f"r{i}", "stream": True, "max_output_tokens": 120}),
        ("/v1/completions", {"prompt": [[5, 6, 7, i % 100 + 3]] * 2, "stream": True, **long}),
    ]


def test_a_storm_of_streams_dropped_at_every_stage_frees_everything(server, http):
    """64 requests at once over every route (n > 1, best_of, echo with logprobs, a
    schema compiled per request, a regex, Responses); clients hang up before the answer
    (mid-prefill or mid-compile), after a few chunks, right after the headers, or read
    to the end. The ones read to the end are whole; then nothing runs, no page is
    locked, and a greedy request gives what it gave before."""
    import aiohttp

    probe = {"prompt": "The storm is over", "max_tokens": 12, **GREEDY}
    before = http.post("/v1/completions", json=probe).json()["choices"][0]["text"]
    problems: list[str] = []
    done = {"whole": 0, "dropped": 0}

    async def one(session: Any, i: int) -> None:
        path, body = storm_bodies(i)[i % 8]
        mode = ("gone", "chunks", "headers", "whole")[(i // 8) % 4]
        if mode == "gone":  # the client leaves before any answer: mid-prefill or mid-compile
            task = asyncio.ensure_future(session.post(server.url + path, json=body))
            await asyncio.sleep(0.05 * (i % 5))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            done["dropped"] += 1
            return
        async with session.post(server.url + path, json=body) as r:
            if r.status != 200:
                problems.append(f"{path} {r.status} {(await r.text())[:200]}")
                return
            if mode == "headers":
                r.close()
            elif mode == "chunks":
                n = 0
                async for _ in r.content:
                    n += 1
                    if n >= 1 + i % 12:
                        break
                r.close()
            else:
                text = await r.text()
                ends = ("[DONE]", "response.completed", "response.incomplete")
                if body.get("stream") and not any(e in text for e in ends):
                    problems.append(f"{path}: the stream did not end: {text[-200:]}")
                if '"error":{' in text:
                    problems.append(f"{path}: an error in the stream: {text[-300:]}")
                done["whole"] += 1
                return
            done["dropped"] += 1

    async def storm() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            await asyncio.gather(*(one(session, i) for i in range(64)))

    asyncio.run(storm())
    assert not problems, problems
    assert done == {"whole": 16, "dropped": 48}
    pool_is_whole(http)
    assert http.post("/v1/completions", json=probe).json()["choices"][0]["text"] == before


# -- a client that never reads ---------------------------------------------------------------------
def test_an_unread_stream_holds_up_no_one(server, http):
    """A client asks for a large stream (n=4, echo, 20 top logprobs) and reads none of
    it, its receive buffer tiny: other clients are served meanwhile, and once it hangs
    up everything is given back."""
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "never read", "n": 4, "logprobs": 20, "echo": True, "stream": True,
                       "max_tokens": 400, "temperature": 1.0, "seed": 1, "ignore_eos": True})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    try:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        for _ in range(400):
            if http.get("/server_info").json()["in_flight"] >= 1:
                break
            time.sleep(0.025)
        for i in range(3):
            r = http.post("/v1/completions", json={"prompt": f"other {i}", "max_tokens": 20, **GREEDY})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
        streamed = []
        with http.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 20, "stream": True,
                                                               **GREEDY}) as r:
            streamed = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert streamed[-1] == "data: [DONE]"
    finally:
        s.close()
    pool_is_whole(http)


# -- pathological but valid parameters -------------------------------------------------------------
def test_every_heavy_parameter_at_once_is_served_and_reproducible(server, http):
    """n=3, echo, 20 top logprobs, 64 stop strings of 256 characters, 1024 logit_bias
    entries, max_tokens to the last position of the context, a seed, and a prompt of
    token ids: served, each choice reaches the context's end, the same seed gives the
    same choices."""
    ctx = http.get("/model_info").json()["context_len"]
    prompt = [(7 * i) % 4000 + 3 for i in range(ctx - 30)]
    stops = [(f"{i:02d}" + "\u00e9" * 254)[:256] for i in range(64)]  # never produced: nothing stops early
    bias = {str(t): (-100.0 if t % 3 else 5.0) for t in range(1000, 2024)}
    body = {"prompt": prompt, "n": 3, "echo": True, "logprobs": 20, "stop": stops, "logit_bias": bias,
            "max_tokens": ctx - len(prompt), "seed": 11, "temperature": 1.0}
    a = http.post("/v1/completions", json=body)
    assert a.status_code == 200, a.text[:300]
    choices = a.json()["choices"]
    assert len(choices) == 3
    for c in choices:
        assert c["finish_reason"] == "length"
        assert len(c["logprobs"]["tokens"]) == ctx  # the prompt echoed, then the output to the context's end
        assert all(len(t) <= 20 for t in c["logprobs"]["top_logprobs"][1:])
    assert a.json()["usage"]["completion_tokens"] == 3 * 30
    b = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in b] == [c["text"] for c in choices]
    over = http.post("/v1/completions", json={**body, "max_tokens": ctx - len(prompt) + 1})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    pool_is_whole(http)


@pytest.mark.parametrize("prompt,says", [
    ([[5, 6], [7, 49152]], "prompt[1] (of 2)"),  # out of the vocabulary
    ([[5, 6], []], "prompt[1] (of 2)"),
    ([[5, -1]], "outside the vocabulary"),
    ([], "prompt is invalid"),
    ([[5], "text"], "prompt is invalid"),
    ([5, 2.0], "prompt is invalid"),
])
def test_token_id_prompts_that_cannot_run_are_400s_naming_the_prompt(http, prompt, says):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "prompt" and says in r.json()["error"]["message"], r.text
    assert wait_idle(http)["live_requests"] == 0


def test_an_echo_of_token_ids_with_no_new_tokens_scores_the_prompt(http):
    """max_tokens=0 with echo (scoring a prompt, as lm-eval does) over a batch of id prompts."""
    r = http.post("/v1/completions", json={"prompt": [[1, 5, 6], [1, 7]], "max_tokens": 0, "echo": True,
                                           "logprobs": 1})
    assert r.status_code == 200, r.text[:300]
    choices = r.json()["choices"]
    assert [len(c["logprobs"]["tokens"]) for c in choices] == [3, 2]
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in choices)


# -- HTTP-level oddities ---------------------------------------------------------------------------
BODY = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()


@pytest.mark.parametrize("headers", [
    {}, {"Content-Type": "text/plain"}, {"Content-Type": "application/json; charset=utf-8"},
    {"Content-Type": "application/json; charset=UTF-8"}, {"Content-Type": "application/x-www-form-urlencoded"},
], ids=["none", "text/plain", "charset", "charset-upper", "form"])
def test_a_json_body_is_read_whatever_its_content_type_says(http, headers):
    """As vLLM and SGLang read it: the body is JSON on these routes (the browser-origin
    guard, not the Content-Type, keeps web pages out)."""
    r = http.post("/v1/completions", content=BODY, headers=headers)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("raw,status,param", [
    (b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 3}', 200, None),  # the last key wins, as in Python
    (b'{"prompt": "hi", "max_tokens": -0}', 200, None),  # -0 is the integer 0
    (b'{"prompt": "hi", "max_tokens": 2.0}', 400, "max_tokens"),  # OpenAI: "expected an integer"
    (b'{"prompt": "hi", "max_tokens": 1e400}', 400, "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 2, "n": NaN}', 400, "n"),
    (b'{"prompt": "hi", "max_tokens": 2, "temperature": -0.0}', 200, None),
    (b'{"prompt": "hi", "max_tokens": 2, "seed": 1e30}', 400, "seed"),
    (b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": -1e400}}', 400, "logit_bias"),
    (b'{"prompt": "hi", "max_tokens": 2, "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
    (b'{"prompt": "hi", "max_tokens": 2, "user": ' + b'{"a":' * 900 + b"1" + b"}" * 900 + b"}", 400, "user"),
    (json.dumps({"prompt": "hi", "max_tokens": 2}).encode("utf-16"), 400, None),
    (b"", 400, None),
    (b"[]", 400, None),
])
def test_odd_json_is_served_or_a_400_naming_the_field(http, raw, status, param):
    r = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text[:300]
    if status == 200:
        assert r.json()["usage"]["completion_tokens"] == (3 if b'"max_tokens": 3' in raw else
                                                          0 if b"-0}" in raw else 2)
    else:
        assert r.json()["error"]["param"] == param, r.text[:300]


def test_methods_paths_and_query_strings(http):
    assert http.head("/health").status_code == 200
    assert http.head("/v1/models").status_code == 200
    r = http.options("/v1/completions")  # no --allowed-origins: no CORS, and a 405 in OpenAI's shape
    assert r.status_code == 405 and "OPTIONS" in r.json()["error"]["message"]
    assert http.get("/v1/completions").status_code == 405
    assert http.post("/v1/completions?foo=bar", content=BODY).status_code == 200  # a query string is ignored
    r = http.post("/v1/completions/", content=BODY)  # a trailing slash: redirected keeping the method
    assert r.status_code == 307 and r.headers["location"].endswith("/v1/completions")
    assert http.post("/v1/completions/", content=BODY, follow_redirects=True).status_code == 200
    r = http.get("/v1/models/%ff%fe")  # not UTF-8: a 404 naming it, not a 500
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert http.get("/health", headers={f"X-H{i}": "v" for i in range(1000)}).status_code == 200


def test_a_body_sent_with_expect_100_continue_and_pipelined_requests(server):
    host, port = server.url.removeprefix("http://").split(":")
    one = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY)
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(one.replace(b"Host: x\r\n", b"Host: x\r\nExpect: 100-continue\r\n") + one)
        got = b""
        while got.count(b'"object":"text_completion"') < 2:
            chunk = s.recv(65536)
            assert chunk, got
            got += chunk
    assert got.startswith(b"HTTP/1.1 100 Continue") and got.count(b"HTTP/1.1 200 OK") == 2


# -- admin endpoints under load --------------------------------------------------------------------
def test_admin_endpoints_under_load_never_disturb_generation(server, http):
    """Flushes, health checks (one generating), metrics, loads and model listings sent
    while 12 requests sharing prefixes run: each is answered (a whole-cache flush is
    refused by name while requests use the cache, as SGLang refuses it), and the
    requests' greedy outputs are those of a quiet server."""
    prompts = [f"shared prefix of many words number {i % 3} " * 6 for i in range(12)]
    want = [http.post("/v1/completions", json={"prompt": p, "max_tokens": 30, **GREEDY}).json()["choices"][0]["text"]
            for p in prompts[:3]]
    answers: list[tuple[str, int, str]] = []

    def admin() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            for k in range(12):
                path = ("/flush_cache", "/health", "/metrics", "/v1/models", "/server_info", "/health_generate",
                        "/v1/loads", "/flush_cache?cache_salt=other")[k % 8]
                r = c.post(path) if path.startswith("/flush") else c.get(path)
                answers.append((path, r.status_code, r.text[:200]))

    threads = [threading.Thread(target=admin) for _ in range(2)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server.url, timeout=120) as c:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            outs = list(pool.map(lambda p: c.post("/v1/completions", json={"prompt": p, "max_tokens": 30, **GREEDY}),
                                 prompts))
    for t in threads:
        t.join()
    assert [o.json()["choices"][0]["text"] for o in outs] == [want[i % 3] for i in range(12)]
    for path, status, text in answers:
        assert status == 200 or (path == "/flush_cache" and status == 400 and "running" in text), (path, status, text)
    pool_is_whole(http)
    assert http.post("/flush_cache").status_code == 200  # idle: flushed
    assert http.get("/server_info").json()["pool"]["evictable"] == 0


# -- a body that stops arriving --------------------------------------------------------------------
class StalledRequest:
    """What read_json reads: a body whose first part arrives and the rest never does."""

    headers: dict[str, str] = {}

    async def stream(self) -> Any:
        yield b'{"prompt": "' + b"x" * 1000
        await asyncio.Event().wait()  # the client stalls for ever
        yield b'"}'  # pragma: no cover


def test_a_body_that_stops_arriving_is_a_408_and_gives_its_budget_back(monkeypatch):
    """A client stalling mid-body held its bytes of the body budget for ever (uvicorn
    has no body timeout): a few such clients left every later request a 503."""
    monkeypatch.setattr(http_api, "BODY_IDLE_TIMEOUT_S", 0.2)

    async def main() -> None:
        budget = http_api.BodyBudget(10_000)
        with pytest.raises(RequestError) as e:
            await http_api.read_json(StalledRequest(), budget)  # type: ignore[arg-type]
        assert e.value.status == 408 and "stopped arriving" in e.value.message and "1012 bytes" in e.value.message
        assert budget.used == 0

    asyncio.run(main())


def test_the_408_reaches_the_client(monkeypatch):
    monkeypatch.setattr(http_api, "BODY_IDLE_TIMEOUT_S", 0.2)
    app = http_api.build_app(SimpleNamespace(args=SimpleNamespace(api_key=None)))
    parts = [{"type": "http.request", "body": b'{"prompt": "', "more_body": True}]
    sent: list[dict] = []

    async def receive() -> dict:
        if parts:
            return parts.pop(0)
        await asyncio.Event().wait()  # the rest never comes
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "scheme": "http", "query_string": b"", "headers": [(b"content-length", b"100")],
             "client": ("t", 1), "server": ("s", 80), "http_version": "1.1", "asgi": {"version": "3.0"}}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 408
    assert "stopped arriving" in json.loads(sent[1]["body"])["error"]["message"]


# -- constraints of requests whose clients left ---------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from plait.runtime.engine import Engine

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, num_threads=1) as e:
        yield e


def test_aborted_requests_constraints_are_not_compiled(engine):
    """The compile queue (outlines: one build at a time) kept every build of requests
    whose clients had left: a client that sent slow constraints and hung up made later
    clients' constraints wait behind them (30 s each at the default limit). A queued
    build nobody waits for is dropped; one another request shares is kept."""
    from plait.runtime.constrained.backend import OUTLINES

    def add(rid: str, regex: str) -> Any:
        sp = {"max_new_tokens": 8, "temperature": 0.0, "regex": regex, "grammar_backend": OUTLINES}
        return engine.add_request([5, 6, 7], sp, rid=rid)[0]

    first = add("head", "[0-9]{3}")  # the first outlines build starts the worker: the rest queue behind it
    gone = [add("gone-a", "[a-c]{4}"), add("gone-b", "[d-f]{4}"), add("shared-1", "(xy){2}")]
    kept = add("shared-2", "(xy){2}")
    compiler = engine.grammar_compiler.compiler(OUTLINES)
    assert [f.source for f in compiler._queue][:3] == [r.grammar.future.source for r in gone]
    for r in gone:
        engine.abort(r.rid)
    while any(not r.finished for r in (first, *gone, kept)):
        engine.step()
    sources = {f.source for f in compiler._cache.values()}
    assert gone[0].grammar.future.source not in sources and gone[1].grammar.future.source not in sources
    assert gone[2].grammar.future.source in sources  # its twin still waited for it
    assert re.fullmatch("[0-9]{3}", engine.pop_result(first)["text"])
    assert engine.pop_result(kept)["text"] == "xyxy"
    for r in gone:
        assert engine.pop_result(r)["meta_info"]["finish_reason"]["type"] == "abort"
    again = engine.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8, "temperature": 0.0,
                                                                  "regex": "[a-c]{4}", "grammar_backend": OUTLINES})
    assert re.fullmatch("[a-c]{4}", again["text"])  # asked again: compiled again
    engine.check_invariants()


def test_llguidance_time_limit_counts_from_the_build_start(monkeypatch):
    """The limit counted from the moment a build was queued: with both pool threads
    busy, a quick build waiting its turn failed as 'took longer than the limit'."""
    from plait.runtime.constrained import llguidance_backend as lb

    monkeypatch.setattr(lb.LLGuidanceCompiler, "_build", lambda self, grammar: (time.sleep(0.8), grammar)[1])
    c = lb.LLGuidanceCompiler(SimpleNamespace(fingerprint="f"), timeout_s=2.0, threads=1)
    try:
        futs = [c.request(f"g{i}") for i in range(4)]  # one after another: the last starts after 2.4 s
        while c.busy:
            c.wait(0.1)
        assert [f.error for f in futs] == [None] * 4 and [f.grammar for f in futs] == ["g0", "g1", "g2", "g3"]
        slow = c.request("slow")
        queued = c.request("queued")
        slow.waiters = queued.waiters = 1
        c.abandon(queued)  # not started: dropped
        assert queued.error and ("f", "queued") not in c._cache
        while c.busy:
            c.wait(0.1)
        assert slow.grammar == "slow"
    finally:
        c.close()
