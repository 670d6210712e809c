"""More SGLang frontend programs, written again here in the idioms of SGLang's docs,
examples and benchmarks (tree-of-thought, multi-document QA, ReAct, multi-chain
reasoning, mt-bench), run through ``import plait as sgl``; one test per gap they found:

1. Programs with ``**kwargs`` or ``*args`` failed: every parameter after ``s`` was
   taken for a named argument (``f.run(q="x")`` on ``def f(s, **kwargs)`` raised
   "unexpected argument 'q'", and ``*args`` got the first value as ``args=``).
2. ``sgl.flush_cache(empty_cache=False)``, SGLang's signature, raised TypeError.
3. ``sgl.system(...)`` on a model whose chat template folds the system text into the
   first user turn (Gemma 3, Llama 2) failed with "drops the content of a 'system'
   message"; a template that refuses the system role now says what to do.

Model outputs are compared with a plain reference ``Engine`` on the same tiny weights,
so nothing depends on what the random model says.
"""

from __future__ import annotations

from typing import Any

import pytest

import plait as sgl
from plait.runtime import Engine

ENGINE_OPTS = {"kv_cache_tokens": 8192, "num_threads": 1, "max_running_requests": 16, "attention_backend": "torch"}


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def backend(folder):
    b = sgl.EngineBackend(folder, **ENGINE_OPTS)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def ref(folder):
    with Engine(folder, **ENGINE_OPTS) as e:
        yield e


def greedy(ref: Engine, prompt: str, **params: Any) -> str:
    return ref.generate(prompt, {"temperature": 0.0, **params})["text"]


# -- 1. *args and **kwargs ------------------------------------------------------------------------
@sgl.function
def ask_with_options(s, question, **options):
    s += "Q: " + question + options.get("suffix", "") + "\nA:" + sgl.gen("answer", max_tokens=4)
    return sorted(options)


@sgl.function
def ask_all(s, head, *questions):
    s += head
    for q in questions:
        s += "Q: " + q + "\nA:" + sgl.gen(max_tokens=3, stop="\n") + "\n"
    return len(questions)


@sgl.function
def outer_program(s, topic):
    s += "Topic: " + topic + "\n"
    seen = ask_with_options(s, "why?", suffix=" (short)")  # a nested call passes **options on
    s += " So" + sgl.gen("more", max_tokens=2)
    return seen


def test_kwargs_and_varargs_programs_get_their_arguments_as_python_passes_them(backend, ref):
    state = ask_with_options.run("Why is the sky blue?", suffix=" Be brief.", temperature=0, backend=backend)
    prompt = "Q: Why is the sky blue? Be brief.\nA:"
    assert state.ret_value == ["suffix"] and state["answer"] == greedy(ref, prompt, max_new_tokens=4)

    # run_batch: dicts with names only **options takes, traced and planned like the others
    states = ask_with_options.run_batch([{"question": "a?", "suffix": "!"}, {"question": "b?"}], temperature=0,
                                        backend=backend)
    assert [st.ret_value for st in states] == [["suffix"], []]
    assert [st.text() for st in states] == [f"Q: {q}\nA:" + greedy(ref, f"Q: {q}\nA:", max_new_tokens=4)
                                           for q in ("a?!", "b?")]
    assert "suffix" in ask_with_options.trace(question="a?", suffix="!").arg_names

    state = ask_all.run("Answer briefly.\n", "one?", "two?", temperature=0, backend=backend)
    assert state.ret_value == 2 and state.text().count("Q: ") == 2 and "Q: two?\nA:" in state.text()

    state = outer_program.run(topic="sky", temperature=0, backend=backend)
    assert state.ret_value == ["suffix"] and state.text().startswith("Topic: sky\nQ: why? (short)\nA:")

    with pytest.raises(TypeError, match="unexpected argument 'extra'"):
        outer_program.run(topic="x", extra=1, backend=backend)
    with pytest.raises(TypeError, match=r"takes 1 positional arguments after s, got 2"):
        outer_program.run("x", "y", backend=backend)


# -- 2. flush_cache(empty_cache=...) ----------------------------------------------------------------
def test_flush_cache_takes_sglangs_empty_cache_keyword(backend):
    assert sgl.flush_cache(backend, empty_cache=False) is True
    assert sgl.flush_cache(backend=backend, empty_cache=True) is True
