"""SGLang programs plait's authors did not write, in the idioms of SGLang's benchmark
scripts (multi-document QA forks one branch per document of a list argument, HellaSwag
and MMLU join the choices into the prompt, few-shot programs loop over a list of
examples, multi-turn chat loops over a list of questions) and its tracing docs
(``compile()`` / ``trace()`` / ``cache()``), run through ``import plait as sgl``; one
test per gap they found:

1. An argument the tracer does not know (``compile()``, ``trace()``, ``cache()``, and
   the layout check of ``run_batch`` for arguments that differ between instances) is
   a placeholder string. A body that used it as a list read the placeholder's own
   characters: ``for q in questions`` traced one chat turn per character of the mark,
   ``s.fork(len(docs))`` then ``docs[i]`` forked one branch per character, a short
   slice (``question[:3]``) left part of the mark in the constant text that
   ``cache()`` prefills, and ``", ".join(choices)`` made the layout check warn about
   an argument named ``', c, h, o, i, c, e, s, '``. As a sequence a placeholder is
   now one item, itself: the loop traces one turn holding the argument, the fork one
   branch, the warning names ``'choices'``; indexing past that item stops the trace,
   naming the argument.

Model outputs are compared with the same program run without tracing, or with a plain
reference ``Engine`` on the same tiny weights, so nothing depends on what the random
model says.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import plait as sgl
from plait.lint import PromptLayoutWarning
from plait.runtime import Engine
from plait.tracer import ForkNode

from lang_fixtures import ENGINE_OPTS, backend, folder, ref  # noqa: F401  (pytest fixtures)


def greedy(ref: Engine, prompt: str, **params: Any) -> dict[str, Any]:
    return ref.generate(prompt, {"temperature": 0.0, **params})


INSTRUCTIONS = "Answer the question with one of the choices. Think about each choice carefully first. " * 3


# -- 1. a list argument the tracer does not know ------------------------------------------------------
@sgl.function
def multi_turn(s, questions):
    s += sgl.system("You are a helpful assistant.")
    for q in questions:
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen("answer", max_tokens=3))


@sgl.function
def multi_document_qa(s, docs, question):
    s += "Please answer a question according to given documents.\nQuestion: " + question + "\nDocuments begin.\n"
    forks = s.fork(len(docs))
    forks += lambda i: docs[i]
    forks.join("concate_and_append")
    s += "\nDocuments end.\nAnswer:" + sgl.gen("answer", max_tokens=3)


@sgl.function
def mmlu_style(s, question, choices):
    s += "Question: " + question + "\nChoices: " + ", ".join(choices) + "\n" + INSTRUCTIONS
    s += "Answer:" + sgl.select("answer", choices=choices)


@sgl.function
def few_shot(s, examples, question):
    for q, a in examples:
        s += "Q: " + q + "\nA: " + a + "\n\n"
    s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=3, stop="\n")


@sgl.function
def rag(s, context, question):
    if context:
        s += "Context: " + context[:2000] + "\n"
    s += f"Question: {question.strip()}\nAnswer:" + sgl.gen("answer", max_tokens=3)


@sgl.function
def pick_second(s, options):
    s += "Option: " + options[1] + sgl.gen("why", max_tokens=3)


@sgl.function
def short_slice(s, question):
    s += INSTRUCTIONS + "Topic: "
    s += question[:3] + "\n" + sgl.gen("answer", max_tokens=3)


def test_a_list_argument_the_tracer_does_not_know_is_one_item(backend, ref, capsys):
    # compile() traces with every argument unknown: the loop runs once, over the argument
    multi_turn.compile().print_graph()
    shown = capsys.readouterr().out
    assert shown.count("begin user") == 1 and "arg questions" in shown and "gen 'answer'" in shown
    assert "\ue000" not in shown  # no turn per character of the mark
    given = multi_turn.trace(questions=["Hi?", "Bye?"])  # given, the list is traced as it is
    assert given.stop_reason is None and given.pretty().count("begin user") == 2

    # one branch holding the documents, then the gen
    docs = multi_document_qa.trace(question="Which?")
    assert docs.stop_reason is None
    pretty = docs.pretty()
    assert "arg docs" in pretty and "gen 'answer'" in pretty and "\ue000" not in pretty
    assert sum(isinstance(n, ForkNode) and len(n.branches) == 1 for n in docs.nodes) == 1
    # as text an unknown argument still marks where it lands: +, f-strings, strip(),
    # truthiness and a slice that keeps all of it
    pretty = rag.trace().pretty()
    assert rag.trace().stop_reason is None
    assert "arg context" in pretty and "arg question" in pretty and "gen 'answer'" in pretty
    # an index past the one item stops, naming the argument
    assert pick_second.trace().stop_reason == "indexes argument 'options' at 1, which is known only at run time"
    # cache() prefills the text before the argument, not the mark's first characters
    assert short_slice.trace().prefix_text(None) == INSTRUCTIONS + "Topic: "
    assert short_slice.cache(backend=backend)


def test_batches_over_list_arguments_run_as_written_and_warn_by_name(backend, ref):
    # run_batch's layout check traces with the differing arguments unknown
    instances = [{"question": "Sky colour?", "choices": ["blue", "green"]},
                 {"question": "Grass colour?", "choices": ["red", "green", "pink"]}]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = mmlu_style.run_batch(instances, temperature=0, backend=backend)
    layout = [str(w.message) for w in caught if issubclass(w.category, PromptLayoutWarning)]
    assert not any("c, h, o" in m or "\ue000" in m for m in layout), layout
    # the warning is right to be given (the choices come before the instructions): by name
    assert any("argument 'choices'" in m for m in layout), layout
    singles = [mmlu_style.run(**kw, temperature=0, backend=backend)["answer"] for kw in instances]
    assert [st["answer"] for st in states] == singles
    assert all(st["answer"] in kw["choices"] for st, kw in zip(states, instances))

    # one fork per document of each instance's own list
    batch = [{"docs": ["Doc one. ", "Doc two. "], "question": "Which?"},
             {"docs": ["Alpha. ", "Beta. ", "Gamma. "], "question": "Which?"}]
    states = multi_document_qa.run_batch(batch, temperature=0, backend=backend)
    for st, kw in zip(states, batch):
        prompt = ("Please answer a question according to given documents.\nQuestion: Which?\nDocuments begin.\n"
                  + "".join(kw["docs"]) + "\nDocuments end.\nAnswer:")
        assert st.text() == prompt + greedy(ref, prompt, max_new_tokens=3)["text"]

    # few-shot examples that differ between instances
    ex = [("1+1", "2"), ("2+2", "4")]
    states = few_shot.run_batch([{"examples": ex, "question": "3+3"}, {"examples": ex[:1], "question": "4+4"}],
                                temperature=0, backend=backend)
    prompt = "Q: 1+1\nA: 2\n\nQ: 4+4\nA:"
    assert states[1]["answer"] == greedy(ref, prompt, max_new_tokens=3, stop=["\n"])["text"]
