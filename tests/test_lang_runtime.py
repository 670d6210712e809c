"""Programs over ZMQ against a real runtime (``plait.Runtime`` launches the server as a
sidecar with a tiny model): SGLang-style programs, one connection shared by many
program threads, streaming, pins, aborts, an unreachable runtime and a dying one."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

import plait as sgl
from plait.runtime import Engine

OPTS = {"kv_cache_tokens": 8192, "num_threads": 1, "max_running_requests": 64}


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def runtime(folder):
    rt = sgl.Runtime(folder, echo_logs=False, **OPTS)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def ref(folder):
    with Engine(folder, **OPTS) as e:
        yield e


def wait_idle(ep, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = ep.get_server_info()
        if info["running"] == 0 and info["waiting"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


@sgl.function
def few_shot_qa(s, question):
    s += "The following are questions with answers.\n\n"
    s += "Q: What is the capital of France?\nA: Paris\n\n"
    s += "Q: What is the capital of Germany?\nA: Berlin\n\n"
    s += "Q: What is the capital of Italy?\nA: Rome\n\n"
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=12)


@sgl.function
def multi_turn_question(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=8))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=8))


def test_programs_over_zmq_match_the_reference(runtime, ref):
    sgl.set_default_backend(runtime)
    try:
        state = few_shot_qa.run(question="What is the capital of Spain?")
        prompt = state.text()[: len(state.text()) - len(state["answer"])]
        expect = ref.generate(prompt, {"temperature": 0, "max_new_tokens": 12, "stop": ["\n", "<|im_end|>"]})
        assert state["answer"] == expect["text"]

        chat = multi_turn_question.run(question_1="Hi!", question_2="And then?", temperature=0)
        msgs = chat.messages()
        assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
        # roles rendered by the model's own template (read from the model's files here)
        first = ref.tokenizer.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
        assert chat.text().startswith(first + chat["answer_1"])
        assert sgl.get_server_info()["protocol_version"] >= 1
        assert sgl.flush_cache() is True
    finally:
        sgl.set_default_backend(None)


def test_select_over_zmq_scores_merged_boundary_tokens(runtime, ref):
    context, choices = "The answer is: hel", ["lo", "p", "icopter"]

    @sgl.function
    def pick(s):
        s += context + sgl.select("w", choices)

    meta = pick.run(backend=runtime).get_meta_info("w")
    tok = ref.tokenizer
    ctx = tok.encode(context, add_special_tokens=False)
    for c, got in zip(choices, meta["input_token_logprobs"]):
        full = tok.encode(context + c, add_special_tokens=False)
        d = next(i for i, (a, b) in enumerate(zip(full, ctx + [-1])) if a != b)
        out = ref.generate(input_ids=full, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                           logprob_start_len=0)["meta_info"]["input_token_logprobs"]
        assert [t for _, t, _ in got] == full[d:]  # SGLang's (logprob, id, text)
        assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _ in out[d:]], abs=1e-4)


def test_many_threads_share_one_connection(runtime, ref):
    qs = [{"question": f"What is the capital of country {i}?"} for i in range(32)]
    states = few_shot_qa.run_batch(qs, num_threads=16, backend=runtime)
    serial = [few_shot_qa.run(backend=runtime, **q)["answer"] for q in qs[:3]]
    assert [s["answer"] for s in states[:3]] == serial
    assert all(s.error() is None for s in states)
    ep = runtime.endpoint
    assert ep._client.handlers == {}  # every request's responses arrived and were routed
    info = wait_idle(ep)
    assert info["pins"]["active"] == 0  # the batch's pin was released
    pool = info["pool"]
    assert pool["free"] + pool["evictable"] + pool["locked"] == pool["total"] and pool["locked"] == 0


def test_streaming_over_zmq(runtime):
    @sgl.function
    def story(s):
        s += "Once upon a time"
        s += sgl.gen("story", max_tokens=24, ignore_eos=True, stop=["zzqq"])

    state = story.run(temperature=0, stream=True, backend=runtime)
    pieces = list(state.text_iter("story"))
    assert len(pieces) > 1 and "".join(pieces) == state["story"]
    again = story.run(temperature=0, backend=runtime)
    assert again["story"] == state["story"]


def test_pin_and_unpin_over_zmq(runtime):
    ep = runtime.endpoint
    text = "A long shared instruction that many programs start with. " * 8
    pin_id = ep.pin(text, ttl_s=60)
    deadline = time.monotonic() + 20
    while ep.get_server_info()["pins"]["active"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep.get_server_info()["pins"]["active"] == 1
    assert ep.unpin(pin_id) is True
    assert ep.unpin(pin_id) is False
    budget = ep.get_server_info()["pins"]["budget_tokens"]
    held = []
    with pytest.raises(sgl.BackendError, match="pin budget") as info:
        for i in range(budget // 900 + 1):
            held.append(ep.pin(f"{i} " + "word " * 900, ttl_s=60))
    assert info.value.code == 400 and len(held) == budget // 900
    assert all(ep.unpin(p) for p in held)


def test_a_raising_program_aborts_over_zmq(runtime):
    ep = runtime.endpoint

    @sgl.function
    def long_then_bug(s):
        s += "Write a long essay."
        s += sgl.gen("essay", max_tokens=800, ignore_eos=True)
        deadline = time.monotonic() + 20
        while ep.get_server_info()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        raise ValueError("bug")

    with pytest.raises(ValueError, match="bug"):
        long_then_bug.run(backend=runtime, temperature=0)
    info = wait_idle(ep)
    assert info["running"] == 0 and info["pool"]["locked"] == 0


def test_unreachable_runtime_raises_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    with pytest.raises(sgl.RuntimeUnavailableError, match="no plait runtime answered"):
        sgl.RuntimeEndpoint(f"tcp://127.0.0.1:{port}", connect_timeout_s=1.0)
    with pytest.raises(sgl.RuntimeUnavailableError, match="no plait runtime answered"):
        sgl.RuntimeEndpoint(f"http://127.0.0.1:{port}", connect_timeout_s=1.0)
    assert time.monotonic() - t < 10
    with pytest.raises(ValueError, match="base_url"):
        sgl.RuntimeEndpoint("localhost:30000")


def test_endpoint_from_the_http_url(runtime):
    ep = sgl.RuntimeEndpoint(runtime.url)
    try:
        assert ep.zmq_address == runtime.zmq_address
        assert few_shot_qa.run(question="Hi?", backend=ep).error() is None
    finally:
        ep.shutdown()


def test_a_runtime_that_dies_mid_program(folder):
    rt = sgl.Runtime(folder, echo_logs=False, restart_engine=False, **OPTS)  # the engine stays dead
    try:
        assert few_shot_qa.run(question="Hi?", backend=rt).error() is None
        os.kill(rt.handle.engine_pid, signal.SIGSTOP)  # freeze it so the next request is surely in flight

        @sgl.function
        def two_steps(s):
            s += "Count:" + sgl.gen("first", max_tokens=4)
            s += sgl.gen("out", max_tokens=200, ignore_eos=True)

        state = two_steps.run(stream=True, backend=rt, temperature=0)
        time.sleep(0.2)
        os.kill(rt.handle.engine_pid, signal.SIGKILL)
        with pytest.raises(sgl.ProgramError, match="engine process exited") as info:
            state["out"]
        assert isinstance(info.value.__cause__, sgl.RuntimeUnavailableError)
        # the front is still up and says the engine is gone
        with pytest.raises(sgl.ProgramError, match="not running"):
            few_shot_qa.run(question="Hi?", backend=rt)["answer"]
        # now the front dies too: the sidecar's client notices the process is gone, and
        # a plain endpoint notices the lost connection
        remote = sgl.RuntimeEndpoint(rt.zmq_address)
        os.kill(rt.pid, signal.SIGKILL)
        with pytest.raises(sgl.ProgramError, match="exited|lost"):
            few_shot_qa.run(question="Hi?", backend=rt)["answer"]
        with pytest.raises(sgl.ProgramError, match="lost|cannot reach"):
            few_shot_qa.run(question="Hi?", backend=remote)["answer"]
        remote.shutdown()
    finally:
        rt.shutdown()
    # the killed server could not remove its private socket folder; the launcher did
    ipc_dir = os.path.dirname(rt.zmq_address[len("ipc://"):])
    assert os.path.basename(ipc_dir).startswith("plait-") and not os.path.exists(ipc_dir)


def test_server_info_carries_the_chat_template_for_remote_clients(runtime, folder):
    from plait.runtime_endpoint import _template_from_info, _template_from_files

    info = runtime.endpoint.get_server_info()
    assert info["chat_template"] is True and "{%" in info["chat_template_text"]
    # a client on another machine: the model path means nothing there
    remote = _template_from_info({**info, "model_path": "/nonexistent/model"})
    local = _template_from_info({"model_path": folder, "chat_template": True})
    text, _ = _template_from_files(folder)
    assert info["chat_template_text"] == text
    for role, history in [("system", ()), ("user", ("system",)), ("assistant", ("system", "user"))]:
        assert remote.markers(role, history) == local.markers(role, history)
