"""Forced and strict tool calls whose arguments have no regex, as JSON holes.

A schema that ``response_format`` serves through llguidance's JSON compiler but that
plait's schema -> regex translation refuses (a ``pattern`` beside ``maxLength``, as
package.json's ``name``; ``not: {enum}`` beside ``maxLength``) was a 400 as a forced or
strict tool, whose calls are one regex. Its arguments are now a JSON hole in that regex
and the whole a Lark grammar (:mod:`plait.runtime.constrained.holes`): checked here on
llguidance with a byte tokenizer (every format, named / required / strict auto), over
HTTP on a tiny model (the arguments validate against the schema), and in the language.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import llguidance
import pytest

from plait.runtime.constrained.holes import has_holes, holes_to_lark
from plait.runtime.server import launch
from plait.tool_parsers import get_tool_parser

# package.json's name, shortened: no regex for the pattern within the length bounds
PKG = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^(?:@[a-z]+/)?[a-z][a-z-]*$", "minLength": 2, "maxLength": 12},
    "private": {"type": "boolean"}}}
NOT_ENUM = {"type": "object", "required": ["tag"], "properties": {
    "tag": {"type": "string", "maxLength": 6, "not": {"enum": ["latest", "next"]}}}}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "pkg", "parameters": PKG}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
JSON_FORMATS = ["hermes", "mistral", "llama3_json", "granite", "deepseek_v3", "deepseek_v31", "phi4_mini_json"]


class _Bytes:  # one token per byte, EOS last
    tokens = [bytes([i]) for i in range(256)] + [b"\xff[eos]"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=[256])


def _accepts(grammar: str, text: str) -> bool:
    m = llguidance.LLMatcher(TOKENIZER, llguidance.grammar_from("lark", grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return bool(m.consume_tokens(list(text.encode()))) and m.is_accepting()


def _calls(parser, calls: list[tuple[str, dict]]) -> str:
    """The calls as the constraint writes them (arguments compact)."""
    from plait.tool_parsers import ToolCall

    text = parser.format_calls([ToolCall(id="c", name=n, arguments=json.dumps(a)) for n, a in calls])
    for _, a in calls:
        text = text.replace(json.dumps(a), json.dumps(a, separators=(",", ":")))
    return text


@pytest.mark.parametrize("fmt", JSON_FORMATS)
def test_every_json_format_forces_calls_with_holes(fmt):
    parser = get_tool_parser(fmt)
    good, bad = [("pkg", {"name": "@ab/c-d"})], [("pkg", {"name": "Ab"})]
    too_long = [("pkg", {"name": "abcdefghijklm"})]  # 13 characters: the pattern alone admits it
    named = parser.constraint(TOOLS, "pkg", False)
    assert has_holes(named.regex)
    grammar = holes_to_lark(named.regex)
    assert _accepts(grammar, _calls(parser, good))
    assert not _accepts(grammar, _calls(parser, bad)) and not _accepts(grammar, _calls(parser, too_long))
    assert not _accepts(grammar, _calls(parser, [("add", {"a": 1})]))  # the named function only
    both = grammar_required = holes_to_lark(parser.constraint(TOOLS, None, True).regex)
    assert _accepts(grammar_required, _calls(parser, [*good, ("add", {"a": 1})]))
    assert _accepts(both, _calls(parser, [("add", {"a": 2}), *good]))
    assert not _accepts(both, _calls(parser, [("add", {"a": 2}), *bad]))
    # strict under auto: free text, then calls whose arguments follow the schema
    auto = holes_to_lark(parser.auto_constraint(TOOLS, None, True, {"pkg"}).regex)
    assert _accepts(auto, "Just text.") and _accepts(auto, "Sure. " + _calls(parser, good))
    assert not _accepts(auto, "Sure. " + _calls(parser, bad))


def test_holes_to_lark_structure():
    """Free text before a group is one lazy terminal with its first text (greedy, it
    ran into the trigger); a non-fixed terminal ending a repeated group is refused."""
    hole = '\ue000{"type":"object"}\ue001'
    grammar = holes_to_lark("[a-z]*(?:<t>" + hole + "</t>)?")
    assert _accepts(grammar, "abc") and _accepts(grammar, "ab<t>{}</t>") and _accepts(grammar, "<t>{}</t>")
    assert not _accepts(grammar, "ab<t>{}") and not _accepts(grammar, "ab<t>[]</t>")
    assert "[lazy]: /(?:[a-z])*<t>/" in grammar
    # (?s:...) around a hole reaches the text beside it; / and raw newlines are escaped
    grammar = holes_to_lark("(?s:a.b/" + hole + "\n)")
    assert _accepts(grammar, "a\nb/{}\n") and not _accepts(grammar, "axb/{}x")
    with pytest.raises(ValueError, match="not a fixed character"):
        holes_to_lark("(?:" + hole + "a*){0,3}")
    assert holes_to_lark("(?:<a>" + hole + "</a>){1,3}").count("%json") == 1  # a repeated rule, not copies


def test_a_schema_neither_backend_follows_stays_a_400():
    from plait.errors import RequestError

    remote = {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}
    with pytest.raises(RequestError, match="cannot be enforced"):
        get_tool_parser("hermes").constraint([{"type": "function", "function": {"name": "r", "parameters": remote}}],
                                             "r", False)


@pytest.fixture(scope="module")
def http(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096, max_running_requests=4,
                served_model_name="tiny") as rt, httpx.Client(base_url=rt.url, timeout=120) as c:
        yield c


def _chat(http, tools, choice, **extra) -> httpx.Response:
    return http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "tools": tools, "tool_choice": choice,
        "temperature": 1.0, **extra})


@pytest.mark.parametrize("schema", [PKG, NOT_ENUM], ids=["pattern+maxLength", "not-enum+maxLength"])
def test_forced_calls_follow_a_schema_without_a_regex(http, schema):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    complete = 0
    for seed in range(6):
        for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
            r = _chat(http, tools, choice, seed=seed)
            assert r.status_code == 200, r.text
            choice0 = r.json()["choices"][0]
            if choice0["finish_reason"] == "length":
                continue
            calls = choice0["message"]["tool_calls"]
            assert calls and calls[0]["function"]["name"] == "f", choice0
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
            complete += 1
    assert complete >= 4  # (a random model mostly finishes short strings well within 120 tokens)


def test_streamed_and_strict_auto(http):
    tools = [{"type": "function", "function": {"name": "f", "parameters": PKG, "strict": True}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "f"}}, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["tool_calls"]
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        args = "".join(json.loads(line[6:])["choices"][0]["delta"].get("tool_calls", [{}])[0]
                       .get("function", {}).get("arguments") or ""
                       for line in r.iter_lines() if line.startswith("data: {")
                       and json.loads(line[6:])["choices"])
    assert args == plain[0]["function"]["arguments"]
    r = _chat(http, tools, "auto")  # strict under auto: served (it was a 400)
    assert r.status_code == 200, r.text
    for call in r.json()["choices"][0]["message"].get("tool_calls") or []:
        jsonschema.validate(json.loads(call["function"]["arguments"]), PKG)
    r = _chat(http, tools, "required", grammar_backend="outlines")
    err = r.json().get("error", {})
    assert r.status_code == 400 and err.get("param") == "grammar_backend" and "llguidance" in err["message"], r.text
    assert _chat(http, TOOLS, "required").status_code == 200


def test_the_language_forces_such_a_call():
    import plait

    g = plait.gen("call", tools=[{"type": "function", "function": {"name": "f", "parameters": PKG}}],
                  tool_choice="required")
    params = g.sampling_params if hasattr(g, "sampling_params") else g.params
    assert params.get("regex") is None and "%json" in params["ebnf"] and params["grammar_backend"] == "llguidance"
    with pytest.raises(ValueError, match="grammar_backend='outlines' cannot enforce"):
        plait.gen("call", tools=[{"type": "function", "function": {"name": "f", "parameters": PKG}}],
                  tool_choice="required", grammar_backend="outlines")


# -- structural tags: a json_schema element (or a legacy structure's schema) with no regex ----------
TAG_FORMAT = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<pkg>"], "tags": [
    {"begin": "<pkg>", "content": {"type": "json_schema", "json_schema": PKG}, "end": "</pkg>"}]}}
TAG_LEGACY = {"type": "structural_tag", "triggers": ["<pkg>"],
              "structures": [{"begin": "<pkg>", "schema": PKG, "end": "</pkg>"}]}


@pytest.mark.parametrize("fmt", [TAG_FORMAT, TAG_LEGACY], ids=["format", "legacy"])
def test_structural_tags_take_schemas_without_a_regex(fmt):
    from plait.runtime.constrained.structural_tag import structural_tag_constraint

    regex, _ = structural_tag_constraint(fmt)
    grammar = holes_to_lark(regex)
    assert _accepts(grammar, 'Hello <pkg>{"name":"left-pad"}</pkg> and <pkg>{"name":"@a/b"}</pkg> bye')
    assert _accepts(grammar, "no tags at all")
    assert not _accepts(grammar, 'x <pkg>{"name":"Left"}</pkg>')
    assert not _accepts(grammar, 'x <pkg>{"name":"abcdefghijklm"}</pkg>')  # past maxLength


def test_structural_tags_with_holes_over_http(http):
    for fmt in (TAG_FORMAT, TAG_LEGACY):
        r = http.post("/generate", json={"text": "Go:", "sampling_params": {
            "structural_tag": fmt, "max_new_tokens": 60, "temperature": 1.0, "seed": 3}})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, "temperature": 1.0, "seed": 3,
            "response_format": fmt})
        assert r.status_code == 200, r.text
        r = http.post("/generate", json={"text": "Go:", "sampling_params": {
            "structural_tag": fmt, "max_new_tokens": 4, "grammar_backend": "outlines"}})
        assert r.status_code == 400 and "llguidance" in r.text, r.text
    # forced into a tag right away: the JSON inside follows the schema
    forced = {"type": "structural_tag", "format": {"type": "tag", "begin": "<pkg>", "end": "</pkg>",
                                                   "content": {"type": "json_schema", "json_schema": PKG}}}
    done = 0
    for seed in range(4):
        r = http.post("/generate", json={"text": "Go:", "sampling_params": {
            "structural_tag": forced, "max_new_tokens": 80, "temperature": 1.0, "seed": seed}})
        assert r.status_code == 200, r.text
        out = r.json()
        if out["meta_info"]["finish_reason"]["type"] == "length":
            continue
        text = out["text"]
        assert text.startswith("<pkg>") and text.endswith("</pkg>"), text
        jsonschema.validate(json.loads(text[len("<pkg>"):-len("</pkg>")]), PKG)
        done += 1
    assert done >= 2


def test_a_hole_beside_a_tool_whose_unique_items_are_kept(http):
    """A required call with a hole beside a tool whose ``uniqueItems`` the guard keeps:
    the sites travel beside the grammar as beside a regex (they were a 400: unique_items
    without regex)."""
    tags = {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 2}, "minItems": 2, "maxItems": 3,
                 "uniqueItems": True}}}
    assert get_tool_parser("hermes").constraint([{"type": "function", "function": {"name": "tag", "parameters": tags}}],
                                                "tag", False).unique  # (kept beside the regex, not in it)
    tools = [{"type": "function", "function": {"name": "pkg", "parameters": PKG}},
             {"type": "function", "function": {"name": "tag", "parameters": tags}}]
    seen = 0
    for seed in range(8):
        r = _chat(http, tools, "required", seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        for call in choice["message"]["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            jsonschema.validate(args, tags if call["function"]["name"] == "tag" else PKG)
            seen += call["function"]["name"] == "tag"
    assert seen >= 1


def test_json_or_calls_with_a_hole(http):
    """A JSON response_format beside tools under auto: the reply is the JSON or calls;
    a tool whose schema has no regex is a hole there too (it was a 400)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}
    for seed in range(4):
        r = _chat(http, [{"type": "function", "function": {"name": "pkg", "parameters": PKG}}], "auto",
                  response_format=fmt, seed=seed)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        calls = choice["message"].get("tool_calls")
        if calls:
            for call in calls:
                jsonschema.validate(json.loads(call["function"]["arguments"]), PKG)
        else:
            assert isinstance(json.loads(choice["message"]["content"])["ok"], bool), choice
