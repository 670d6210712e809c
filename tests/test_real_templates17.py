"""Tool calling with the real chat templates of open models plait did not write.

The templates in ``tests/data/templates17/`` are the models' own (data, not code):

- ``qwen3.jinja``: Qwen/Qwen3-0.6B ``tokenizer_config.json`` ``chat_template`` (as copied
  to llama.cpp's ``models/templates/Qwen-Qwen3-0.6B.jinja``); hermes ``<tool_call>``
  calls, ``<think>`` reasoning, ``namespace``, ``messages[::-1]``, ``enable_thinking``.
- ``llama3.2.jinja``: meta-llama/Llama-3.2-3B-Instruct (llama.cpp
  ``models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja``); JSON calls with
  ``parameters``, ``strftime_now``, ``tojson(indent=4)``, ``raise_exception``.
- ``mistral-nemo.jinja``: mistralai/Mistral-Nemo-Instruct-2407 (llama.cpp
  ``models/templates/mistralai-Mistral-Nemo-Instruct-2407.jinja``); ``[TOOL_CALLS]``,
  call ids that must be 9 alphanumerics, strict user/assistant alternation.
- ``granite-3.3.jinja``: ibm-granite/granite-3.3-2b-instruct (llama.cpp
  ``models/templates/ibm-granite-granite-3.3-2B-Instruct.jinja``); ``<|tool_call|>[...]``.
- ``gemma3.jinja``: google/gemma-3-*-it ``tokenizer_config.json`` ``chat_template``; no
  tool support and strict alternation (plait's generic tool prompt).

Each renders a multi-turn tool conversation through the server's renderer; each
format's realistic outputs parse (and stream) into OpenAI ``tool_calls``; two tiny
servers (Qwen3's template with the qwen3 reasoning parser, Mistral's template) answer
the official ``openai`` client, streamed and not, under every ``tool_choice``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest

from plait.errors import RequestError
from plait.runtime.constrained.regexes import escape
from plait.runtime.server import launch
from plait.runtime.server.openai_api import _messages, chat_turn, render_chat, server_tool_parser
from plait.tool_parsers import detect_tool_parser, get_tool_parser, mistral_call_id

from conftest import with_chat_template
from test_tool_parsers17b import _stream as streamed

TEMPLATES = Path(__file__).parent / "data" / "templates17"
MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}
NESTED = {"type": "object", "properties": {"filter": {"type": "object"}, "tags": {"type": "array"}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two digits", "parameters": ADD}},
    {"type": "function", "function": {"name": "search", "description": "Search", "parameters": NESTED}},
]
CALL_ID = "call_9f8e7d6c5b4a39281706f5e4"  # an id as OpenAI (and plait's hermes parser) writes it
# the brief's conversation: system, user (text parts), assistant calls (arguments as JSON
# text), tool result, user
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather in "}, {"type": "text", "text": "Zürich?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21, "sky": "sunny \\"mostly\\""}'},
    {"role": "user", "content": "Thanks! And 2 + 3?"},
]
# ... with the assistant's answer to the result before the next question (what templates
# that want roles to alternate, Mistral's, ask for)
ANSWERED = CONVERSATION[:4] + [{"role": "assistant", "content": "It is 21 C and sunny in Zürich."}] + CONVERSATION[4:]


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def render(tok, source: str, messages, tools=TOOLS, body: dict | None = None) -> tuple[str, str]:
    """(the parser the server picks, the prompt it renders) for ``messages`` under ``source``."""
    tok.chat_template = source
    front = SimpleNamespace(tokenizer=tok, args=SimpleNamespace(tool_call_parser=None))
    parser = server_tool_parser(front)
    fns = [t["function"] for t in tools] if tools else None
    return parser, render_chat(front, _messages({"messages": messages}), fns, parser, chat_turn(body or {}))


# -- rendering -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, parser", [("qwen3.jinja", "hermes"), ("llama3.2.jinja", "llama3_json"),
                                          ("mistral-nemo.jinja", "mistral"), ("granite-3.3.jinja", "granite"),
                                          ("gemma3.jinja", None)])
def test_the_templates_format_is_detected(name, parser):
    assert detect_tool_parser(template(name)) == parser


def test_qwen3_renders_the_conversation(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("qwen3.jinja"), CONVERSATION)
    assert parser == "hermes"
    assert "You are a helpful assistant.\n\n# Tools" in text and '"name": "search"' in text
    assert "What is the weather in Zürich?" in text  # the text parts, joined
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temp": 21, "sky": "sunny \\"mostly\\""}\n</tool_response>' in text
    assert text.endswith("<|im_start|>user\nThanks! And 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # chat_template_kwargs reach the template: Qwen3's switch that turns thinking off
    _, off = render(hf_tokenizer, template("qwen3.jinja"), CONVERSATION,
                    body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_llama32_renders_the_conversation(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("llama3.2.jinja"), ANSWERED)
    assert parser == "llama3_json"
    assert re.search(r"Today Date: \d\d \w\w\w \d{4}\n", text)  # strftime_now
    assert '{\n    "type": "function",\n    "function": {\n        "name": "get_weather"' in text  # tojson(indent=4)
    assert '{"name": "get_weather", "parameters": {"city": "Zürich", "unit": "celsius"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text
    assert text.endswith("Thanks! And 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # the template's own limit: one call per assistant message, refused by its words
    two = ANSWERED[:2] + [{**ANSWERED[2], "tool_calls": ANSWERED[2]["tool_calls"] * 2}] + ANSWERED[3:]
    with pytest.raises(RequestError, match="only supports single tool-calls"):
        render(hf_tokenizer, template("llama3.2.jinja"), two)


def test_mistral_gets_nine_character_ids(hf_tokenizer):
    """Mistral's template raises on ids that are not 9 alphanumerics: OpenAI's
    ``call_...`` ids reach it as 9 characters, the same for the call and its result."""
    parser, text = render(hf_tokenizer, template("mistral-nemo.jinja"), ANSWERED)
    assert parser == "mistral"
    short = mistral_call_id(CALL_ID)
    assert len(short) == 9 and short.isalnum() and mistral_call_id(CALL_ID) == short
    assert mistral_call_id("a1B2c3D4e") == "a1B2c3D4e"  # a Mistral id stays as it is
    assert f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {{"city": "Zürich", "unit": "celsius"}}, ' \
           f'"id": "{short}"}}]' in text
    assert f'"call_id": "{short}"}}[/TOOL_RESULTS]' in text
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith("[INST]You are a helpful assistant.\n\nThanks! And 2 + 3?[/INST]")
    # a user turn right after a tool result: the template's own rule refuses it, a 400 in its words
    with pytest.raises(RequestError, match="roles must alternate"):
        render(hf_tokenizer, template("mistral-nemo.jinja"), CONVERSATION)


def test_granite_renders_the_conversation(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("granite-3.3.jinja"), ANSWERED)
    assert parser == "granite"
    assert "<|start_of_role|>available_tools<|end_of_role|>[\n    {" in text
    assert "<|start_of_role|>tool<|end_of_role|>" in text
    assert text.endswith("<|start_of_role|>user<|end_of_role|>Thanks! And 2 + 3?<|end_of_text|>\n"
                         "<|start_of_role|>assistant<|end_of_role|>")


@pytest.mark.parametrize("messages", [CONVERSATION, ANSWERED], ids=["tool-then-user", "answered"])
def test_gemma3_without_tool_support_keeps_roles_alternating(hf_tokenizer, messages):
    """Gemma 3's template has no tool role and raises unless user and model turns
    alternate: the tool results and the next user message make one user turn."""
    parser, text = render(hf_tokenizer, template("gemma3.jinja"), messages)
    assert parser == "hermes"  # plait's generic tool prompt
    assert text.count("<start_of_turn>user\n") == 3 - (messages is CONVERSATION)
    assert "<start_of_turn>model\n<tool_call>\n" in text
    assert '<tool_response>\n{"temp": 21' in text
    assert text.endswith("Thanks! And 2 + 3?<end_of_turn>\n<start_of_turn>model\n")


# -- parsing each family's output ------------------------------------------------------------------
UNICODE_ARGS = '{"city": "São Paulo \\"centro\\"", "unit": "celsius"}'
NESTED_ARGS = '{"filter": {"and": [{"k": "a\\\\b"}, {"k": "</tool_call>"}]}, "tags": ["日本", "x"]}'
# (parser, output, [(name, arguments text)], content)
OUTPUTS = [
    # Qwen2.5 / Qwen3 / Hermes 2 Pro / SmolLM3: hermes blocks, text before, parallel calls
    ("hermes", f'I will check both.\n<tool_call>\n{{"name": "get_weather", "arguments": {UNICODE_ARGS}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "search", "arguments": {NESTED_ARGS}}}\n</tool_call>',
     [("get_weather", UNICODE_ARGS), ("search", NESTED_ARGS)], "I will check both."),
    # Llama 3.1 / 3.2: a bare JSON call; with <|python_tag|>; parallel with "; "
    ("llama3_json", '{"name": "add", "parameters": {"a": 2, "b": 3}}', [("add", '{"a": 2, "b": 3}')], ""),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {UNICODE_ARGS}}}; '
                    f'{{"name": "search", "parameters": {NESTED_ARGS}}}',
     [("get_weather", UNICODE_ARGS), ("search", NESTED_ARGS)], ""),
    # Mistral: the JSON array (v0.3 / Nemo) and the name[ARGS] form (newer tokenizers)
    ("mistral", f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {UNICODE_ARGS}}}, '
                f'{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}]',
     [("get_weather", UNICODE_ARGS), ("add", '{"a": 1, "b": 2}')], ""),
    ("mistral", f'Checking.[TOOL_CALLS]search[ARGS]{NESTED_ARGS}', [("search", NESTED_ARGS)], "Checking."),
    # Granite 3.x
    ("granite", f'<|tool_call|>[{{"name": "get_weather", "arguments": {UNICODE_ARGS}}}, '
                f'{{"name": "search", "arguments": {NESTED_ARGS}}}]',
     [("get_weather", UNICODE_ARGS), ("search", NESTED_ARGS)], ""),
    # Llama 3.2 pythonic
    ("pythonic", '[get_weather(city="São Paulo", unit="celsius"), add(a=1, b=2)]',
     [("get_weather", '{"city": "São Paulo", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')], ""),
]


def _stream(parser, text: str, step: int = 3, cut: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) as the stream of ``parser`` sends them (chunks of ``step``)."""
    return streamed(parser, text, step, cut, TOOLS)


@pytest.mark.parametrize("parser, text, calls, content", OUTPUTS)
def test_family_outputs_parse_and_stream_alike(parser, text, calls, content):
    got_content, got = get_tool_parser(parser).parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == content
    for name, args in calls:
        json.loads(args)
    for step in (1, 7):
        s_content, s_calls = _stream(parser, text, step)
        assert s_calls == calls and s_content.strip() == content


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Sã'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Sã'),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Sã'),
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Sã'),
])
def test_truncated_calls(parser, text):
    """Cut off by max_tokens: a finished parse keeps the text as content; read as cut
    (finish_reason length) the call is one, its arguments as far as written, as streamed."""
    p = get_tool_parser(parser)
    assert p.parse(text, TOOLS) == (text, [])
    _, calls = p.parse(text, TOOLS, cut=True)
    assert [(c.name, c.arguments, c.cut) for c in calls] == [("get_weather", '{"city": "Sã', True)]
    assert _stream(parser, text, 2, cut=True)[1] == [("get_weather", '{"city": "Sã')]


def test_parser_ids_and_forcing_regexes():
    assert get_tool_parser("hermes").parse('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                                           '</tool_call>', TOOLS)[1][0].id.startswith("call_")
    mid = get_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]', TOOLS)[1][0].id
    assert len(mid) == 9 and mid.isalnum()
    regex = get_tool_parser("granite").constraint(TOOLS, "add", False).regex
    assert re.fullmatch(regex, '<|tool_call|>[{"name": "add", "arguments": {"a":1,"b":2}}]')
    assert get_tool_parser("mistral").constraint(TOOLS, "add", False).regex.startswith(r"\[TOOL_CALLS\]\[")


# -- servers, through the official openai client ---------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tiny_model_factory, tmp_path_factory):
    folder = with_chat_template(tiny_model_factory("llama"), tmp_path_factory.mktemp("qwen3-tpl"), template("qwen3.jinja"))
    with launch(str(folder), num_threads=1, kv_cache_tokens=8192, max_running_requests=8, served_model_name=MODEL,
                reasoning_parser="qwen3") as rt:
        yield openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def mistral(tiny_model_factory, tmp_path_factory):
    folder = with_chat_template(tiny_model_factory("llama"), tmp_path_factory.mktemp("mistral-tpl"),
                        template("mistral-nemo.jinja"))
    with launch(str(folder), num_threads=1, kv_cache_tokens=8192, max_running_requests=8,
                served_model_name=MODEL) as rt:
        yield openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)


QWEN_OUTPUT = ('<think>\nThe user wants the weather and a sum.\n</think>\n\nLet me check.\n<tool_call>\n'
               f'{{"name": "get_weather", "arguments": {UNICODE_ARGS}}}\n</tool_call>\n<tool_call>\n'
               '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>')


def _collect(stream) -> tuple[str, str, list[tuple[str, str, str]], str | None]:
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            reasoning += getattr(d, "reasoning_content", None) or ""
            content += d.content or ""
            for c in d.tool_calls or []:
                e = calls.setdefault(c.index, ["", "", ""])
                e[0] = c.id or e[0]
                e[1] += (c.function.name or "") if c.function else ""
                e[2] += (c.function.arguments or "") if c.function else ""
            finish = ch.finish_reason or finish
    return reasoning, content, [tuple(calls[k]) for k in sorted(calls)], finish


def _ask(client, stream: bool, **kw):
    args = dict(model=MODEL, messages=CONVERSATION, tools=TOOLS, temperature=0, max_tokens=300)
    args.update(kw)
    if stream:
        return _collect(client.chat.completions.create(stream=True, **args))
    r = client.chat.completions.create(**args)
    m = r.choices[0].message
    calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
    return getattr(m, "reasoning_content", None) or "", m.content or "", calls, r.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_reasoning_then_parallel_calls(qwen3, stream):
    """The model's output (forced here by the raw ``regex`` extra, as a real Qwen3 writes
    it): a think block, a sentence, two calls; tool_choice auto."""
    reasoning, content, calls, finish = _ask(qwen3, stream, extra_body={"regex": escape(QWEN_OUTPUT)})
    assert reasoning == "The user wants the weather and a sum."
    assert content.strip() == "Let me check."
    assert [(n, a) for _, n, a in calls] == [("get_weather", UNICODE_ARGS), ("add", '{"a": 2, "b": 3}')]
    assert all(i.startswith("call_") for i, _, _ in calls) and len({i for i, _, _ in calls}) == 2
    assert finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_tool_choice_none_and_parallel_false(qwen3, stream):
    reasoning, content, calls, finish = _ask(qwen3, stream, tool_choice="none",
                                             extra_body={"regex": escape(QWEN_OUTPUT)})
    assert calls == [] and "<tool_call>" in content and finish == "stop"  # not parsed
    _, _, calls, finish = _ask(qwen3, stream, parallel_tool_calls=False, extra_body={"regex": escape(QWEN_OUTPUT)})
    assert [n for _, n, _ in calls] == ["get_weather"] and finish == "tool_calls"  # the first call only


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_qwen3_forced_calls(qwen3, stream, choice):
    # (a random model thinks until max_tokens, and writes strings as long: the reasoning is
    # bounded, then a call forced to a function whose arguments are bounded)
    tools = TOOLS[1:2] if choice == "required" else TOOLS
    _, content, calls, finish = _ask(qwen3, stream, tool_choice=choice, parallel_tool_calls=False, tools=tools,
                                     extra_body={"max_reasoning_chars": 16})
    assert finish == "tool_calls" and len(calls) == 1 and not content.strip()
    if isinstance(choice, dict):
        assert calls[0][1] == "add" and set(json.loads(calls[0][2])) == {"a", "b"}


def test_unknown_named_tool_is_a_400(qwen3):
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        qwen3.chat.completions.create(model=MODEL, messages=CONVERSATION, tools=TOOLS,
                                      tool_choice={"type": "function", "function": {"name": "nope"}})


@pytest.mark.parametrize("stream", [False, True])
def test_mistral_agent_loop_round_trips_its_ids(mistral, stream):
    """A forced call on Mistral's template gets a 9-character id; sent back in the
    history with its result, the template takes it (it raised on ``call_...`` ids)."""
    ask = dict(model=MODEL, tools=TOOLS[1:2], temperature=0, max_tokens=200)
    first = [ANSWERED[0], {"role": "user", "content": "2 + 3?"}]
    if stream:
        _, content, calls, finish = _collect(mistral.chat.completions.create(
            messages=first, tool_choice="required", parallel_tool_calls=False, stream=True, **ask))
    else:
        r = mistral.chat.completions.create(messages=first, tool_choice="required", parallel_tool_calls=False, **ask)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        content, calls = m.content or "", [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
    assert finish == "tool_calls" and len(calls) == 1 and not content
    cid, name, args = calls[0]
    assert len(cid) == 9 and cid.isalnum()
    history = first + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": cid, "type": "function",
                                                                "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": cid, "content": "5"},
    ]
    r = mistral.chat.completions.create(messages=history, max_tokens=4, **{k: v for k, v in ask.items()
                                                                            if k != "max_tokens"})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # OpenAI-style ids from another server work too; the template's alternation rule is a 400
    r = mistral.chat.completions.create(messages=ANSWERED, max_tokens=4, model=MODEL, tools=TOOLS)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError, match="roles must alternate"):
        mistral.chat.completions.create(messages=CONVERSATION, max_tokens=4, model=MODEL, tools=TOOLS)


def test_mistral_output_with_special_marker_parses(mistral):
    out = f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {UNICODE_ARGS}}}]'
    for stream in (False, True):
        _, content, calls, finish = _ask_answered(mistral, stream, out)
        assert [(n, a) for _, n, a in calls] == [("get_weather", UNICODE_ARGS)] and finish == "tool_calls"
        assert not content


def _ask_answered(client, stream: bool, out: str):
    args = dict(model=MODEL, messages=ANSWERED, tools=TOOLS, temperature=0, max_tokens=300,
                extra_body={"regex": escape(out)})
    if stream:
        return _collect(client.chat.completions.create(stream=True, **args))
    r = client.chat.completions.create(**args)
    m = r.choices[0].message
    return "", m.content or "", [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []], \
        r.choices[0].finish_reason
