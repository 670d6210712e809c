"""The regex path (runtime/constrained/json_schema.py) and the finiteness check
(runtime/constrained/finite.py) on recursive schemas with keywords beside the
recursion: annotation siblings change nothing, a ``$ref`` merged into its surroundings
is counted as a recursion (it was inlined past the count and refused as "nested too
deeply"), free-form objects' repeated keys validate under either reading, and
``if``/``then``/``else`` / ``not`` beside a recursion never make finite.py refuse a
schema that has a finite value. ``jsonschema`` is the reference for every output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from plait.errors import RequestError
from plait.runtime.constrained.finite import schema_unending
from plait.runtime.constrained.json_schema import RECURSION_UNROLL, SchemaError, schema_to_regex
from plait.runtime.sampling_params import SamplingParams
from regex_sampling import sample

ANNOTATIONS = {"title": "T", "description": "d", "default": None, "examples": [None], "$comment": "c"}
NULL = {"type": "null"}


def validator(schema: object):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def outlines(schema: object) -> str:
    return SamplingParams.from_dict({"json_schema": schema, "grammar_backend": "outlines"}).constraint().grammar


def assert_sound(schema: object, regex: str, n: int = 40) -> list[str]:
    v = validator(schema)
    texts = sample(regex, n, seed=7)
    for t in texts:
        assert re.fullmatch(regex, t)
        errors = list(v.iter_errors(json.loads(t)))
        assert not errors, (t, errors[0].message)
    return texts


def depth(x: object) -> int:
    if isinstance(x, dict):
        return 1 + max((depth(v) for v in x.values()), default=0)
    if isinstance(x, list):
        return 1 + max((depth(v) for v in x), default=0)
    return 0


# (name, schema, path to the dict the annotations go beside)
RECURSIVE = [
    ("anyOf-required", {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, NULL]}}, "required": ["a"]},
     ("properties", "a")),
    ("oneOf-required", {"type": "object", "properties": {"a": {"oneOf": [{"$ref": "#"}, NULL]}}, "required": ["a"]},
     ("properties", "a")),
    ("anyOf-beside-type", {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, NULL],
                                                                "type": ["object", "null"]}}, "required": ["a"]},
     ("properties", "a")),
    ("anyOf-beside-not", {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, NULL],
                                                               "not": {"type": "string"}}}, "required": ["a"]},
     ("properties", "a")),
    ("anyOf-beside-maxProperties", {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, NULL],
                                                                         "maxProperties": 3}}, "required": ["a"]},
     ("properties", "a")),
    ("allOf-ref", {"type": "object", "properties": {"a": {"allOf": [{"$ref": "#"}]}}}, ("properties", "a")),
    ("anyOf-allOf-ref", {"type": "object", "properties": {"a": {"anyOf": [{"allOf": [{"$ref": "#"}]}, NULL]}},
                         "required": ["a"]}, ("properties", "a")),
    ("pydantic-v2-optional", {"$defs": {"N": {"type": "object", "title": "N", "required": ["v"], "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/N"}, NULL]}}}}, "$ref": "#/$defs/N"},
     ("$defs", "N", "properties", "next")),
    ("pydantic-v1-allOf", {"definitions": {"N": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"allOf": [{"$ref": "#/definitions/N"}]}}, "required": ["v"]}},
        "$ref": "#/definitions/N"}, ("definitions", "N", "properties", "next")),
    ("items-anyOf", {"type": "array", "maxItems": 3, "items": {"anyOf": [{"$ref": "#"}, {"type": "integer"}]}},
     ("items",)),
    ("root-anyOf", {"anyOf": [{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, NULL]}, ()),
]


def annotated(schema: dict, place: tuple[str, ...], extra: dict) -> dict:
    out = json.loads(json.dumps(schema))
    node = out
    for key in place:
        node = node[key]
    node.update(extra)
    return out


@pytest.mark.parametrize("name, schema, place", RECURSIVE, ids=[r[0] for r in RECURSIVE])
def test_annotations_beside_a_recursion_change_nothing(name, schema, place):
    plain = schema_to_regex(schema)
    for key, value in ANNOTATIONS.items():
        assert schema_to_regex(annotated(schema, place, {key: value})) == plain, key
    assert schema_to_regex(annotated(schema, place, ANNOTATIONS)) == plain
    texts = assert_sound(annotated(schema, place, ANNOTATIONS), plain)
    # the recursion is unrolled (values nest), and then ended
    assert max(depth(json.loads(t)) for t in texts) >= 2


def test_a_merged_ref_is_counted_like_a_ref():
    # the same recursion written three ways unrolls to the same depth
    ref = {"type": "object", "properties": {"a": {"$ref": "#"}}}
    via_all_of = {"type": "object", "properties": {"a": {"allOf": [{"$ref": "#"}]}}}
    via_any_of = {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}], "type": "object"}}}
    regexes = {schema_to_regex(s) for s in (ref, via_all_of, via_any_of)}
    assert len(regexes) == 1
    deepest = "{" + '"a":{' * (RECURSION_UNROLL + 1) + "}" * (RECURSION_UNROLL + 2)
    assert re.fullmatch(regexes.pop(), deepest)


def test_a_recursion_the_regex_cannot_end_names_the_ref_and_the_limit():
    # finite.py does not read 'required' in an allOf part beside the properties, so this
    # reaches the translator, which unrolls it and finds no end
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}}, "allOf": [{"required": ["next"]}]}
    for s in (schema, {**schema, "description": "a list", "title": "L"}):
        with pytest.raises(SchemaError) as e:
            schema_to_regex(s)
        msg = str(e.value)
        assert "nested too deeply" not in msg
        assert "'$ref' at #/properties/next" in msg and "recursive ('#')" in msg
        assert f"{RECURSION_UNROLL + 1} levels" in msg and "llguidance" in msg
        with pytest.raises(RequestError, match=r"recursive \('#'\)"):
            outlines(s)


# -- free-form objects: repeated keys --------------------------------------------------------------
def pairs_of(text: str) -> list[list[tuple[str, object]]]:
    found: list[list[tuple[str, object]]] = []

    def hook(pairs):
        found.append(pairs)
        return dict(pairs)

    json.loads(text, object_pairs_hook=hook)
    return found


@pytest.mark.parametrize("schema", [
    {"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": {"type": "integer",
                                                                                        "minimum": 0}, "maxProperties": 3},
    {"type": "object", "patternProperties": {"^[ab]$": {"type": "boolean"}}, "additionalProperties": False,
     "maxProperties": 4, "minProperties": 1},
])
def test_repeated_free_form_keys_validate_under_either_reading(schema):
    regex = outlines(schema)
    v = validator(schema)
    repeats = 0
    for text in sample(regex, 60, seed=11):
        assert re.fullmatch(regex, text)
        for pairs in pairs_of(text):
            names = [k for k, _ in pairs]
            if len(set(names)) == len(names):
                continue
            repeats += 1
            first = {}
            for k, x in pairs:
                first.setdefault(k, x)
            last = dict(pairs)  # what json (and so jsonschema) reads
            assert v.is_valid(last) and v.is_valid(first), text
            # either reading is a text the regex admits itself (the other copies left out)
            for reading in (first, last):
                assert re.fullmatch(regex, json.dumps(reading, separators=(",", ":"))), (text, reading)
    assert repeats  # the samples do exercise repeats


def test_min_properties_above_one_on_free_form_objects_is_refused():
    with pytest.raises(SchemaError, match=r"'minProperties' at # is supported up to 1 .* keys could repeat"):
        schema_to_regex({"type": "object", "minProperties": 2})


# -- finite.py: if/then/else and not beside a recursion ---------------------------------------------
TREE = {"type": "object", "properties": {"kind": {"enum": ["leaf", "node"]},
                                        "kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kind"]}
# (name, schema, a finite value of it: checked with jsonschema first)
FINITE = [
    ("if-then-ref", {**TREE, "if": {"properties": {"kind": {"const": "node"}}}, "then": {"required": ["kids"]}},
     {"kind": "leaf"}),
    ("if-else-ref", {**TREE, "if": {"properties": {"kind": {"const": "leaf"}}},
                     "else": {"properties": {"kids": {"minItems": 1}}}}, {"kind": "leaf"}),
    ("then-ref-required", {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"],
                           "if": {"properties": {"kind": {"const": "b"}}},
                           "then": {"properties": {"next": {"$ref": "#"}}, "required": ["next"]}}, {"kind": "a"}),
    ("if-is-the-ref", {"type": "object", "properties": {"x": {"type": "integer"}, "c": {
        "if": {"$ref": "#"}, "then": {"required": ["x"]}}}}, {"x": 1, "c": {"x": 2}}),
    ("not-ref", {"type": "object", "properties": {"next": {"$ref": "#"}}, "not": {"required": ["next"]}}, {}),
    ("not-is-the-ref", {"type": ["object", "null"], "properties": {"a": {"not": {"$ref": "#"}}}}, None),
    ("not-type-beside-anyOf", {"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, NULL],
                                                                   "not": {"type": "string"}}}, "required": ["a"]},
     {"a": None}),
    ("else-not-ref", {"type": "object", "properties": {"n": {"type": "integer"}}, "if": {"required": ["n"]},
                      "else": {"not": {"$ref": "#/properties/n"}}}, {"n": 0}),
    ("if-true-then-false-ref", {"anyOf": [NULL, {"type": "object", "properties": {"a": {"$ref": "#"}},
                                                 "if": True, "then": {"required": ["a"]}}]}, None),
]


@pytest.mark.parametrize("name, schema, witness", FINITE, ids=[f[0] for f in FINITE])
def test_conditions_and_negations_beside_a_recursion_are_not_refused(name, schema, witness):
    assert validator(schema).is_valid(witness)  # the schema does have a finite value
    assert schema_unending(schema) is None
    c = None
    try:  # the regex path compiles what it can; it never reports "no finite output" here
        c = outlines(schema)
    except RequestError as e:
        assert "goes on forever" not in str(e) and "nested too deeply" not in str(e), str(e)
    if c is not None:
        assert_sound(schema, c, 20)


def test_an_unending_recursion_beside_if_or_not_is_still_refused():
    linked = {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}
    for extra in ({"not": {"type": "string"}}, {"if": {"required": ["x"]}, "then": {"maxProperties": 1}},
                  {"else": {"not": {"$ref": "#"}}}, {"not": {"$ref": "#"}}):
        why = schema_unending({**linked, **extra})
        assert why is not None and "no finite value for: '#'" in why, extra


def test_a_recursion_only_then_makes_unending_is_let_through():
    # documented in finite.py: 'then' only narrows, and is not read, so a recursion it
    # alone makes unending counts as finite (never a false refusal)
    schema = {"type": "object", "properties": {"next": {"$ref": "#"}}, "if": True, "then": {"required": ["next"]}}
    assert schema_unending(schema) is None
