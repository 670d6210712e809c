"""SGLang frontend programs written again here in the idioms of SGLang's benchmarks
(tree-of-thought search over forks of forks, a ReAct trace replayed through one-branch
forks, the JSON-schema benchmark's program and its tokenizer lookup), run through
``import plait as sgl``; one test per gap they found:

1. A program whose model call (or role) failed kept the error to itself: nothing was
   logged, so a caller that only printed ``state.text()`` got the text cut short with
   no sign of why (SGLang warns with the error). A failure is now logged as a warning
   naming it; an aborted program is not.
2. ``get_server_info()`` had no ``tokenizer_path`` (SGLang's JSON-schema benchmark
   reads ``default_backend.get_server_info()["tokenizer_path"]``): KeyError.

The programs that already ran are kept as regression tests; model outputs are
compared with a plain reference ``Engine`` on the same tiny weights, so nothing
depends on what the random model says.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

import plait as sgl
from plait.runtime import Engine

from lang_fixtures import backend, folder, ref  # noqa: F401  (pytest fixtures)

END = "<|im_end|>"  # the tiny model's tokenizer is SmolLM2's (ChatML)


def greedy(ref: Engine, prompt: str, **params: Any) -> str:
    return ref.generate(prompt, {"temperature": 0.0, **params})["text"]


# -- 1. a failed program says so --------------------------------------------------------------------
@sgl.function
def answer_then_more(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3)
    s += "\nMore:" + sgl.gen("more", max_tokens=3, temperature=-1)  # refused by the runtime
    s += "\nNever appended."


@sgl.function
def nested_roles(s):
    with s.user():
        s += sgl.assistant("hi")


def test_a_failed_program_is_logged_as_a_warning_naming_the_error(backend, ref, caplog):
    with caplog.at_level(logging.WARNING, logger="plait"):
        state = answer_then_more.run(question="Why?", temperature=0, backend=backend)
        text = state.text()
    # the text stops where the program failed; what ran before is there and right
    assert state["answer"] == greedy(ref, "Q: Why?\nA:", max_new_tokens=3)
    assert text == "Q: Why?\nA:" + state["answer"] + "\nMore:"
    assert isinstance(state.error(), sgl.BackendError)
    with pytest.raises(sgl.ProgramError):
        state["more"]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "plait"]
    assert any("temperature" in m and "program failed" in m for m in warned), warned

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="plait"):
        state = nested_roles.run(backend=backend)
        state.text()
    assert isinstance(state.error(), ValueError)
    assert any("roles do not nest" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@sgl.function
def long_story(s):
    s += "Once upon a time" + sgl.gen("story", max_tokens=400, ignore_eos=True)


def test_an_aborted_program_is_not_logged_as_a_failure(backend, caplog):
    with caplog.at_level(logging.WARNING, logger="plait"):
        state = long_story.run(stream=True, temperature=0, backend=backend)
        pieces = state.text_iter("story")
        next(pieces)
        state.abort()
        list(pieces)
        state.text()
    assert isinstance(state.error(), sgl.ProgramCancelled)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "plait"], caplog.text


# -- 2. the JSON-schema benchmark's program and its tokenizer lookup -------------------------------
@sgl.function
def schema_gen(s, message, json_schema, max_tokens):
    system, user = message
    s += sgl.system(system)
    s += sgl.user(user)
    s += sgl.assistant(sgl.gen("json_output", temperature=0, max_tokens=max_tokens, json_schema=json_schema))


def test_json_schema_benchmark_program_and_its_tokenizer_path(backend, folder):
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False})
    arguments = [{"message": (json.dumps("You answer in JSON."), json.dumps(q)), "json_schema": schema,
                  "max_tokens": 24} for q in ("Is water wet?", "Is fire cold?")]
    previous = sgl.global_config.default_backend
    sgl.set_default_backend(backend)
    try:
        states = schema_gen.run_batch(arguments, temperature=0, num_threads=2, progress_bar=True)
        info = sgl.global_config.default_backend.get_server_info()
    finally:
        sgl.set_default_backend(previous)
    for state in states:
        assert state.error() is None
        out = state["json_output"]
        if state.get_meta_info("json_output")["finish_reason"]["type"] != "length":
            assert set(json.loads(out)) == {"ok"}
        assert state.messages()[-1] == {"role": "assistant", "content": out}
    assert info["tokenizer_path"] == info["model_path"] == backend.get_model_name()
    assert sgl.get_server_info(backend)["tokenizer_path"] == info["model_path"]


# -- regression: tree-of-thought search (forks of forks, groups iterated and extended) ---------------
def propose(s, question, n):
    s += sgl.user("Plan how to solve: " + question)
    forks = s.fork(n)
    forks += sgl.assistant(sgl.gen("plan", max_tokens=3))
    return forks


def execute(s, n):
    s += sgl.user("Now solve it.")
    forks = s.fork(n)
    forks += sgl.assistant(sgl.gen("answer", max_tokens=3))
    return forks


@sgl.function
def tree_search(s, question, num_branches):
    solutions = []
    for plan in propose(s, question, num_branches):
        solutions.extend(execute(plan, num_branches))
    return [(leaf["plan"], leaf["answer"], leaf.text()) for leaf in solutions]


def test_tree_of_thought_search_over_forks_of_forks(backend, ref):
    args = [{"question": "2 + 3?", "num_branches": 2}, {"question": "7 - 4?", "num_branches": 2}]
    states = tree_search.run_batch(args, temperature=0, num_threads=2, progress_bar=True, backend=backend)
    for arg, state in zip(args, states):
        leaves = state.ret_value
        assert len(leaves) == 4
        for plan, answer, text in leaves:
            # each leaf's answer is the greedy continuation of its own transcript
            head = text[: text.rindex(answer + END)] if answer else text[: text.rindex(END)]
            assert answer == greedy(ref, head, max_new_tokens=3, stop=[END])
            assert ("Plan how to solve: " + arg["question"]) in text and "Now solve it." in text
            assert text.index(plan) < text.index("Now solve it.")
    single = tree_search.run(**args[0], temperature=0, backend=backend)
    assert single.ret_value == states[0].ret_value


# -- regression: a ReAct trace replayed with one-branch forks --------------------------------------
@sgl.function
def webthink(s, question, triplets):
    s += "Solve the task with Thought, Action, Observation steps.\nQuestion: " + question + "\n"
    steps = []
    for i in range(1, len(triplets) + 2):
        s += "Thought " + str(i) + ":"
        ss = s.fork(1)
        ss[0] += sgl.gen(name="thought_action", max_tokens=4, stop="Observation")
        ss.join()
        steps.append(ss[0]["thought_action"])
        if i > len(triplets):
            break
        t = triplets[i - 1]
        s += t["thought"] + "\nAction " + str(i) + ":" + t["action"] + "\nObservation " + str(i) + ":" + \
            t["observation"] + "\n"
    return steps


def test_react_replay_with_one_branch_forks(backend, ref):
    triplets = [{"thought": " look it up", "action": " Search[x]", "observation": " x is y"}]
    states = webthink.run_batch([{"question": "What is x?", "triplets": triplets}] * 2, temperature=0,
                                progress_bar=True, backend=backend)
    for state in states:
        text = state.text()
        assert text.endswith("Observation 1: x is y\nThought 2:")
        first, second = state.ret_value
        assert first == greedy(ref, text[: text.index("Thought 1:") + 10], max_new_tokens=4, stop=["Observation"])
        assert second == greedy(ref, text, max_new_tokens=4, stop=["Observation"])
        # as in SGLang, join gathers only variables new to the parent: the second step's
        # join leaves the list the first one made
        assert state["thought_action"] == [first]
