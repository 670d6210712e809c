"""SGLang frontend programs plait's authors did not write, in the idioms of SGLang's
docs, examples and benchmarks (the frontend tutorial, the LLM-judge and multi-stage
fork examples, the async-io Runtime example, reasoning models' templates, logprob
readers), run through ``import plait as sgl``; one test per gap they found:

1. Logprob entries were ``(logprob, token_id)`` pairs unless
   ``return_text_in_logprobs=True``; SGLang always returns triples, with None for
   the text, so ``for lp, tid, text in meta["output_token_logprobs"]`` failed.
2. ``f.run("a", q="b")`` on ``def f(s, q)`` silently took ``q="b"``; Python (and
   SGLang, which calls the body with both) raises "multiple values for argument".
3. ``sgl.RuntimeEndpoint(url, api_key, verify)`` (SGLang's signature) raised TypeError.
4. ``sgl.Runtime(..., launch_timeout=...)`` was refused as an unknown engine option.
5. ``sgl.Runtime`` had no ``async_generate`` / ``add_request``; and a stream consumer's
   callback that raised (chunks after an early exit) killed the in-process engine.
6. ``s.fork(0)`` (one branch per item of an empty list) raised; SGLang gives an empty group.
7. ``s += s.system(...)``, as SGLang's frontend tutorial writes it, raised TypeError
   (the role method appended and returned None).
8. ``f.run(..., n=2)`` / ``use_thread=`` / ``stop_regex=`` (SGLang's ``run`` keywords)
   were taken for program arguments.
9. With Qwen3's chat template every assistant turn opened after an empty think block,
   which switches the model's reasoning off; a reply now opens as the template's
   generation prompt opens it.
10. ``sgl.Engine.generate(..., image_data=...)`` (or ``lora_path``, ``return_hidden_states``
    ...) failed with "unexpected keyword"; they are refused by name, accepted when unset.

Model outputs are compared with a plain reference ``Engine`` on the same tiny
weights, so nothing depends on what the random model says.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import plait as sgl
from plait.backend import generate_outputs
from plait.runtime import Engine

from lang_fixtures import backend, folder, ref  # noqa: F401  (pytest fixtures)


def greedy(ref: Engine, prompt: str, **params: Any) -> dict[str, Any]:
    return ref.generate(prompt, {"temperature": 0.0, **params})


# -- 1. logprob entries are always (logprob, token_id, text) -------------------------------------
@sgl.function
def scored_answer(s, question):
    s += "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=3, return_logprob=True, top_logprobs_num=2, logprob_start_len=0)


def test_logprob_entries_are_triples_with_none_text_as_in_sglang(backend, ref, folder):
    state = scored_answer.run("Why?", temperature=0, backend=backend)
    meta = state.get_meta_info("answer")
    want = greedy(ref, "Q: Why?\nA:", max_new_tokens=3)
    # the reader of SGLang's examples: three names per entry
    ids = [tid for _, tid, text in meta["output_token_logprobs"]]
    assert ids == want["output_ids"]
    assert all(text is None for _, _, text in meta["output_token_logprobs"])
    assert all(len(e) == 3 and e[2] is None for row in meta["output_top_logprobs"] for e in row)
    assert len(meta["output_top_logprobs"]) == 3 and all(len(row) == 2 for row in meta["output_top_logprobs"])
    first, *rest = meta["input_token_logprobs"]
    assert first[0] is None and len(first) == 3 and all(len(e) == 3 for e in rest)

    # with return_text_in_logprobs the third field is the token's text
    with_text = scored_answer.run("Why?", temperature=0, return_text_in_logprobs=True, backend=backend)
    entries = with_text.get_meta_info("answer")["output_token_logprobs"]
    assert [e[1] for e in entries] == ids and "".join(e[2] for e in entries) == with_text["answer"]

    # streamed pieces carry triples too, and concatenate to the whole list
    async def pieces() -> list[Any]:
        st = scored_answer.run("Why?", temperature=0, stream=True, backend=backend)
        return [m async for _, m in st.text_async_iter("answer", return_meta_data=True)]

    metas = asyncio.run(pieces())
    streamed = [e for m in metas for e in m["output_token_logprobs"]]
    assert [tid for _, tid, text in streamed] == ids and all(text is None for *_, text in streamed)

    # sgl.Engine.generate / sgl.Runtime.generate (SGLang's offline calls) have the same shape
    out = generate_outputs(backend, "Q: Why?\nA:", {"max_new_tokens": 2, "temperature": 0}, None, return_logprob=True)
    assert [e[1:] for e in out["meta_info"]["output_token_logprobs"]] == [(i, None) for i in ids[:2]]


# -- 2. a value given by position and by name ------------------------------------------------------
@sgl.function
def echo(s, q, suffix="!"):
    s += q + suffix


def test_an_argument_given_twice_is_refused_as_python_does(backend):
    with pytest.raises(TypeError, match="multiple values for argument 'q'"):
        echo.run("a", q="b", backend=backend)
    with pytest.raises(TypeError, match="multiple values for argument 'suffix'"):
        echo.run("a", "?", suffix=".", backend=backend)
    assert echo.run("a", suffix="?", backend=backend).text() == "a?"
    assert echo.bind(q="x").run(q="y", backend=backend).text() == "y!"  # a bound value is a default


# -- 3. RuntimeEndpoint(url, api_key, verify) -------------------------------------------------------
@pytest.fixture
def https_info_server(tmp_path):
    """An HTTPS server with a self-signed certificate whose /server_info names a ZMQ
    address nothing listens on: the endpoint gets past HTTPS only if it trusts it."""
    import http.server
    import json
    import shutil
    import socket
    import ssl
    import subprocess
    import threading

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    body = json.dumps({"zmq_address": f"tcp://127.0.0.1:{dead_port}"}).encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", str(cert), dead_port
    server.shutdown()
    server.server_close()


def test_runtime_endpoint_takes_sglangs_verify_argument(https_info_server):
    url, cert, dead_port = https_info_server
    # the default checks the certificate: the HTTPS step fails
    with pytest.raises(sgl.RuntimeUnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
        sgl.RuntimeEndpoint(url, connect_timeout_s=1.0)
    # verify=False (positional, as SGLang's signature) and verify=<CA file> get past
    # HTTPS to the ZMQ address the server named
    for verify in (False, cert):
        with pytest.raises(sgl.RuntimeUnavailableError, match=f"tcp://127.0.0.1:{dead_port}"):
            sgl.RuntimeEndpoint(url, None, verify, connect_timeout_s=0.5)
    with pytest.raises(ValueError, match="verify='/no/such/ca.pem' is invalid"):
        sgl.RuntimeEndpoint(url, verify="/no/such/ca.pem")


# -- 4. sgl.Runtime(launch_timeout=...) -------------------------------------------------------------
def test_runtime_takes_sglangs_launch_timeout(monkeypatch):
    import plait.runtime.server as server

    seen: dict[str, Any] = {}

    def fake_launch(model: Any, **options: Any) -> Any:
        seen.update(options, model=model)
        raise RuntimeError("not launched")

    monkeypatch.setattr(server, "launch", fake_launch)
    with pytest.raises(RuntimeError, match="not launched"):
        sgl.Runtime(model_path="m", launch_timeout=42.0, log_level="error")
    assert seen == {"model": "m", "startup_timeout": 42.0, "log_level": "error"}
    with pytest.raises(ValueError, match="launch_timeout and startup_timeout were both given"):
        sgl.Runtime("m", launch_timeout=1.0, startup_timeout=2.0)


# -- 5. Runtime.async_generate / add_request ---------------------------------------------------------
def test_runtime_async_generate_streams_the_text_of_one_generation(backend, ref, monkeypatch):
    # the method streams through the runtime's endpoint; an in-process backend stands
    # in for a launched sidecar (the same BaseBackend.submit)
    rt = object.__new__(sgl.Runtime)
    rt.endpoint = backend
    want = greedy(ref, "Hello", max_new_tokens=8)["text"]
    stop = want[len(want) // 2: len(want) // 2 + 3]  # cuts the text in the middle

    async def run() -> tuple[list[str], list[str], list[str]]:
        plain = [p async for p in rt.async_generate("Hello", {"max_new_tokens": 8, "temperature": 0})]
        stopped = [p async for p in rt.add_request("Hello", {"max_new_tokens": 8, "temperature": 0, "stop": stop})]
        many = await asyncio.gather(*[collect(f"Q{i}") for i in range(3)])
        return plain, stopped, many

    async def collect(prompt: str) -> str:
        return "".join([p async for p in rt.async_generate(prompt, {"max_new_tokens": 4, "temperature": 0})])

    plain, stopped, many = asyncio.run(run())
    assert len(plain) > 1 and "".join(plain) == want
    assert "".join(stopped) == greedy(ref, "Hello", max_new_tokens=8, stop=stop)["text"] and stop not in "".join(stopped)
    assert many == [greedy(ref, f"Q{i}", max_new_tokens=4)["text"] for i in range(3)]

    async def early_exit() -> None:
        agen = rt.async_generate("Hello", {"max_new_tokens": 400, "ignore_eos": True})
        async for _ in agen:
            break
        await agen.aclose()  # aborts the request

    aborted: list[str] = []
    abort = backend.abort
    monkeypatch.setattr(backend, "abort", lambda rid: (aborted.append(rid), abort(rid)))
    asyncio.run(early_exit())
    assert len(aborted) == 1
    deadline = time.monotonic() + 30
    while backend.get_server_info()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert backend.get_server_info()["running"] == 0

    async def bad(params: dict[str, Any]) -> list[str]:
        return [p async for p in rt.async_generate("Hello", params)]

    with pytest.raises(sgl.BackendError, match="max_new_tokens=-1 is invalid"):
        asyncio.run(bad({"max_new_tokens": -1}))
    with pytest.raises(ValueError, match="n=2 is invalid for a streamed generate"):
        asyncio.run(bad({"n": 2}))


# -- 6. s.fork(0) ------------------------------------------------------------------------------------
@sgl.function
def judge_each(s, article, dimensions):
    s += "Article: " + article + "\n"
    forks = s.fork(len(dimensions))  # one branch per dimension: none for an empty list
    for f, d in zip(forks, dimensions):
        f += "Judge " + d + ":" + sgl.gen("judgement", max_tokens=3)
    forks.join()
    for f, d in zip(forks, dimensions):
        s += d + ": " + f["judgement"] + "\n"
    s += "Score:" + sgl.gen("score", max_tokens=2)
    return len(forks)


def test_a_fork_of_zero_branches_is_an_empty_group(backend, ref):
    state = judge_each.run("hi", [], temperature=0, backend=backend)
    assert state.ret_value == 0 and "judgement" not in state
    assert state["score"] == greedy(ref, "Article: hi\nScore:", max_new_tokens=2)["text"]
    # a batch mixing empty and non-empty lists (traced, planned) runs both
    states = judge_each.run_batch([{"article": "a", "dimensions": []}, {"article": "b", "dimensions": ["x", "y"]}],
                                  temperature=0, backend=backend)
    assert [st.ret_value for st in states] == [0, 2] and len(states[1]["judgement"]) == 2
    assert states[0]["score"] == greedy(ref, "Article: a\nScore:", max_new_tokens=2)["text"]
    # the trace of an empty fork records what runs: no branches, no join, the gen after
    graph = judge_each.trace(article="a", dimensions=[])
    assert graph.stop_reason is None and "fork" not in graph.pretty() and "gen 'score'" in graph.pretty()
    with pytest.raises(ValueError, match="fork size=-1 is invalid; allowed: an integer >= 0"):
        _fork(-1, backend)


def _fork(size: int, backend: Any) -> None:
    @sgl.function
    def forked(s):
        s += "x"
        s.fork(size)

    forked.run(backend=backend)


# -- 7. s += s.system(...) ---------------------------------------------------------------------------
@sgl.function
def chat_example(s, question):
    s += s.system("You are a helpful assistant.")  # "Same as: s += system(...)" in SGLang's tutorial
    s.user("Question: " + question)  # appends by itself
    s += sgl.assistant("Answer:" + sgl.gen("answer", max_tokens=3))


def test_a_role_method_appends_once_whether_or_not_it_is_added(backend, ref):
    tok = ref.tokenizer
    for state in [chat_example.run("Why?", temperature=0, backend=backend),
                  *chat_example.run_batch([{"question": "Why?"}, {"question": "Why?"}], temperature=0,
                                          backend=backend)]:
        msgs = state.messages()
        assert [m["role"] for m in msgs] == ["system", "user", "assistant"]
        prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True) + "Answer:"
        assert state["answer"] == greedy(ref, prompt, max_new_tokens=3)["text"]
        assert msgs[2]["content"] == "Answer:" + state["answer"]


# -- 8. run()'s n, use_thread and stop_regex ---------------------------------------------------------
@sgl.function
def sample_answer(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3)


@sgl.function
def count_to(s, n):
    s += "Count to " + str(n) + ":" + sgl.gen("count", max_tokens=2)


def test_run_takes_sglangs_n_use_thread_and_stop_regex(backend, ref):
    state = sample_answer.run("Why?", n=2, temperature=0, use_thread=False, backend=backend)
    want = greedy(ref, "Q: Why?\nA:", max_new_tokens=3)["text"]
    assert state["answer"] == [want, want] and state.text().endswith("A:" + want)
    states = sample_answer.run_batch([{"question": "Why?"}], n=2, temperature=0, backend=backend)
    assert states[0]["answer"] == [want, want]
    assert sample_answer.run("Why?", stop_regex=[], temperature=0, backend=backend)["answer"] == want
    with pytest.raises(ValueError, match="stop_regex"):  # run()'s stop_regex is checked (and used: test_stop_regex18)
        sample_answer.run("Why?", stop_regex=r"\d(", backend=backend)
    # a program's own parameter of that name is still its argument
    state = count_to.run(n=3, temperature=0, backend=backend)
    assert state["count"] == greedy(ref, "Count to 3:", max_new_tokens=2)["text"]


# -- 9. an assistant turn opens as the template opens a reply ---------------------------------------
# Written here after Qwen3's template: the last assistant message after the last user
# turn is written after an empty think block, while a reply opens without one.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and loop.last and loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# after DeepSeek-R1's: a reply opens with "<think>\n", a finished message has none; that
# opening is not taken (the answer would follow an unclosed think tag in later turns)
R1_LIKE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|User|>' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{- '<|Assistant|>' + m.content + '<|end|>' }}"
    "{%- else %}{{- m.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|Assistant|><think>\\n' }}{%- endif %}"
)


class Scripted(sgl.BaseBackend):
    """Answers every generate request with ``reply``; roles through ``template``."""

    def __init__(self, reply: str, template: Any) -> None:
        self.reply, self.template, self.requests = reply, template, []

    def submit(self, req: Any, on_chunk: Any = None) -> Any:
        from plait.backend import Pending

        self.requests.append(req)
        p = Pending(req, on_chunk)
        text = "" if req.sampling_params.get("max_new_tokens") == 0 else self.reply
        p.result(0, {"text": text, "output_ids": [], "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}})
        return p

    def abort(self, rid: str) -> None:
        pass

    def get_chat_template(self) -> Any:
        return self.template


@sgl.function
def reasoned_turns(s, model_type):
    s += sgl.user("Give me a capital.")
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("first", max_tokens=32), model_type=model_type))
    s += sgl.user("Another one.")
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("second", max_tokens=32), model_type=model_type))


@pytest.mark.parametrize("source, model_type, reply, opens", [
    (QWEN3_LIKE, "qwen3", "<think>\nHm.\n</think>\n\nParis.", "<|im_start|>assistant\n"),
    (R1_LIKE, "deepseek-r1", "Hm.\n</think>\n\nParis.", "<|Assistant|>"),
])
def test_an_assistant_turn_opens_as_the_template_opens_a_reply(source, model_type, reply, opens, folder):
    from plait.chat_template import jinja_template

    template = jinja_template(source, {"bos_token": "<s>"})
    fake = Scripted(reply, template)
    state = reasoned_turns.run(model_type, backend=fake)
    gens = [r.text for r in fake.requests if r.sampling_params.get("max_new_tokens") != 0]
    assert len(gens) == 2 and all(t.endswith(opens) for t in gens)
    assert "<think>\n\n</think>" not in "".join(gens)  # thinking is not switched off
    assert (state["first"], state["first_reasoning_content"]) == ("Paris.", "Hm.")
    assert (state["second"], state["second_reasoning_content"]) == ("Paris.", "Hm.")
    # the second request holds the first turn's answer only, after the history's own text
    assert gens[1].startswith(gens[0][: -len(opens)])
    # a template whose reply opens as its messages are written (SmolLM2's) reads as before
    with open(Path(folder) / "chat_template.jinja") as f:
        smol = jinja_template(f.read())
    assert smol.markers("assistant", ("user",)) == ("<|im_start|>assistant\n", "<|im_end|>\n")


def test_a_failing_stream_consumer_fails_its_request_not_the_backend(backend, ref):
    from plait.backend import Request

    def boom(index: int, piece: str, meta: dict[str, Any]) -> None:
        raise RuntimeError("consumer gone")

    pending = backend.submit(Request(text="Hello", sampling_params={"max_new_tokens": 4}, stream=True), boom)
    with pytest.raises(sgl.BackendError, match="the stream's consumer failed: RuntimeError: consumer gone"):
        pending.wait(30)
    # the in-process engine's thread survived: later programs run
    assert sample_answer.run("Why?", temperature=0, backend=backend)["answer"] == \
        greedy(ref, "Q: Why?\nA:", max_new_tokens=3)["text"]


# -- 10. sgl.Engine.generate with SGLang's other keywords --------------------------------------------
def test_engine_generate_names_sglangs_keywords_it_does_not_serve(backend, ref):
    engine = object.__new__(sgl.Engine)  # the offline engine over the module's in-process backend
    engine.endpoint = backend
    params = {"max_new_tokens": 3, "temperature": 0}
    out = engine.generate("Hello", params, image_data=None, lora_path=None, return_hidden_states=False,
                          data_parallel_rank=None)
    assert out["text"] == greedy(ref, "Hello", max_new_tokens=3)["text"]
    with pytest.raises(ValueError, match="image_data='cat.png' is not supported: plait serves text-only models"):
        engine.generate("Hello", params, image_data="cat.png")
    with pytest.raises(ValueError, match="lora_path='adapter' is not supported: plait serves no LoRA adapters"):
        asyncio.run(engine.async_generate("Hello", params, lora_path="adapter"))
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_tokens'"):
        engine.generate("Hello", params, max_tokens=3)
