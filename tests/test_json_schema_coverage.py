"""JSON Schema keywords enforced for the real-world corpus (benchmarks/schema_corpus):
for each, random instances of the translated regex validate with jsonschema, and
hand-made invalid instances are refused by the regex. Torch-free and model-free."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from plait.runtime.constrained.json_schema import SchemaError, schema_to_regex
from regex_sampling import sample


def admits(regex: str, value: object) -> bool:
    return re.fullmatch(regex, json.dumps(value, separators=(",", ":"), ensure_ascii=False)) is not None


def check_sound(schema: dict, n: int = 60) -> str:
    """The regex of ``schema``; ``n`` random instances of it validate (formats too)."""
    regex = schema_to_regex(schema)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    texts = sample(regex, n, seed=7)
    for text in texts:
        assert re.fullmatch(regex, text), text  # the sampler draws from the regex
        errors = list(validator.iter_errors(json.loads(text)))
        assert not errors, (text, errors[0].message)
    return regex


ZOD_UUID = (r"^([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[1-8][0-9a-fA-F]{3}-[89abAB][0-9a-fA-F]{3}-[0-9a-fA-F]{12}|"
            r"00000000-0000-0000-0000-000000000000|ffffffff-ffff-ffff-ffff-ffffffffffff)$")
ZOD_DATETIME = (r"^(?:(?:\d\d[2468][048]|\d\d[13579][26]|\d\d0[48]|[02468][048]00|[13579][26]00)-02-29|\d{4}-"
                r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12]\d|3[01])|(?:0[469]|11)-(?:0[1-9]|[12]\d|30)|(?:02)-"
                r"(?:0[1-9]|1\d|2[0-8])))T(?:(?:[01]\d|2[0-3]):[0-5]\d(?::[0-5]\d(?:\.\d+)?)?(?:Z))$")
ZOD_EMAIL = r"^(?!\.)(?!.*\.\.)([A-Za-z0-9_'+\-\.]*)[A-Za-z0-9_+-]@([A-Za-z0-9][A-Za-z0-9\-]*\.)+[A-Za-z]{2,}$"
CASES = [
    # (schema, valid values the regex admits, invalid values it must refuse)
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "patternProperties": {"^a": {"minimum": 3}}},
     [{"a": 3}, {}], [{"a": 2}]),
    ({"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}}, "additionalProperties": False,
      "maxProperties": 2}, [{}, {"x-ab": 1}, {"x-a": 1, "x-b": 2}], [{"y": 1}, {"x-a": "s"}, {"x-a": 1, "x-b": 2, "x-c": 3}]),
    ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "additionalProperties": {"type": "boolean"}},
     [{"a": True}, {}], [{"c": True}, {"a": 1}]),
    ({"type": "object", "propertyNames": {"pattern": "^[a-z]{1,3}$"}, "properties": {"ok": {"type": "null"},
                                                                                    "TOO": {"type": "null"}}},
     [{"ok": None}, {}], [{"TOO": None}]),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}, [{"k": 1}], [{}]),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 4, "minLength": 2}, ["ab", "abcd"], ["a", "abcde", "A"]),
    ({"type": "string", "pattern": "^v[0-9]{1,3}$", "maxLength": 10}, ["v1", "v123"], ["v", "1"]),
    ({"type": "string", "pattern": "^refs/(heads|tags)/.*$"}, ["refs/heads/x", 'refs/tags/a"b\\'], ["refs/x"]),
    ({"type": "string", "pattern": r"^\d+\.\d+(?:[+-]\S+)?$"}, ["1.2", "1.2-rc1"], ["1", "1.2-", "١.٢"]),
    ({"type": "string", "pattern": r"\w+[\\](\w+\.)*\w+\.dll"}, ["a\\b.dll", "x\\y.z.dll"], ["a/b.dll"]),
    ({"type": "string", "pattern": "^[^a-c]$"}, ["d", "\n", '"', "é"], ["a", "dd"]),
    ({"type": "array", "items": {"enum": ["x", "y", "z"]}, "uniqueItems": True}, [[], ["x", "z"], ["x", "y", "z"]],
     [["x", "x"], ["w"]]),
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 2}, [[False, True]],
     [[True, True], [True]]),
    ({"type": "array", "items": {"enum": [1, 1.0, 2, True]}, "uniqueItems": True}, [[1, 2, True]], [[1, 1]]),
    ({"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"], "maxLength": 2}, "uniqueItems": True,
      "maxItems": 1}, [["a"]], [["ccc"]]),
    # oneOf narrowed until no admitted value satisfies two branches as written:
    # null satisfies both branches (so oneOf refuses it); strings and numbers one each
    ({"oneOf": [{"type": ["string", "null"]}, {"type": ["number", "null"]}]}, ["x", 1.5], [None, True]),
    # branches without a type: every non-object satisfies both; objects differ by "op"
    ({"oneOf": [{"properties": {"op": {"enum": ["add", "test"]}, "v": {}}, "required": ["op", "v"],
                 "additionalProperties": False},
                {"properties": {"op": {"enum": ["remove"]}}, "required": ["op"], "additionalProperties": False}]},
     [{"op": "add", "v": 1}, {"op": "remove"}], ["add", 1, {"op": "remove", "v": 1}]),
    # a listed value set that the other branch's pattern refuses
    ({"type": "string", "oneOf": [{"pattern": "^([0-9]{1,3}\\.){3}[0-9]{1,3}$"}, {"enum": ["alpha", "beta"]}]},
     ["1.2.3.4", "beta"], ["gamma"]),
    # closed objects with no required names: {} satisfies both, so each must carry its own name
    ({"type": "object", "oneOf": [{"properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                                  {"properties": {"b": {"type": "integer"}}, "additionalProperties": False}]},
     [{"a": 1}, {"b": 2}], [{}, {"a": 1, "b": 2}]),
    # an open branch: the other one's objects must lack its required name (they never write it)
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, [{"b": 1}, {}], [{"a": 1}]),
    # not: {required: [...]} and an anyOf of those: an object lacks a name of each set
    ({"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "not": {"required": ["a", "b"]}},
     [{"a": 1}, {"b": 1, "c": 1}, {}], [{"a": 1, "b": 1}]),
    ({"type": "object", "properties": {"a": {}, "b": {}},
      "not": {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}}, [{}], [{"a": 1}, {"b": 1}]),
    # allOf: both items schemas hold, vendor keywords ignored, two anyOf lists both hold
    ({"allOf": [{"type": "array", "items": {"type": "integer"}, "x-kind": "a"},
                {"items": {"minimum": 0}, "x-kind": "b"}]}, [[0, 3]], [[-1], ["s"]]),
    ({"allOf": [{"anyOf": [{"type": "integer"}, {"type": "string"}]},
                {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "boolean"}]}]}, ["ab"], [1, True, "abc"]),
    # if/then/else on one property with listed values: the values that fail 'if' are the
    # others of the list beside it (objects without the property satisfy an 'if' that
    # does not require it)
    ({"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "n": {"type": "integer"}},
      "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
      "else": {"properties": {"n": {"maximum": 0}}}},
     [{"kind": "a", "n": 5}, {"kind": "b", "n": -1}, {"kind": "c"}, {"n": 3}], [{"kind": "a"}, {"kind": "b", "n": 1}, {}]),
    ({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}}, "required": ["kind"],
      "allOf": [{"if": {"properties": {"kind": {"const": "a"}}}, "then": {"properties": {"n": {"minimum": 10}}}},
                {"if": {"properties": {"kind": {"const": "b"}}}, "then": {"properties": {"n": {"maximum": -10}}}}]},
     [{"kind": "a", "n": 10}, {"kind": "b", "n": -10}, {"kind": "a"}], [{"kind": "a", "n": 0}, {"kind": "b", "n": 0}]),
    ({"type": "object", "properties": {"t": {"enum": [1, 2]}, "x": {"type": "string"}},
      "if": {"properties": {"t": {"const": 1}}, "required": ["t"]}, "then": {"required": ["x"]},
      "else": {"properties": {"x": {"maxLength": 1}}}},
     [{"t": 1, "x": "long"}, {"t": 2, "x": "s"}, {"x": "s"}, {}], [{"t": 1}, {"x": "long"}, {"t": 2, "x": "ab"}]),
    # 'if' on a property whose values are not listed beside it: the values failing it are
    # the other values (not its const/enum), or, nested, those failing the inner condition
    ({"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
      "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
      "else": {"properties": {"n": {"maximum": 0}}}},
     [{"kind": "a", "n": 5}, {"kind": "ab", "n": -1}, {"kind": "", "n": 0}, {"n": 3}],
     [{"kind": "a"}, {"kind": "b", "n": 1}, {}, {"kind": 1, "n": 1}]),
    ({"type": "object", "properties": {"k": {}, "n": {"type": "integer"}}, "required": ["n"],
      "allOf": [{"if": {"properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]},
                 "then": {"properties": {"n": {"minimum": 5}}}, "else": {"properties": {"n": {"maximum": -5}}}}]},
     [{"k": "x", "n": 5}, {"k": "y", "n": 9}, {"k": "z", "n": -5}, {"k": 1, "n": -5}, {"n": -6}],
     [{"k": "x", "n": 0}, {"k": "z", "n": 5}, {"n": 5}]),
    ({"type": "object", "properties": {"runs": {"type": "object", "properties": {"using": {"type": "string"}}},
                                       "out": {"type": "integer"}},
      "if": {"properties": {"runs": {"properties": {"using": {"const": "c"}}}}},
      "then": {"properties": {"out": {"minimum": 1}}}, "else": {"properties": {"out": {"maximum": -1}}}},
     [{"runs": {"using": "c"}, "out": 1}, {"runs": {"using": "cc"}, "out": -1}, {"runs": {}, "out": 1}, {"out": 2}],
     [{"runs": {"using": "c"}, "out": -1}, {"runs": {"using": "d"}, "out": 1}, {"runs": {}, "out": -1}]),
    # if: {not: C}: C's failing values satisfy it, C's values fail it (prometheus' form)
    ({"type": "object", "properties": {"a": {"type": ["string", "null"]}, "b": {"type": ["string", "null"]}},
      "allOf": [{"if": {"not": {"properties": {"a": {"const": None}}}}, "then": {"properties": {"b": {"const": None}}}},
                {"if": {"not": {"properties": {"b": {"const": None}}}}, "then": {"properties": {"a": {"const": None}}}}]},
     [{"a": "x", "b": None}, {"a": None, "b": "y"}, {"b": "y"}, {"a": "x"}, {}],
     [{"a": "x", "b": "y"}]),
    # not of such a condition: the values failing it (hemtt's form); not of a $ref to a typed enum
    ({"type": "object", "properties": {"parallel": {"type": "boolean"}, "foreach": {"type": "boolean"}},
      "anyOf": [{"not": {"properties": {"parallel": {"enum": [True]}}}},
                {"properties": {"foreach": {"enum": [True]}}, "required": ["foreach"]}]},
     [{"parallel": False}, {"foreach": True, "parallel": True}, {"foreach": True}],  # in the layout's key order
     [{}, {"parallel": True}, {"foreach": False}, {"parallel": True, "foreach": False}]),
    ({"type": "object", "properties": {"k": {"type": "string"}}, "not": {"properties": {"k": {"const": "x"}},
                                                                         "required": ["k"]}},
     [{}, {"k": "y"}, {"k": "xx"}], [{"k": "x"}]),
    ({"$defs": {"p": {"type": "string", "enum": ["int", "long"]}}, "type": "string", "not": {"$ref": "#/$defs/p"}},
     ["x", "in", "longer", ""], ["int", "long"]),
    # schema dependencies: the object lacks the name, or has it and satisfies the schema
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"properties": {"b": {"minimum": 5}}, "required": ["b"]}}},
     [{}, {"b": 1}, {"b": 5, "a": 1}], [{"a": 1}, {"b": 4, "a": 1}, {"a": 1, "b": 4}]),  # in the layout's key order
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "properties": {"page": {"type": "string"}, "scripts": {"type": "integer"}, "c": {"type": "null"}},
      "dependencies": {"page": {"not": {"required": ["scripts"]}}, "c": ["page"]}},
     [{}, {"page": "x"}, {"scripts": 1}, {"page": "x", "c": None}],
     [{"page": "x", "scripts": 1}, {"c": None}, {"scripts": 1, "c": None}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {}, "dependentSchemas": {}},
     [{}, {"a": 1}], [{"a": "x"}]),
    # contains: items up to the first one that also satisfies 'contains', then any items
    ({"type": "array", "items": {"enum": ["a", "b", "t"]}, "contains": {"const": "t"}},
     [["t"], ["a", "t", "b"], ["t", "t"], ["b", "a", "t"]], [[], ["a", "b"], ["x", "t"]]),
    ({"contains": {"type": "integer", "minimum": 5}, "minContains": 1, "minItems": 1},
     [[5], ["x", 7, None], [9, 1]], [[1, "x"], [], [4.5]]),
    # not: {enum} / {const}: listed values filtered, strings written as any but the excluded
    ({"type": "string", "not": {"enum": ["none", "no", "", "a-b]"]}}, ["n", "nonee", "x", "no\n", "a-b"],
     ["none", "no", "", "a-b]"]),
    ({"type": ["string", "boolean", "null"], "not": {"enum": [True, None, "a"]}}, ["ab", "", False], ["a", True, None]),
    ({"enum": ["a", "b", "c"], "not": {"const": "b"}}, ["a", "c"], ["b"]),
    ({"type": "object", "properties": {"k": {"type": "string", "not": {"const": "reserved"}}}, "required": ["k"]},
     [{"k": "ok"}, {"k": "reserve"}], [{"k": "reserved"}]),
    # a branch whose type excludes the keywords beside it admits nothing: left out
    ({"type": "object", "properties": {"k": {"type": "integer"}}, "oneOf": [{"type": "string"}, {"required": ["k"]}]},
     [{"k": 1}], [{}, "s"]),
    # oneOf with exclusive branches: types, const discriminators, required sets
    ({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}, ["a", ["a"]], [1]),
    ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                 "required": ["kind"]},
                {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}, "y": {"type": "string"}},
                 "required": ["kind"]}]},
     [{"kind": "a", "x": 1}, {"kind": "b"}], [{"kind": "d"}]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, [{"a": 1}, {"b": 1}], [{"a": 1, "b": 2}, {}]),
    # enum beside other keywords: the values that satisfy them all
    ({"type": "string", "enum": ["a", "bb", "ccc"], "maxLength": 2, "example": "a", "nullable": True},
     ["a", "bb"], ["ccc", None]),
    # recursion unrolled a few levels, ended by the optional property
    ({"$defs": {"n": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}},
                      "required": ["v"]}}, "$ref": "#/$defs/n"},
     [{"v": 1}, {"v": 1, "next": {"v": 2}}], [{"next": {"v": 1}}, {"v": 1, "next": {}}]),
    ({"$id": "https://example.com/s.json", "definitions": {"x": {"type": "integer", "maximum": 3}},
      "$ref": "https://example.com/s.json#/definitions/x"}, [3], [4]),
    # allOf over $refs with keywords beside them; additionalProperties of one part covers the other's properties
    ({"definitions": {"a": {"type": "object", "properties": {"a": {"type": "integer"}}},
                      "b": {"type": "object", "properties": {"b": {"type": "string"}}, "additionalProperties": False}},
      "allOf": [{"$ref": "#/definitions/a"}, {"$ref": "#/definitions/b"}]},
     [{}, {"b": "x"}], [{"a": 1}]),
    ({"definitions": {"a": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
      "allOf": [{"$ref": "#/definitions/a", "properties": {"c": {"type": "null"}}}]},
     [{"a": 1}, {"a": 1, "c": None}], [{"c": None}]),
    # formats added for the corpus
    ({"type": "string", "format": "uri-template"}, ["https://x.org/{id}", "/a{?q,r*}"], ["{", "a b"]),
    ({"type": "string", "format": "json-pointer"}, ["", "/a/b~1c"], ["a", "/~2"]),
    ({"type": "string", "format": "relative-json-pointer"}, ["0", "1/a", "2#"], ["-1", "/a"]),
    ({"type": "string", "format": "regex"}, ["abc"], ["a("]),
    ({"type": "string", "format": "byte"}, ["", "YWJj", "YQ=="], ["YQ", "a b"]),
    # a pattern beside a format (zod v4's z.uuid() and z.iso.datetime() write both): the
    # strings both admit (it was refused: "'pattern' and 'format' cannot be combined")
    ({"type": "string", "format": "uuid", "pattern": ZOD_UUID},
     ["123e4567-e89b-42d3-a456-426614174000", "00000000-0000-0000-0000-000000000000"],
     ["123e4567-e89b-02d3-a456-426614174000", "123e4567e89b42d3a456426614174000", "x"]),
    ({"type": "string", "format": "date-time", "pattern": ZOD_DATETIME},
     ["2024-02-28T12:30:00Z", "2023-12-31T23:59:59.123Z"],
     ["2024-01-31T12:30Z", "2024-01-31T12:30:00+01:00", "2024-13-01T00:00:00Z"]),
    ({"type": "string", "format": "date", "pattern": "^2024-", "maxLength": 10},
     ["2024-01-31"], ["2023-01-31", "2024-02-30"]),
    ({"type": "string", "format": "date-time", "pattern": ZOD_DATETIME, "maxLength": 20},
     ["2024-02-28T12:30:00Z"], ["2024-02-28T12:30:00.5Z"]),
    # look-aheads right after a leading ^ (zod v4's z.email(), which writes format email
    # beside it; password rules): the rest of the pattern's automaton intersected with
    # each positive one and without each negative one (refused before: "look-ahead")
    ({"type": "string", "format": "email", "pattern": ZOD_EMAIL},
     ["ada@example.com", "a.b+c@x-y.org"],
     [".a@b.co", "a..b@c.de", "a@b", "a b@c.de", "a.@b.co"]),
    ({"type": "string", "pattern": r"^(?=.*[A-Z])(?=.*\d).{8,}$"}, ["Abcdefg1", "12345678A", "a\"B1\\cdef"],
     ["abcdefg1", "ABCDEFGH", "Ab1", "Abc\ndefg1"]),
    ({"type": "string", "pattern": "^(?!admin$)(?!root)[a-z]+$"}, ["adminx", "bob", "roo"],
     ["admin", "rooted", "root", "Bob"]),
    ({"type": "string", "pattern": "^(?!admin)[a-z]+$", "maxLength": 6}, ["bob", "admi", "xadmin"],
     ["admin", "admins", "abcdefg"]),
    # (a pattern and a format whose counted maxima make too large a regex together: the
    # format's maxima dropped, its shape kept; refused before)
    ({"type": "string", "pattern": "^https://[a-z.]+/x$", "format": "uri"}, ["https://a.b/x"],
     ["http://a.b/x", "https://a.b/y"]),
    ({"type": "string", "format": "idn-hostname"}, ["example.com"], ["-a.com"]),
    ({"type": "string", "format": "date-time", "maxLength": 40}, ["2024-01-02T03:04:05Z"], ["2024-01-02"]),
    ({"type": "integer", "format": "int64"}, [1], ["1"]),  # not a format of any draft: an annotation
]


@pytest.mark.parametrize("schema, good, bad", CASES, ids=[json.dumps(c[0])[:60] for c in CASES])
def test_keyword_is_enforced_soundly(schema, good, bad):
    regex = check_sound(schema)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    for v in good:
        assert validator.is_valid(v), v  # the case itself is right
        assert admits(regex, v), v
    for v in bad:
        assert not admits(regex, v), v


def test_unsatisfiable_branches_and_properties_are_left_out():
    # oneOf branch 1 requires what branch 0 requires and more, so branch 0 objects cannot have it all
    regex = check_sound({"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"}},
                         "oneOf": [{"required": ["a"]}, {"required": ["a", "b"]}]})
    assert admits(regex, {"a": None}) and not admits(regex, {"a": None, "b": None})
    regex = check_sound({"type": "object", "properties": {"gone": False, "x": {"type": "null"}}})
    assert not admits(regex, {"gone": 1}) and admits(regex, {"x": None})


@pytest.mark.parametrize(
    "schema, keyword",
    [
        # a oneOf whose branches may overlap is refused (it was once checked on the regexes,
        # which an object with an extra property can satisfy twice)
        ({"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]}, "oneOf"),
        ({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "a": {"type": "string"}}},
         "patternProperties"),
        # b's additionalProperties: false forbids a, which allOf requires
        ({"definitions": {"b": {"type": "object", "properties": {"b": {}}, "additionalProperties": False}},
          "allOf": [{"required": ["a"], "properties": {"a": {}}}, {"$ref": "#/definitions/b"}]}, "requires 'a'"),
        ({"type": "string", "pattern": "^(a|bb)+$", "maxLength": 3}, "pattern"),
        ({"type": "string", "pattern": "^(?i)abc$"}, "pattern"),
        ({"type": "string", "pattern": "^a(?=b)"}, "pattern"),
        ({"type": "string", "pattern": "a^b"}, "pattern"),
        ({"type": "string", "pattern": "^[a-z]+$", "format": "date"}, "no string satisfies both"),
        ({"type": "string", "pattern": r"^(?=.*[A-Z])(?=.*\d).{8,}$", "maxLength": 9}, "past 20000 characters"),
        ({"type": "string", "maxLength": 3, "not": {"enum": ["abc"]}}, "'not'"),
        ({"type": "integer", "not": {"const": 0}}, "'not'"),
        ({"type": "string", "not": {"const": "a/b"}}, "'not'"),
        # 'if' on a property whose values neither it nor the schema beside it lists
        ({"type": "object", "properties": {"k": {"type": "string"}}, "if": {"properties": {"k": {"minLength": 2}}},
          "then": {"required": ["k"]}}, "'if'"),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxItems": 3}, "'contains'"),
        ({"type": "array", "contains": {"const": 1}, "maxContains": 2}, "'contains'"),
        ({"type": "array", "contains": {"const": 1}, "minContains": 2}, "'contains'"),
        ({"type": "array", "items": {"enum": [1, 2]}, "contains": {"const": 1}, "uniqueItems": True}, "'contains'"),
        ({"type": "object", "dependencies": {"a": "b"}}, "'dependencies'"),
        ({"type": "object", "if": {"minProperties": 1}, "then": {"required": ["k"]}}, "'if'"),
        ({"type": "string", "format": "date", "maxLength": 5}, "format"),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "items": {"enum": [{"a": 1}, {"a": 2}]}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2}, "minProperties"),
        ({"$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}, "minItems": 1}}, "$ref": "#/$defs/t"},
         "$ref"),
        ({"$ref": "other.json#/x"}, "$ref"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(schema, keyword):
    with pytest.raises(SchemaError, match=re.escape(keyword)):
        schema_to_regex(schema)


def test_corpus_files_are_real_schemas_with_sources():
    """The corpus the benchmark reads: at least 300 schemas, each with a cited source."""
    import gzip
    import os

    folder = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "schema_corpus")
    rows = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".jsonl.gz"):
            with gzip.open(os.path.join(folder, name), "rt", encoding="utf-8") as f:
                rows += [json.loads(line) for line in f]
    assert len(rows) >= 300
    assert all("@" in r["source"] and isinstance(r["schema"], (dict, bool)) for r in rows)
    assert len({r["source"] for r in rows}) == len(rows)


def test_excluded_strings_compile_to_an_index():
    """outlines-core builds the index of a string with excluded values (the regex shares
    one tail after the divergence: a tail per branch made the build exponential in the
    words' length)."""
    import outlines_core

    words = ["abcdefghijklmnop", "abcdefghijkxyz", "none", ""]
    regex = check_sound({"type": "string", "not": {"enum": words}})
    vocab = outlines_core.Vocabulary(3, {c: [i] for i, c in enumerate('"abcdefghijklmnopxyz', start=4)})
    index = outlines_core.Index(regex, vocab)
    assert index.get_initial_state() is not None
    for w in words:
        assert not admits(regex, w)
    assert admits(regex, "abcdefghijklmnopq") and admits(regex, "abcdefghijk")


# -- $ref resolution and ECMA-262 patterns (issue 14) -----------------------------------------
REF_DOC = {
    "$id": "https://example.com/schemas/root.json",
    "definitions": {"a/b": {"type": "integer", "minimum": 5, "maximum": 9},
                    "[x]+ %": {"type": "string", "enum": ["p", "q"]},
                    "t~": {"type": "boolean"}},
    "type": "object",
    "properties": {
        "own_uri": {"$ref": "https://example.com/schemas/root.json#/definitions/a~1b"},
        "relative": {"$ref": "root.json#/definitions/t~0"},
        "encoded": {"$ref": "#/definitions/%5Bx%5D%2B%20%25"},
        "whole": {"$ref": "root.json#/definitions"},
    },
    "required": ["own_uri", "relative", "encoded"],
    "additionalProperties": False,
}


def test_refs_to_the_documents_own_uri_and_encoded_pointers_are_local():
    """A ``$ref`` that resolves (RFC 3986) against the root's ``$id`` to the document
    itself is local; pointer fragments are percent-decoded, then ``~1``/``~0`` read."""
    regex = check_sound(REF_DOC)
    assert admits(regex, {"own_uri": 5, "relative": True, "encoded": "q"})
    for bad in ({"own_uri": 4, "relative": True, "encoded": "q"}, {"own_uri": 5, "relative": 1, "encoded": "q"},
                {"own_uri": 5, "relative": True, "encoded": "r"}):
        assert not jsonschema.Draft202012Validator(REF_DOC).is_valid(bad)
        assert not admits(regex, bad), bad


@pytest.mark.parametrize("schema", [
    {"$id": "https://example.com/schemas/root.json", "$ref": "other.json#/definitions/a"},  # another document
    {"$ref": "https://example.com/root.json#/x"},  # no $id: a URL is another document
    {"definitions": {"a": {"type": "integer"}}, "$anchor": "top", "$ref": "#top"},  # a plain-name fragment
])
def test_refs_to_other_documents_and_anchors_are_refused(schema):
    with pytest.raises(SchemaError, match=re.escape("'$ref'")):
        schema_to_regex(schema)


ECMA_CASES = [
    # (ECMA-262 pattern, strings that match it, strings that do not)
    (r"^(?<major>0|[1-9]\d*)\.(?<minor>0|[1-9]\d*)$", ["0.1", "12.30"], ["01.1", "1", "a.b"]),
    (r"^[\w-_.]+/[\w-_.]+$", ["a-b/c_d.e", "x/-"], ["a b/c", "a/b/c", "/x"]),
]


@pytest.mark.parametrize("pattern, good, bad", ECMA_CASES, ids=[c[0] for c in ECMA_CASES])
def test_ecma_262_patterns_are_read_as_ecma_262_writes_them(pattern, good, bad):
    """Spellings Python's ``re`` does not read (so ``jsonschema`` cannot validate them)
    are read as ECMA-262 reads them: instances are validated against the same schema with
    the pattern in Python's spelling (``ecma_to_python``), which matches ECMA-262's reading
    on these cases."""
    from plait.runtime.constrained.json_schema import ecma_to_python

    schema = {"type": "string", "pattern": pattern}
    python = {"type": "string", "pattern": ecma_to_python(pattern)}
    regex = schema_to_regex(schema)
    for text in sample(regex, 60, seed=3):
        assert jsonschema.Draft202012Validator(python).is_valid(json.loads(text)), text
    for v in good:
        assert admits(regex, v), v
    for v in bad:
        assert not jsonschema.Draft202012Validator(python).is_valid(v) and not admits(regex, v), v


DRAFT7 = "http://json-schema.org/draft-07/schema#"


def test_keywords_beside_a_ref_do_nothing_in_drafts_3_to_7():
    """Drafts 3 to 7 ignore the keywords beside a ``$ref``. Applying them anyway is a
    narrowing in most places, but not under ``oneOf``: a branch narrowed by them was
    proved exclusive of the other, and the other's values (which the real branch also
    admits) were admitted — found in review, ``{"kind": "b"}`` below."""
    loose = {"$schema": DRAFT7, "definitions": {"s": {"type": "string"}}, "$ref": "#/definitions/s", "maxLength": 2}
    regex = check_sound(loose)
    assert admits(regex, "abcd") and jsonschema.Draft7Validator(loose).is_valid("abcd")
    one_of = {"$schema": DRAFT7, "definitions": {"o": {"type": "object"}},
              "oneOf": [{"$ref": "#/definitions/o", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]}
    assert not jsonschema.Draft7Validator(one_of).is_valid({"kind": "b"})
    try:
        regex = check_sound(one_of)
    except SchemaError:
        return  # refused: sound
    assert not admits(regex, {"kind": "b"})
