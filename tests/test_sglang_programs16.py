"""SGLang frontend programs plait's authors did not write, in the idioms of public
projects that use ``import sglang as sgl`` (an evaluation client that replays chat
transcripts through ``run_batch`` and reads logprobs off the executor, scripts that set
a named chat template on ``runtime.endpoint``, profiling scripts that run programs
positionally, SGLang's choices-method docs and its debug-studio docs), run through
``import plait as sgl``; one test per gap they found:

1. ``state.stream_executor.meta_info["answer"]`` (SGLang's executor, read after
   ``run_batch``) and ``backend.model_info["tokenizer_path"]`` raised AttributeError.
2. A custom ``ChoicesSamplingMethod`` whose ``__call__`` takes
   ``unconditional_token_logprobs`` without a default (SGLang always passes it, None
   unless the method asks for it) failed with TypeError inside the program.
3. ``from sglang.lang.chat_template import get_chat_template`` then
   ``runtime.endpoint.chat_template = get_chat_template("chatml")``: the import
   failed, and an assignment would have been silently ignored. Both now say that roles
   render with the served model's own template; reading ``chat_template`` works.
4. ``s.begin_debug_region(name)`` (SGLang's debug studio) raised AttributeError; it is
   accepted, warns, and changes nothing.
5. ``s.fork(n)`` with an integer that is not a Python ``int`` (numpy's; SGLang calls
   ``int(size)``) was refused.
6. ``gen(tools=[python_function])`` (an SGLang fork's function-calling example) said
   "tools[0].type must be 'function'"; it now says the tool is a Python function and
   what a tool must be.

Model outputs are compared with a plain reference ``Engine`` on the same tiny
weights, so nothing depends on what the random model says.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import plait as sgl
from plait.choices import ChoicesDecision, ChoicesSamplingMethod
from plait.runtime import Engine

from lang_fixtures import backend, folder, ref  # noqa: F401  (pytest fixtures)

END = "<|im_end|>\n"  # the tiny model's tokenizer is SmolLM2's (ChatML): a turn's end


def greedy(ref: Engine, prompt: str, **params: Any) -> str:
    return ref.generate(prompt, {"temperature": 0.0, **params})["text"]


# -- 1. an evaluation client: transcripts through run_batch, logprobs off the executor ---------------
@sgl.function
def replay_chat(s, messages, max_completion_tokens):
    for m in messages:
        s += getattr(sgl, m["role"])(m["content"])
    s += sgl.assistant(sgl.gen("answer", max_tokens=max_completion_tokens, return_logprob=True,
                               logprob_start_len=0, stop=[], stop_token_ids=[]))


def test_executor_meta_info_and_model_info_as_an_eval_client_reads_them(backend, ref, folder):
    chats = [
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three."}],
    ]
    states = replay_chat.run_batch([{"messages": c, "max_completion_tokens": 5} for c in chats],
                                   temperature=0, backend=backend)
    for chat, state in zip(chats, states):
        assert state.error() is None
        answer = state.stream_executor.meta_info["answer"]
        assert answer is state.get_meta_info("answer")
        assert state.stream_executor.variables["answer"] == state["answer"]
        logprobs, token_ids, _ = zip(*answer["output_token_logprobs"])
        input_logprobs, input_ids, _ = zip(*answer["input_token_logprobs"])
        assert len(token_ids) == answer["completion_tokens"] <= 5
        assert len(input_ids) == answer["prompt_tokens"]  # logprob_start_len=0: every prompt token
        assert answer["finish_reason"]["type"] in ("length", "stop")
        # the answer is the reference's greedy continuation of the prompt the roles rendered
        text = state.text()
        assert text.endswith(state["answer"] + END)
        prompt = text[: len(text) - len(state["answer"] + END)]
        assert state["answer"] == greedy(ref, prompt, max_new_tokens=5, stop=[END.strip()])
        assert ref.tokenizer.encode(prompt, add_special_tokens=False) == list(input_ids)
        assert state.messages()[-1] == {"role": "assistant", "content": state["answer"].lstrip()}  # as SGLang strips it
        # (a chat without a system message starts with the template's default one, as in SGLang)
        default = [] if chat[0]["role"] == "system" else ["system"]
        assert [m["role"] for m in state.messages()[:-1]] == default + [m["role"] for m in chat]
    info = backend.model_info
    assert info["model_path"] == info["tokenizer_path"] == backend.get_model_name() == folder
    assert info["is_generation"] is True


@sgl.function
def gen_text(s, text, tokens, temperature):
    s += text
    s += sgl.gen("out", max_tokens=tokens, temperature=temperature)


@sgl.function
def replay_only(s, messages):
    for m in messages:
        s += getattr(sgl, m["role"])(m["content"])
    return s


def test_positional_arguments_named_like_run_keywords_and_programs_without_gen(backend, ref):
    # a profiling script's program: its own parameter is called temperature, passed by position
    state = gen_text.run("word word word", 4, 0.0, backend=backend)
    assert state["out"] == greedy(ref, "word word word", max_new_tokens=4)
    # a program that only replays a transcript (and returns its state): the text is the template's
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    state = replay_only.run(messages=msgs, backend=backend)
    assert state.ret_value is state
    assert state.messages() == msgs
    assert state.text() == backend.engine.tokenizer.apply_chat_template(msgs, tokenize=False)


# -- 2. custom choice methods get every keyword of SGLang's interface -------------------------------
class LastChoice(ChoicesSamplingMethod):
    """A method written to SGLang's signature: every keyword required."""

    def __call__(self, *, choices, normalized_prompt_logprobs, input_token_logprobs, output_token_logprobs,
                 unconditional_token_logprobs):
        return ChoicesDecision(choices[-1], {"unconditional": unconditional_token_logprobs,
                                             "normalized": normalized_prompt_logprobs})


class LeastUnconditional(ChoicesSamplingMethod):
    """Asks for the unconditional logprobs and reads them from ``**kwargs``."""

    @property
    def requires_unconditional_logprobs(self) -> bool:
        return True

    def __call__(self, **kwargs):
        sums = [sum(e[0] or 0.0 for e in row) for row in kwargs["unconditional_token_logprobs"]]
        return ChoicesDecision(kwargs["choices"][sums.index(min(sums))], {"sums": sums})


@sgl.function
def pick(s, method):
    s += sgl.user("What is the capital of France?")
    s += sgl.assistant(sgl.gen("answer", choices=["London", "Paris", "Berlin"], choices_method=method))


def test_custom_choice_methods_get_every_keyword(backend):
    state = pick.run(method=LastChoice(), backend=backend)
    assert state["answer"] == "Berlin"
    meta = state.get_meta_info("answer")
    assert meta["unconditional"] is None and len(meta["normalized"]) == 3
    # the normalized logprobs are those the built-in method decides on
    builtin = pick.run(method=sgl.token_length_normalized, backend=backend)
    assert meta["normalized"] == builtin.get_meta_info("answer")["normalized_prompt_logprobs"]

    state = pick.run(method=LeastUnconditional(), backend=backend)
    sums = state.get_meta_info("answer")["sums"]
    assert len(sums) == 3 and state["answer"] == ["London", "Paris", "Berlin"][sums.index(min(sums))]
    # the same unconditional logprobs SGLang's documented method reads
    documented = pick.run(method=sgl.unconditional_likelihood_normalized, backend=backend)
    rows = documented.get_meta_info("answer")["unconditional_token_logprobs"]
    assert sums == [sum(e[0] or 0.0 for e in row) for row in rows]


# -- 3. named chat templates ---------------------------------------------------------------------------
@sgl.function
def one_turn(s):
    s += sgl.user("hi")
    s += sgl.assistant(sgl.gen("a", max_tokens=2, temperature=0))


def test_a_named_chat_template_is_used_and_the_backend_s_is_readable(backend):
    from plait.chat_template import ChatTemplate, get_chat_template, jinja_template

    template = backend.chat_template
    assert isinstance(template, ChatTemplate) and template is backend.get_chat_template()
    assert template.stop_str == ("<|im_end|>",)
    chatml = get_chat_template("chatml")  # SGLang's name: plait's built-in ChatML
    assert chatml.markers("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    with pytest.raises(ValueError, match=r"get_chat_template\('vicuna_v1.1'\).*built in: chatml.*--chat-template"):
        get_chat_template("vicuna_v1.1")
    # an assigned template is what roles render with (SGLang's backend.chat_template = ...)
    marked = jinja_template("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                            "{% if add_generation_prompt %}[assistant]{% endif %}", name="marked")
    backend.chat_template = marked
    try:
        assert backend.chat_template is marked
        assert one_turn.run(backend=backend).text().startswith("[user]hi[assistant]")
        with pytest.raises(ValueError, match="chat_template='chatml' is invalid; allowed: a ChatTemplate"):
            backend.chat_template = "chatml"
    finally:
        backend.chat_template = None
    assert backend.chat_template is template
    assert one_turn.run(backend=backend).text().startswith("<|im_start|>")


# -- 4. the debug studio's region marker ------------------------------------------------------------------
@sgl.function
def text_qa(s, question):
    s.begin_debug_region("TEXT_QA")
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", max_tokens=6)


def test_a_debug_region_warns_and_changes_nothing(backend, ref):
    with pytest.warns(UserWarning, match=r"begin_debug_region\('TEXT_QA'\).*no debug studio"):
        state = text_qa.run(question="What is the capital of France?", temperature=0, backend=backend)
    assert state["answer"] == greedy(ref, "Q: What is the capital of France?\nA:", max_new_tokens=6, stop=["\n"])
    assert state.text() == "Q: What is the capital of France?\nA:" + state["answer"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = text_qa.trace(question="x")  # tracing runs the body too
    assert graph.complete and [site.name for site in graph.call_sites()] == ["answer"]


# -- 5. fork sizes of other integer types ----------------------------------------------------------------
class Index:
    """An integer of another type (numpy's int64 behaves so)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __index__(self) -> int:
        return self.n


@sgl.function
def branches(s, n):
    s += "Tips:"
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += f"\n{i + 1}." + sgl.gen("tip", max_tokens=3)
    forks.join()


def test_fork_takes_any_integer_type(backend, ref):
    state = branches.run(n=Index(2), temperature=0, backend=backend)
    assert state["tip"] == [greedy(ref, f"Tips:\n{i}.", max_new_tokens=3) for i in (1, 2)]
    for bad in (True, 2.0, "2", Index(-1)):
        with pytest.raises(ValueError, match=r"fork size=.* is invalid; allowed: an integer >= 0"):
            branches.run(n=bad, backend=backend)


# -- 6. tools given as Python functions ----------------------------------------------------------------------
def get_current_weather(location: str, unit: str = "fahrenheit") -> str:
    """Get the current weather in a given location."""
    return location + unit


def test_tools_given_as_python_functions_are_refused_naming_the_function():
    with pytest.raises(ValueError, match=r"tools\[1\] is a Python function \('get_current_weather'\).*"
                                         r"allowed: OpenAI function tools"):
        sgl.gen("answer", tools=[{"type": "function", "function": {"name": "f", "parameters": {}}},
                                 get_current_weather], tool_choice="auto")


def test_a_program_s_own_backend_with_only_get_chat_template_still_renders_roles(backend):
    """The roles' template is read through chat_template_of: a duck-typed backend of the
    program's own (no BaseBackend, no chat_template attribute) keeps working."""
    from plait.backend import chat_template_of

    class Own:
        def get_chat_template(self):
            return backend.get_chat_template()

    assert chat_template_of(Own()) is backend.get_chat_template()
