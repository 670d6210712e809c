"""``uniqueItems`` over strings and numbers where the JSON is one part of a larger
regex: forced tool calls (``tool_choice`` required / named / ``allowed_tools``, every
parser, the language's ``gen(tools=...)`` too), ``structural_tag`` schemas (the newer
``format`` tree and the legacy structures), and a JSON reply beside tools under
``auto``. Until now these were a 400 whose text said the opposite ("over strings and
numbers the engine keeps them beside the grammar"): each embeds a schema as a regex,
and the guard only followed a JSON value that was the whole output.

Now the regex is built without the keyword and the guard follows every JSON value that
begins right after a fixed text (the call's envelope before its arguments, a tag's
begin): :class:`~plait.runtime.constrained.unique_items.OutputTracker`, the
``unique_items`` sampling parameter. Also here: an array whose items can take fewer
distinct values than its ``minItems`` is a 400 up front (it compiled and dead-ended a
few tokens in), and an ``allowed_tools`` error names the tool by its place in the
request's ``tools`` (it named its place among the allowed ones).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

import plait as sgl
from plait.errors import RequestError
from plait.runtime.constrained.unique_items import Duplicate, OutputTracker, plan
from plait.runtime.sampling_params import SamplingParams
from plait.tool_parsers import TOOL_PARSERS, get_tool_parser

from test_unique_items import engines, oracle_generate  # noqa: F401  (pytest fixture)

TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
        "required": ["tags"], "additionalProperties": False}
CODES = {"type": "object", "properties": {
    "codes": {"type": "array", "items": {"type": "string", "pattern": "^[a-c]{2}$"}, "minItems": 4, "maxItems": 4,
              "uniqueItems": True}}, "required": ["codes"], "additionalProperties": False}
TAG_TOOL = {"type": "function", "function": {"name": "tag", "description": "Tag a photo", "parameters": TAGS}}
CODE_TOOL = {"type": "function", "function": {"name": "codes", "parameters": CODES}}
PLAIN_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


def repeats(groups, text: str) -> bool:
    t = OutputTracker([(a.encode(), s) for a, s in groups])
    try:
        t.feed(text.encode())
    except Duplicate:
        return True
    return False


# -- following JSON values inside other text ----------------------------------------------------------
def test_values_after_an_anchor_are_followed_one_by_one():
    g = [('"arguments": ', [["tags"]])]
    assert repeats(g, '<tool_call>{"name": "t", "arguments": {"tags":["a","b","a"]}}</tool_call>')
    # each call's arguments are their own value: the same item in two calls is fine
    assert not repeats(g, '{"name": "t", "arguments": {"tags":["a"]}}\n{"name": "t", "arguments": {"tags":["a"]}}')
    # text before the anchor is not JSON to keep
    assert not repeats(g, 'x ["a","a"] {"tags":["a","a"]} then "arguments": {"tags":["a"]}')
    # the anchor written inside a kept value does not stop that value being followed
    assert repeats(g, '"arguments": {"note":"\\"arguments\\": {","tags":["a","a"]}')
    # an anchor followed by no container (free text) and one that never closes: the real one still counts
    assert repeats(g, '"arguments": hello "arguments": {"x": [ "arguments": {"tags":["z","z"]}')
    # "": the output's start (a JSON reply), beside anchored ones
    assert repeats([("", [["tags"]]), ("<t>", [["codes"]])], '<t>{"codes":["a","a"]}')
    assert repeats([("", [["tags"]]), ("<t>", [["codes"]])], '{"tags":["a","a"]}')
    assert not repeats([("<t>", [["codes"]])], '{"codes":["a","a"]}')


def test_an_array_with_too_few_possible_items_is_refused_up_front():
    for items in ({"enum": ["x", "y"]}, {"type": "boolean"}, {"const": 3}, {"enum": [1, 1.0, 2]}):
        schema = {"type": "array", "items": items, "minItems": 3, "uniqueItems": True}
        with pytest.raises(ValueError, match=r"'uniqueItems' with [12] possible item values cannot reach 'minItems' 3"):
            plan(schema)
        with pytest.raises(RequestError, match="cannot reach 'minItems' 3") as e:
            SamplingParams(json_schema={"type": "object", "properties": {"a": schema}}).constraint()
        assert e.value.param == "json_schema"
    plan({"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "uniqueItems": True})  # reachable


@pytest.mark.parametrize("bad,match", [
    ([["x", "tags"]], "unique_items=.* is invalid"),
    ([["x", [["a", 1.5]]]], "unique_items=.* is invalid"),
    ([["x", [["a", 10**30]]]], "unique_items=.* is invalid"),  # (msgspec cannot carry it to the engine)
    ([["x" * 300, [["a"]]]], "unique_items=.* is invalid"),
    ("tags", "unique_items=.* is invalid"),
])
def test_unique_items_param_is_checked(bad, match):
    with pytest.raises(RequestError, match=match) as e:
        SamplingParams.from_dict({"regex": "[a-z]+", "unique_items": bad})
    assert e.value.param == "unique_items"
    with pytest.raises(RequestError, match="unique_items is given without regex or ebnf"):
        SamplingParams.from_dict({"unique_items": [["x", [["a"]]]]})


# -- forced tool calls ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [p for p in TOOL_PARSERS if p != "pythonic"])
def test_every_json_parser_keeps_arguments_unique_beside_its_regex(name):
    c = get_tool_parser(name).constraint([PLAIN_TOOL, TAG_TOOL], "tag", False)
    assert len(c.unique) == 1 and c.unique[0][1] == [["tags"]]
    before = c.unique[0][0]
    # the anchor is what the regex writes right before the arguments: the parser's own call text has it
    call = get_tool_parser(name).format_calls([_call("tag", {"tags": ["a"]})])
    assert before in call and call[call.index(before) + len(before):].lstrip().startswith("{")
    assert repeats(c.unique, call.replace('["a"]', '["a", "a"]'))
    assert not repeats(c.unique, call.replace('["a"]', '["a", "b"]'))


def _call(name: str, args: dict):
    from plait.tool_parsers import ToolCall

    return ToolCall("call_1", name, json.dumps(args))


def test_pythonic_keeps_a_keyword_argument_unique():
    c = get_tool_parser("pythonic").constraint([TAG_TOOL], None, False)
    assert c.unique == [("tags=", [[]])]
    assert repeats(c.unique, '[tag(tags=["a", "a"])]') and not repeats(c.unique, '[tag(tags=["a", "b"])]')


def _arguments(text: str) -> dict:
    _, calls = get_tool_parser("hermes").parse(text, [TAG_TOOL])
    assert len(calls) == 1, text
    return json.loads(calls[0].arguments)


def test_a_forced_call_that_repeats_an_item_is_turned_aside(engines):
    e, _ = engines
    c = get_tool_parser("hermes").constraint([TAG_TOOL], "tag", False)
    target = '<tool_call>\n{"name": "tag", "arguments": {"tags":["red","blue","red","green"]}}\n</tool_call>'
    out = oracle_generate(e, "Call:", target, {**c.sampling(), "max_new_tokens": 60})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out
    args = _arguments(out["text"])
    jsonschema.validate(args, TAGS)
    assert args["tags"][:2] == ["red", "blue"] and len(args["tags"]) >= 3
    # the same regex without unique_items writes the duplicate: the guard made the difference
    free = oracle_generate(e, "Call:", target, {"regex": c.regex, "max_new_tokens": 60})
    assert free["text"] == target


def test_language_gen_forces_a_call_with_unique_arguments(engines):
    e, _ = engines
    g = sgl.gen("call", tools=[TAG_TOOL], tool_choice="required", max_tokens=60)
    c = get_tool_parser("hermes").constraint([TAG_TOOL], None, True)
    assert g.params["regex"] == c.regex and g.params["unique_items"] == c.unique
    target = '<tool_call>\n{"name": "tag", "arguments": {"tags":["x","x"]}}\n</tool_call>'
    out = oracle_generate(e, "Go:", target, {"regex": g.params["regex"], "unique_items": g.params["unique_items"],
                                             "max_new_tokens": 60})
    args = _arguments(out["text"])
    assert args["tags"][0] == "x" and len(set(args["tags"])) == len(args["tags"])


# -- structural tags ----------------------------------------------------------------------------------
def test_structural_tag_schemas_keep_unique_items(engines):
    e, _ = engines
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Codes: "},
        {"type": "tag", "begin": "<c>", "content": {"type": "json_schema", "json_schema": CODES}, "end": "</c>"}]}}
    outs = e.generate(["A", "B"], {"structural_tag": tag, "temperature": 1.0, "seed": 3, "n": 4,
                                   "max_new_tokens": 60})
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        value = json.loads(o["text"][len("Codes: <c>"):-len("</c>")])
        jsonschema.validate(value, CODES)
    legacy = {"structures": [{"begin": "<c>", "schema": CODES, "end": "</c>"}], "triggers": ["<c>"]}
    assert SamplingParams(structural_tag=legacy).constraint().unique
    # no fixed text right before the schema: refused by the element's path
    after_regex = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": "[a-z]+"}, {"type": "json_schema", "json_schema": CODES}]}}
    with pytest.raises(RequestError, match=r"structural_tag\.format\.elements\[1\]\.json_schema: its 'uniqueItems' "
                                           r"can be kept only where fixed text comes right before"):
        SamplingParams(structural_tag=after_regex).constraint()


# -- over HTTP, with the openai client ---------------------------------------------------------------
def test_openai_forced_tool_calls_and_structural_tags_with_a_set_argument(tiny_model_factory):
    import openai

    from plait.runtime.server import launch

    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096, max_running_requests=8) as rt:
        client = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        msgs = [{"role": "user", "content": "Four codes."}]
        for choice in ("required", {"type": "function", "function": {"name": "codes"}},
                       {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                           {"type": "function", "function": {"name": "codes"}}]}}):
            r = client.chat.completions.create(model=model, messages=msgs, tools=[PLAIN_TOOL, CODE_TOOL],
                                               tool_choice=choice, max_tokens=120, temperature=1.0, seed=7, n=4,
                                               parallel_tool_calls=False)
            seen = 0
            for ch in r.choices:
                assert ch.finish_reason == "tool_calls", ch
                for call in ch.message.tool_calls:
                    if call.function.name == "codes":
                        value = json.loads(call.function.arguments)
                        jsonschema.validate(value, CODES)  # uniqueItems included
                        seen += 1
            assert seen >= 1
        # a JSON reply beside tools under auto: either the JSON or calls, both kept distinct
        r = client.chat.completions.create(
            model=model, messages=msgs, tools=[CODE_TOOL], max_tokens=120, temperature=1.0, seed=2, n=4,
            response_format={"type": "json_schema", "json_schema": {"name": "codes", "schema": CODES}})
        for ch in r.choices:
            if ch.message.tool_calls:
                for call in ch.message.tool_calls:
                    jsonschema.validate(json.loads(call.function.arguments), CODES)
            else:
                jsonschema.validate(json.loads(ch.message.content), CODES)
        tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<c>", "end": "</c>", "content": {
            "type": "json_schema", "json_schema": CODES}}}
        r = client.chat.completions.create(model=model, messages=msgs, response_format=tag, max_tokens=80,
                                           temperature=1.0, seed=4, n=4)
        for ch in r.choices:
            assert ch.finish_reason == "stop", ch
            jsonschema.validate(json.loads(ch.message.content[3:-4]), CODES)
        # allowed_tools: an error names the tool by its place in the request's tools
        bad = {"type": "function", "function": {"name": "rows", "parameters": {"type": "object", "properties": {
            "rows": {"type": "array", "items": {"type": "object"}, "uniqueItems": True}}}}}
        with pytest.raises(openai.BadRequestError, match=r"tools\[2\]\.function\.parameters \(function 'rows'\)") as e:
            client.chat.completions.create(
                model=model, messages=msgs, tools=[PLAIN_TOOL, CODE_TOOL, bad], max_tokens=8,
                tool_choice={"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
                    {"type": "function", "function": {"name": "rows"}}]}})
        assert "objects or arrays" in str(e.value)


# -- the tracker's bookkeeping ---------------------------------------------------------------------
def test_path_automaton_agrees_with_the_pattern_matcher():
    import random

    from plait.runtime.constrained.unique_items import ANY, DEEP, _start, _step

    def _matches(pattern: list, path: list) -> bool:  # the patterns' meaning, written directly
        if not pattern:
            return not path
        head = pattern[0]
        if head == DEEP:
            return any(_matches(pattern[1:], path[i:]) for i in range(len(path) + 1))
        if not path:
            return False
        step = path[0]
        if head == ANY or head == step and isinstance(head, int) == isinstance(step, int):
            return _matches(pattern[1:], path[1:])
        return False

    rng = random.Random(5)
    steps = ["a", "b", 0, 1]
    for _ in range(400):
        sites = [[rng.choice(steps + [ANY, DEEP]) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 3))]
        path = [rng.choice(steps) for _ in range(rng.randint(0, 6))]
        states = _start(sites)
        for p in path:
            states = _step(sites, states, p)
        by_automaton = {i for i, pos in states if pos == len(sites[i])}
        assert by_automaton == {i for i, s in enumerate(sites) if _matches(s, path)}, (sites, path)


def test_copies_share_frames_until_one_changes_them():
    t = OutputTracker([(b"", [["*", "tags"]])])
    t.feed(b'[{"tags":["a","b"')
    c = t.copy()
    c.feed(b',"c"')
    t.feed(b',"c"')  # each has its own items: neither saw the other's "c"
    for x in (t, c):
        with pytest.raises(Duplicate):
            x.copy().feed(b',"c"')
        x.copy().feed(b',"d"]}]')
    d = t.copy()
    d.feed(b'],"x":1},{"tags":["a"')  # a new array at another index: its own items
    with pytest.raises(Duplicate):
        d.feed(b',"a"')
    with pytest.raises(Duplicate):
        t.feed(b',"a"')  # the original's array is untouched by the copy's
