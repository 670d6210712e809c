"""Requests from careless or hostile clients against a real server: each is served or
gets a 4xx naming the problem, and none of them stops another client's stream."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from plait.runtime.server import launch

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=8192, max_running_requests=16,
                echo_logs=False) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def recursive_refs(levels: int) -> dict[str, Any]:
    """A small schema whose $refs, each used twice per level, expand to 2**levels copies."""
    defs: dict[str, Any] = {"d0": {"type": "integer"}}
    for i in range(1, levels + 1):
        prev = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": prev, "b": prev}, "required": ["a", "b"]}
    return {"$defs": defs, "$ref": f"#/$defs/d{levels}"}


def nested(depth: int) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        s = {"type": "array", "items": s}
    return s


CLIENT_ERRORS = [  # raw body or JSON, the param the 4xx names (None: the body)
    (b'{"text": "hi", "sampling_params": {"max_new_tokens": ' + b"9" * 5000 + b"}}", None),
    (b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": "x"}}, "response_format"),
    ({"text": "hi", "sampling_params": {"json_schema": nested(600)}}, "json_schema"),
    ({"messages": [{"role": "user", "content": "hi"}],  # the field the client sent
      "response_format": {"type": "json_schema", "json_schema": {"schema": nested(600)}}}, "response_format"),
    # a regex translation expands every $ref: 2**19 copies is over the limit (llguidance,
    # a grammar, does not expand them: test_ref_expansion_is_no_problem_for_a_grammar)
    ({"text": "hi", "sampling_params": {"json_schema": recursive_refs(19), "grammar_backend": "outlines"}},
     "json_schema"),
    ({"text": "hi", "sampling_params": {"min_new_tokens": 2, "stop_token_ids": [1000000]}}, "stop_token_ids"),
    ({"text": "x" * 20_000_000, "sampling_params": {"max_new_tokens": 1}}, "text"),
    # a chat asks for at least one token, as OpenAI and vLLM (it was answered 200 with nothing)
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
]


@pytest.mark.parametrize("body,param", CLIENT_ERRORS, ids=lambda v: str(v)[:30])
def test_client_errors_are_4xx_naming_the_field(http, body, param):
    path = ("/v1/chat/completions" if isinstance(body, dict) and "messages" in body
            else "/v1/responses" if isinstance(body, dict) and "input" in body else "/generate")
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == param, r.text[:300]
    assert http.get("/health").status_code == 200


def test_ref_expansion_is_no_problem_for_a_grammar(http):
    import json

    import jsonschema

    schema = recursive_refs(19)
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": schema, "max_new_tokens": 24,
                                                                       "temperature": 0.0}})
    assert r.status_code == 200, r.text[:300]
    text = r.json()["text"]
    try:
        jsonschema.validate(json.loads(text), schema)
    except json.JSONDecodeError:  # cut by max_new_tokens: a prefix of a valid instance
        assert r.json()["meta_info"]["finish_reason"]["type"] == "length" and text.startswith('{"a":')


def test_many_optional_properties_never_a_500(http):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1200)}}
    r = http.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": schema, "max_new_tokens": 4}})
    assert r.status_code in (200, 400), r.text[:300]
    if r.status_code == 400:
        assert r.json()["error"]["param"] == "json_schema"


@pytest.mark.parametrize("sp", [
    {"temperature": 1e-300}, {"temperature": 1.0, "repetition_penalty": 1e-300},
])
def test_numerically_extreme_sampling_is_served(http, sp):
    r = http.post("/generate", json={"text": "hello", "sampling_params": {**sp, "max_new_tokens": 4, "seed": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4


def test_a_bystander_streams_while_hostile_requests_are_refused(server, http):
    """A long stream runs while a 20 MB prompt and an exponential $ref schema are sent:
    the stream receives tokens between the moment those requests were sent and the
    moment their answers came (the front's loop never stalled on them)."""
    events: list[tuple[str, float]] = []
    lock = threading.Lock()
    started = threading.Event()

    def note(what: str) -> None:
        with lock:
            events.append((what, time.monotonic()))

    done = threading.Event()

    def stream() -> int:
        # streams one after another until the hostile requests are answered and a few
        # more tokens came (one stream of fixed length could end before them on a
        # loaded machine, and the ordering below would say nothing)
        n = after = 0
        body = {"text": "a bystander", "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 200}}
        while after < 3:
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        note("token")
                        started.set()
                        after += done.is_set()
        return n

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(stream)
        assert started.wait(60)
        try:
            for body in ({"text": "word " * 4_000_000, "sampling_params": {"max_new_tokens": 1}},
                         {"text": "hi", "sampling_params": {"json_schema": recursive_refs(20),
                                                            "grammar_backend": "outlines"}}):
                note("sent")
                r = http.post("/generate", json=body)
                note("answered")
                assert r.status_code == 400, r.text[:200]
        finally:
            done.set()
        assert fut.result() > 0
    kinds = [k for k, _ in sorted(events, key=lambda e: e[1])]
    first_sent, last_answer = kinds.index("sent"), len(kinds) - 1 - kinds[::-1].index("answered")
    # ordering, not timing: tokens reached the bystander while the hostile requests were
    # being handled (a stalled front delivers none until it is free), and after them
    assert "token" in kinds[first_sent:last_answer], kinds
    assert "token" in kinds[last_answer:], kinds


def metric(http: httpx.Client, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*{labels}[^}}]*}})? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def long_model(tmp_path_factory, tokenizer_dir):
    """A tiny model with a 64k context: a request can decode for longer than a test runs."""
    from conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("long"), tokenizer_dir, "llama", max_position_embeddings=65536)


def test_stream_dropped_before_its_first_token_is_aborted_unstarted(long_model):
    """One running slot: a blocker decodes (a long-context model, so it outlasts the
    test); a stream queued behind it is dropped by its client; it is aborted while still
    waiting (no token is ever generated for it)."""
    with launch(str(long_model), num_threads=1, kv_cache_tokens=66000, max_running_requests=1,
                echo_logs=False) as rt, httpx.Client(base_url=rt.url, timeout=60) as http:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(http.post, "/generate", json={
                "text": "block", "sampling_params": {**GREEDY, "max_new_tokens": 60_000}})
            for _ in range(400):
                if http.get("/server_info").json()["running"] == 1:
                    break
                time.sleep(0.05)
            aborts = metric(http, "plait_requests_total", 'finish_reason="abort"')
            body = json.dumps({"text": "dropped", "stream": True, "sampling_params": {**GREEDY, "max_new_tokens": 5}})
            host, port = rt.url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port))) as s:
                s.sendall(f"POST /generate HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
                for _ in range(400):  # queued behind the blocker
                    if http.get("/server_info").json()["waiting"] == 1:
                        break
                    time.sleep(0.05)
                assert http.get("/server_info").json()["waiting"] == 1
            # the client is gone; the blocker still holds the only slot
            for _ in range(400):
                if metric(http, "plait_requests_total", 'finish_reason="abort"') > aborts:
                    break
                time.sleep(0.05)
            info = http.get("/server_info").json()
            assert metric(http, "plait_requests_total", 'finish_reason="abort"') == aborts + 1
            assert info["running"] == 1 and info["waiting"] == 0  # the blocker runs on
            assert metric(http, "plait_generation_tokens_total") == 0  # the dropped one never produced any
            http.post("/abort_request", json={"abort_all": True})
            assert blocker.result().status_code in (200, 499)


def test_a_killed_language_client_has_its_requests_aborted(long_model):
    """A program on RuntimeEndpoint is SIGKILLed mid-gen: its pings stop, and the server
    aborts what it left decoding (it used to run to max_new_tokens)."""
    import os
    import signal
    import subprocess
    import sys

    with launch(str(long_model), num_threads=1, kv_cache_tokens=66000, client_timeout_s=2.0,
                echo_logs=False) as rt, httpx.Client(base_url=rt.url, timeout=60) as http:
        program = (
            "import plait as sgl\n"
            f"ep = sgl.RuntimeEndpoint({rt.zmq_address!r})\n"
            "from plait.backend import Request\n"
            "p = ep.submit(Request(text='a long one', sampling_params={'max_new_tokens': 60000, 'temperature': 0,"
            " 'ignore_eos': True}))\n"
            "print('submitted', flush=True)\n"
            "p.wait()\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "submitted"
            for _ in range(400):
                if http.get("/server_info").json()["running"] == 1:
                    break
                time.sleep(0.05)
            assert http.get("/server_info").json()["running"] == 1
            aborts = metric(http, "plait_requests_total", 'finish_reason="abort"')
            os.kill(proc.pid, signal.SIGKILL)
            for _ in range(400):  # bounded: 20 s for a 2 s client timeout
                if http.get("/server_info").json()["in_flight"] == 0:
                    break
                time.sleep(0.05)
            assert http.get("/server_info").json()["in_flight"] == 0
            assert metric(http, "plait_requests_total", 'finish_reason="abort"') == aborts + 1
            assert metric(http, "plait_generation_tokens_total") < 60000  # stopped early
        finally:
            proc.kill()
            proc.wait()


def test_oversized_headers_are_refused(http):
    r = http.get("/health", headers={"X-Big": "a" * (2 << 20)})
    assert r.status_code == 431 and "headers" in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


def test_stale_socket_folders_of_dead_servers_are_swept(tmp_path):
    import os
    import subprocess
    import sys

    from plait.runtime.server.serve import OWNER_FILE, sweep_stale_socket_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid in (("plait-dead", dead.pid), ("plait-live", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / OWNER_FILE).write_text(str(pid))
    (tmp_path / "plait-foreign").mkdir()  # no owner file: not ours to judge
    (tmp_path / "other-dead").mkdir()
    (tmp_path / "other-dead" / OWNER_FILE).write_text(str(dead.pid))
    assert sweep_stale_socket_dirs(str(tmp_path)) == [str(tmp_path / "plait-dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-dead", "plait-foreign", "plait-live"]


def test_non_stream_disconnect_is_not_an_internal_error(long_model, capfd):
    """A client that hangs up on a non-streaming request is an abort, not a server fault
    (it used to log InvalidStateError from result() on a cancelled task)."""
    with launch(str(long_model), num_threads=1, kv_cache_tokens=66000, echo_logs=True) as rt, \
            httpx.Client(base_url=rt.url, timeout=60) as http:
        aborts = metric(http, "plait_requests_total", 'finish_reason="abort"')
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(rt.url + "/generate", timeout=0.5,
                       json={"text": "hang up", "sampling_params": {**GREEDY, "max_new_tokens": 60_000}})
        for _ in range(400):
            if metric(http, "plait_requests_total", 'finish_reason="abort"') > aborts:
                break
            time.sleep(0.05)
        assert metric(http, "plait_requests_total", 'finish_reason="abort"') == aborts + 1
    err = capfd.readouterr().err
    assert "InvalidStateError" not in err and "internal error" not in err, err[-2000:]


@pytest.mark.parametrize("messages,says", [(None, "messages is required"), ("hi", "got a string"),
                                           ([], "got an empty array"), ({"role": "user"}, "got an object")])
def test_messages_of_the_wrong_shape_say_what_was_sent(messages, says):
    """`"messages": "hi"` was answered "messages is required", though the client sent it."""
    from plait.errors import RequestError
    from plait.runtime.server.openai_api import _messages

    body = {} if messages is None else {"messages": messages}
    with pytest.raises(RequestError, match=says) as e:
        _messages(body)
    assert e.value.param == "messages"
