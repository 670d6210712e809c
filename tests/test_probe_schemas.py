"""Real-world JSON Schemas the authors did not write (pydantic v2 output, OpenAI strict
schemas, draft-4/7 and 2020-12 idioms, hostile inputs) through
``SamplingParams.constraint()``: each compiles to something whose outputs ``jsonschema``
accepts, or is refused with a ``RequestError`` naming the place. Then the bugs this
probe found, one test each."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from plait.errors import RequestError
from plait.runtime.constrained import json_schema as js
from plait.runtime.sampling_params import SamplingParams
from regex_sampling import sample
from test_llguidance import grammars, tokenizer, vocab  # noqa: F401 (fixtures)
from test_schema_trial import outputs


def constraint(schema: object, backend: str):
    return SamplingParams.from_dict({"json_schema": schema, "grammar_backend": backend}).constraint()


def strict_json(text: str) -> object:
    """RFC 8259 JSON: Python's parser also reads NaN and Infinity, which are not JSON."""
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def assert_valid(schema: object, texts: list[str]) -> None:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    v = cls(schema, format_checker=cls.FORMAT_CHECKER)
    assert texts
    for text in texts:
        errors = list(v.iter_errors(strict_json(text)))
        assert not errors, (text, errors[0].message)


def pydantic_schemas() -> list[tuple[str, object]]:
    """pydantic v2 ``model_json_schema()`` of the shapes users send: nested models,
    Optional (anyOf with null), Literal, Enum, discriminated unions, $defs + $ref,
    recursive models, dict[str, X], tuples (prefixItems), constrained fields, formats,
    annotations (title, description, examples, default)."""
    import datetime
    import enum
    import uuid
    from typing import Annotated, Literal, Optional, Union

    from pydantic import BaseModel, Field, conint, constr

    class Color(str, enum.Enum):
        red = "red"
        green = "green"

    class Address(BaseModel):
        street: str = Field(..., title="Street", description="the street", examples=["Main St"], max_length=12)
        zip: constr(pattern=r"^\d{5}(-\d{4})?$")
        country: Literal["US", "CA"] = "US"

    class User(BaseModel):
        id: uuid.UUID
        email: str = Field(json_schema_extra={"format": "email"}, max_length=30)
        age: conint(ge=0, le=130) | None = None
        score: float = Field(0.5, gt=0, lt=1)
        color: Color
        created: datetime.datetime
        birthday: Optional[datetime.date] = None
        pairs: list[tuple[int, str]] = Field(default_factory=list, max_length=2)
        meta: dict[str, int] = {}
        address: Optional[Address] = None

    class Cat(BaseModel):
        pet_type: Literal["cat"]
        meows: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]
        barks: float

    class Owner(BaseModel):
        pet: Union[Cat, Dog] = Field(..., discriminator="pet_type")
        pets: list[Annotated[Union[Cat, Dog], Field(discriminator="pet_type")]] = Field(max_length=2)

    class Tree(BaseModel):
        value: int
        children: list["Tree"] = Field(default_factory=list, max_length=2)

    class Steps(BaseModel):
        steps: list[constr(max_length=8)] = Field(min_length=1, max_length=3)
        m: int = Field(multiple_of=5, ge=0, le=100)
        f: float = Field(ge=-1.5, le=2.5)
        s: str = Field(pattern=r"^[A-Z][a-z]{1,6}$")

    return [(f"pyd-{m.__name__}-{mode}", m.model_json_schema(mode=mode))
            for m in (Address, User, Owner, Tree, Steps) for mode in ("validation", "serialization")]


HAND = [
    ("empty", {}),
    ("draft4-exclusive-bool", {"$schema": "http://json-schema.org/draft-04/schema#", "id": "http://x.com/s.json",
                               "definitions": {"pos": {"type": "integer", "minimum": 0, "exclusiveMinimum": True}},
                               "type": "object", "properties": {"a": {"$ref": "#/definitions/pos"},
                                                                "b": {"type": "number", "maximum": 10,
                                                                      "exclusiveMaximum": True}},
                               "required": ["a", "b"], "additionalProperties": False}),
    ("draft7-dependencies", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                             "properties": {"cc": {"type": "integer"}, "addr": {"type": "string", "maxLength": 5}},
                             "dependencies": {"cc": {"required": ["addr"], "properties": {"addr": {"maxLength": 3}}}}}),
    ("2020-anchor", {"$defs": {"n": {"$anchor": "name", "type": "string", "maxLength": 4}}, "type": "object",
                     "properties": {"a": {"$ref": "#name"}}, "required": ["a"], "additionalProperties": False}),
    ("2020-dependentRequired", {"type": "object", "properties": {k: {"type": "integer"} for k in "xyz"},
                                "dependentRequired": {"x": ["y", "z"]}, "additionalProperties": False}),
    ("2020-if-then-else", {"type": "object", "properties": {"country": {"enum": ["US", "NL"]},
                                                            "postal": {"type": "string"}},
                           "required": ["country", "postal"], "if": {"properties": {"country": {"const": "US"}}},
                           "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}},
                           "else": {"properties": {"postal": {"pattern": "^[0-9]{4} ?[A-Z]{2}$"}}},
                           "additionalProperties": False}),
    ("2020-contains", {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}),
    ("2020-contains-minmax", {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 10},
                              "minContains": 2, "maxContains": 3}),
    ("2020-unevaluatedProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "unevaluatedProperties": False}),
    ("2020-prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 4}],
                          "items": False, "minItems": 2}),
    ("remote-ref", {"type": "object", "properties": {"a": {"$ref": "https://json.schemastore.org/package.json"}}}),
    ("file-ref", {"$ref": "file:///etc/passwd"}),
    ("look-ahead", {"type": "string", "pattern": "^(?=.*[A-Z])(?=.*\\d).{8,}$"}),
    ("back-reference", {"type": "string", "pattern": "^(a+)\\1$"}),
    ("unicode-names", {"type": "object", "properties": {"名前": {"type": "string", "maxLength": 3},
                                                         "émoji😀": {"type": "boolean"}, "a\"b": {"type": "null"},
                                                         "back\\slash": {"const": 1}, "new\nline": {"type": "integer"},
                                                         "\u2028": {"enum": ["\u2029", "\u0007"]}},
                       "required": ["名前", "émoji😀", "a\"b", "back\\slash", "new\nline", "\u2028"],
                       "additionalProperties": False}),
    ("openai-strict", {"type": "object", "properties": {
        "steps": {"type": "array", "items": {"type": "object", "properties": {"explanation": {"type": "string"},
                                                                           "output": {"type": "string"}},
                                             "required": ["explanation", "output"], "additionalProperties": False}},
        "final_answer": {"type": "string"}}, "required": ["steps", "final_answer"], "additionalProperties": False}),
    ("openapi-nullable", {"type": "object", "properties": {"a": {"type": "string", "nullable": True, "maxLength": 3,
                                                                 "example": "x", "x-order": 1}}, "required": ["a"]}),
    ("big-enum", {"enum": [f"value_{i}" for i in range(5000)]}),
]


@pytest.mark.parametrize("name, schema", pydantic_schemas() + HAND, ids=[n for n, _ in pydantic_schemas() + HAND])
def test_probe_schema_compiles_soundly_or_is_refused_by_place(name, schema, grammars, vocab):  # noqa: F811
    done: set[tuple[str, str]] = set()
    for backend in ("auto", "llguidance", "outlines"):
        try:
            c = constraint(schema, backend)
        except RequestError as e:
            assert e.param == "json_schema"
            assert re.search(r"at #|processing json-schema:///#|characters|nested too deeply", str(e)), (backend, str(e))
            continue
        if (c.backend, c.grammar) not in done:
            done.add((c.backend, c.grammar))
            texts = outputs(grammars, vocab, c, 2)
            if c.backend == "outlines" or not any(k in json.dumps(schema) for k in ('"string"', "{}")):
                assert texts  # free-form strings may outrun a random walk's cap on llguidance
            if texts:
                assert_valid(schema, texts)


# -- bugs found, each fixed ------------------------------------------------------------------------
def test_long_enum_is_translated_without_pairwise_comparisons(monkeypatch):
    # a 20 000-value enum took a minute on the regex path: its values were deduplicated by
    # comparing each with every kept one, and jsonschema checked each against the whole
    # enum again (quadratic both); the translation ran on a front thread, unbounded
    calls = 0
    equal = js._json_equal

    def counting(a: object, b: object) -> bool:
        nonlocal calls
        calls += 1
        return equal(a, b)

    monkeypatch.setattr(js, "_json_equal", counting)
    n = 3000
    original = jsonschema.validators.Draft202012Validator.VALIDATORS["enum"]
    for schema in ({"enum": [f"value_{i}" for i in range(n)] + ["value_7"]},
                   {"type": "integer", "enum": list(range(0, 7 * n, 7)) + [7.0]}):
        seen: list[object] = []

        def enum_check(validator, enums, instance, schema, seen=seen):  # noqa: ANN001
            seen.append(instance)
            return original(validator, enums, instance, schema)

        monkeypatch.setitem(jsonschema.validators.Draft202012Validator.VALIDATORS, "enum", enum_check)
        c = constraint(schema, "outlines")
        assert calls < n and not seen  # linear: no pairwise equality, enum not re-checked
        monkeypatch.setitem(jsonschema.validators.Draft202012Validator.VALIDATORS, "enum", original)
        texts = sample(c.grammar, 30, seed=1)
        assert_valid(schema, texts)
        assert len(c.grammar.split("|")) == n  # the repeat (7 and 7.0 are one JSON value) written once


def test_json_keys_compare_as_json_does():
    assert js._json_unique([1, 1.0, True, 1, "a", [1], [1.0], {"a": 1}, {"a": 1.0}, None, False, 0, -0.0]) == \
        [1, True, "a", [1], {"a": 1}, None, False, 0]
    assert js._json_common([1, True, 2.0, {"x": [1]}, "1"], [1.0, 2, {"x": [1.0]}, False]) == [1, 2.0, {"x": [1]}]


@pytest.mark.parametrize("text, where", [
    ('{"enum": [NaN, 1]}', "#/enum/0"),
    ('{"const": Infinity}', "#/const"),
    ('{"type": "number", "maximum": 1e400}', "#/maximum"),
    ('{"type": "integer", "minimum": -Infinity}', "#/minimum"),
    ('{"type": "object", "properties": {"a/b": {"exclusiveMaximum": NaN}}}', "#/properties/a~1b/exclusiveMaximum"),
])
def test_non_json_numbers_are_refused_by_place(text, where):
    # Python's json (the HTTP body's parser too) reads NaN, Infinity and 1e400 (as inf):
    # an enum holding NaN wrote 'NaN' as the output on the regex path, and a bound of
    # inf failed inside the llguidance translation as an OverflowError
    for backend in ("auto", "llguidance", "outlines"):
        for schema in (text, json.loads(text)):
            with pytest.raises(RequestError, match=f"holds -?(nan|inf) at {where};"):
                constraint(schema, backend)


def test_a_deep_schema_is_refused_on_llguidance_before_it_is_encoded():
    # schema_grammar encoded a caller's dict with json.dumps before checking its depth: a
    # schema 700 levels deep failed with a RecursionError instead of the depth limit
    from plait.runtime.constrained.llguidance_backend import schema_grammar

    s: dict = {"type": "integer"}
    for _ in range(700):
        s = {"type": "object", "properties": {"x": s}}
    with pytest.raises(ValueError, match="nested more than 64 levels deep"):
        schema_grammar(s, None)


def test_the_translation_time_limit_holds_inside_allof_merges(monkeypatch):
    # the 5 s limit was checked per subschema translated, not inside allOf merges and
    # listed-value lookups: an allOf of 90 if/then conditions on one enum property ran
    # 37 s (200 of them, 490 s) on a front thread before failing with "longer than 5 s".
    # Here the limit is made 0 s: a check that stops at once fails before any subschema
    # is written, and counting the merges shows where it stopped.
    merges = 0
    merge = js._Translator.merge

    def counting(self, subs, path):  # noqa: ANN001
        nonlocal merges
        merges += 1
        return merge(self, subs, path)

    monkeypatch.setattr(js._Translator, "merge", counting)
    monkeypatch.setattr(js, "MAX_TRANSLATE_S", 0.0)
    schema = {"type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(30)]}, "x": {"type": "string"}},
              "required": ["k"],
              "allOf": [{"if": {"properties": {"k": {"const": f"v{i}"}}},
                         "then": {"properties": {"x": {"maxLength": i % 7 + 1}}}} for i in range(30)]}
    t = js._Translator(schema, "")
    t.deadline = 0.0  # long past
    with pytest.raises(js.SchemaError, match="took longer than 0 s to translate"):
        t.merge(t.all_of(schema, "#"), "#")
    assert merges == 1  # stopped in the first merge, not after all of them


def test_exponential_pattern_automata_are_cut_off_by_place(monkeypatch):
    # patternProperties keys are checked exclusive (and whitespace_pattern whitespace-only)
    # with interegular automata built on a front thread, with no limit: the key
    # '^(a|b)*a(a|b){15}$' (2**16 states) held it for minutes; {12} took 5 s
    from plait.runtime.constrained import fsm_limits

    monkeypatch.setattr(fsm_limits, "MAX_FSM_S", 0.05)
    schema = {"type": "object", "patternProperties": {"^(a|b)*a(a|b){12}$": {"type": "integer"}, "^c": {}}}
    for backend in ("llguidance", "outlines"):
        with pytest.raises(RequestError, match=r"patternProperties' at #/patternProperties/\^\(a\|b\)\*a\(a\|b\)\{12\}\$: "
                                               r"the patterns are too complex to check|patternProperties at "
                                               r"#/patternProperties: the patterns are too complex to check"):
            constraint(schema, backend)
    # many small patterns: the pairwise check is what runs out of time, and the message says how many
    many = {"type": "object", "patternProperties": {f"^k{i}_[a-z]+$": {"type": "integer"} for i in range(120)}}
    with pytest.raises(RequestError, match=r"too complex to check that they are exclusive \(120 patterns, 7140 pairs"):
        constraint(many, "llguidance")
    with pytest.raises(RequestError, match=r"whitespace_pattern=.* is too complex to check"):
        SamplingParams.from_dict({"json_schema": {"type": "object"}, "whitespace_pattern": "( |\t)*\t( |\t){12}",
                                  "grammar_backend": "outlines"}).constraint()
    # small patterns are checked as before, and the limit is the thread's own
    simple = {"type": "object", "patternProperties": {"^(a|b)*a(a|b){3}$": {"type": "integer"}, "^c": {}}}
    for backend in ("llguidance", "outlines"):
        assert constraint(simple, backend).backend == backend


def test_fsm_deadline_builds_the_same_automata():
    import interegular

    from plait.runtime.constrained.fsm_limits import FsmTooLarge, fsm_deadline

    pattern = "(a|b)*a(a|b){5}"
    with fsm_deadline(60):
        inside = interegular.parse_pattern(pattern).to_fsm()
    outside = interegular.parse_pattern(pattern).to_fsm()
    assert len(inside.states) == len(outside.states) > 32
    assert inside.equivalent(outside)
    with pytest.raises(FsmTooLarge), fsm_deadline(-1):
        interegular.parse_pattern(pattern).to_fsm()


def test_patterns_against_listed_values_and_names_are_matched_under_a_limit(monkeypatch):
    # the translation matched patterns against an enum's values (through jsonschema) and
    # against listed property names with Python's re, which backtracks without limit while
    # holding the GIL: '^(a+)+$' against a listed 40-character 'aaa...!' stalled the front
    # for hours. Now the regex module matches them (it sees through that one) under a time
    # limit, past which the schema is refused by name.
    monkeypatch.setattr(js, "MAX_MATCH_S", 0.02)
    hard = {"type": "object", "properties": {"a" * 30 + "!": {"type": "integer"}},
            "patternProperties": {"^(a|aa)+$": {"type": "string"}}}  # backtracks in both engines
    for backend in ("outlines", "llguidance"):
        with pytest.raises(RequestError, match=r"pattern '\^\(a\|aa\)\+\$' takes longer than 0.02 s to match "
                                               r"'a+!' \(catastrophic backtracking\)"):
            constraint(hard, backend)
    monkeypatch.setattr(js, "MAX_MATCH_S", 1.0)
    long = "a" * 40 + "!"
    values = {"type": "string", "pattern": "^(a+)+$", "enum": [long, "aaa"]}
    names = {"type": "object", "properties": {long: {"type": "integer"}}, "required": [long],
             "patternProperties": {"^(a+)+$": {"type": "string"}}, "additionalProperties": False}
    for backend in ("outlines", "llguidance"):
        assert constraint(names, backend).backend == backend
    c = constraint(values, "outlines")
    assert c.grammar == '"aaa"'
    assert_valid(values, sample(c.grammar, 3, seed=0))
    # (jsonschema itself would backtrack on the name: the outputs are checked by hand)
    for text in sample(constraint(names, "outlines").grammar, 3, seed=0):
        value = strict_json(text)
        assert list(value) == [long] and type(value[long]) is int  # its own schema; '^(a+)+$' does not match it


def test_boolean_schemas_as_text_on_llguidance(grammars, vocab):  # noqa: F811
    # 'true' (the JSON text of the schema every value satisfies, what response_format
    # sends for {"schema": true}) failed on llguidance with "Expecting object schema to
    # apply options"; 'false' with the same words instead of saying nothing satisfies it
    c = constraint("true", "llguidance")
    assert c.backend == "llguidance"
    assert_valid(True, outputs(grammars, vocab, c, 3))
    for backend in ("llguidance", "outlines", "auto"):
        with pytest.raises(RequestError, match=r"at # is false: no value can satisfy it"):
            constraint("false", backend)


def test_listed_values_are_checked_within_the_translation_time_limit():
    # each value's check may match patterns for up to MAX_MATCH_S: 100 values of an enum
    # beside a backtracking pattern ran 100 s with no check of the 5 s limit between them
    schema = {"type": "string", "pattern": "^(a|aa)+$", "enum": [f"a{i}" for i in range(100)]}
    t = js._Translator(schema, "")
    t.deadline = 0.0  # long past
    with pytest.raises(js.SchemaError, match="took longer than"):
        t.finite_values(schema, "#")


@pytest.mark.parametrize("as_text", [False, True])
def test_a_schema_too_deep_for_recursion_is_a_request_error(as_text):
    """A schema 600 properties deep (1200 levels of JSON) is refused by its depth, as the
    64-level limit says, before anything recurses into it (the UTF-8 check's json.dumps
    raised RecursionError: a 500 through the server)."""
    schema: dict = {"type": "object"}
    node = schema
    for _ in range(600):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    value = schema
    if as_text:
        import sys

        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(10_000)  # json.dumps itself recurses: write the text once
        try:
            value = json.dumps(schema)
        finally:
            sys.setrecursionlimit(limit)
    # (as text, the parse itself stops: "not valid JSON: maximum recursion depth exceeded")
    with pytest.raises(RequestError, match="recursion depth" if as_text else "nested more than 64 levels") as info:
        SamplingParams(json_schema=value).constraint()
    assert info.value.param == "json_schema"
