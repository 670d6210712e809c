"""Prompt-layout lint (language) and the early-divergence counter (runtime)."""

from __future__ import annotations

import sys
import warnings

import pytest

import plait
from plait.lint import PromptLayoutWarning
from plait.runtime.memory import PageAllocator
from plait.runtime.radix_cache import RadixCache

INSTRUCTIONS = ("You are a careful assistant for the support desk. Answer in two sentences, cite the policy "
                "section you used, never promise refunds, and ask for the order number when it is missing. ") * 2


@plait.function
def stamped(s, now, question):
    s += plait.system(f"Current time: {now}. " + INSTRUCTIONS)
    s += plait.user(question)
    s += plait.assistant(plait.gen("answer", max_tokens=8))


@plait.function
def well_laid_out(s, now, question):
    s += plait.system(INSTRUCTIONS + f"Current time: {now}.")
    s += plait.user(question)
    s += plait.assistant(plait.gen("answer", max_tokens=8))


def test_a_timestamp_before_the_instructions_is_reported():
    (issue,) = stamped.lint()
    assert "argument 'now'" in issue.value and issue.offset == len("Current time: ")
    assert issue.tokens_lost == len(". " + INSTRUCTIONS) // 4 and issue.following.startswith(". You are")
    assert "put the constant text first" in str(issue).lower()
    assert well_laid_out.lint() == []


@plait.function
def stamped_inside(s, question):
    import datetime

    s += plait.system(f"Current time: {datetime.datetime.now().isoformat()}. " + INSTRUCTIONS)
    s += plait.user(question)
    s += plait.assistant(plait.gen("answer", max_tokens=8))


def test_a_timestamp_the_program_computes_is_reported():
    """No argument carries it: found by tracing twice (the text differs between traces)."""
    (issue,) = stamped_inside.lint()
    assert issue.value.startswith("text that changes from call to call ('20") and issue.offset == len("Current time: ")
    assert issue.tokens_lost == len(". " + INSTRUCTIONS) // 4 and issue.following.startswith(". You are")

    @plait.function
    def ids_in_forks(s, question):
        import uuid

        forks = s.fork(2)
        for f in forks:
            f += f"[request {uuid.uuid4()}] " + INSTRUCTIONS + question + plait.gen("a", max_tokens=4)

    issues = ids_in_forks.lint()
    assert len(issues) == 2 and all(i.offset == len("[request ") for i in issues)

    @plait.function
    def stamped_last(s, question):
        import time

        s += INSTRUCTIONS + question + f" (asked at {time.time()})" + plait.gen("a", max_tokens=4)

    assert stamped_last.lint() == []  # nothing long after it


def test_string_defaults_vary_unless_a_batch_leaves_them():
    @plait.function
    def greet(s, question, user="guest", shots=2):
        s += "User: " + user + ". " + INSTRUCTIONS
        for i in range(shots):  # a non-string default stays bound: the body still runs
            s += f"Example {i}. "
        s += question + plait.gen("a", max_tokens=4)

    (issue,) = greet.lint()  # callers may pass user
    assert issue.value == "argument 'user'"
    assert issue.tokens_lost == len(". " + INSTRUCTIONS + "Example 0. Example 1. ") // 4  # shots=2 ran
    assert greet.lint([{"question": "a?"}, {"question": "b?"}]) == []  # every instance takes the default
    (issue,) = greet.lint([{"question": "a?", "user": "ann"}, {"question": "b?", "user": "bob"}])
    assert issue.value == "argument 'user'"


def test_batch_constants_and_gen_outputs():
    same_time = [{"now": "9:00", "question": q} for q in ("a?", "b?")]
    assert stamped.lint(same_time) == []  # the same value everywhere is shared, not dynamic

    @plait.function
    def two_steps(s, topic):
        s += "Topic: " + topic + "\n" + plait.gen("draft", max_tokens=8)
        s += "\n" + INSTRUCTIONS + plait.gen("final", max_tokens=8)

    found = two_steps.lint(min_tokens=10)
    # "topic" is followed by 1 token only, but INSTRUCTIONS is shared only if it moves before
    # both the argument and the output of gen 'draft': one report names both, from "Topic: " on
    assert [(i.value, i.offset, i.count) for i in found] == [("argument 'topic', output of gen 'draft'", 7, 2)]
    assert two_steps.lint(min_tokens=1000) == []


def test_run_batch_warns():
    from test_lang_unit import FakeBackend

    @plait.function
    def plain_stamped(s, now, question):  # no roles: the fake backend has no chat template
        s += f"Current time: {now}. " + INSTRUCTIONS + question + plait.gen("answer", max_tokens=4)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states = plain_stamped.run_batch([{"now": "9:00", "question": "a?"}, {"now": "9:01", "question": "b?"}],
                                         backend=FakeBackend())
    assert all(st["answer"] == "<out>" for st in states)
    assert any(issubclass(w.category, PromptLayoutWarning) and "'now'" in str(w.message) for w in caught)


def test_cli_lint(tmp_path, monkeypatch, capsys):
    from plait.cli import main

    (tmp_path / "myprompts.py").write_text(
        "import plait\n"
        f"LONG = {INSTRUCTIONS!r}\n"
        "@plait.function\n"
        "def ask(s, user_id, q):\n"
        "    s += 'User ' + user_id + '. ' + LONG + q + plait.gen('a', max_tokens=4)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["lint", "myprompts:ask"]) == 1
    assert "argument 'user_id'" in capsys.readouterr().out
    assert main(["lint", "myprompts:ask", "--min-tokens", "100000"]) == 0
    with pytest.raises(SystemExit):
        main(["lint", "myprompts:LONG"])
    sys.modules.pop("myprompts", None)
    # a file path, as pytest and uvicorn take them (from another directory)
    monkeypatch.chdir(tmp_path.parent)
    assert main(["lint", f"{tmp_path.name}/myprompts.py:ask"]) == 1
    assert "argument 'user_id'" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["lint", "nowhere/missing.py:ask"])
    assert "no file" in capsys.readouterr().err


@pytest.mark.parametrize("ps", [1, 4])
def test_divergence_is_found_token_by_token(ps):
    alloc = PageAllocator(64, ps)
    cache = RadixCache(alloc)
    cached = list(range(100, 140))
    pages = alloc.alloc(40 // ps)
    cache.insert(cached, alloc.pages_to_slots(pages), None)
    assert cache.divergence([*cached[:6], 1, 2, 3] + cached[9:], None, 64) == 6  # a value at token 6
    assert cache.divergence(cached + [5] * 10, None, 64) is None  # follows the cached prefix through
    assert cache.divergence([7] + cached[1:], None, 64) is None  # nothing in common at all
    assert cache.divergence([*cached[:6], 1], None, 64) == 6  # short prompts too (the scheduler counts long ones)
    assert cache.divergence([*cached[:6], 1, 2, 3] + cached[9:], "other", 64) is None
    assert cache.divergence([*cached[:30], 1] + cached[31:], None, 16) is None  # beyond the limit


def test_engine_counts_early_divergences(tiny_model_factory):
    from plait.runtime import Engine

    body = list(range(200, 340))
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, page_size=4) as e:
        params = {"max_new_tokens": 1, "temperature": 0.0}
        e.generate(input_ids=[11, 12, 13] + body, sampling_params=params)
        assert e.stats()["cache_early_divergences"] == 0
        e.generate(input_ids=[11, 12, 99] + body, sampling_params=params)  # a "timestamp" at token 2
        assert e.stats()["cache_early_divergences"] == 1
        e.generate(input_ids=[11, 12, 13] + body, sampling_params=params)  # a full hit
        assert e.stats()["cache_early_divergences"] == 1


def test_every_value_before_the_constant_text_is_named():
    """Two arguments before the instructions: moving only the last would leave the first
    in front, so one report names both (the first's position, the text both precede)."""
    @plait.function
    def two_ids(s, tenant, user, question):
        s += "Tenant " + tenant + ", user " + user + ". " + INSTRUCTIONS + question + plait.gen("a", max_tokens=4)

    (issue,) = two_ids.lint()
    assert issue.value == "argument 'tenant', argument 'user'" and issue.count == 2
    assert issue.offset == len("Tenant ") and issue.tokens_lost == len(". " + INSTRUCTIONS) // 4
    text = str(issue)
    assert "after 7 characters of constant text, come before" in text, text
    (one,) = two_ids.lint([{"tenant": "acme", "user": u, "question": "q?"} for u in ("ann", "bob")])
    assert one.value == "argument 'user'" and one.count == 1 and "comes before" in str(one)
