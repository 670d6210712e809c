"""SGLang's own frontend programs, run through ``import plait as sgl``: the shapes of
its ``test_programs.py`` (decode_int, dtype_gen, decode_json_regex, parallel_encoding),
of ``examples/frontend_language`` (readme_examples' tip_suggestion, parallel_sample)
and of its frontend tutorials (separate_reasoning), written again here, small, with
one test per gap they found:

1. ``gen_int`` / ``dtype=int|float`` ran to max_tokens: the number regex left the
   model no way to end it, so "The number of hours in a day is " gave 128 digits. A
   number now ends at the first whitespace or punctuation after it (a stop string).
2. ``from sglang.lang.ir import REGEX_INT, REGEX_FLOAT, REGEX_STR`` had no
   counterpart: ``plait.ir`` has them.
3. ``sgl.separate_reasoning(gen(...), model_type=...)`` did not exist.
4. ``sgl.OpenAI`` (and SGLang's other hosted-API backends) and
   ``RuntimeEndpoint(chat_template_name=...)`` failed without saying why.

Model outputs are compared with a plain reference ``Engine`` on the same tiny
weights; reasoning is checked on a scripted backend, whose replies are ours.
"""

from __future__ import annotations

import asyncio
import json
import re
import string
from typing import Any

import pytest

import plait as sgl
from plait.backend import BaseBackend, Pending, Request
from plait.ir import DTYPE_REGEX, DTYPE_STOP, REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR
from plait.reasoning import get_reasoning_parser
from plait.runtime import Engine

from lang_fixtures import backend, folder, ref  # noqa: F401  (pytest fixtures)

GREEDY = {"temperature": 0.0}
JSON_INT = r"-?(0|[1-9][0-9]*)"


def ref_gen(ref: Engine, prompt: str, **params: Any) -> dict[str, Any]:
    return ref.generate(prompt, {**GREEDY, **params})


class Scripted(BaseBackend):
    """Answers every generate request with ``reply`` (streamed in ``chunk``-character
    pieces), roles through ``template``; records the requests."""

    def __init__(self, reply: str, template: Any, chunk: int = 5) -> None:
        self.reply, self.template, self.chunk = reply, template, chunk
        self.requests: list[Request] = []

    def submit(self, req: Request, on_chunk: Any = None) -> Pending:
        self.requests.append(req)
        p = Pending(req, on_chunk)
        meta = {"prompt_tokens": 1, "completion_tokens": 1, "finish_reason": {"type": "stop"}}
        text = "" if req.sampling_params.get("max_new_tokens") == 0 else self.reply
        for i in range(req.n):
            if req.stream:
                for k in range(0, len(text), self.chunk):
                    p.chunk(i, text[k:k + self.chunk])
            p.result(i, {"text": text, "output_ids": [], "meta_info": dict(meta)})
        return p

    def abort(self, rid: str) -> None:
        pass

    def get_chat_template(self) -> Any:
        return self.template


# -- 1. numbers end ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, number, ends", [
    ("int", "-24", DTYPE_STOP["int"]),
    ("float", "3.14e-2", DTYPE_STOP["float"]),
])
def test_a_number_ends_at_the_first_character_that_cannot_continue_it(kind, number, ends):
    rx = DTYPE_REGEX[kind]
    assert re.fullmatch(rx, number)
    for c in ends:  # a stop string, and whatever its token carries after it is allowed
        assert re.fullmatch(rx, number + c) and re.fullmatch(rx, number + c + "hours, and more\n")
    others = set(string.printable) - set(ends) - set(string.digits) - set(".eE+-")
    assert others and not any(re.fullmatch(rx, number + c) for c in others)
    assert not re.fullmatch(rx, number + "hours") and not re.fullmatch(rx, " " + number)
    assert not any(re.fullmatch(rx, bad) for bad in ("+1", "007", "-", ""))  # JSON's numbers: they parse anywhere
    assert "." not in DTYPE_STOP["float"] and re.fullmatch(rx, "3.5")  # a float goes on after its point


def test_decode_int_program_reads_whole_numbers(backend, ref):
    """SGLang's test_decode_int: each value is a bare number, as the runtime's
    constrained decoding gives it with the number's stop strings."""

    @sgl.function
    def decode_int(s):
        s += "The number of hours in a day is " + sgl.gen_int("hours", max_tokens=8) + "\n"
        s += "The number of days in a year is " + sgl.gen_int("days", max_tokens=8) + "\n"

    state = decode_int.run(temperature=0, backend=backend)
    prompt = "The number of hours in a day is "
    want = ref_gen(ref, prompt, regex=DTYPE_REGEX["int"], stop=list(DTYPE_STOP["int"]), max_new_tokens=8)
    assert state["hours"] == want["text"] and re.fullmatch(JSON_INT, state["hours"])
    second = prompt + state["hours"] + "\nThe number of days in a year is "
    want = ref_gen(ref, second, regex=DTYPE_REGEX["int"], stop=list(DTYPE_STOP["int"]), max_new_tokens=8)
    assert state["days"] == want["text"] and re.fullmatch(JSON_INT, state["days"])
    assert state.text() == second + state["days"] + "\n"
    reason = state.get_meta_info("days")["finish_reason"]
    assert reason["type"] == "length" or reason.get("matched") in DTYPE_STOP["int"]
    assert json.loads(state["hours"]) == int(state["hours"])


def test_number_stops_are_the_gens_own_without_the_chat_template_s(backend):
    fake = Scripted("7", backend.get_chat_template())

    @sgl.function
    def ask(s):
        s += sgl.user("How many?")
        s += sgl.assistant(sgl.gen_int("n", stop="!") + sgl.gen("f", dtype=float) + sgl.gen("b", dtype=bool))

    state = ask.run(backend=fake)
    # a typed gen is constrained (a regex): the constraint, not the template's end-of-turn
    # text, ends it (that stop string also cut constrained output short: lang_compat3)
    stops = [r.sampling_params.get("stop") for r in fake.requests]
    assert list(backend.get_chat_template().stop_str)
    assert stops[0] == ["!", *DTYPE_STOP["int"]] and stops[1] == list(DTYPE_STOP["float"]) and stops[2] is None
    assert [r.sampling_params["regex"] for r in fake.requests] == [DTYPE_REGEX["int"], DTYPE_REGEX["float"],
                                                                   DTYPE_REGEX["bool"]]
    assert state["n"] == "7"


def test_decode_json_regex_with_sglang_s_regex_names(backend, ref):
    """SGLang's test_decode_json_regex, with ``plait.ir``'s REGEX_* in place of
    ``sglang.lang.ir``'s and the stops SGLang's program gives them."""

    @sgl.function
    def decode_json(s):
        s += "Here is the JSON object:\n"
        with s.var_scope("json_output"):
            s += "{\n"
            s += '  "population": ' + sgl.gen("population", regex=REGEX_INT, stop=[" ", "\n"]) + ",\n"
            s += '  "latitude": ' + sgl.gen("latitude", regex=REGEX_FLOAT, stop=[" ", "\n"]) + "\n"
            s += "}"

    state = decode_json.run(temperature=0.0, max_new_tokens=6, backend=backend)
    obj = json.loads(state["json_output"])
    assert isinstance(obj["population"], int) and isinstance(obj["latitude"], (int, float))
    prompt = 'Here is the JSON object:\n{\n  "population": '
    assert state["population"] == ref_gen(ref, prompt, regex=REGEX_INT, stop=[" ", "\n"], max_new_tokens=6)["text"]
    # SGLang's patterns: a number (then whitespace), True/False, a double-quoted string
    assert re.fullmatch(REGEX_INT, "-12 \n") and re.fullmatch(REGEX_FLOAT, "1.5\n")
    assert not any(re.fullmatch(REGEX_INT, bad) for bad in ("1,", "+1", "01"))
    assert REGEX_BOOL == DTYPE_REGEX["bool"] and REGEX_STR == DTYPE_REGEX["str"]
    assert re.fullmatch(REGEX_STR, '"Paris, \\"France\\""') and not re.fullmatch(REGEX_STR, '"a"b"')


# -- 3. separate_reasoning ----------------------------------------------------------------------------
THOUGHT = "<think>\nThe user wants capitals.\n</think>\n\nParis is the capital."


@sgl.function
def two_turns(s):
    """The SGLang frontend-reasoning tutorial's multi-turn program, both ways of
    wrapping: a whole assistant turn, and a gen between assistant_begin/end."""
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user("Give me a capital.")
    s += sgl.assistant(sgl.separate_reasoning(sgl.gen("first", max_tokens=64), model_type="qwen3"))
    s += sgl.user("Another one.")
    s += sgl.assistant_begin()
    s += "Sure: " + sgl.separate_reasoning(sgl.gen("second", max_tokens=64), model_type="deepseek-r1")
    s += sgl.assistant_end()


@pytest.mark.parametrize("stream", [False, True])
def test_separate_reasoning_keeps_the_answer_in_the_text_and_the_reasoning_aside(backend, stream):
    fake = Scripted(THOUGHT, backend.get_chat_template())
    state = two_turns.run(backend=fake, stream=stream)
    pieces = list(state.text_iter()) if stream else []
    assert state["first"] == "Paris is the capital." and state["first_reasoning_content"] == "The user wants capitals."
    assert state["second"] == "Paris is the capital." and state["second_reasoning_content"] == "The user wants capitals."
    assert [m["content"] for m in state.messages() if m["role"] == "assistant"] == \
        ["Paris is the capital.", "Sure: Paris is the capital."]
    # the second turn's prompt, and the whole text, hold the answers only
    assert "<think>" not in fake.requests[1].text and "Paris is the capital." in fake.requests[1].text
    assert "think" not in state.text() and state.text().count("Paris is the capital.") == 2
    if stream:
        assert "".join(pieces) == state.text() and not any("think" in p for p in pieces)


def test_separate_reasoning_streams_the_reasoning_variable(backend):
    fake = Scripted(THOUGHT, backend.get_chat_template(), chunk=3)
    state = two_turns.run(backend=fake, stream=True)
    assert "".join(state.text_iter("first_reasoning_content")) == "The user wants capitals."
    assert "".join(state.text_iter("second")) == "Paris is the capital."


def test_separate_reasoning_without_a_reasoning_section_and_with_n(backend):
    plain = Scripted("Rome.", backend.get_chat_template())

    @sgl.function
    def ask(s, model_type):
        s += "Q: a capital?\nA: " + sgl.separate_reasoning(sgl.gen("a", max_tokens=8), model_type=model_type)

    qwen = ask.run(model_type="qwen3", backend=plain)
    assert (qwen["a"], qwen["a_reasoning_content"]) == ("Rome.", None)  # qwen3: the section is optional
    r1 = ask.run(model_type="deepseek-r1", backend=plain)
    assert (r1["a"], r1["a_reasoning_content"]) == ("", "Rome.")  # deepseek-r1 starts inside it

    @sgl.function
    def many(s):
        s += "Q: a capital?\nA: " + sgl.separate_reasoning(sgl.gen("a", n=2, max_tokens=8), model_type="qwen3")

    state = many.run(backend=Scripted(THOUGHT, None))
    assert state["a"] == ["Paris is the capital."] * 2 and state["a_reasoning_content"] == ["The user wants capitals."] * 2


def test_separate_reasoning_constrains_the_answer_after_the_reasoning(backend, ref):
    ip = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"

    @sgl.function
    def regular_expression_gen(s):
        s += "Q: What is the IP address of the Google DNS servers?\nA: "
        s += sgl.separate_reasoning(sgl.gen("answer", temperature=0, regex=ip, max_tokens=24), model_type="qwen3")

    fake = Scripted("8.8.8.8", None)
    regular_expression_gen.run(backend=fake)
    parser = get_reasoning_parser("qwen3")
    sent = fake.requests[0].sampling_params["regex"]
    assert sent == parser.constraint_prefix() + "(?:" + ip + ")"
    assert re.fullmatch(sent, THOUGHT.replace("Paris is the capital.", "8.8.4.4")) and re.fullmatch(sent, "8.8.8.8")

    state = regular_expression_gen.run(backend=backend)
    raw = ref_gen(ref, "Q: What is the IP address of the Google DNS servers?\nA: ", regex=sent, max_new_tokens=24)
    reasoning, answer = parser.parse(raw["text"])
    assert (state["answer"], state["answer_reasoning_content"]) == (answer, reasoning)
    if raw["meta_info"]["finish_reason"]["type"] != "length":
        assert re.fullmatch(ip, state["answer"])


@pytest.mark.parametrize("expr, model_type, match", [
    (lambda: sgl.gen("a"), "kimi", r"model_type='kimi' is invalid; allowed: deepseek-r1, qwen3"),
    (lambda: sgl.gen("a"), None, r"model_type=None is invalid"),
    (lambda: sgl.gen(max_tokens=4), "qwen3", r"needs a named gen"),
    (lambda: sgl.select("c", ["x", "y"]), "qwen3", r"cannot split select 'c'"),
    (lambda: sgl.gen("j", json_schema={"type": "object"}), "qwen3", r"cannot split gen 'j' with json_schema"),
    (lambda: sgl.gen_int("n"), "qwen3", r"cannot split gen 'n' with dtype=<class 'int'>: a number ends"),
    (lambda: sgl.user("hi"), "qwen3", r"has no gen"),
    (lambda: sgl.separate_reasoning(sgl.gen("a"), model_type="qwen3"), "qwen3", r"gen 'a' is already inside"),
])
def test_separate_reasoning_refuses_what_it_cannot_split(expr, model_type, match):
    with pytest.raises(ValueError, match=match):
        sgl.separate_reasoning(expr(), model_type=model_type)


# -- 4. what plait does not have says so -------------------------------------------------------------
def test_hosted_api_backends_and_frontend_templates_are_refused_by_name():
    for name in ("OpenAI", "Anthropic", "LiteLLM", "VertexAI"):
        with pytest.raises(AttributeError, match=f"plait has no {name} backend: .*plait.Runtime"):
            getattr(sgl, name)
        assert not hasattr(sgl, name)
    # a template name SGLang's table has and plait does not: a warning, then the runtime's template
    with pytest.warns(UserWarning, match="chat_template_name='qwen' is not built into plait.*runtime's chat"), \
            pytest.raises(sgl.RuntimeUnavailableError):
        sgl.RuntimeEndpoint("http://127.0.0.1:9", chat_template_name="qwen", connect_timeout_s=0.5)


# -- SGLang program shapes that already worked, kept working ------------------------------------------
def test_forks_read_without_join_and_parallel_encoding(backend, ref):
    """readme_examples' tip_suggestion (branches read without join) and
    test_parallel_encoding (join by concate_and_append)."""
    head = "Here are two tips for staying healthy: 1. Balanced Diet. 2. Regular Exercise.\n\n"

    @sgl.function
    def tip_suggestion(s):
        s += head
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"Now, expand tip {i + 1} into a paragraph:\n"
            f += sgl.gen("detailed_tip", max_tokens=5, stop="\n\n")
        s += "Tip 1:" + forks[0]["detailed_tip"] + "\n"
        s += "Tip 2:" + forks[1]["detailed_tip"] + "\n"
        s += "In summary" + sgl.gen("summary", max_tokens=5)

    state = tip_suggestion.run(temperature=0, backend=backend)
    tips = [ref_gen(ref, head + f"Now, expand tip {i + 1} into a paragraph:\n", max_new_tokens=5, stop=["\n\n"])["text"]
            for i in range(2)]
    body = head + f"Tip 1:{tips[0]}\nTip 2:{tips[1]}\nIn summary"
    assert state.text() == body + state["summary"] and state["summary"] == ref_gen(ref, body, max_new_tokens=5)["text"]

    @sgl.function
    def parallel_encoding(s, question, context_0, context_1):
        s += "USER: Please memorize these statements.\n"
        contexts = [context_0, context_1]
        forks = s.fork(len(contexts))
        forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
        forks.join(mode="concate_and_append")
        s += "Question: " + question + "\nASSISTANT:" + sgl.gen("answer", max_tokens=5)

    state = parallel_encoding.run(question="Who is the father of Julian?", context_0="Ethan is the father of Liam.",
                                  context_1="Noah is the father of Julian.", temperature=0, backend=backend)
    prompt = ("USER: Please memorize these statements.\nStatement 0: Ethan is the father of Liam.\n"
              "Statement 1: Noah is the father of Julian.\nQuestion: Who is the father of Julian?\nASSISTANT:")
    assert state.text() == prompt + state["answer"]
    assert state["answer"] == ref_gen(ref, prompt, max_new_tokens=5)["text"]


def test_parallel_sample_and_positional_run_batch(backend, ref):
    """examples' parallel_sample (+= on a fork group, gathered lists) and run_batch
    over argument lists with a progress bar, as SGLang's choices_logprob runs it."""

    @sgl.function
    def parallel_sample(s, question, n):
        s += "Question: " + question + "\n"
        forks = s.fork(n)
        forks += "Reasoning:" + sgl.gen("reasoning", stop="\n", max_tokens=4) + "\n"
        forks += "Tool:" + sgl.gen("tool", choices=["calculator", "browser"]) + "\n"
        forks.join()

    state = parallel_sample.run(question="Compute 5 + 2 + 4.", n=2, temperature=0, backend=backend)
    reasoning = ref_gen(ref, "Question: Compute 5 + 2 + 4.\nReasoning:", stop=["\n"], max_new_tokens=4)["text"]
    assert state["reasoning"] == [reasoning] * 2 and len(state["tool"]) == 2
    assert set(state["tool"]) <= {"calculator", "browser"} and state.text() == "Question: Compute 5 + 2 + 4.\n"

    @sgl.function
    def tool_use(s, question):
        s += "To answer this question: " + question + ", "
        s += "I need to use a " + sgl.gen("tool", choices=["calculator", "search engine"])

    by_list = tool_use.run_batch([["What is 5 + 6?"], ["Who is Michael Jordan?"]], progress_bar=True, num_threads=2,
                                 backend=backend)
    by_dict = [tool_use.run(question=q, backend=backend) for q in ("What is 5 + 6?", "Who is Michael Jordan?")]
    assert [s["tool"] for s in by_list] == [s["tool"] for s in by_dict]
    assert [s.get_meta_info("tool")["input_token_logprobs"] for s in by_list] == \
        [s.get_meta_info("tool")["input_token_logprobs"] for s in by_dict]


def test_streaming_a_variable_sync_and_async(backend, ref):
    """SGLang's streaming.py: text_iter(var_name=...) and text_async_iter."""

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=6)

    want = ref_gen(ref, "Q: What is the capital of France?\nA:", max_new_tokens=6)["text"]
    state = qa.run(question="What is the capital of France?", temperature=0, stream=True, backend=backend)
    assert "".join(state.text_iter(var_name="answer")) == want == state["answer"]

    async def consume() -> str:
        st = qa.run(question="What is the capital of France?", temperature=0, stream=True, backend=backend)
        return "".join([piece async for piece in st.text_async_iter(var_name="answer")])

    assert asyncio.run(consume()) == want
