"""Tool-call and reasoning parsers on recorded-style model outputs (well-formed and
malformed), their streaming forms against the non-streamed parse, and the regexes that
force calls: every text a forcing regex admits parses into calls whose arguments
validate against the function's schema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.chat_template import messages_without_tool_support, template_uses_tools
from plait.errors import RequestError
from plait.reasoning import REASONING_PARSERS, get_reasoning_parser
from plait.regex import check_regex
from plait.tool_parsers import (
    MAX_CONSTRAINED_CALLS, TOOL_PARSERS, ToolCall, check_tools, detect_tool_parser, generic_tools_prompt,
    get_tool_parser, strict_names,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "additionalProperties": False}}

# (parser, text, expected calls [(name, arguments object)], expected content)
RECORDED = [
    # hermes (Qwen2.5 / Hermes style)
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     [("get_weather", {"city": "Paris", "unit": "celsius"})], ""),
    ("hermes", 'Let me look that up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
               '</tool_call>', [("get_weather", {"city": "Oslo"})], "Let me look that up."),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})], ""),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n</tool_call>',
     [("add", {"a": 3, "b": 4})], ""),  # arguments written as a JSON string
    ("hermes", '<tool_call>\n{"name": "now", "arguments": {}}', [("now", {})], ""),  # no closing tag
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', [], None),  # cut off
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>', [], None),
    ("hermes", '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>', [], None),  # unknown
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
               '{"name": "nope", "arguments": {}}\n</tool_call>', [("add", {"a": 1, "b": 2})],
     '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),  # the bad one stays content
    ("hermes", "The weather is nice today.", [], None),
    # llama3_json
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima"}}',
     [("get_weather", {"city": "Lima"})], ""),
    ("llama3_json", '{"name": "add", "parameters": {"a": 5, "b": 6}}; {"name": "now", "parameters": {}}',
     [("add", {"a": 5, "b": 6}), ("now", {})], ""),
    ("llama3_json", 'Sure! {"name": "add", "arguments": {"a": 1, "b": 1}}', [("add", {"a": 1, "b": 1})], "Sure!"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": ', [], None),
    ("llama3_json", 'I think {"x": 1} is a JSON object.', [], None),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Kyiv"}}, '
                '{"name": "add", "arguments": {"a": 2, "b": 2}}]',
     [("get_weather", {"city": "Kyiv"}), ("add", {"a": 2, "b": 2})], ""),
    ("mistral", 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}', [("get_weather", {"city": "Bern"})],
     "Checking."),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2,', [], None),
    ("mistral", '[TOOL_CALLS]unknown_fn[ARGS]{"x": 1}', [], None),
    # pythonic
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]',
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})], ""),
    ("pythonic", '<|python_start|>[now()]<|python_end|>', [("now", {})], ""),
    ("pythonic", '[add(a=1, b=2, c=[true, null, {"k": "v"}])]', [("add", {"a": 1, "b": 2, "c": [True, None, {"k": "v"}]})],
     ""),
    ("pythonic", 'Here you go: [add(a=1, b=2)]', [], None),  # a call list after text is content
    ("pythonic", '[add(a=1, b=', [], None),
    ("pythonic", '[os.system("rm -rf /")]', [], None),
    ("pythonic", '[1, 2, 3]', [], None),
]


# outputs whose call breaks after its name and arguments began (cut off by the length
# limit, or broken JSON): a call whose name streamed stays a call, with the arguments
# written so far (docs/serving.md, "Tool calling")
BROKEN_AFTER_NAME = {
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par': "get_weather",
    '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>': "get_weather",
    '{"name": "add", "parameters": {"a": 1, "b": ': "add",
    '[TOOL_CALLS][{"name": "add", "arguments": {"a": 2,': "add",
}


def _calls(calls: list[ToolCall]) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name,text,calls,content", RECORDED)
def test_recorded_outputs_parse_or_stay_content(name, text, calls, content):
    left, got = get_tool_parser(name).parse(text, TOOLS)
    assert _calls(got) == calls
    if not calls:
        assert left == text  # unparsable output is returned unchanged, as content
    else:
        assert left == content
        # (Mistral's templates take 9 alphanumerics only)
        shape = r"[0-9A-Za-z]{9}" if name == "mistral" else r"call_[0-9a-f]{24}"
        assert all(re.fullmatch(shape, c.id) for c in got)
        assert len({c.id for c in got}) == len(got)


def _assemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """What a client assembles from chat deltas (as the openai client's stream state does)."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["name"]
                calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
            calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
    return content, calls


@pytest.mark.parametrize("name,text,calls,content", RECORDED)
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_stream_assembles_to_the_parse(name, text, calls, content, step):
    stream = get_tool_parser(name).stream(TOOLS)
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i:i + step])
    deltas += stream.finish()
    got_content, got_calls = _assemble(deltas)
    want_content, want = get_tool_parser(name).parse(text, TOOLS)
    if text in BROKEN_AFTER_NAME and got_calls:
        assert want == [] and [c["name"] for c in got_calls] == [BROKEN_AFTER_NAME[text]]
        start = text.index("{", text.index('"name"'))  # the arguments object
        assert text[start:].startswith(got_calls[0]["arguments"]) and got_calls[0]["arguments"].startswith("{")
        return
    if not calls:
        assert got_calls == [] and got_content == text
        return
    # arguments are the same text streamed and not; content equal up to the blank between parts
    assert [(c["name"], c["arguments"]) for c in got_calls] == [(c.name, c.arguments) for c in want]
    assert got_content.split() == want_content.split()
    # names stream before their arguments
    firsts = [d for d in deltas if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert all(f["tool_calls"][0]["function"]["arguments"] == "" for f in firsts)


def test_stream_holds_back_a_partial_marker_then_releases_plain_text():
    s = get_tool_parser("hermes").stream(TOOLS)
    assert s.feed("Hello <tool") == [{"content": "Hello"}]
    assert s.feed("box>") == [{"content": " <toolbox>"}]  # it was not a call after all
    assert s.finish() == []


CUT_MARKUP = {
    "hermes": ("<tool_", '<tool_call>\n{"name": "', '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_c'),
    "mistral": ("[TOOL_", '[TOOL_CALLS][{"na', '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'),
    "pythonic": ("<|python_st", "<|python_start|>[ad", "<|python_start|>[add(a=1, b=2)]<|python_end|>"),
    "llama3_json": ("<|python_t", '<|python_tag|>{"na', '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'),
}


@pytest.mark.parametrize("name", sorted(CUT_MARKUP))
def test_a_call_cut_off_before_its_name_is_not_content(name):
    # a forced call cut by max_tokens after "<tool_" came back as content "<tool_"
    p = get_tool_parser(name)
    for text in CUT_MARKUP[name][:2]:
        for prefix in ("",) if name == "pythonic" else ("", "Sure. "):  # (pythonic: the whole output is the calls)
            content, calls = p.parse(prefix + text, TOOLS, cut=True)
            assert (content, calls) == (prefix.strip(), []), (text, content, calls)
            s = p.stream(TOOLS)
            deltas = [d for ch in prefix + text for d in s.feed(ch)] + s.finish(cut=True)
            assert "".join(d.get("content", "") for d in deltas).strip() == prefix.strip(), deltas
            assert not any("tool_calls" in d for d in deltas), deltas
        # not cut: the model ended there, so it is what it wrote
        assert p.parse(text, TOOLS, cut=False) == (text, [])
    if name == "hermes":  # a complete call, then the next one cut before its name
        content, calls = p.parse(CUT_MARKUP[name][2], TOOLS, cut=True)
        assert content == "" and [c.name for c in calls] == ["add"] and not calls[0].cut


def test_stream_arguments_grow_before_the_call_is_closed():
    s = get_tool_parser("hermes").stream(TOOLS)
    out = s.feed('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert out[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert out[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]}
    out = s.feed(', "b": 2}}\n</tool_call>')
    assert out == [{"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 2}'}}]}]
    assert s.finish() == []
    assert s.calls[0].arguments == '{"a": 1, "b": 2}'


@pytest.mark.parametrize("tail", ['b', 'b", "unit": "cel', 'b\\"</tool_call>'])
def test_hermes_end_tag_inside_an_argument_string_of_a_cut_call(tail):
    # a forced call cut by max_tokens after an argument string that mentions the end tag
    # was split there: the call's arguments stopped before the tag, the rest came back as
    # content (and streamed and not differed)
    p = get_tool_parser("hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>' + tail
    content, calls = p.parse(text, TOOLS, cut=True)
    assert content == "" and [(c.name, c.cut) for c in calls] == [("get_weather", True)]
    assert calls[0].arguments == text[text.index('{"city"'):]
    s = p.stream(TOOLS)
    deltas = [d for i in range(0, len(text), 3) for d in s.feed(text[i:i + 3])] + s.finish(cut=True)
    assert not any(d.get("content") for d in deltas), deltas
    assert [(c.name, c.arguments) for c in s.calls] == [(c.name, c.arguments) for c in calls]
    # finished with its end tag, then a second call: both, nothing as content
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}\n</tool_call>\n' \
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in p.parse(whole, TOOLS)[1]] == [
        ("get_weather", '{"city": "a</tool_call>b"}'), ("add", '{"a": 1, "b": 2}')]


# -- forcing regexes ---------------------------------------------------------------------------------
def _examples(name: str, parallel: bool) -> list[str]:
    one = {
        "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>',
        "llama3_json": '{"name": "get_weather", "parameters": {"city":"Paris"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Paris"}}]',
        "pythonic": '[get_weather(city="Paris")]',
        "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city":"Paris"}}]',
        "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                       '{"city":"Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "deepseek_v31": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}'
                        '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "phi4_mini_json": 'functools[{"name": "get_weather", "arguments": {"city":"Paris"}}]',
    }[name]
    two = {
        "hermes": one + '\n<tool_call>\n{"name": "add", "arguments": {"a":1,"b":-2}}\n</tool_call>',
        "llama3_json": one + '; {"name": "now", "parameters": {}}',
        "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}, '
                   '{"name": "now", "arguments": {}}]',
        "pythonic": '[get_weather(city="Paris", unit="celsius"), now()]',
        "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}, '
                   '{"name": "now", "arguments": {}}]',
        "deepseek_v3": one.removesuffix("<｜tool▁calls▁end｜>") + '\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n'
                                                              '```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "deepseek_v31": one.removesuffix("<｜tool▁calls▁end｜>") + '<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}'
                                                               '<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "phi4_mini_json": 'functools[{"name": "get_weather", "arguments": {"city":"Paris","unit":"celsius"}}, '
                          '{"name": "now", "arguments": {}}]',
    }[name]
    return [one, two] if parallel else [one]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_forcing_regex_admits_the_format_and_nothing_else(name):
    p = get_tool_parser(name)
    rx = p.constraint(TOOLS, None, True).regex
    assert check_regex(rx) == rx
    one, two = _examples(name, True)
    assert re.fullmatch(rx, one) and re.fullmatch(rx, two)
    assert _calls(p.parse(two, TOOLS)[1])[0][0] == "get_weather"
    single = p.constraint(TOOLS, None, False).regex
    assert re.fullmatch(single, one) and not re.fullmatch(single, two)
    named = p.constraint(TOOLS, "add", True).regex
    assert not re.fullmatch(named, one)
    assert not re.fullmatch(rx, "")  # at least one call
    assert not re.fullmatch(rx, one.replace('"Paris"', "5"))  # the schema types the arguments
    assert not re.fullmatch(rx, one.replace("get_weather", "get_wheather"))


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("choice", [None, "add"])
def test_every_forced_output_parses_and_validates(name, choice):
    p = get_tool_parser(name)
    rx = p.constraint(TOOLS, choice, True).regex

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(re.compile(rx), fullmatch=True))
    def check(text: str) -> None:
        content, calls = p.parse(text, TOOLS)
        assert content == "" and 1 <= len(calls) <= MAX_CONSTRAINED_CALLS
        for c in calls:
            assert choice is None or c.name == choice
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])

    check()


def test_forcing_regex_errors_name_the_tool():
    bad = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(RequestError) as e:
        get_tool_parser("hermes").constraint(bad, None, False).regex
    assert e.value.param == "tools[1].function.parameters" and "uniqueItems" in e.value.message
    with pytest.raises(RequestError) as e:
        get_tool_parser("hermes").constraint(TOOLS, "missing", False).regex
    assert e.value.param == "tool_choice"
    odd = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"not-an-identifier": {"type": "integer"}}}}}]
    with pytest.raises(RequestError, match="not-an-identifier") as e:
        get_tool_parser("pythonic").constraint(odd, None, False).regex
    assert e.value.param == "tools[0].function.parameters"
    # a Python keyword as a property, or a function name ast cannot read as a call (an MCP
    # server's "API-post-search"), forced calls that never parsed: no tool_calls came back
    kw = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"from": {"type": "string"}}}}}]
    with pytest.raises(RequestError, match="'from'") as e:
        get_tool_parser("pythonic").constraint(kw, None, False).regex
    assert e.value.param == "tools[0].function.parameters"
    dashed = [TOOLS[1], {"type": "function", "function": {"name": "API-post-search", "parameters": ADD}}]
    for choice in (None, "API-post-search"):
        with pytest.raises(RequestError, match="API-post-search") as e:
            get_tool_parser("pythonic").constraint(dashed, choice, False).regex
        assert e.value.param == "tools[1].function.name"
    assert get_tool_parser("pythonic").constraint(dashed, "add", False).regex  # (not the one called)
    for name, ok in (("f", True), ("match", True), ("class", False), ("a-b", False), ("None", False)):
        tools = [{"type": "function", "function": {"name": name, "parameters": ADD}}]
        assert bool(get_tool_parser("pythonic").parse(f"[{name}(a=1, b=2)]", tools)[1]) == ok, name
        if ok:
            assert get_tool_parser("pythonic").constraint(tools, None, False).regex
        else:
            with pytest.raises(RequestError):
                get_tool_parser("pythonic").constraint(tools, None, False)
    # the Responses API's flat tools are named without .function
    flat = [{"type": "function", "name": "f", "parameters": bad[1]["function"]["parameters"]}]
    with pytest.raises(RequestError) as e:
        get_tool_parser("hermes").constraint(flat, None, False).regex
    assert e.value.param == "tools[0].parameters"


# -- strict tools under tool_choice "auto" ----------------------------------------------------------
TRIGGERED = sorted(n for n in TOOL_PARSERS if get_tool_parser(n).triggers)


def test_every_format_but_pythonic_has_a_trigger():
    assert TRIGGERED == sorted(set(TOOL_PARSERS) - {"pythonic"})
    assert get_tool_parser("pythonic").auto_constraint(TOOLS, None, True, {"get_weather"}) is None


@pytest.mark.parametrize("name", TRIGGERED)
def test_strict_auto_regex_leaves_text_free_and_keeps_strict_calls_to_their_schema(name):
    p = get_tool_parser(name)
    c = p.auto_constraint(TOOLS, None, True, {"get_weather"})  # add and now are not strict
    rx = c.regex
    assert check_regex(rx) == rx
    one, two = _examples(name, True)
    trigger = p.triggers[0]
    for text in ("", "The weather is fine.", "a < b, [x], {\"y\": 1}\n", trigger[:-1] + "x no call"):
        assert re.fullmatch(rx, text), text  # the model may answer without a call
    for text in (one, two, "Let me check.\n" + one, one + "\nDone."):
        assert re.fullmatch(rx, text), text
    assert not re.fullmatch(rx, "Let me check. " + trigger + " and then some text")  # a trigger starts a call
    assert not re.fullmatch(rx, one.replace('"Paris"', "5"))  # the strict function's schema types its arguments
    assert not re.fullmatch(rx, one.replace("get_weather", "get_wheather"))
    # a function that is not strict takes any object: get_weather's arguments given to add
    assert re.fullmatch(rx, one.replace("get_weather", "add"))
    assert not re.fullmatch(p.auto_constraint(TOOLS, None, True, {"get_weather", "add"}).regex,
                            one.replace("get_weather", "add"))
    # one block of calls (several in it with parallel calls allowed), not text between calls
    assert not re.fullmatch(rx, one + "\nand then\n" + one)
    single = p.auto_constraint(TOOLS, None, False, {"get_weather"}).regex
    assert re.fullmatch(single, one) and not re.fullmatch(single, two)
    # an allowed_tools set: calls to the others are refused
    assert not re.fullmatch(p.auto_constraint(TOOLS, {"add"}, True, {"get_weather"}).regex, one)


@pytest.mark.parametrize("name", TRIGGERED)
def test_every_strict_auto_output_parses_its_calls_valid(name):
    p = get_tool_parser(name)
    rx = p.auto_constraint(TOOLS, None, True, {"get_weather", "add", "now"}).regex

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(re.compile(rx), fullmatch=True))
    def check(text: str) -> None:
        content, calls = p.parse(text, TOOLS)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        if any(t in text for t in p.triggers):
            assert calls, text  # the trigger was the start of calls
        assert not any(t in content for t in p.triggers)

    check()


def test_strict_auto_names_an_unenforceable_strict_schema():
    bad = [TOOLS[0], {"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(RequestError) as e:
        get_tool_parser("hermes").auto_constraint(bad, None, True, {"f"})
    assert e.value.param == "tools[1].function.parameters" and "uniqueItems" in e.value.message
    # not strict: any object, nothing to enforce
    assert get_tool_parser("hermes").auto_constraint(bad, None, True, {"get_weather"}) is not None
    assert strict_names(bad) == {"f"}
    assert strict_names([{"type": "function", "name": "g", "strict": True}, {"type": "function", "name": "h"}]) == {"g"}


@pytest.mark.parametrize("name", sorted(set(TOOL_PARSERS) - {"pythonic"}))  # pythonic: keyword arguments
def test_forced_arguments_are_objects_where_the_schema_admits_other_values(name):
    # a forced call with `null` or `1` as its arguments did not parse: it came back as content
    p = get_tool_parser(name)
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for params in ({**obj, "type": ["object", "null"]}, {"anyOf": [obj, {"type": "integer"}]}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        rx = p.constraint(tools, None, False).regex

        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.from_regex(re.compile(rx), fullmatch=True))
        def check(text: str) -> None:
            content, calls = p.parse(text, tools)
            assert content == "" and len(calls) == 1
            jsonschema.validate(json.loads(calls[0].arguments), obj)

        check()


@pytest.mark.parametrize("tools,param", [
    ("nope", "tools"),
    ([], "tools"),
    ([{"type": "retrieval"}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}],
     "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": ["array", "null"]}}}],
     "tools[0].function.parameters"),
])
def test_check_tools_names_the_field(tools, param):
    with pytest.raises(RequestError) as e:
        check_tools(tools)
    assert e.value.param == param and e.value.status == 400


def test_detect_parser_and_generic_prompt():
    assert detect_tool_parser("{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>") == "hermes"
    assert detect_tool_parser("[AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|python_tag|>{{ tools }}") == "llama3_json"
    assert detect_tool_parser("<|python_start|>") == "pythonic"
    assert detect_tool_parser("<|im_start|>{{ message.content }}") is None and detect_tool_parser(None) is None
    for name in TOOL_PARSERS:
        prompt = generic_tools_prompt(TOOLS, name)
        assert all(t["function"]["name"] in prompt for t in TOOLS)
        assert get_tool_parser(name).hint in prompt
    with pytest.raises(ValueError, match="allowed: hermes"):
        get_tool_parser("xml")


def test_template_tool_support_and_fallback_messages():
    assert template_uses_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}")
    assert not template_uses_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "rainy"},
    ]
    out = messages_without_tool_support(history, [t["function"] for t in TOOLS])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith(generic_tools_prompt([t["function"] for t in TOOLS]))
    assert out[0]["content"].endswith("Be brief.")
    # the assistant's calls are written in the parser's format, so they parse back
    _, calls = get_tool_parser("hermes").parse(out[2]["content"], TOOLS)
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert out[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrainy\n</tool_response>"


# -- reasoning ---------------------------------------------------------------------------------------
REASONING = [
    ("deepseek-r1", "<think>\nThe user wants 2+2.\n</think>\n\n4", "The user wants 2+2.", "4"),
    ("deepseek-r1", "Thinking without the opening tag</think>Answer", "Thinking without the opening tag", "Answer"),
    ("deepseek-r1", "cut off mid-thought <b", "cut off mid-thought <b", ""),
    ("deepseek-r1", "a </thin b</think>c", "a </thin b", "c"),
    ("qwen3", "<think>\nhmm\n</think>\n\nHello!", "hmm", "Hello!"),
    ("qwen3", "Hello, no thinking here.", None, "Hello, no thinking here."),
    ("qwen3", "<think>still thinking", "still thinking", ""),
    ("qwen3", "x</think>y", None, "x</think>y"),
    # no section: the text as it is, leading whitespace too (the stream dropped it: a probe)
    ("qwen3", " Hello", None, " Hello"),
    ("qwen3", "\n\nHi <think>x", None, "\n\nHi <think>x"),
    ("qwen3", "  <think> why </think> answer", "why", "answer"),
    ("deepseek-r1", "  plain", "plain", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_parse_and_stream(name, text, reasoning, content):
    p = get_reasoning_parser(name)
    assert p.parse(text) == (reasoning, content)
    for step in (1, 3, 100):
        s = p.stream()
        r = c = ""
        for i in range(0, len(text), step):
            a, b = s.feed(text[i:i + step])
            r, c = r + a, c + b
        a, b = s.finish()
        assert (r + a, c + b) == (reasoning or "", content)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_constraints_start_after_the_reasoning(name):
    p = get_reasoning_parser(name)
    body = r'\{"a":[0-9]\}'
    rx = re.compile(p.constraint_prefix() + body)
    check_regex(p.constraint_prefix() + body)
    assert rx.fullmatch('<think>a < b, </thin, <think></think>\n\n{"a":1}')
    assert not rx.fullmatch('<think>x</think>y</think>{"a":1}')  # the section ends at the first </think>
    assert not rx.fullmatch('<think>x</think>{"a":12}')  # after it, the constraint holds
    assert bool(rx.fullmatch('{"a":1}')) == (not p.forced)  # qwen3's section is optional
    bounded = re.compile(p.constraint_prefix(5) + body)
    assert bounded.fullmatch('<think>12345</think>{"a":1}') and not bounded.fullmatch('<think>123456</think>{"a":1}')
    # a forced tool call after reasoning parses once the reasoning is split off
    hermes = get_tool_parser("hermes")
    full = re.compile(p.constraint_prefix() + hermes.constraint(TOOLS, "now", False).regex)
    text = '<think>call now</think>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert full.fullmatch(text)
    reasoning, content = p.parse(text)
    assert reasoning == "call now" and _calls(hermes.parse(content, TOOLS)[1]) == [("now", {})]


def test_server_args_check_parser_names():
    from plait.runtime.server.args import ServerArgs

    assert ServerArgs(tool_call_parser="pythonic", reasoning_parser="qwen3").tool_call_parser == "pythonic"
    with pytest.raises(ValueError, match="tool_call_parser='xml' is invalid; allowed: hermes"):
        ServerArgs(tool_call_parser="xml")
    with pytest.raises(ValueError, match="reasoning_parser='o1' is invalid; allowed: deepseek-r1, qwen3"):
        ServerArgs(reasoning_parser="o1")


DEEP = "[" * 5000 + "]" * 5000  # past Python's JSON recursion limit


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": ' + DEEP + '}}\n</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": ' + DEEP + '}}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": ' + DEEP + '}}]'),
    ("granite", '<|tool_call|>[{"name": "add", "arguments": {"a": ' + DEEP + '}}]'),
    ("phi4_mini_json", 'functools[{"name": "add", "arguments": {"a": ' + DEEP + '}}]'),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": "
     + DEEP + "}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("pythonic", "[add(a=" + DEEP + ")]"),
])
def test_arguments_nested_past_the_recursion_limit_are_not_a_crash(name, text):
    """A model that writes arguments nested thousands deep (pushed there by a raw regex
    beside tools, or a long context) gets its text back as content or a call; parsing
    raised RecursionError, a 500 or a dead stream on the server."""
    left, calls = get_tool_parser(name).parse(text, TOOLS)
    assert calls or left == text
    stream = get_tool_parser(name).stream(TOOLS)
    for i in range(0, len(text), 4096):
        stream.feed(text[i:i + 4096])
    stream.finish()


def test_mcp_style_dotted_names_are_called_in_every_json_format():
    """MCP's tool-name format adds dots (and up to 128 characters) to OpenAI's rule: an
    MCP bridge's "github.create_issue" was a 400. Every format but pythonic (a call
    there is Python, where a dot is attribute access: refused when forced) writes and
    reads it; a space is still refused, naming the field."""
    import re

    from plait.tool_parsers import ToolCall, check_tools

    name = "github.create_issue"
    tools = [{"type": "function", "function": {"name": name, "parameters": ADD}}]
    assert [fn["name"] for fn in check_tools(tools)] == [name]
    assert check_tools([{"type": "function", "function": {"name": "a" * 128}}])
    for bad in ("a" * 129, "bad name", "a/b", ""):
        with pytest.raises(RequestError, match=r"1 to 128 of a-z, A-Z, 0-9, _, - and \.") as e:
            check_tools([{"type": "function", "function": {"name": bad}}])
        assert e.value.param == "tools[0].function.name"
    for fmt in sorted(TOOL_PARSERS):
        parser = get_tool_parser(fmt)
        if fmt == "pythonic":
            with pytest.raises(RequestError, match="not a Python identifier"):
                parser.constraint(tools, name, False)
            continue
        text = parser.format_calls([ToolCall(id="c", name=name, arguments='{"a":1,"b":2}')])
        content, calls = parser.parse(text, tools)
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, {"a": 1, "b": 2})], (fmt, text)
        regex = parser.constraint(tools, name, False).regex
        assert re.fullmatch(regex, text.replace('{"a": 1, "b": 2}', '{"a":1,"b":2}')), (fmt, text)


@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": Infinity, "b": 1}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": NaN, \\"b\\": 1}"}\n</tool_call>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": -Infinity, "b": 1}}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": NaN, "b": 1}}]'),
    ("granite", '<|tool_call|>[{"name": "add", "arguments": {"a": NaN, "b": 1}}]'),
    ("pythonic", "[add(a=1e999, b=1)]"),
    ("pythonic", "[add(a=-1e999, b=1)]"),
])
def test_nan_and_infinity_are_no_json_arguments(fmt, text):
    """Python's json reads NaN and Infinity, no client's JSON parser does: such a call
    came back with arguments '{"a": Infinity}' (finish_reason tool_calls). It is now
    text the model wrote, as a call with broken JSON is."""
    parser = get_tool_parser(fmt)
    content, calls = parser.parse(text, TOOLS)
    assert calls == [] and content == text
    ok = text.replace("-Infinity", "2").replace("Infinity", "2").replace("NaN", "2").replace("-1e999", "2")
    ok = ok.replace("1e999", "2")
    assert [json.loads(c.arguments) for c in parser.parse(ok, TOOLS)[1]] == [{"a": 2, "b": 1}]
