"""The server, end to end: a real front + engine started with ``launch()`` on a tiny
model, driven over HTTP (the official ``openai`` client and raw requests) and over
the language clients' ZMQ socket.

Greedy outputs are compared with greedy outputs of the same server (serial runs), so
nothing here depends on what the random model says.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time
import uuid
from typing import Any

import httpx
import msgspec
import openai
import pytest
import zmq

from plait import protocol as P
from plait.runtime.server import launch

from http_helpers import wait_idle

API_KEY = "sk-plait-test"
MODEL = "tiny"
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = [f"Request number {i} says that the {w} is" for i, w in
           enumerate(["sky", "sea", "forest", "city", "desert", "river", "mountain", "garden"] * 8)]


@pytest.fixture(scope="module")
def server(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=16384, max_running_requests=128,
                api_key=API_KEY, served_model_name=MODEL) as rt:
        yield rt


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def generate(http: httpx.Client, text: str, max_new_tokens: int = 12, **fields: Any) -> dict[str, Any]:
    r = http.post("/generate", json={"text": text, "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens},
                                     **fields})
    assert r.status_code == 200, r.text
    return r.json()


def assert_memory_returned(http: httpx.Client) -> None:
    info = wait_idle(http)
    pool = info["pool"]
    assert info["invariant_ok"], info["invariant_error"]
    assert pool["free"] + pool["evictable"] + pool["locked"] == pool["total"]
    assert pool["locked"] == 0, pool  # no request holds KV any more


def sse_events(lines: Any) -> list[Any]:
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# -- OpenAI client ---------------------------------------------------------------------------------
def test_models_and_info_routes(server, http, oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [MODEL]
    info = http.get("/model_info").json()
    assert info["served_model_name"] == MODEL and info["context_len"] == 1024 and info["vocab_size"] == 49152
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["protocol_version"] == P.PROTOCOL_VERSION
    assert http.get("/health_generate").status_code == 200
    sinfo = http.get("/server_info").json()
    assert sinfo["front_pid"] == server.pid and sinfo["engine_pid"] == server.engine_pid
    assert sinfo["zmq_address"] == server.zmq_address
    # SGLang's top-level names (its server args, scheduler facts and version)
    assert sinfo["version"] == http.get("/version").json()["version"]
    assert sinfo["max_total_num_tokens"] == sinfo["pool"]["total"] * sinfo["page_size"]
    assert sinfo["chunked_prefill_size"] == sinfo["config"]["chunked_prefill_size"]
    missing = http.get("/no/such/route")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_openai_completions_match_native(http, oai):
    base = generate(http, PROMPTS[0])
    out = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == base["text"]
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == base["meta_info"]["prompt_tokens"]
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details.cached_tokens >= 0
    # several prompts x n choices, each greedy choice equal to its prompt's baseline
    other = generate(http, PROMPTS[1])
    multi = oai.completions.create(model=MODEL, prompt=PROMPTS[:2], n=2, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == [0, 1, 2, 3]
    assert [c.text for c in multi.choices] == [base["text"]] * 2 + [other["text"]] * 2
    # echo with logprobs covers prompt and output tokens
    echo = oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, echo=True, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == PROMPTS[0] + base["text"][: len(echo.choices[0].text) - len(PROMPTS[0])]
    assert len(lp.tokens) == base["meta_info"]["prompt_tokens"] + 3
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])


def test_openai_seeded_sampling_is_reproducible(oai):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, top_p=0.9, seed=1234)
    a = oai.completions.create(**kw)
    b = oai.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_openai_chat_matches_template(server, http, oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    out = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                      logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.args.model)
    ids = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(ids, add_special_tokens=False)
    ref = http.post("/generate", json={"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 10}}).json()
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content == ref["text"]
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 10
    content = out.choices[0].logprobs.content
    assert len(content) == 10
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    # greedy: the chosen token is the most likely one
    assert all(c.top_logprobs[0].token == c.token for c in content)


def test_openai_streams_concatenate_to_the_full_text(oai):
    full = oai.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0,
                                  extra_body={"ignore_eos": True})
    stream = oai.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0, stream=True,
                                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])

    messages = [{"role": "user", "content": "Tell me about rivers."}]
    chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    chat_stream = list(oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                   stream=True, extra_body={"ignore_eos": True}))
    assert chat_stream[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chat_stream if c.choices)
    assert text == chat.choices[0].message.content
    assert chat_stream[-1].choices[0].finish_reason == "length"


def test_stop_strings_are_never_streamed(http, oai):
    base = generate(http, PROMPTS[4], 24)
    text = base["text"]
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip(), "the greedy text should have a stop candidate in the middle"
    expected = text[: text.index(stop)]
    stream = oai.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=[stop],
                                    stream=True, extra_body={"ignore_eos": True})
    pieces = []
    for c in stream:
        pieces.append(c.choices[0].text)
        assert stop not in "".join(pieces)
    assert "".join(pieces) == expected
    out = oai.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=24, temperature=0, stop=stop,
                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"


# -- native API ----------------------------------------------------------------------------------
def test_native_generate_shapes_and_logprobs(http):
    one = generate(http, PROMPTS[5])
    assert set(one) == {"text", "output_ids", "meta_info"}
    assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    batch = http.post("/generate", json={"text": PROMPTS[5:7], "sampling_params": {**GREEDY, "max_new_tokens": 12}})
    outs = batch.json()
    assert isinstance(outs, list) and len(outs) == 2 and outs[0]["output_ids"] == one["output_ids"]
    ids_out = http.post("/generate", json={"input_ids": [one["output_ids"][:3]] * 2,
                                           "sampling_params": {**GREEDY, "max_new_tokens": 2}}).json()
    assert len(ids_out) == 2 and ids_out[0]["output_ids"] == ids_out[1]["output_ids"]
    lp = http.post("/generate", json={
        "text": PROMPTS[5], "sampling_params": {**GREEDY, "max_new_tokens": 4}, "return_logprob": True,
        "logprob_start_len": 0, "top_logprobs_num": 3, "return_text_in_logprobs": True,
    }).json()["meta_info"]
    assert [e[1] for e in lp["output_token_logprobs"]] == one["output_ids"][:4]
    assert all(isinstance(e[2], str) for e in lp["output_token_logprobs"])
    assert len(lp["input_token_logprobs"]) == one["meta_info"]["prompt_tokens"]
    assert all(len(row) == 3 for row in lp["output_top_logprobs"])
    # without return_text_in_logprobs: SGLang's (logprob, token_id, None) triples, streamed or not
    req = {"text": PROMPTS[5], "sampling_params": {**GREEDY, "max_new_tokens": 4}, "return_logprob": True,
           "top_logprobs_num": 2}
    bare = http.post("/generate", json=req).json()["meta_info"]
    events = [json.loads(line[6:]) for line in http.post("/generate", json={**req, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    for meta in (bare, events[-2]["meta_info"], events[-1]["meta_info"]):
        assert [e[1] for e in meta["output_token_logprobs"]] == one["output_ids"][:4]
        assert all(len(e) == 3 and e[2] is None for e in meta["output_token_logprobs"] + meta["input_token_logprobs"])
        assert all(len(e) == 3 and e[2] is None for row in meta["output_top_logprobs"] for e in row)


def test_native_stream_is_cumulative(http):
    one = generate(http, PROMPTS[6])
    with http.stream("POST", "/generate", json={"text": PROMPTS[6], "stream": True,
                                                "sampling_params": {**GREEDY, "max_new_tokens": 12}}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    texts = [e["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert events[-2]["text"] == one["text"] and events[-2]["output_ids"] == one["output_ids"]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_64_concurrent_streams_match_serial_greedy(http, oai):
    serial = [generate(http, p, 16)["text"] for p in PROMPTS]

    def stream(p: str) -> tuple[str, str | None]:
        s = oai.completions.create(model=MODEL, prompt=p, max_tokens=16, temperature=0, stream=True,
                                   extra_body={"ignore_eos": True})
        chunks = list(s)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(stream, PROMPTS))
    assert [t for t, _ in got] == serial
    assert all(f == "length" for _, f in got)
    assert_memory_returned(http)


# -- abort and disconnect --------------------------------------------------------------------------
LONG = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 900}


def test_abort_request_frees_memory(http, server):
    rid = f"abort-{uuid.uuid4().hex}"
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as other:
        with other.stream("POST", "/generate", json={"text": PROMPTS[7], "stream": True, "rid": rid,
                                                     "sampling_params": LONG}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first[6:])["meta_info"]["id"] == rid
            assert http.post("/abort_request", json={"rid": rid}).json() == {"aborted": [rid]}
            events = sse_events(lines)
    final = events[-2]
    assert events[-1] == "[DONE]"
    assert final["meta_info"]["finish_reason"]["type"] == "abort"
    assert final["meta_info"]["completion_tokens"] < 900
    assert_memory_returned(http)


def test_stream_disconnect_frees_memory(http, server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as other:
        with other.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[8], "stream": True,
                                                           "max_tokens": 900, "temperature": 0, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
        # leaving the block closes the connection mid-stream
    assert http.get("/server_info").json()["pool"]["total"] > 0
    assert_memory_returned(http)


def test_non_stream_disconnect_frees_memory(http, server):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/generate", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=0.3,
                   json={"text": PROMPTS[9], "sampling_params": {**LONG, "max_new_tokens": 1000}})
    assert_memory_returned(http)
    # the abort shows in the metrics
    assert 'finish_reason="abort"' in http.get("/metrics").text


# -- bad input -------------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]
BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b'{"model": "tiny", "prompt": "caf\xe9"}', None),  # invalid UTF-8 in the body
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"model": MODEL}, "prompt"),
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 5}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),  # past a signed 64-bit integer
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 1000}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 1000}, "logprobs"),
    ("/v1/completions", {"prompt": "word " * 1100}, "prompt"),  # over the context length
    ("/v1/completions", {"prompt": [[5, 10**9]]}, "prompt"),  # token id outside the vocabulary
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, "no_such_field"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone surrogate"}', "prompt"),
    ("/v1/chat/completions", {"model": MODEL}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -3}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
    ("/generate", {}, "text"),
    ("/generate", {"text": 5}, "text"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "input_ids"),
    ("/generate", {"input_ids": [10**9]}, "input_ids"),
    ("/generate", {"input_ids": [[1, 2], "x"]}, "input_ids"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 10**30}}, "max_new_tokens"),
    ("/generate", {"text": "hi", "sampling_params": {"bogus": 1}}, "sampling_params"),
    ("/generate", {"text": "hi", "sampling_params": "greedy"}, "sampling_params"),
    ("/generate", {"text": "hi", "sampling_params": {"n": 100000}}, "n"),
    ("/generate", {"text": "hi", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 1000, "stream": True}, "top_logprobs_num"),
    ("/generate", {"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
    ("/generate", {"text": "hi", "rid": "bad#rid"}, "rid"),
    ("/abort_request", {"rid": 5}, "rid"),
]


def test_bad_input_matrix(http, server):
    """Each bad request gets a 400 naming the field; a good request running meanwhile
    and the next one are served exactly as before."""
    base = generate(http, PROMPTS[10], 24)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, http, PROMPTS[10], 24)
        for path, body, param in BAD:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = http.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["param"] == param, (path, body, err)
            assert err["code"] == 400 and err["type"] == "invalid_request_error"
            if param is not None:  # the message names the field (or the unknown key)
                named = "bogus" if body == {"text": "hi", "sampling_params": {"bogus": 1}} else param
                assert named in err["message"], err
        assert running.result()["output_ids"] == base["output_ids"]
    assert generate(http, PROMPTS[10], 24)["output_ids"] == base["output_ids"]
    assert_memory_returned(http)


def test_api_key_guards_every_route_but_the_probes(server):
    """As SGLang: /health, /health_generate and /metrics answer without the key (load
    balancers, routers, Prometheus); every other route is a 401 without it."""
    routes = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/server_info"),
              ("POST", "/v1/chat/completions"), ("POST", "/generate"), ("GET", "/model_info"),
              ("POST", "/flush_cache"), ("POST", "/abort_request"), ("GET", "/v1/responses/x"),
              ("GET", "/health/"), ("GET", "/metrics/x")]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, path in routes:
            r = httpx.request(method, server.url + path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers)
            assert r.json()["error"]["type"] == "authentication_error"
        for path in ("/health", "/health_generate", "/metrics"):
            r = httpx.get(server.url + path, headers=headers, timeout=60)
            assert r.status_code == 200, (path, headers, r.text)
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_flush_cache_of_one_salt_keeps_the_others(http):
    text = PROMPTS[10] * 3
    for salt in ("tenant-a", "tenant-b"):
        generate(http, text, 2, cache_salt=salt)
    wait_idle(http)
    # a misspelt or repeated parameter is a 400, not a flush of everything (or of one of them)
    for query in ({"cache-salt": "tenant-a"}, [("cache_salt", "tenant-a"), ("cache_salt", "tenant-b")]):
        bad = http.post("/flush_cache", params=query)
        assert bad.status_code == 400 and bad.json()["error"]["param"] in ("cache-salt", "cache_salt"), bad.text
    # a body was ignored (a flush of every tenant); an undecodable salt became U+FFFD and was
    # flushed; an empty parameter name was named as nothing
    for kwargs, param in (({"json": {"cache_salt": "tenant-a", "x": 1}}, "x"), ({"content": b"not json"}, None),
                          ({"json": {"cache_salt": None}}, "cache_salt"), ({"json": ["tenant-a"]}, None),
                          ({"json": {"cache_salt": "tenant-b"}, "params": {"cache_salt": "tenant-a"}}, "cache_salt")):
        bad = http.post("/flush_cache", **kwargs)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (kwargs, bad.text)
    for raw, needle in (("cache_salt=%FF", "UTF-8"), ("=x", "''")):
        bad = http.post("/flush_cache?" + raw)
        assert bad.status_code == 400 and needle in bad.json()["error"]["message"], bad.text
    assert generate(http, text, 2, cache_salt="tenant-a")["meta_info"]["cached_tokens"] > 0
    r = http.post("/flush_cache", params={"cache_salt": "tenant-a"}).json()
    assert r["success"] is True and "tenant-a" in r["message"]
    assert generate(http, text, 2, cache_salt="tenant-a")["meta_info"]["cached_tokens"] == 0
    assert generate(http, text, 2, cache_salt="tenant-b")["meta_info"]["cached_tokens"] > 0
    wait_idle(http)
    r = http.post("/flush_cache", json={"cache_salt": "tenant-b"})  # the salt in a JSON body, as the query's
    assert r.status_code == 200 and "tenant-b" in r.json()["message"], r.text
    assert generate(http, text, 2, cache_salt="tenant-b")["meta_info"]["cached_tokens"] == 0


def test_update_weights_from_disk_drops_the_cache(http, tiny_model_factory, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_factory("llama"), copy, copy_function=shutil.copy)  # new files: new fingerprint
    text = PROMPTS[9] * 3
    first = generate(http, text, 3)
    assert generate(http, text, 3)["meta_info"]["cached_tokens"] > 0
    wait_idle(http)
    fingerprint = http.get("/server_info").json()["weights_fingerprint"]
    r = http.post("/update_weights_from_disk", json={"model_path": str(copy)})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert http.get("/server_info").json()["weights_fingerprint"] != fingerprint
    again = generate(http, text, 3)
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == first["output_ids"]
    for body in ({}, {"model_path": str(tmp_path / "nowhere")}):
        bad = http.post("/update_weights_from_disk", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model_path", bad.text


def test_flush_cache_and_metrics(http):
    generate(http, PROMPTS[11] * 3, 4)
    hit = generate(http, PROMPTS[11] * 3, 4)
    assert hit["meta_info"]["cached_tokens"] > 0
    wait_idle(http)
    assert http.post("/flush_cache").json()["success"] is True
    assert http.get("/server_info").json()["pool"]["evictable"] == 0
    assert generate(http, PROMPTS[11] * 3, 4)["meta_info"]["cached_tokens"] == 0
    streamed = http.post("/generate", json={"text": PROMPTS[11], "stream": True,
                                            "sampling_params": {**GREEDY, "max_new_tokens": 4}})
    assert streamed.status_code == 200 and "[DONE]" in streamed.text  # streams feed the inter-token histogram
    text = http.get("/metrics").text
    for name in ("plait_requests_total", "plait_time_to_first_token_seconds_bucket",
                 "plait_time_per_output_token_seconds_bucket", "plait_inter_token_latency_seconds_bucket",
                 "plait_e2e_request_latency_seconds_bucket", "plait_prompt_tokens_total",
                 "plait_generation_tokens_total", "plait_prefix_cache_queried_tokens_total",
                 "plait_prefix_cache_hit_tokens_total", "plait_kv_pages_used", "plait_kv_pages_total",
                 "plait_num_running_reqs", "plait_num_waiting_reqs", "plait_prefix_cache_early_divergences_total",
                 "plait_hicache_loaded_tokens_total", "plait_hicache_prefetched_tokens_total",
                 "plait_window_kv_pages_total", "plait_spec_accepted_tokens_total"):
        assert name in text, name
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["plait_prefix_cache_hit_tokens_total"] > 0
    assert values["plait_generation_tokens_total"] > 0
    assert values["plait_kv_pages_total"] > 0


# -- the language clients' socket ----------------------------------------------------------------------
class ZmqClient:
    def __init__(self, address: str, api_key: str | None = API_KEY) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address)
        self.api_key = api_key

    def send(self, msg: Any) -> None:
        if self.api_key is not None:
            msg = msgspec.structs.replace(msg, api_key=self.api_key)
        self.sock.send(P.encode(msg))

    def recv(self, timeout_ms: int = 30000) -> Any:
        assert self.sock.poll(timeout_ms), "no answer from the server"
        return P.decode_response(self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


@pytest.fixture()
def zclient(server):
    c = ZmqClient(server.zmq_address)
    yield c
    c.close()


def test_zmq_socket_requires_the_api_key(server, http, zclient):
    """With --api-key, every ZMQ message must carry it: without it (or with a wrong one)
    nothing runs and the answer is a 401 naming api_key."""
    for key in (None, "wrong"):
        bad = ZmqClient(server.zmq_address, api_key=key)
        try:
            for msg in (P.GenerateRequest(f"nokey-{key}", text="hi", sampling_params={"max_new_tokens": 2}),
                        P.ServerInfoRequest(f"info-{key}"), P.FlushCacheRequest(f"flush-{key}")):
                bad.send(msg)
                reply = bad.recv()
                assert isinstance(reply, P.ErrorResponse) and reply.rid == msg.rid
                assert (reply.code, reply.param, reply.error_type) == (401, "api_key", "authentication_error")
            running = zclient
            running.send(P.GenerateRequest("keyed", text="hi", sampling_params={**GREEDY, "max_new_tokens": 200}))
            bad.send(P.AbortRequest(abort_all=True))  # refused: it cannot touch others' requests either
            bad.send(P.AbortRequest(rid="keyed"))
            assert bad.recv().code == 401 and bad.recv().code == 401
            result = running.recv()
            assert isinstance(result, P.GenerateResult)
            assert result.meta_info["finish_reason"] == {"type": "length", "length": 200}
        finally:
            bad.close()
    assert http.get("/server_info").json()["in_flight"] == 0


def test_runtime_endpoint_sends_the_key(server):
    from plait.runtime_endpoint import RuntimeEndpoint

    ep = RuntimeEndpoint(server.zmq_address, API_KEY)
    try:
        assert ep.get_server_info()["context_len"] > 0
    finally:
        ep.shutdown()
    with pytest.raises(Exception, match="API key"):
        RuntimeEndpoint(server.zmq_address, connect_timeout_s=10)
    from plait.errors import BackendError

    with pytest.raises(BackendError, match="needs an API key") as info:  # through the HTTP URL too
        RuntimeEndpoint(server.url, connect_timeout_s=10)
    assert info.value.param == "api_key" and info.value.code == 401


def test_zmq_generate_stream_and_result(http, zclient):
    base = generate(http, PROMPTS[12], 12, return_logprob=True)
    zclient.send(P.GenerateRequest("z1", text=PROMPTS[12], sampling_params={**GREEDY, "max_new_tokens": 12},
                                   stream=True, return_logprob=True))
    chunks, result = [], None
    while result is None:
        msg = zclient.recv()
        assert msg.rid == "z1"
        if isinstance(msg, P.StreamChunk):
            chunks.append(msg)
        else:
            assert isinstance(msg, P.GenerateResult), msg
            result = msg
    assert "".join(c.text for c in chunks) == result.text == base["text"]
    assert [t for c in chunks for t in c.token_ids] == result.output_ids == base["output_ids"]
    assert sum(len(c.meta["output_token_logprobs"]) for c in chunks) == 12
    assert result.meta_info["finish_reason"] == {"type": "length", "length": 12}
    # n > 1 by input_ids, not streamed: one result per index
    zclient.send(P.GenerateRequest("z2", input_ids=base["output_ids"][:4],
                                   sampling_params={**GREEDY, "max_new_tokens": 3, "n": 3}))
    results = [zclient.recv() for _ in range(3)]
    assert sorted(r.index for r in results) == [0, 1, 2]
    assert len({tuple(r.output_ids) for r in results}) == 1


def test_zmq_errors_abort_and_control(http, zclient):
    zclient.send(P.GenerateRequest("bad", text="hi", sampling_params={"temperature": -1.0}))
    err = zclient.recv()
    assert isinstance(err, P.ErrorResponse) and err.rid == "bad" and err.code == 400 and err.param == "temperature"
    zclient.send(P.GenerateRequest("both", text="hi", input_ids=[1]))
    assert isinstance(zclient.recv(), P.ErrorResponse)
    zclient.sock.send(b"\x93not a message")
    assert isinstance(zclient.recv(), P.ErrorResponse)

    zclient.send(P.GenerateRequest("long", text=PROMPTS[13], sampling_params=LONG, stream=True))
    assert isinstance(zclient.recv(), P.StreamChunk)
    zclient.send(P.GenerateRequest("long", text="dup", sampling_params={"max_new_tokens": 1}))
    dup = zclient.recv()
    while isinstance(dup, P.StreamChunk):
        dup = zclient.recv()
    assert isinstance(dup, P.ErrorResponse) and dup.param == "rid"
    zclient.send(P.AbortRequest(abort_all=True))
    msg = zclient.recv()
    while isinstance(msg, P.StreamChunk):
        msg = zclient.recv()
    assert isinstance(msg, P.GenerateResult) and msg.meta_info["finish_reason"]["type"] == "abort"

    zclient.send(P.ServerInfoRequest("info"))
    info = zclient.recv()
    assert isinstance(info, P.ServerInfo) and info.rid == "info" and info.info["context_len"] == 1024
    wait_idle(http)
    zclient.send(P.FlushCacheRequest("flush"))
    flushed = zclient.recv()
    assert isinstance(flushed, P.FlushCacheResult) and flushed.rid == "flush" and flushed.ok
    assert_memory_returned(http)


def test_zmq_pin_is_routed(http, zclient):
    """Pins go to the engine's pin_prefix/unpin; an engine without them says so."""
    zclient.send(P.PinRequest("pin", text=PROMPTS[14] * 4, ttl_s=30))
    reply = zclient.recv()
    if isinstance(reply, P.ErrorResponse):
        assert reply.code == 501 and "pin" in reply.message
        return
    assert isinstance(reply, P.PinResult) and reply.rid == "pin" and reply.num_tokens > 0
    for _ in range(200):  # the pin holds its pages once its prefill ran
        info = http.get("/server_info").json()
        if info["pins"]["active"] == 1:
            break
        time.sleep(0.025)
    assert info["pins"]["active"] == 1 and info["pool"]["locked"] > 0
    zclient.send(P.UnpinRequest("unpin", reply.pin_id))
    done = zclient.recv()
    assert isinstance(done, P.UnpinResult) and done.ok
    zclient.send(P.UnpinRequest("again", reply.pin_id))
    assert zclient.recv().ok is False
    assert_memory_returned(http)


# -- pieces without a server ---------------------------------------------------------------------
def test_stream_holds_back_possible_stop_strings():
    from plait.runtime.detokenizer import safe_text_len

    assert safe_text_len("hello wor", ["world"]) == len("hello ")
    assert safe_text_len("hello w", ["world", "xyz"]) == len("hello ")
    assert safe_text_len("hello", ["world"]) == len("hello")
    assert safe_text_len("abcab", ["abcabd"]) == 0
    assert safe_text_len("anything", []) == len("anything")


ERRORS_EVERYWHERE = [  # (text, sampling params, other fields, param the error names)
    ("hi", {"max_new_tokens": -1}, {}, "max_new_tokens"),
    ("hi", {"top_p": 0.0}, {}, "top_p"),
    ("hi", {"bogus": 1}, {}, "sampling_params"),
    ("hi", {"stop": [1, 2]}, {}, "stop"),
    ("hi", {"regex": "(unclosed"}, {}, "regex"),
    ("hi", {"json_schema": {"type": "array", "uniqueItems": True}}, {}, "json_schema"),
    ("hi", {"regex": "a", "json_schema": {}}, {}, "regex"),
    ("hi", {}, {"return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ("hi", {}, {"top_logprobs_num": 1000}, "top_logprobs_num"),
    ("", {}, {}, "text"),
    ("word " * 1100, {}, {}, "text"),
]


def test_one_validation_error_reaches_every_client_alike(server, http, zclient, tiny_model_factory):
    """The same RequestError (message and param) reaches an HTTP client, a ZMQ client,
    an in-process Engine caller and a language program on the in-process backend."""
    from plait.engine_backend import EngineBackend
    from plait.errors import BackendError, RequestError
    from plait.backend import Request
    from plait.runtime.engine import Engine

    engine = Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, num_threads=1)
    backend = EngineBackend(engine)
    try:
        for i, (text, sp, fields, param) in enumerate(ERRORS_EVERYWHERE):
            r = http.post("/generate", json={"text": text, "sampling_params": sp, **fields})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            zclient.send(P.GenerateRequest(f"e{i}", text=text, sampling_params=sp, **fields))
            z = zclient.recv()
            assert isinstance(z, P.ErrorResponse) and z.rid == f"e{i}"
            with pytest.raises(RequestError) as local:
                engine.generate(text, sp, **fields)
            with pytest.raises(BackendError) as program:
                backend.submit(Request(rid=f"p{i}", text=text, sampling_params=sp, **fields)).wait()
            # Engine.generate names its own argument: `prompt` where the wire says `text`
            local_param, local_msg = param, err["message"]
            if param == "text":
                local_param, local_msg = "prompt", err["message"].replace("text", "prompt", 1)
            assert (err["param"], z.param, program.value.param) == (param,) * 3, (text[:10], sp, fields)
            assert err["message"] == z.message == program.value.message, (err, z, program.value)
            assert (local.value.param, local.value.message) == (local_param, local_msg)
            assert err["code"] == z.code == local.value.status == program.value.code == 400
    finally:
        backend.shutdown()
        engine.shutdown()


def test_server_options_are_validated_once_on_their_way_to_the_engine(monkeypatch):
    """launch() validates ServerArgs; the server and engine processes rebuild them from
    JSON without running the checks again (and get equal values)."""
    from plait.runtime.config import EngineConfig, build_trusted
    from plait.runtime.server.args import ServerArgs

    args = ServerArgs.from_kwargs(None, port=0, api_key="k", kv_cache_tokens=4096, page_size=4, restart_engine=False)
    calls = []
    for cls in (ServerArgs, EngineConfig):
        monkeypatch.setattr(cls, "__post_init__", lambda self: calls.append(type(self).__name__))
    again = ServerArgs.from_validated_json(args.to_json())
    assert again == args and again.engine == args.engine and calls == []
    assert build_trusted(EngineConfig, json.loads(args.to_json())["engine"]) == args.engine and calls == []


def test_protocol_is_torch_free_and_round_trips():
    import subprocess
    import sys

    code = "import sys, plait.protocol; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    msg = P.GenerateRequest("r", input_ids=[1, 2], sampling_params={"max_new_tokens": 2}, stream=True)
    assert P.decode_request(P.encode(msg)) == msg
    err = P.ErrorResponse("r", "bad", 400, "invalid_request_error", "n")
    assert P.decode_response(P.encode(err)) == err


def test_streamed_generate_with_n_names_the_request_in_every_event(http):
    """With n > 1 the chunk events carried each sample's internal id (``gen-...#0``) and
    the final events the request's: every event names the request, as the final one did."""
    body = {"text": "Hi", "stream": True, "return_logprob": True,
            "sampling_params": {"temperature": 0.7, "ignore_eos": True, "max_new_tokens": 4, "n": 2}}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        events = [e for e in sse_events(r.iter_lines()) if e != "[DONE]"]
    assert {e["index"] for e in events} == {0, 1} and len(events) > 2
    ids = {e["meta_info"]["id"] for e in events}
    assert len(ids) == 1 and "#" not in next(iter(ids)), ids
