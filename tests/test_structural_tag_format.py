"""The newer ``structural_tag`` shape (xgrammar's, passed through by SGLang and vLLM):
``{"type": "structural_tag", "format": {...}}``, a tree of elements, enforced as one
regex: each element's semantics, the limits and errors, and the served paths."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from plait.regex import check_regex
from plait.runtime.constrained.structural_tag import (
    MAX_FORMAT_DEPTH,
    MAX_FORMAT_ELEMENTS,
    MAX_FORMAT_LIST,
    format_regex,
    structural_tag_regex,
)
from test_server_hostile import http, server  # noqa: F401  (the same server, one per module)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
W = {"type": "json_schema", "json_schema": WEATHER}


def rx(fmt: dict) -> str:
    out = structural_tag_regex({"type": "structural_tag", "format": fmt})
    check_regex(out)  # the engine's dialect, every time
    return out


def tag(begin: str, content: dict, end: str | list[str] = "</f>") -> dict:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def const(v: str) -> dict:
    return {"type": "const_string", "value": v}


THINK = tag("<think>", {"type": "any_text"}, "</think>")
CALLS = {"type": "triggered_tags", "triggers": ["<f="],
         "tags": [tag("<f=w>", W), tag("<f=t>", {"type": "regex", "pattern": "[0-9]{2}"})]}

CASES = [  # (format, texts that match, texts that do not)
    (const("Hi. (a+b)*"), ["Hi. (a+b)*"], ["Hi.", "Hi. ab", "hi. (a+b)*"]),
    (W, ['{"city":"Paris"}'], ['{"town":"Paris"}', '{"city":1}', "x"]),
    ({"type": "json_schema", "json_schema": True}, ["1", '"a"', "null"], ["x"]),
    ({"type": "regex", "pattern": "[A-Z]{3}-[0-9]{4}"}, ["ABC-1234"], ["AB-1234", "ABC-12345"]),
    ({"type": "any_text"}, ["", "anything\n at all"], []),
    ({"type": "any_text", "excludes": ["<bad>", "STOP"]}, ["", "a <ba d> ST OP"], ["x<bad>", "STOP", "aSTOPb"]),
    ({"type": "any_text", "max_chars": 3}, ["", "a\nb"], ["abcd"]),
    ({"type": "sequence", "elements": [const("A: "), W]}, ['A: {"city":"Rome"}'], ['{"city":"Rome"}', "A: "]),
    ({"type": "or", "elements": [const("yes"), const("no"), W]}, ["yes", "no", '{"city":""}'], ["yesno", "maybe"]),
    ({"type": "optional", "content": const("x")}, ["", "x"], ["xx"]),
    ({"type": "sequence", "elements": [const("a"), {"type": "plus", "content": const("b")}]}, ["ab", "abbb"], ["a"]),
    ({"type": "sequence", "elements": [const("a"), {"type": "star", "content": const("b")}]}, ["a", "abb"], ["b"]),
    ({"type": "repeat", "min": 2, "max": 3, "content": const("ab")}, ["abab", "ababab"], ["ab", "abababab"]),
    ({"type": "repeat", "min": 1, "max": -1, "content": const("z")}, ["z", "zzzzz"], [""]),
    # tag: its content's unlimited element stops at the first end (one of several)
    (THINK, ["<think></think>", "<think>a</thin>\n</think>"],
     ["<think>a</think>b</think>", "<think>a", "x<think></think>"]),
    (tag("<r>", {"type": "any_text"}, ["</r>", "</a>"]), ["<r>x</r>", "<r>x</a>"], ["<r>x</a></r>"]),
    (tag("<r>", {"type": "sequence", "elements": [const("("), {"type": "any_text"}]}, "</r>"),
     ["<r>(abc</r>"], ["<r>abc</r>", "<r>(a</r>b</r>"]),
    (tag("<r>", {"type": "sequence", "elements": [{"type": "any_text"}, const("!")]}, "</r>"),
     ["<r>abc!</r>"], ["<r>a</r>b!</r>"]),  # a non-last any_text may not write the end either
    (tag("<r>", {"type": "optional", "content": {"type": "any_text", "excludes": ["#"]}}, "</r>"),
     ["<r></r>", "<r>ab</r>"], ["<r>a#</r>"]),
    (tag("<j>", W, "</j>"), ['<j>{"city":"X"}</j>'], ["<j>{}</j>", '<j>{"city":"X"}']),
    # triggered_tags: free text; each trigger starts one of its tags
    (CALLS, ["", "hello", 'a <f=w>{"city":"P"}</f> b <f=t>42</f>', "<f", "x <f x"],
     ["<f=x>1</f>", "<f=t>4</f>", "<f=", '<f=w>{"city":"P"}']),
    ({**CALLS, "at_least_one": True}, ['<f=t>42</f>', '<f=t>42</f> then <f=w>{"city":""}</f>.'],
     ["", "hi", "hi <f=t>42</f>"]),
    ({**CALLS, "stop_after_first": True}, ["", "hi", "hi <f=t>42</f>"],
     ["hi <f=t>42</f> more", "<f=t>42</f><f=t>42</f>"]),
    ({**CALLS, "at_least_one": True, "stop_after_first": True}, ["<f=t>42</f>"], ["", "a<f=t>42</f>", "<f=t>42</f>."]),
    ({**CALLS, "excludes": ["STOP"]}, ["a <f=t>12</f>"], ["STOP", "<f=t>12</f>STOP"]),
    (tag("<resp>", CALLS, "</resp>"), ["<resp>hi <f=t>12</f> ok</resp>"], ["<resp>hi</resp>x</resp>", "<resp>hi"]),
    (tag("<resp>", {**CALLS, "stop_after_first": True}, "</resp>"), ["<resp>a</resp>", "<resp>a<f=t>12</f></resp>"],
     ["<resp>a<f=t>12</f>b</resp>"]),
    # tags_with_separator: tags only, separated
    ({"type": "tags_with_separator", "tags": [tag("<a>", W, "</a>"), tag("<b>", const("x"), "</b>")],
      "separator": ","}, ["", "<b>x</b>", '<b>x</b>,<a>{"city":"Q"}</a>,<b>x</b>'], ["<b>x</b><b>x</b>", " <b>x</b>"]),
    ({"type": "tags_with_separator", "tags": [tag("<b>", const("x"), "</b>")], "separator": ",",
      "at_least_one": True}, ["<b>x</b>", "<b>x</b>,<b>x</b>"], [""]),
    ({"type": "tags_with_separator", "tags": [tag("<b>", const("x"), "</b>")], "separator": ",",
      "stop_after_first": True}, ["", "<b>x</b>"], ["<b>x</b>,<b>x</b>"]),
    # dispatch: a pattern, then its element, in free text
    ({"type": "dispatch", "rules": [["<w>", W], ["<n>", {"type": "regex", "pattern": "[0-9]"}]]},
     ["", "a <w>{\"city\":\"B\"} b <n>7 c"], ["<w>x", "<n>x"]),
    ({"type": "dispatch", "rules": [["<n>", {"type": "regex", "pattern": "[0-9]"}]], "loop": False},
     ["abc", "abc <n>7"], ["<n>7 x"]),
    # the documented recipe: reasoning, then free text with calls
    ({"type": "sequence", "elements": [THINK, CALLS]},
     ['<think>hmm</think>I call <f=w>{"city":"Oslo"}</f>', "<think></think>"], ["no think", "<think>a</think><f=x>"]),
]


@pytest.mark.parametrize("fmt, good, bad", CASES, ids=[f"{i}-{c[0].get('type', 'tag')}" for i, c in enumerate(CASES)])
def test_each_element_admits_its_texts_only(fmt, good, bad):
    r = rx(fmt)
    for text in good:
        assert re.fullmatch(r, text), (text, r[:200])
    for text in bad:
        assert not re.fullmatch(r, text), (text, r[:200])


def test_a_tag_may_leave_its_type_out_and_the_legacy_shape_is_unchanged():
    legacy = {"type": "structural_tag", "triggers": ["<f="],
              "structures": [{"begin": "<f=w>", "schema": WEATHER, "end": "</f>"}]}
    new = {"type": "triggered_tags", "triggers": ["<f="],
           "tags": [{"begin": "<f=w>", "content": W, "end": "</f>"}]}
    for text in ("", 'a<f=w>{"city":"P"}</f>b', "<f=x>", '<f=w>{"city":"P"}'):
        assert bool(re.fullmatch(structural_tag_regex(legacy), text)) == bool(re.fullmatch(rx(new), text))


def nest(depth: int) -> dict:
    f: dict = const("x")
    for _ in range(depth - 1):
        f = {"type": "optional", "content": f}
    return f


BAD = [  # (format, words the message holds)
    ({"type": "nope"}, ["format.type=\"nope\"", "allowed: const_string"]),
    ({"value": "x"}, ["format.type=null", "allowed"]),
    ("text", ["format=\"text\"", "format element"]),
    ({"type": "const_string"}, ["format.value is missing"]),
    ({"type": "const_string", "value": 3}, ["format.value=3", "a string"]),
    ({"type": "const_string", "value": "x", "valu": 1}, ["unknown field(s) 'valu'"]),
    ({"type": "sequence", "elements": []}, ["format.elements=[]"]),
    ({"type": "sequence", "elements": [const("a"), {"type": "tag", "begin": "<a>", "end": "</a>"}]},
     ["format.elements[1].content is missing"]),
    ({"type": "or", "elements": "x"}, ["format.elements=\"x\""]),
    ({"type": "json_schema"}, ["format.json_schema is missing"]),
    ({"type": "json_schema", "json_schema": {"type": "array", "uniqueItems": True}},
     ["format.json_schema", "uniqueItems"]),
    ({"type": "json_schema", "json_schema": WEATHER, "style": "qwen_xml"}, ["format.style=\"qwen_xml\"", "\"json\""]),
    ({"type": "json_schema", "json_schema": WEATHER, "any_order": True}, ["format.any_order=true"]),
    ({"type": "regex", "pattern": "a^b"}, ["format.pattern", "anchor"]),
    ({"type": "regex", "pattern": "(a"}, ["format.pattern"]),
    ({"type": "any_text", "max_tokens": 10}, ["format.max_tokens=10", "not supported"]),
    ({"type": "any_text", "max_chars": -1}, ["format.max_chars=-1"]),
    (tag("<t>", {"type": "any_text", "max_chars": 5}, "</t>"), ["format.content.max_chars", "outside any tag"]),
    ({"type": "any_text", "excludes": "x"}, ["format.excludes=\"x\""]),
    ({"type": "any_text", "excludes": ["ab", "b"]}, ["'b' ends 'ab'"]),
    ({"type": "repeat", "min": 3, "max": 2, "content": const("a")}, ["format.max=2"]),
    ({"type": "repeat", "min": 1, "max": 10**6, "content": const("a")}, ["format.max=1000000", "MAX_REPEAT_COUNT"]),
    ({"type": "repeat", "max": 2, "content": const("a")}, ["format.min is missing"]),
    (tag("<t>", const("a"), 5), ["format.end=5"]),
    (tag({"type": "token", "token": "<|x|>"}, const("a")), ["format.begin", "token-level"]),
    (tag("<t>", {"type": "any_text"}, ""), ["format.content (any_text)", "\"\""]),
    ({"type": "grammar", "grammar": "root ::= \"a\""}, ["format.type='grammar'", "EBNF", "ebnf sampling parameter"]),
    ({"type": "qwen_xml_parameter", "json_schema": WEATHER}, ["format.type='qwen_xml_parameter'", "not supported"]),
    ({"type": "any_tokens"}, ["format.type='any_tokens'", "token-level"]),
    ({"type": "sequence", "elements": [const("a"), {"type": "token", "token": 5}]},
     ["format.elements[1].type='token'"]),
    ({**CALLS, "triggers": []}, ["format.triggers=[]"]),
    ({**CALLS, "tags": [tag("<g>", const("a"))]}, ["format.tags[0].begin='<g>' starts with none"]),
    ({**CALLS, "tags": [const("a")]}, ["format.tags[0]", "a tag element"]),
    ({**CALLS, "at_least_one": "yes"}, ["format.at_least_one=\"yes\""]),
    ({**CALLS, "triggers": ["<f=", "x<f="]}, ["'<f=' ends 'x<f='"]),
    (tag("<r>", {**CALLS, "triggers": ["</r>"], "tags": [tag("</r>x", const("a"))]}, "</r>"),
     ["format.content.triggers", "enclosing tag's end"]),
    ({"type": "tags_with_separator", "tags": [tag("<b>", const("x"))]}, ["format.separator is missing"]),
    ({"type": "dispatch", "rules": [["<a>"]]}, ["format.rules=", "[pattern, format] pairs"]),
    ({"type": "dispatch", "rules": [["<a>", const("x")], ["<a>", const("y")]]}, ["appears twice"]),
    (nest(MAX_FORMAT_DEPTH + 1), [f"allowed: at most {MAX_FORMAT_DEPTH} (MAX_FORMAT_DEPTH)"]),
    ({"type": "sequence", "elements": [const("a")] * (MAX_FORMAT_LIST + 1)}, ["MAX_FORMAT_LIST"]),
    ({"type": "sequence", "elements": [{"type": "sequence", "elements": [const("a")] * 60}] * 60},
     [f"more than {MAX_FORMAT_ELEMENTS} elements", "MAX_FORMAT_ELEMENTS"]),
    (const(""), ["only the empty output"]),
    (const("a" * 100_001), ["format (as a regex)", "at most 100000"]),
    ({"type": "repeat", "min": 1, "max": 100, "content": {"type": "repeat", "min": 100, "max": 100,
                                                           "content": const("a" * 200)}},
     ["format repeats a regex of", "MAX_EXPANDED_CHARS"]),  # small as text, 2M states as an automaton
]


@pytest.mark.parametrize("fmt, words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_formats_are_errors_naming_the_element_and_what_is_allowed(fmt, words):
    with pytest.raises(ValueError) as e:
        rx(fmt)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_limits_are_checked_before_any_work():
    """A tree past the element limit is refused by its count, before any schema in it is
    translated (the last one here would be refused for itself)."""
    bad_schema = {"type": "json_schema", "json_schema": {"uniqueItems": True, "type": "array"}}
    fmt = {"type": "sequence", "elements": [{"type": "sequence", "elements": [const("a")] * 60}] * 5 + [bad_schema]}
    with pytest.raises(ValueError, match="MAX_FORMAT_ELEMENTS"):
        rx(fmt)
    deep: dict = {"type": "optional", "content": const("a")}
    for _ in range(5000):  # far past the depth limit: no RecursionError, no 500
        deep = {"type": "optional", "content": deep}
    with pytest.raises(ValueError, match="MAX_FORMAT_DEPTH"):
        rx(deep)


def test_format_beside_legacy_fields_is_an_error():
    with pytest.raises(ValueError, match="beside format"):
        format_regex({"type": "structural_tag", "format": const("a"), "triggers": ["<"]})


# --- served ---------------------------------------------------------------------------

SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
FINITE = {"type": "sequence", "elements": [  # every output of it ends: the tiny model completes it
    tag("<r>", {"type": "regex", "pattern": "[a-c]{1,3}"}, "</r>"),
    {"type": "tags_with_separator", "tags": [tag("<w>", {"type": "json_schema", "json_schema": SMALL}, "</w>")],
     "separator": ",", "at_least_one": True, "stop_after_first": True},
]}
FINITE_RX = re.compile(r'<r>[a-c]{1,3}</r><w>(.*)</w>', re.S)


def check_finite(text: str, finish: str) -> None:
    assert finish == "stop", (finish, text)
    m = FINITE_RX.fullmatch(text)
    assert m, text
    jsonschema.validate(json.loads(m.group(1)), SMALL)


def test_served_on_chat_completions_and_the_responses_api(http):
    fmt = {"type": "structural_tag", "format": FINITE}
    r = http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Go"}], "response_format": fmt,
        "max_tokens": 80, "temperature": 0.8, "seed": 3})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    check_finite(c["message"]["content"], c["finish_reason"])
    r = http.post("/v1/responses", json={"model": "default", "input": "Go", "text": {"format": fmt},
                                         "max_output_tokens": 80, "temperature": 0.8})
    assert r.status_code == 200, r.text
    msg = [it for it in r.json()["output"] if it["type"] == "message"][0]
    check_finite(msg["content"][0]["text"], "stop" if r.json()["status"] == "completed" else r.json()["status"])
    bad = http.post("/v1/responses", json={"model": "default", "input": "Go", "max_output_tokens": 4,
                                           "text": {"format": {"type": "structural_tag", "format": {"type": "x"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format", bad.text
    assert "text.format.format.type=\"x\"" in bad.json()["error"]["message"], bad.text


def test_triggered_tags_served_with_the_trigger_pushed_up(http, tokenizer_dir):
    """Free text on the tiny model, its '<' token pushed up: each '<' starts a tag."""
    from transformers import AutoTokenizer

    lt = AutoTokenizer.from_pretrained(tokenizer_dir).convert_tokens_to_ids("<")
    fmt = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<"], "tags": [
        tag("<w>", {"type": "json_schema", "json_schema": WEATHER}, "</w>")]}}
    r = http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Weather?"}], "response_format": fmt,
        "max_tokens": 60, "temperature": 0.0, "logit_bias": {str(lt): 30}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    whole = re.findall(r"<w>(.*?)</w>", text)
    assert whole, text
    for body in whole:
        jsonschema.validate(json.loads(body), WEATHER)
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert re.fullmatch(structural_tag_regex(fmt), text), text


def test_native_generate_takes_it_as_a_sampling_parameter(http):
    fmt = {"type": "structural_tag", "format": FINITE}
    for value in (fmt, json.dumps(fmt)):  # the object, or its JSON text as SGLang sends it
        r = http.post("/generate", json={"text": "Go:", "sampling_params": {
            "structural_tag": value, "max_new_tokens": 80, "temperature": 0.8, "seed": 5}})
        assert r.status_code == 200, r.text
        check_finite(r.json()["text"], r.json()["meta_info"]["finish_reason"]["type"])
    recipe = {"type": "structural_tag", "format": {"type": "sequence", "elements": [THINK, CALLS]}}
    r = http.post("/generate", json={"text": "Go:", "sampling_params": {  # the documented recipe compiles
        "structural_tag": recipe, "max_new_tokens": 12, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    assert "<think>".startswith(r.json()["text"]) or r.json()["text"].startswith("<think>"), r.text
    for bad, words in (({"type": "structural_tag", "format": {"type": "grammar", "grammar": "root ::= \"a\""}},
                        "structural_tag.format.type='grammar'"),
                       ({"type": "structural_tag", "format": nest(MAX_FORMAT_DEPTH + 1)}, "MAX_FORMAT_DEPTH"),
                       ({"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>"}},
                        "structural_tag.format.content is missing")):
        r = http.post("/generate", json={"text": "hi", "sampling_params": {"structural_tag": bad,
                                                                           "max_new_tokens": 4}})
        assert r.status_code == 400 and words in r.text, r.text


@pytest.mark.parametrize("fmt, words", [
    ({"type": "unknown_kind"}, "response_format.format.type=\"unknown_kind\""),
    ({"type": "sequence", "elements": [const("a"), {"type": "any_tokens"}]},
     "response_format.format.elements[1].type='any_tokens'"),
    ({"type": "regex"}, "response_format.format.pattern=None"),
    (nest(MAX_FORMAT_DEPTH + 1), "MAX_FORMAT_DEPTH"),
    ({"type": "sequence", "elements": [const("a")] * (MAX_FORMAT_LIST + 1)}, "MAX_FORMAT_LIST"),
])
def test_bad_formats_are_400s_over_http(http, fmt, words):
    r = http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {"type": "structural_tag", "format": fmt}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and words in err["message"], err


def test_the_openai_client_sends_it(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
    fmt = {"type": "structural_tag", "format": FINITE}
    msgs = [{"role": "user", "content": "Go"}]
    out = client.chat.completions.create(model="default", messages=msgs, max_tokens=80, temperature=0.8, seed=1,
                                         response_format=fmt)  # type: ignore[arg-type]
    check_finite(out.choices[0].message.content or "", out.choices[0].finish_reason)
    out = client.chat.completions.create(model="default", messages=msgs, max_tokens=80, temperature=0.8, seed=2,
                                         extra_body={"response_format": fmt})
    check_finite(out.choices[0].message.content or "", out.choices[0].finish_reason)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=msgs, max_tokens=4,
                                       response_format={"type": "structural_tag",  # type: ignore[arg-type]
                                                        "format": {"type": "grammar", "grammar": "root ::= \"a\""}})
    assert "grammar" in str(e.value)
