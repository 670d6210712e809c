"""SGLang's / vLLM's ``structural_tag`` response format: free text in which each
trigger starts one of the structures (begin, a JSON value of its schema, end)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from plait.runtime.constrained.structural_tag import free_text_regexes, structural_tag_regex
from test_server_hostile import http, server  # noqa: F401  (the same server, one per module)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}
FMT = {"type": "structural_tag", "triggers": ["<function="],
       "structures": [{"begin": "<function=get_weather>", "schema": WEATHER, "end": "</function>"}]}


@pytest.mark.parametrize("text, ok", [
    ("Hello", True), ("", True), ("a <functio b", True), ("<function", True),
    ('Hi <function=get_weather>{"city":"Paris"}</function> done', True),
    ('<function=get_weather>{"city":"Paris"}</function><function=get_weather>{"city":"Rome"}</function>', True),
    ('<<function=get_weather>{"city":"P"}</function>\n', True),
    ('Hi <function=foo>{}</function>', False),  # no structure begins so
    ('x<function=get_weather>{"city":"P"}', False),  # no end
    ('<function=get_weather>{"town":"P"}</function>', False),  # not the schema's
    ("<function=", False),
])
def test_the_regex_admits_free_text_and_whole_structures_only(text, ok):
    assert (re.fullmatch(structural_tag_regex(FMT), text) is not None) == ok


@pytest.mark.parametrize("text, free, first", [
    ("a", True, False), ("aa", False, True), ("aba", True, False), ("baab", False, False),
    ("baa", False, True), ("aaa", False, False), ("abaa", False, True),
])
def test_free_text_holds_no_trigger_and_a_segment_ends_at_its_first(text, free, first):
    """A self-overlapping trigger ('aa'): free text holds none; a segment's one
    occurrence is its end ('aaa' holds it earlier)."""
    free_rx, firsts = free_text_regexes(["aa"])
    assert (re.fullmatch(free_rx, text) is not None) == free
    assert (re.fullmatch(firsts["aa"], text) is not None) == first


@pytest.mark.parametrize("change, words", [
    ({"triggers": []}, "triggers"), ({"structures": []}, "structures"),
    ({"triggers": ["<f", "x<f"]}, "ends"),
    ({"structures": [{"begin": "<tool>", "schema": WEATHER, "end": "</tool>"}]}, "starts with none"),
    ({"structures": [{"begin": "<function=a>", "end": "</function>"}]}, "structures[0]"),
    ({"structures": [{"begin": "<function=a>", "schema": {"uniqueItems": True, "type": "array"}, "end": "x"}]},
     "uniqueItems"),
])
def test_bad_formats_are_errors_naming_the_part(change, words):
    with pytest.raises(ValueError) as e:
        structural_tag_regex({**FMT, **change})
    assert words in str(e.value)


def test_served_on_chat_completions(http, tokenizer_dir):
    """Over HTTP on the tiny model, its '<' token pushed up by logit_bias so that it
    writes the trigger: each '<' then begins a structure, whose JSON validates."""
    from transformers import AutoTokenizer

    lt = AutoTokenizer.from_pretrained(tokenizer_dir).convert_tokens_to_ids("<")
    fmt = {"type": "structural_tag", "triggers": ["<"],
           "structures": [{"begin": "<w>", "schema": WEATHER, "end": "</w>"}]}
    r = http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "Weather?"}], "response_format": fmt,
        "max_tokens": 60, "temperature": 0.0, "logit_bias": {str(lt): 30}})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    rx = structural_tag_regex(fmt)
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert re.fullmatch(rx, text), text
    whole = re.findall(r"<w>(.*?)</w>", text)
    assert whole, text
    for body in whole:
        jsonschema.validate(json.loads(body), WEATHER)
    # outside the structures no '<' is free: the text less them holds none but a cut one's
    rest = re.sub(r"<w>.*?</w>", "", text)
    cut = rest[rest.find("<"):] if "<" in rest else ""
    assert rest.count("<") <= 1 and (cut.startswith("<w>") or "<w>".startswith(cut)), text
    bad = http.post("/v1/chat/completions", json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "response_format": {**fmt, "triggers": ["{"]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format", bad.text
    assert "starts with none of the triggers" in bad.json()["error"]["message"]


def test_native_generate_takes_it_as_a_sampling_parameter(http, tokenizer_dir):
    """SGLang's ``sampling_params.structural_tag`` (its JSON text) on ``/generate``."""
    from transformers import AutoTokenizer

    lt = AutoTokenizer.from_pretrained(tokenizer_dir).convert_tokens_to_ids("<")
    fmt = {"structures": [{"begin": "<w>", "schema": WEATHER, "end": "</w>"}], "triggers": ["<"]}
    r = http.post("/generate", json={"text": "Weather:", "sampling_params": {
        "structural_tag": json.dumps(fmt), "max_new_tokens": 60, "temperature": 0.0, "logit_bias": {str(lt): 30}}})
    assert r.status_code == 200, r.text
    text = r.json()["text"]
    whole = re.findall(r"<w>(.*?)</w>", text)
    assert whole, text
    for body in whole:
        jsonschema.validate(json.loads(body), WEATHER)
    for bad, words in (({"structural_tag": "{not json", "regex": None}, "structural_tag is not valid JSON"),
                       ({"structural_tag": json.dumps(fmt), "regex": "a+"}, "at most one constraint"),
                       ({"structural_tag": json.dumps({**fmt, "triggers": ["{"]})}, "starts with none")):
        r = http.post("/generate", json={"text": "hi", "sampling_params": {**bad, "max_new_tokens": 4}})
        assert r.status_code == 400 and words in r.text, r.text
