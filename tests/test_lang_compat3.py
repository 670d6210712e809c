"""SGLang compatibility gaps of the language, one test (or a few) per gap:

1. A streamed program whose body raises keeps (and streams) what it appended before,
   and the exception reaches the consumer: from ``text_iter()`` / ``text_async_iter()``
   once the stream ends, from ``sync()``, as the cause of reading a variable the body
   never appended, and in the log (SGLang prints it).
2. ``gen_int`` / ``gen_string`` take SGLang's positional parameters; ``gen`` and
   ``select`` keep SGLang's order.
3. ``repr(state)`` is SGLang's ``ProgramState(<text>)``, unquoted.
4. A constrained gen inside a chat role is not cut by the template's end-of-turn stop
   string (its output may contain that text); unconstrained gens still stop there, and
   the user's stop strings still apply to constrained ones.

Fast parts run on the scripted fake backend of ``test_lang_unit``; the end-to-end
constraint check runs on the tiny random model through the in-process backend.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
import threading

import pytest

import plait as sgl
from plait.chat_template import ChatTemplate, jinja_render
from plait.ir import DTYPE_REGEX, DTYPE_STOP

from lang_fixtures import backend, folder  # noqa: F401  (pytest fixtures)
from test_lang_unit import SMOLLM2_TEMPLATE, FakeBackend

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]


# -- 1. a streamed body that raises ----------------------------------------------------------------
@sgl.function
def boom(s):
    s += "Q: hi\n"
    s += sgl.gen("a", max_tokens=4)
    raise RuntimeError("boom")


def streamed_boom(fake: FakeBackend) -> sgl.ProgramState:
    fake.reply = lambda prompt, params: "abcdefgh"
    fake.chunks = 4
    return boom.run(stream=True, backend=fake)


def test_a_streamed_body_that_raises_keeps_its_text_and_raises_at_the_end_of_the_stream(caplog):
    fake = FakeBackend()
    with caplog.at_level(logging.ERROR, logger="plait"):
        state = streamed_boom(fake)
        pieces = []
        with pytest.raises(RuntimeError, match="boom"):
            for piece in state.text_iter():
                pieces.append(piece)
    assert "".join(pieces) == "Q: hi\nabcdefgh" == state.text()
    assert state["a"] == "abcdefgh" and fake.aborted == []  # what it appended ran to its end
    with pytest.raises(RuntimeError, match="boom"):
        state.sync()
    assert isinstance(state.error(), RuntimeError)
    # logged with its traceback when it happened (SGLang's body thread prints it)
    logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], RuntimeError)]
    assert logged and logged[0].levelno == logging.ERROR and "boom" in logged[0].getMessage()


def test_a_streamed_body_that_raises_reaches_variable_streams_and_reads():
    state = streamed_boom(FakeBackend())
    assert "".join(state.text_iter("a")) == "abcdefgh"  # the variable came: its stream ends cleanly
    with pytest.raises(RuntimeError, match="boom"):
        list(state.text_iter("never"))  # the body raised before appending it
    with pytest.raises(sgl.ProgramError, match="raised before appending it") as info:
        state["never"]
    assert isinstance(info.value.__cause__, RuntimeError)
    assert state.text() == "Q: hi\nabcdefgh"  # text() does not raise: it returns what was made

    async def consume() -> list[str]:
        return [p async for p in streamed_boom(FakeBackend()).text_async_iter()]

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(consume())


def test_a_streamed_body_that_returns_raises_nothing_and_run_without_stream_still_raises():
    @sgl.function
    def fine(s):
        s += "Q: hi\n" + sgl.gen("a", max_tokens=4)
        return 7

    fake = FakeBackend()
    state = fine.run(stream=True, backend=fake)
    assert "".join(state.text_iter()) == "Q: hi\n<out>"
    state.sync()
    assert state.ret_value == 7 and state.error() is None
    with pytest.raises(RuntimeError, match="boom"):
        boom.run(backend=fake)


def test_a_variable_the_finished_program_never_set_streams_one_empty_piece():
    """SGLang's ``text_iter(name)`` / ``text_async_iter(name)`` yield one ``""`` for a
    name the program never set once it has finished (plait's yielded nothing); a set
    but empty variable yields nothing, as there."""
    @sgl.function
    def fine(s):
        s += "Q: hi\n" + sgl.gen("a", max_tokens=4)
        s += sgl.gen("empty", max_tokens=4)

    fake = FakeBackend()
    fake.reply = lambda prompt, params: "" if prompt.endswith("<out>") else "<out>"
    state = fine.run(stream=True, backend=fake)
    assert list(state.text_iter("never")) == [""] and list(state.text_iter("empty")) == []
    assert "".join(state.text_iter("a")) == "<out>" and state["empty"] == ""

    async def consume(name: str, meta: bool) -> list:
        return [p async for p in fine.run(stream=True, backend=fake).text_async_iter(name, return_meta_data=meta)]

    assert asyncio.run(consume("never", False)) == [""] == asyncio.run(consume("never", True))
    assert asyncio.run(consume("empty", False)) == []


def test_a_streamed_body_failing_on_an_aborted_program_is_not_logged_as_an_error(caplog):
    fake = FakeBackend()
    fake.hold = threading.Event()
    started = threading.Event()

    @sgl.function
    def reads(s):
        s += "x" + sgl.gen("a", max_tokens=4)
        started.set()
        s += s["a"]

    with caplog.at_level(logging.ERROR, logger="plait"):
        state = reads.run(stream=True, backend=fake)
        started.wait(5)
        while not fake.gens():
            threading.Event().wait(0.01)
        state.abort()
        with pytest.raises(sgl.ProgramError, match="aborted by the caller"):
            state.sync()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert isinstance(state.error(), sgl.ProgramCancelled)


# -- 2. SGLang's positional parameters -------------------------------------------------------------
# (sgl-project/sglang python/sglang/lang/api.py)
SGLANG_GEN = ["name", "max_tokens", "min_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature",
              "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
              "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "dtype", "choices",
              "choices_method", "regex", "json_schema"]
SGLANG_GEN_DTYPE = ["name", "max_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                    "top_k", "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
                    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"]
SGLANG_SELECT = ["name", "choices", "temperature", "choices_method"]


def positional(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds]


def test_gen_int_gen_string_gen_and_select_take_sglangs_positional_parameters():
    assert positional(sgl.gen)[:len(SGLANG_GEN)] == SGLANG_GEN
    assert positional(sgl.gen_int) == SGLANG_GEN_DTYPE
    assert positional(sgl.gen_string) == SGLANG_GEN_DTYPE
    assert positional(sgl.select) == SGLANG_SELECT
    # gen_int(name, max_tokens, n, stop, stop_token_ids, stop_regex, temperature, top_p)
    g = sgl.gen_int("n", 8, None, [";"], None, None, 0.5, 0.9)
    assert g.params == {"max_new_tokens": 8, "stop": [";"], "temperature": 0.5, "top_p": 0.9, "dtype": int}
    g = sgl.gen_string("s", 6, 2, None, [7], None, None, None, 5, return_logprob=True, seed=3)
    assert g.params == {"max_new_tokens": 6, "n": 2, "stop_token_ids": [7], "top_k": 5, "return_logprob": True,
                        "seed": 3, "dtype": str}
    assert sgl.gen_int("n", 8, None, None, None, r"\d").params["stop_regex"] == [r"\d"]
    with pytest.raises(ValueError, match="stop_regex"):
        sgl.gen_int("n", 8, None, None, None, r"\d(")
    with pytest.raises(TypeError):
        sgl.gen_int("n", dtype=float)
    s = sgl.select("c", ["a", "b"], 0.5)
    assert (s.name, s.choices, s.temperature) == ("c", ["a", "b"], 0.5)


# -- 3. repr(state) ------------------------------------------------------------------------------------
def test_repr_of_a_state_is_sglangs_unquoted_form():
    @sgl.function
    def qa(s):
        s += "Q: 'x'\n" + sgl.gen("a", max_tokens=4)

    state = qa.run(backend=FakeBackend())
    assert repr(state) == "ProgramState(Q: 'x'\n<out>)"
    assert repr(state)[len("ProgramState("):-1] == state.text()  # as SGLang's cot_decoding example slices it


# -- 4. the end-of-turn stop and constraints -------------------------------------------------------------
def test_constrained_gens_in_a_role_do_not_get_the_end_of_turn_stop():
    fake = FakeBackend(template=ChatTemplate(jinja_render(SMOLLM2_TEMPLATE)))

    @sgl.function
    def chat(s):
        s += sgl.user("Hi")
        s += sgl.assistant(sgl.gen("free", max_tokens=4))
        s += sgl.assistant(sgl.gen("free_stop", max_tokens=4, stop="\n"))
        s += sgl.assistant(sgl.gen("re", regex=r"(<\|im_end\|>|<\|im_fin\|>)x"))
        s += sgl.assistant(sgl.gen("re_stop", regex=r"[a-z<|>_]+", stop=["\n", "<|im_end|>"]))
        s += sgl.assistant(sgl.gen("js", json_schema={"type": "string"}))
        s += sgl.assistant(sgl.gen("eb", ebnf='root ::= "a"'))
        s += sgl.assistant(sgl.gen_int("i"))
        s += sgl.assistant(sgl.gen_string("str"))
        s += sgl.assistant(sgl.gen("tool", tools=TOOLS, tool_choice="required"))
        s += sgl.assistant(sgl.gen("tool_auto", tools=TOOLS))

    chat.run(backend=fake, stop="END")
    stops = [r.sampling_params.get("stop") for r in fake.gens()]
    assert stops == [
        ["END", "<|im_end|>"],  # unconstrained: the end-of-turn text ends the reply
        ["\n", "<|im_end|>"],
        ["END"],  # constrained: only the user's stop strings (run()'s default here)
        ["\n", "<|im_end|>"],  # the gen's own stop strings, as given
        ["END"],
        ["END"],
        ["END", *DTYPE_STOP["int"]],  # a dtype keeps the stop strings that end its value
        ["END"],
        ["END"],  # a forced tool call is a regex
        ["END", "<|im_end|>"],  # tool_choice auto: free text
    ]
    assert fake.gens()[6].sampling_params["regex"] == DTYPE_REGEX["int"]


def test_a_constrained_reply_may_contain_the_end_of_turn_text(backend):
    """The repro: on the tiny model (SmolLM2's ChatML template, end of turn
    ``<|im_end|>``) the constraint forces the reply to spell ``<|im_end|>`` out in
    plain tokens; the implicit stop string used to cut it to ''."""

    @sgl.function
    def chat(s):
        s += sgl.user("Say it.")
        s += sgl.assistant(sgl.gen("only", regex=r"<\|im_end\|>x", max_tokens=32))
        s += sgl.assistant(sgl.gen("either", regex=r"(<\|im_end\|>|<\|im_fin\|>)x", max_tokens=32))
        s += sgl.assistant(sgl.gen("free", max_tokens=4))

    state = chat.run(backend=backend, temperature=0)
    assert state["only"] == "<|im_end|>x"
    assert re.fullmatch(r"(<\|im_end\|>|<\|im_fin\|>)x", state["either"]), state["either"]
    assert state.get_meta_info("only")["finish_reason"].get("matched") != "<|im_end|>"
    # (messages()[0] is the system text the template writes when a program has none)
    assert state.messages()[2] == {"role": "assistant", "content": "<|im_end|>x"}
