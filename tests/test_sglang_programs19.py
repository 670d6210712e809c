"""SGLang programs and scripts plait's authors did not write, in the idioms of SGLang's
lang tests (a program that runs another program, as its multi-function tracing test
does), its RAG example (which polls the executor until the program is finished), its
benchmark scripts (``read_jsonl`` / ``dump_state_text`` from ``sglang.utils``, settings
read from numpy arrays) and its offline-engine and frontend docs (``stream_and_merge``,
``print_highlight``, ``wait_for_server``), run through ``import plait as sgl``; one test
per gap they found:

1. A program whose body runs another program (``branch = expand(tip=...)``) had that
   program run for real whenever the body was traced: ``run_batch`` ran it three more
   times per instance (its plan and its layout check trace every instance), two of them
   with the tracer's placeholder text as the argument, and ``compile()`` ran it too
   (or, with no default backend yet, recorded "no backend"). A program run from a
   traced body now runs nothing: the trace stops there, as SGLang's tracer does not
   run it either.
2. ``state.stream_executor.is_finished`` (SGLang's RAG example polls it, then reads
   ``stream_executor.variables``) raised AttributeError.
3. Settings of another number type (numpy's ``int64`` max_tokens, ``float32`` /
   ``float64`` temperature, a tuple of stop token ids), as programs read them from a
   data set, failed: refused by the in-process engine ("max_new_tokens=np.int64(5) is
   invalid"), and over ZMQ with "Encoding objects of type numpy.int64 is unsupported";
   a tuple of stop token ids worked over ZMQ but not in process. They are now the
   Python numbers (and list) they stand for, on both backends and in ``sgl.Engine``.
4. ``from sglang.utils import read_jsonl, dump_state_text`` (every benchmark script),
   ``stream_and_merge`` / ``async_stream_and_merge`` (the offline-engine docs),
   ``print_highlight`` and ``wait_for_server`` (the frontend tutorial) had no
   counterpart: ``plait.utils`` has them.

Model outputs are compared with a plain reference ``Engine`` on the same tiny weights,
so nothing depends on what the random model says.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import plait as sgl
from plait.runtime import Engine
from plait.utils import (
    async_stream_and_merge, dump_state_text, print_highlight, read_jsonl, stream_and_merge, trim_overlap,
    wait_for_server,
)

from lang_fixtures import ENGINE_OPTS, backend, folder, ref  # noqa: F401  (pytest fixtures)


def greedy(ref: Engine, prompt: str, **params: Any) -> dict[str, Any]:
    return ref.generate(prompt, {"temperature": 0.0, **params})


@pytest.fixture(scope="module")
def runtime(folder):
    rt = sgl.Runtime(model_path=folder, echo_logs=False, **ENGINE_OPTS)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def llm(folder):
    engine = sgl.Engine(model_path=folder, **ENGINE_OPTS)
    yield engine
    engine.shutdown()


# -- 1. a program that runs another program is not run by the tracer --------------------------------
EXPAND_PROMPT = "Please expand the following tip into a detailed paragraph:"
tips_seen: list[str] = []  # the tip of every run of expand's body


@sgl.function
def expand(s, tip):
    tips_seen.append(tip)
    s += EXPAND_PROMPT + tip + "\n"
    s += sgl.gen("detailed_tip", max_tokens=4)


@sgl.function
def tip_summary(s, topic):
    branch = expand(tip=topic, temperature=0)  # a program run of its own, not on s
    s += "Tip: " + branch["detailed_tip"] + "\nIn summary" + sgl.gen("summary", max_tokens=3)


def test_a_program_run_from_a_traced_body_runs_nothing(backend, ref, monkeypatch):
    tips_seen.clear()
    # compile() traces: before a default backend is set (SGLang's test compiles first)
    monkeypatch.setattr(sgl.global_config, "default_backend", None)
    graph = tip_summary.compile().graph
    assert graph.stop_reason == "runs program 'expand', whose outputs are known only at run time"
    assert tips_seen == []
    # run_batch traces each instance (its plan, and twice more for the layout check)
    monkeypatch.setattr(sgl.global_config, "default_backend", backend)
    states = tip_summary.run_batch([{"topic": "health"}, {"topic": "money"}], temperature=0)
    assert sorted(tips_seen) == ["health", "money"]  # once each, never a placeholder
    for state, topic in zip(states, ["health", "money"]):
        tip = greedy(ref, EXPAND_PROMPT + topic + "\n", max_new_tokens=4)["text"]
        prompt = "Tip: " + tip + "\nIn summary"
        assert state.text() == prompt + greedy(ref, prompt, max_new_tokens=3)["text"]
    # trace() too; a run outside any trace still runs
    tips_seen.clear()
    assert tip_summary.trace(topic="x").stop_reason.startswith("runs program 'expand'")
    assert tips_seen == []
    assert expand.run(tip="x", temperature=0, backend=backend)["detailed_tip"] == greedy(
        ref, EXPAND_PROMPT + "x\n", max_new_tokens=4)["text"]


# -- 2. the executor's is_finished, polled as SGLang's RAG example does ----------------------------
@sgl.function
def generation(s, question, *context, gate=None):
    s += sgl.user("Given this question:\n" + question + "\nAnd this context:\n" + "\n".join(context))
    if gate is not None:
        gate.wait()
    s += sgl.assistant(sgl.gen("answer", max_tokens=5))


def test_executor_is_finished_once_the_program_is_done(backend, ref):
    state = generation.run("Who?", "Alice met Bob.", "Bob left.", temperature=0, backend=backend)
    assert state.stream_executor.is_finished
    answer = state.stream_executor.variables["answer"]
    text = state.text()
    prompt = text[: text.index(answer)]
    assert answer == greedy(ref, prompt, max_new_tokens=5, stop=["<|im_end|>"])["text"]
    # a streamed program is not finished while its body still runs
    gate = threading.Event()
    streamed = generation.run("Who?", "Alice met Bob.", "Bob left.", gate=gate, temperature=0, stream=True,
                              backend=backend)
    assert not streamed.stream_executor.is_finished
    gate.set()
    deadline = time.monotonic() + 60
    while not streamed.stream_executor.is_finished and time.monotonic() < deadline:
        time.sleep(0.05)
    assert streamed.stream_executor.is_finished
    assert streamed.stream_executor.variables["answer"] == answer


# -- 3. settings read from numpy ---------------------------------------------------------------------
@sgl.function
def few_shot(s, question, max_tokens):
    s += "Q: What is the capital of France?\nA: Paris\nQ: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=max_tokens, stop_token_ids=(2,))


@pytest.mark.parametrize("which", ["backend", "runtime"])
def test_numpy_numbers_are_settings_like_python_ones(which, request, ref):
    b = request.getfixturevalue(which)
    limits = np.array([3, 5], dtype=np.int64)  # as read from a data frame
    states = few_shot.run_batch([{"question": "Capital of Italy?", "max_tokens": limits[0]},
                                 {"question": "Capital of Spain?", "max_tokens": limits[1]}],
                                temperature=np.float32(0.0), backend=b)
    for state, q, n in zip(states, ["Italy", "Spain"], [3, 5]):
        prompt = f"Q: What is the capital of France?\nA: Paris\nQ: Capital of {q}?\nA:"
        assert state["answer"] == greedy(ref, prompt, max_new_tokens=n, stop_token_ids=[2])["text"]
    # run()'s defaults: numpy's float64 is a float subclass the wire protocol did not encode
    state = few_shot.run("Capital of Italy?", None, max_new_tokens=np.int64(4), temperature=np.float64(0.0),
                         top_k=np.int32(1), backend=b)
    prompt = "Q: What is the capital of France?\nA: Paris\nQ: Capital of Italy?\nA:"
    assert state["answer"] == greedy(ref, prompt, max_new_tokens=4, stop_token_ids=[2])["text"]
    # select's temperature, and a float where an integer belongs is still refused by name
    assert isinstance(sgl.select("c", ["a", "b"], temperature=np.float32(0.0)).temperature, float)
    with pytest.raises(sgl.ProgramError, match=r"max_new_tokens=5\.0 is invalid"):
        few_shot.run("x", 5.0, backend=b)["answer"]


def test_numpy_numbers_in_the_offline_engine(llm, ref):
    out = llm.generate("The capital of France is", {"max_new_tokens": np.int64(4), "temperature": np.float64(0)})
    assert out["text"] == greedy(ref, "The capital of France is", max_new_tokens=4)["text"]


# -- 4. sglang.utils ---------------------------------------------------------------------------------
@sgl.function
def boolq(s, question):
    s += "Question: " + question + "\nAnswer:" + sgl.gen("answer", max_tokens=3, stop=["\n"])


def test_utils_read_and_dump_as_the_benchmarks_do(backend, ref, tmp_path):
    data = tmp_path / "questions.jsonl"
    data.write_text('# a comment line\n{"question": "Is water wet?"}\n\n{"question": "Is fire cold?"}\n')
    lines = read_jsonl(str(data))[:2]  # a list: the benchmarks slice it
    assert lines == [{"question": "Is water wet?"}, {"question": "Is fire cold?"}]
    states = boolq.run_batch(lines, temperature=0, backend=backend, progress_bar=True)
    out = tmp_path / "tmp_output_plait.txt"
    dump_state_text(str(out), states)
    dump_state_text(str(out), ["a plain string", 42], mode="a")
    texts = [s.text() for s in states] + ["a plain string", "42"]
    expected = "".join(f"{'=' * 40} {i} {'=' * 40}\n{t}\n{'=' * 80}\n\n" for i, t in enumerate(texts[:2]))
    expected += "".join(f"{'=' * 40} {i} {'=' * 40}\n{t}\n{'=' * 80}\n\n" for i, t in enumerate(texts[2:]))
    assert out.read_text() == expected
    prompt = "Question: Is water wet?\nAnswer:"
    assert states[0].text() == prompt + greedy(ref, prompt, max_new_tokens=3, stop=["\n"])["text"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"a": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 is not a JSON value"):
        read_jsonl(str(bad))


def test_utils_merge_an_offline_engine_stream(llm, ref, capsys):
    assert trim_overlap("Hello wor", "world") == "ld"
    assert trim_overlap("abc", "xyz") == "xyz"
    params = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
    expected = greedy(ref, "Hello, my name is", max_new_tokens=6, ignore_eos=True)["text"]
    assert stream_and_merge(llm, "Hello, my name is", params) == expected

    async def merged() -> list[str]:
        return [piece async for piece in async_stream_and_merge(llm, "Hello, my name is", params)]

    pieces = asyncio.run(merged())
    assert len(pieces) >= 2 and "".join(pieces) == expected
    print_highlight(expected)
    assert capsys.readouterr().out == expected + "\n"


def test_utils_wait_for_server(runtime):
    wait_for_server(runtime.url, timeout=30)  # a live runtime answers at once
    with pytest.raises(TimeoutError, match="did not answer"):
        wait_for_server("http://127.0.0.1:9", timeout=0.3)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with pytest.raises(RuntimeError, match="exited with code 0"):
        wait_for_server("http://127.0.0.1:9", timeout=30, process=gone)
    wait_for_server(runtime.url, timeout=30)  # the runtime is still up
