"""The DeepSeek-V3 / R1 / V3.1 and Phi-4-mini tool-call formats (parsers ``deepseek_v3``,
``deepseek_v31``, ``phi4_mini_json``), and more real templates rendered with a tool
conversation: Llama 3.1's (as Llama 3.3 ships it) and Qwen2.5's.

The templates added to ``tests/data/templates17/`` are the models' own (data, not code):

- ``deepseek-r1-distill.jinja``: deepseek-ai/DeepSeek-R1-Distill-Qwen-32B (llama.cpp
  ``models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja``); the V3 / R1 call
  blocks (``function<｜tool▁sep｜>NAME\\n```json ...``), arguments concatenated as text; no
  ``tools`` variable (plait's generic tool prompt).
- ``deepseek-v3.1.jinja``: deepseek-ai/DeepSeek-V3.1 (llama.cpp
  ``models/templates/deepseek-ai-DeepSeek-V3.1.jinja``); ``NAME<｜tool▁sep｜>{...}`` blocks.
- ``deepseek-v3-vllm.jinja``: vLLM ``examples/tool_chat_template_deepseekv3.jinja``
  (DeepSeek-V3's template with a tools section; arguments written with ``tojson``).
- ``phi4-mini.jinja``: microsoft/Phi-4-mini-instruct ``tokenizer_config.json``
  ``chat_template`` (tools only through a system message's ``tools`` key: plait's
  generic prompt).
- ``phi4-mini-vllm.jinja``: vLLM ``examples/tool_chat_template_phi4_mini.jinja``
  (``functools[...]``; prints a call's arguments with ``{{ }}``).
- ``llama3.3.jinja``: meta-llama/Llama-3.3-70B-Instruct (llama.cpp
  ``models/templates/meta-llama-Llama-3.3-70B-Instruct.jinja``), the Llama 3.1 template
  (``builtin_tools``, ``<|eom_id|>``, tools in the first user message).
- ``qwen2.5.jinja``: Qwen/Qwen2.5-7B-Instruct ``tokenizer_config.json`` ``chat_template``
  (llama.cpp ``models/templates/Qwen-Qwen2.5-7B-Instruct.jinja``, as minja's tests embed it).

(vLLM's ``tool_chat_template_deepseekv31.jinja`` is not here: Jinja2 refuses it,
``{% set tool_json = tool | tojson}``.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.errors import RequestError
from plait.regex import check_regex
from plait.runtime.server.openai_api import _messages, chat_turn, render_chat, server_tool_parser
from plait.runtime.server.sglang_options import translate
from plait.tool_parsers import TOOL_PARSERS, ToolCall, detect_tool_parser, generic_tools_prompt, get_tool_parser

TEMPLATES = Path(__file__).parent / "data" / "templates17"
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
NEW = ("deepseek_v3", "deepseek_v31", "phi4_mini_json")

A1, A12, A23, A45 = '{"a": 1}', '{"a": 1, "b": 2}', '{"a": 2, "b": 3}', '{"a": 4, "b": 5}'
ZH = '{"city": "Zürich", "unit": "celsius"}'
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
C, S, CE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
UNICODE_ARGS = '{"city": "São Paulo \\"centro\\"", "unit": "celsius"}'
# (the end markers inside a string argument do not end the call)
NESTED_ARGS = f'{{"filter": {{"and": [{{"k": "a\\\\b"}}, {{"k": "{CE}{E}```"}}]}}, "tags": ["日本", "x", {{"deep": [1, {{}}]}}]}}'


def v3(name: str, args: str) -> str:
    return f"{C}function{S}{name}\n```json\n{args}\n```{CE}"


def v31(name: str, args: str) -> str:
    return f"{C}{name}{S}{args}{CE}"


# (parser, output, [(name, arguments text)], content)
OUTPUTS = [
    # DeepSeek-V3 / R1: text before, two calls (a line break between blocks, as the template writes them)
    ("deepseek_v3", f"Let me check both.{B}{v3('get_weather', UNICODE_ARGS)}\n{v3('search', NESTED_ARGS)}{E}",
     [("get_weather", UNICODE_ARGS), ("search", NESTED_ARGS)], "Let me check both."),
    ("deepseek_v3", f"{B}{v3('add', A23)}{E}", [("add", '{"a": 2, "b": 3}')], ""),
    # ... the end markers left out at the end of the output (a model that stopped there)
    ("deepseek_v3", f"{B}{C}function{S}add\n```json\n{{\"a\": 1, \"b\": 2}}", [("add", '{"a": 1, "b": 2}')], ""),
    # ... text after the calls is content
    ("deepseek_v3", f"{B}{v3('add', A12)}{E}Done.", [("add", '{"a": 1, "b": 2}')], "Done."),
    # DeepSeek-V3.1: NAME<sep>{...} blocks, no separators
    ("deepseek_v31", f"I will look.{B}{v31('get_weather', UNICODE_ARGS)}{v31('search', NESTED_ARGS)}{E}",
     [("get_weather", UNICODE_ARGS), ("search", NESTED_ARGS)], "I will look."),
    # each DeepSeek parser reads the other's form
    ("deepseek_v3", f"{B}{v31('add', A45)}{E}", [("add", '{"a": 4, "b": 5}')], ""),
    ("deepseek_v31", f"{B}{v3('search', NESTED_ARGS)}{E}", [("search", NESTED_ARGS)], ""),
    # Phi-4-mini: functools[...], text before, "parameters" read too, text after is content
    ("phi4_mini_json", f'Sure.\nfunctools[{{"name": "get_weather", "arguments": {UNICODE_ARGS}}}, '
                       f'{{"name": "search", "parameters": {NESTED_ARGS}}}]',
     [("get_weather", UNICODE_ARGS), ("search", NESTED_ARGS)], "Sure."),
    ("phi4_mini_json", 'functools[{"name": "add", "arguments": {"a": 1, "b": 2}}] Anything else?',
     [("add", '{"a": 1, "b": 2}')], "Anything else?"),
]


def _stream(parser: str, text: str, step: int, cut: bool = False, tools=TOOLS) -> tuple[str, list[tuple[str, str]]]:
    s = get_tool_parser(parser).stream(tools)
    deltas = []
    for i in range(0, len(text), step):
        deltas += s.feed(text[i:i + step])
    deltas += s.finish(cut)
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["function"]["arguments"] == ""  # the name streams before the arguments
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] += c["function"].get("name", "")
            entry[1] += c["function"].get("arguments", "")
    return content, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("parser, text, calls, content", OUTPUTS)
def test_outputs_parse_and_stream_alike(parser, text, calls, content):
    got_content, got = get_tool_parser(parser).parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in got] == calls
    assert got_content == content
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in got) and len({c.id for c in got}) == len(got)
    for _, args in calls:
        json.loads(args)
    for step in (1, 7):
        s_content, s_calls = _stream(parser, text, step)
        assert s_calls == calls
        assert s_content.split() == content.split()


@pytest.mark.parametrize("parser, text", [
    ("deepseek_v3", "No tools needed: 2 + 3 = 5."),
    ("deepseek_v3", f"{B}{v3('launch_rocket', '{}')}{E}"),  # an unknown function
    ("deepseek_v3", f"{B}{v3('add', '{a: 1}')}{E}"),  # not JSON
    ("deepseek_v3", f"{B}{v3('add', '[1, 2]')}{E}"),  # not an object
    ("deepseek_v31", f"{B}{v31('add', A1 + ' and more')}{E}"),  # text after the arguments
    ("phi4_mini_json", "I used functools.partial and functools.reduce here."),
    ("phi4_mini_json", 'functools[{"name": "nope", "arguments": {}}]'),
    ("phi4_mini_json", 'functools[{"name": "add", "arguments": {"a": 1,}}]'),
])
def test_what_is_no_call_stays_content(parser, text):
    assert get_tool_parser(parser).parse(text, TOOLS) == (text, [])
    for step in (1, 7):
        content, calls = _stream(parser, text, step)
        if calls:  # a call whose name streamed stays one in the stream (cut), as documented
            assert parser != "phi4_mini_json" or "nope" not in text
            continue
        assert content == text


def test_a_bad_block_beside_a_good_one_is_content():
    text = f"{B}{v3('add', A12)}\n{v3('nope', '{}')}{E}"
    content, calls = get_tool_parser("deepseek_v3").parse(text, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    assert content == v3("nope", "{}")


@pytest.mark.parametrize("parser, text", [
    ("deepseek_v3", f'{B}{C}function{S}get_weather\n```json\n{{"city": "Sã'),
    ("deepseek_v31", f'{B}{C}get_weather{S}{{"city": "Sã'),
    ("phi4_mini_json", 'functools[{"name": "get_weather", "arguments": {"city": "Sã'),
])
def test_truncated_calls(parser, text):
    """Cut off by max_tokens: a finished parse keeps the text as content; read as cut
    (finish_reason length) the call is one, its arguments as far as written, as streamed."""
    p = get_tool_parser(parser)
    assert p.parse(text, TOOLS) == (text, [])
    _, calls = p.parse(text, TOOLS, cut=True)
    assert [(c.name, c.arguments, c.cut) for c in calls] == [("get_weather", '{"city": "Sã', True)]
    for step in (1, 7):
        assert _stream(parser, text, step, cut=True)[1] == [("get_weather", '{"city": "Sã')]


@pytest.mark.parametrize("parser, cut_text", [
    ("deepseek_v3", "<｜tool▁ca"), ("deepseek_v3", f"{B}{C}funct"), ("deepseek_v3", f"{B}{C}function{S}get_wea"),
    ("deepseek_v31", f"{B}{C}get_wea"), ("phi4_mini_json", "functools"), ("phi4_mini_json", 'functools[{"na'),
])
def test_a_call_cut_off_before_its_name_is_not_content(parser, cut_text):
    p = get_tool_parser(parser)
    for prefix in ("", "Sure. "):
        assert p.parse(prefix + cut_text, TOOLS, cut=True) == (prefix.strip(), [])
        content, calls = _stream(parser, prefix + cut_text, 1, cut=True)
        assert (content.strip(), calls) == (prefix.strip(), [])
    assert p.parse(cut_text, TOOLS) == (cut_text, [])  # not cut: it is what the model wrote


def test_a_plain_reply_cut_off_keeps_its_last_word():
    # "functools[" begins with "f": a reply cut after "of" kept "o" under a prefix rule
    p = get_tool_parser("phi4_mini_json")
    for text in ("The capital of", "It is a func"):
        assert p.parse(text, TOOLS, cut=True) == (text, [])
        assert _stream("phi4_mini_json", text, 1, cut=True) == (text, [])


@pytest.mark.parametrize("parser", NEW)
def test_format_calls_round_trips(parser):
    """An assistant's earlier calls, written into a prompt in the format, parse back."""
    p = get_tool_parser(parser)
    calls = [ToolCall("call_1", "get_weather", UNICODE_ARGS), ToolCall("call_2", "search", NESTED_ARGS),
             ToolCall("call_3", "add", '{"a": 1, "b": 2}')]
    text = p.format_calls(calls)
    content, got = p.parse(text, TOOLS)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(c.name, json.loads(c.arguments)) for c in calls]
    if parser.startswith("deepseek"):  # the model's own text of the arguments
        assert [c.arguments for c in got] == [c.arguments for c in calls]
    assert p.hint and p.hint.splitlines()[-1][:12] in generic_tools_prompt(TOOLS, parser)


def test_formats_as_the_templates_write_them():
    calls = [ToolCall("x", "add", '{"a": 1}'), ToolCall("y", "now", "{}")]
    assert get_tool_parser("deepseek_v3").format_calls(calls) == f"{B}{v3('add', A1)}\n{v3('now', '{}')}{E}"
    assert get_tool_parser("deepseek_v31").format_calls(calls) == f"{B}{v31('add', A1)}{v31('now', '{}')}{E}"
    assert get_tool_parser("phi4_mini_json").format_calls(calls) == \
        'functools[{"name": "add", "arguments": {"a": 1}}, {"name": "now", "arguments": {}}]'


# -- forced calls ----------------------------------------------------------------------------------
@pytest.mark.parametrize("parser", NEW)
def test_forcing_regex_writes_the_family_format(parser):
    p = get_tool_parser(parser)
    one = p.format_calls([ToolCall("x", "add", '{"a":1,"b":2}')])
    two = p.format_calls([ToolCall("x", "add", '{"a":1,"b":2}'), ToolCall("y", "get_weather", '{"city":"Oslo"}')])
    if parser == "phi4_mini_json":  # (format_calls spaces the arguments; forced ones are compact)
        one = 'functools[{"name": "add", "arguments": {"a":1,"b":2}}]'
        two = one[:-1] + ', {"name": "get_weather", "arguments": {"city":"Oslo"}}]'
    rx = p.constraint(TOOLS, None, True).regex
    assert check_regex(rx) == rx
    assert re.fullmatch(rx, one) and re.fullmatch(rx, two)
    single = p.constraint(TOOLS, None, False).regex
    assert re.fullmatch(single, one) and not re.fullmatch(single, two)
    named = p.constraint(TOOLS, "get_weather", False).regex
    assert not re.fullmatch(named, one)
    assert not re.fullmatch(rx, one.replace('"a":1', '"a":"1"'))  # the schema types the arguments
    assert not re.fullmatch(rx, "")
    with pytest.raises(RequestError, match="not in tools"):
        p.constraint(TOOLS, "nope", False).regex


@pytest.mark.parametrize("parser", NEW)
@pytest.mark.parametrize("choice", [None, "search"])
def test_every_forced_output_parses(parser, choice):
    p = get_tool_parser(parser)
    rx = p.constraint(TOOLS, choice, True).regex
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

    @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(re.compile(rx), fullmatch=True))
    def check(text: str) -> None:
        content, calls = p.parse(text, TOOLS)
        assert content == "" and calls
        for c in calls:
            assert choice is None or c.name == choice
            jsonschema.validate(json.loads(c.arguments), schemas[c.name])
        assert _stream(parser, text, 7)[1] == [(c.name, c.arguments) for c in calls]

    check()


# -- names -----------------------------------------------------------------------------------------
def test_parser_names_and_sglang_aliases():
    from plait.runtime.server.args import ServerArgs

    assert set(NEW) <= set(TOOL_PARSERS)
    assert get_tool_parser("deepseek_v3").special_marker and get_tool_parser("deepseek_v31").special_marker
    assert not get_tool_parser("phi4_mini_json").special_marker  # "functools" is text
    for name in NEW:
        assert ServerArgs(tool_call_parser=name).tool_call_parser == name
    assert translate({"tool_call_parser": "deepseekv3"})["tool_call_parser"] == "deepseek_v3"
    assert translate({"tool_call_parser": "deepseekv31"})["tool_call_parser"] == "deepseek_v31"


# -- the templates ---------------------------------------------------------------------------------
def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize("name, parser", [
    ("deepseek-r1-distill.jinja", "deepseek_v3"), ("deepseek-v3-vllm.jinja", "deepseek_v3"),
    ("deepseek-v3.1.jinja", "deepseek_v31"), ("phi4-mini.jinja", "phi4_mini_json"),
    ("phi4-mini-vllm.jinja", "phi4_mini_json"), ("llama3.3.jinja", "llama3_json"), ("qwen2.5.jinja", "hermes"),
    # the earlier ones are unchanged
    ("qwen3.jinja", "hermes"), ("llama3.2.jinja", "llama3_json"), ("mistral-nemo.jinja", "mistral"),
    ("granite-3.3.jinja", "granite"), ("gemma3.jinja", None),
])
def test_the_templates_format_is_detected(name, parser):
    assert detect_tool_parser(template(name)) == parser


CALL_ID = "call_9f8e7d6c5b4a39281706f5e4"
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What is the weather in "}, {"type": "text", "text": "Zürich?"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": CALL_ID, "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Zürich", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": '{"temp": 21, "sky": "sunny \\"mostly\\""}'},
    {"role": "assistant", "content": "It is 21 C and sunny in Zürich."},
    {"role": "user", "content": "Thanks! And 2 + 3?"},
]
TWO_CALLS = CONVERSATION[:2] + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "5"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def render(tok, source: str, messages, tools=TOOLS) -> tuple[str, str]:
    """(the parser the server picks, the prompt it renders) for ``messages`` under ``source``."""
    tok.chat_template = source
    front = SimpleNamespace(tokenizer=tok, args=SimpleNamespace(tool_call_parser=None))
    parser = server_tool_parser(front)
    fns = [t["function"] for t in tools] if tools else None
    return parser, render_chat(front, _messages({"messages": messages}), fns, parser, chat_turn({}))


def _assistant_calls(text: str, parser: str) -> list[tuple[str, Any]]:
    """The calls written into a prompt, read back with the parser."""
    _, calls = get_tool_parser(parser).parse(text, TOOLS)
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_deepseek_r1_renders_with_the_generic_prompt(hf_tokenizer):
    """R1's template reads no ``tools``: plait's generic prompt teaches the V3 blocks, and
    the earlier calls are written in them (parsed back the same)."""
    parser, text = render(hf_tokenizer, template("deepseek-r1-distill.jinja"), TWO_CALLS)
    assert parser == "deepseek_v3"
    assert get_tool_parser("deepseek_v3").hint in text and '"name": "search"' in text
    calls = get_tool_parser("deepseek_v3").format_calls(
        [ToolCall("", "get_weather", '{"city": "Zürich"}'), ToolCall("", "add", '{"a": 2, "b": 3}')])
    assert f"<｜Assistant｜>{calls}<｜end▁of▁sentence｜>" in text
    assert _assistant_calls(text[text.index(B):], "deepseek_v3") == [("get_weather", {"city": "Zürich"}),
                                                                        ("add", {"a": 2, "b": 3})]
    assert "<｜User｜><tool_response>\nsunny\n</tool_response>\n<tool_response>\n5\n</tool_response>\n\nThanks!" in text
    assert text.endswith("<｜Assistant｜><think>\n")


def test_deepseek_v31_renders_with_the_generic_prompt(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("deepseek-v3.1.jinja"), CONVERSATION)
    assert parser == "deepseek_v31"
    assert get_tool_parser("deepseek_v31").hint in text
    assert f"{B}{v31('get_weather', ZH)}{E}" in text
    assert text.endswith("<｜User｜>Thanks! And 2 + 3?<｜Assistant｜></think>")


def test_deepseek_v3_template_with_tools(hf_tokenizer):
    """vLLM's DeepSeek-V3 template reads ``tools`` and writes arguments with ``tojson``."""
    parser, text = render(hf_tokenizer, template("deepseek-v3-vllm.jinja"), TWO_CALLS)
    assert parser == "deepseek_v3"
    assert "# Tools" in text and '{"type": "function", "function": {"name": "get_weather"' in text
    assert _assistant_calls(text[text.index(B + C):], "deepseek_v3") == [("get_weather", {"city": "Zürich"}),
                                                                            ("add", {"a": 2, "b": 3})]
    assert re.search(r"<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>\s*"
                     r"<｜tool▁output▁begin｜>5<｜tool▁output▁end｜><｜User｜>Thanks!", text)


def test_phi4_mini_vllm_template(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("phi4-mini-vllm.jinja"), TWO_CALLS)
    assert parser == "phi4_mini_json"
    assert "functools[" in text and '"name": "search"' in text
    # the template prints the arguments with {{ }}: their JSON text, not a Python repr ({'a': 2, ...})
    assert '<|assistant|>{"name": "get_weather", "arguments": {"city": "Zürich"}},' \
           '{"name": "add", "arguments": {"a": 2, "b": 3}}<|end|>' in text
    assert "<|tool|>sunny<|end|><|tool|>5<|end|>" in text and text.endswith("<|user|>Thanks!<|end|><|assistant|>")


def test_phi4_mini_own_template_gets_the_generic_prompt(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("phi4-mini.jinja"), CONVERSATION)
    assert parser == "phi4_mini_json"
    assert text.startswith("<|system|>You can call functions") and get_tool_parser("phi4_mini_json").hint in text
    assert '<|assistant|>functools[{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}]' \
           '<|end|>' in text
    assert text.endswith("<|user|>Thanks! And 2 + 3?<|end|><|assistant|>")


def test_llama31_template_renders_the_conversation(hf_tokenizer):
    """Llama 3.1's template (3.3 ships the same): tools in the first user message, a
    call as ``{"name", "parameters"}``, results under the ipython role."""
    parser, text = render(hf_tokenizer, template("llama3.3.jinja"), CONVERSATION)
    assert parser == "llama3_json"
    assert "Environment: ipython\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n" \
           "You are a helpful assistant.<|eot_id|>" in text
    assert "Given the following functions, please respond with a JSON" in text
    assert '{\n    "type": "function",\n    "function": {\n        "name": "get_weather"' in text
    assert "What is the weather in Zürich?<|eot_id|>" in text  # the text parts, joined
    assert '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_weather", "parameters": ' \
           '{"city": "Zürich", "unit": "celsius"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n" in text
    assert text.endswith("Thanks! And 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(RequestError, match="only supports single tool-calls"):
        render(hf_tokenizer, template("llama3.3.jinja"), TWO_CALLS)


def test_qwen25_template_renders_the_conversation(hf_tokenizer):
    parser, text = render(hf_tokenizer, template("qwen2.5.jinja"), TWO_CALLS)
    assert parser == "hermes"
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n<tool_call>\n' \
           '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\n5\n</tool_response>" \
           "<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    assert _assistant_calls(text, "hermes") == [("get_weather", {"city": "Zürich"}), ("add", {"a": 2, "b": 3})]
