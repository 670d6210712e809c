"""Round 6 of the schema probes: JSON Schemas as generators and tools write them (pydantic
2 ``model_json_schema()``, zod-to-json-schema, OpenAI strict mode, draft-04 to 2020-12
idioms), each through ``SamplingParams.constraint()`` on ``auto`` and on each backend,
outputs checked with ``jsonschema`` against the original schema. What this probe found,
one test each:

- llguidance wrote a listed string (``const`` / ``enum``, also inside an object or array
  value) without its control characters: ``"a\\u0001b"`` admitted ``"ab"``, and a
  ``const`` of U+007F compiled to a grammar with no output (a failed build, where
  ``auto`` could have used the regex translation);
- llguidance read listed integers as 64-bit floats: ``enum: [12345678901234567891]``
  admitted ``12345678901234567000``;
- both backends read a boolean ``exclusiveMinimum`` / ``exclusiveMaximum`` as draft 4
  does in documents whose ``$schema`` is a later draft (draft 7), where ``jsonschema``
  compares with the boolean as 0/1: ``minimum: 0, exclusiveMinimum: true`` admitted 1,
  which ``jsonschema`` rejects; now a 400 naming the keyword and place. Without
  ``$schema`` (OpenAPI 3.0 tool parameters) it keeps draft 4's meaning, the only one
  under which a later metaschema does not reject the document;
- ``not: {}`` (zod-to-json-schema's ``z.never()`` / ``z.undefined()`` / ``z.nan()``, a
  schema nothing satisfies) was refused on every backend ("negated schemas");
- ``if`` without ``then`` or ``else`` (a no-op) was refused on every backend;
- a ``oneOf`` whose branches differ only by an optional ``const`` tag (pydantic's
  discriminated unions of models whose fields all have defaults, ``Literal`` tags
  included) was refused on every backend: no branch was proved exclusive;
- a tuple place no item fits (draft-6 ``items: [true, false]``, a ``prefixItems`` entry
  ``not: {}``) was refused by the regex translation, naming ``prefixItems`` where the
  schema says ``items``, although shorter arrays are valid.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

import jsonschema
import pytest
from pydantic import BaseModel, Discriminator, Field, Tag

from plait.errors import RequestError
from plait.runtime.sampling_params import SamplingParams
from test_llguidance import engine, grammars, tokenizer, vocab  # noqa: F401 (fixtures)
from test_schema_probe16 import admitted, constraint, validator, walks

D4 = "http://json-schema.org/draft-04/schema#"
D6 = "http://json-schema.org/draft-06/schema#"
D7 = "http://json-schema.org/draft-07/schema#"
BACKENDS = ("auto", "llguidance", "outlines")


def assert_sound(grammars, vocab, schema: object, backends=BACKENDS, n: int = 6) -> None:  # noqa: F811
    v = validator(schema)
    for backend in backends:
        texts = walks(grammars, vocab, schema, backend, n)
        assert texts, backend
        for text in texts:
            assert v.is_valid(json.loads(text)), (backend, text)


# -- llguidance wrote listed strings without their control characters ----------------------------
@pytest.mark.parametrize("schema, bad, good", [
    ({"const": "a\u0001b"}, '"ab"', '"a\\u0001b"'),
    ({"type": "string", "enum": ["x", "tab\u001fsep"]}, '"tabsep"', '"tab\\u001fsep"'),
    ({"const": {"k": "a\u0001"}}, '{"k":"a"}', '{"k":"a\\u0001"}'),
])
def test_listed_strings_with_control_characters_are_written_as_listed(grammars, vocab, schema, bad, good):  # noqa: F811
    v = validator(schema)
    assert not v.is_valid(json.loads(bad)) and v.is_valid(json.loads(good))
    with pytest.raises(RequestError, match=r"(const|enum) at #.* control character U\+00(01|1F)"):
        constraint(schema, "llguidance")
    assert constraint(schema, "auto").backend == "outlines"
    assert not admitted(grammars, vocab, schema, "auto", bad)
    assert admitted(grammars, vocab, schema, "auto", good)


def test_a_const_of_delete_goes_to_the_regex_translation(grammars, vocab):  # noqa: F811
    # llguidance writes no U+007F in a string: its grammar had no output and the build failed
    schema = {"type": "object", "properties": {"sep": {"const": "\u007f"}}, "required": ["sep"]}
    assert constraint(schema, "auto").backend == "outlines"
    assert admitted(grammars, vocab, schema, "auto", '{"sep":"\u007f"}')


# -- llguidance read listed integers as floats -----------------------------------------------------
def test_listed_integers_past_a_float_stay_exact(grammars, vocab):  # noqa: F811
    schema = {"type": "object", "properties": {"id": {"enum": [12345678901234567891, 1]}}, "required": ["id"]}
    with pytest.raises(RequestError, match=r"enum at #/properties/id holds the integer 12345678901234567891"):
        constraint(schema, "llguidance")
    assert constraint(schema, "auto").backend == "outlines"
    assert not validator(schema).is_valid({"id": 12345678901234567000})
    assert not admitted(grammars, vocab, schema, "auto", '{"id":12345678901234567000}')
    assert admitted(grammars, vocab, schema, "auto", '{"id":12345678901234567891}')
    # a float holds 2**60 exactly: still llguidance's
    assert constraint({"const": 2**60}, "auto").backend == "llguidance"


# -- draft 4's boolean exclusive bounds in later drafts --------------------------------------------
@pytest.mark.parametrize("dialect", [{"$schema": D7}])
@pytest.mark.parametrize("backend", BACKENDS)
def test_boolean_exclusive_bound_outside_draft_4_is_a_400_naming_it(dialect, backend):
    schema = {**dialect, "type": "object", "required": ["n"],
              "properties": {"n": {"type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3}}}
    assert not validator(schema).is_valid({"n": 1})  # jsonschema compares with true as 1
    with pytest.raises(RequestError, match=r"'exclusiveMinimum' at #/properties/n is true: a boolean is draft 4's "
                                           r"form.*'\$schema' is draft 7.*allowed: a number"):
        constraint(schema, backend)


@pytest.mark.parametrize("dialect", [{"$schema": D4}, {}])
def test_boolean_exclusive_bound_in_draft_4_keeps_its_meaning(grammars, vocab, dialect):  # noqa: F811
    schema = {**dialect, "type": "integer", "minimum": 0, "exclusiveMinimum": True, "maximum": 3}
    if not dialect:  # no later draft's metaschema takes the boolean: draft 4 is the reading left
        with pytest.raises(jsonschema.SchemaError):
            jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.Draft4Validator.check_schema(schema)
    for backend in BACKENDS:
        assert admitted(grammars, vocab, schema, backend, "1"), backend
        assert not admitted(grammars, vocab, schema, backend, "0"), backend


# -- zod's z.never(): not: {} ----------------------------------------------------------------------
ZOD_NEVER = {"$schema": D7, "type": "object", "additionalProperties": False,
             "properties": {"gone": {"not": {}}, "n": {"anyOf": [{"type": "integer"}, {"not": {}}]}},
             "required": ["n"]}


def test_not_of_the_empty_schema_is_false_on_every_backend(grammars, vocab):  # noqa: F811
    assert_sound(grammars, vocab, ZOD_NEVER)
    for backend in BACKENDS:
        assert admitted(grammars, vocab, ZOD_NEVER, backend, '{"n":3}'), backend
        assert not admitted(grammars, vocab, ZOD_NEVER, backend, '{"gone":1,"n":3}'), backend
    with pytest.raises(RequestError, match="no value can satisfy it"):
        constraint({"not": {"description": "never"}}, "auto")


# -- if without then/else ----------------------------------------------------------------------------
def test_if_without_then_or_else_constrains_nothing(grammars, vocab):  # noqa: F811
    schema = {"$schema": D7, "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "if": {"properties": {"a": {"const": 1}}}}
    assert_sound(grammars, vocab, schema)
    for backend in BACKENDS:
        assert admitted(grammars, vocab, schema, backend, '{"a":1}'), backend
        assert admitted(grammars, vocab, schema, backend, '{"a":2}'), backend


# -- pydantic discriminated unions of all-default models -------------------------------------------
class Circle(BaseModel):
    kind: Literal["circle"] = "circle"
    r: float = 1.0


class Square(BaseModel):
    kind: Literal["square"] = "square"
    side: float = 1.0


class Canvas(BaseModel):
    shape: Union[Circle, Square] = Field(discriminator="kind")


class On(BaseModel):
    t: Literal["on"] = "on"


class Off(BaseModel):
    t: Literal["off"] = "off"


class Switch(BaseModel):  # a callable discriminator: oneOf without a mapping
    state: Annotated[Union[Annotated[On, Tag("on")], Annotated[Off, Tag("off")]],
                     Discriminator(lambda v: v.get("t") if isinstance(v, dict) else getattr(v, "t", None))]


@pytest.mark.parametrize("model", [Canvas, Switch])
def test_one_of_told_apart_by_an_optional_tag_carries_the_tag(grammars, vocab, model):  # noqa: F811
    schema = model.model_json_schema()
    field = next(iter(schema["properties"]))
    empty = json.dumps({field: {}}, separators=(",", ":"))
    assert not validator(schema).is_valid(json.loads(empty))  # {} satisfies both branches
    assert_sound(grammars, vocab, schema)
    tag = "kind" if model is Canvas else "t"
    value = "square" if model is Canvas else "off"
    for backend in BACKENDS:
        assert not admitted(grammars, vocab, schema, backend, empty), backend
        assert admitted(grammars, vocab, schema, backend, json.dumps({field: {tag: value}}, separators=(",", ":")))


# -- a tuple place no item fits ----------------------------------------------------------------------
@pytest.mark.parametrize("schema", [
    {"$schema": D6, "type": "array", "items": [{"type": "integer"}, False], "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"not": {}}]},
])
def test_a_tuple_place_no_item_fits_ends_the_array_there(grammars, vocab, schema):  # noqa: F811
    v = validator(schema)
    assert v.is_valid([7]) and not v.is_valid([7, 8])
    assert_sound(grammars, vocab, schema)
    for backend in BACKENDS:
        assert admitted(grammars, vocab, schema, backend, "[7]"), backend
        assert not admitted(grammars, vocab, schema, backend, "[7,8]"), backend
    bad = {**schema, "minItems": 2}
    with pytest.raises(RequestError, match="no array satisfies"):
        constraint(bad, "outlines")


# -- generation on a tiny model: finished outputs validate -----------------------------------------
GENERATED = [ZOD_NEVER, Canvas.model_json_schema(), Switch.model_json_schema(),
             {"type": "object", "properties": {"sep": {"enum": ["\u0001", "\u007f"]},
                                               "id": {"const": 12345678901234567891}}, "required": ["sep", "id"]}]


def test_tiny_model_generations_validate_against_the_original_schemas(engine):  # noqa: F811
    prompts, params = [], []
    for schema in GENERATED:
        for seed in (1, 2, 3):
            prompts.append("JSON:")
            params.append({"json_schema": schema, "temperature": 1.0, "seed": seed, "max_new_tokens": 48})
    outs = engine.generate(prompts, params)
    finished = 0
    for p, o in zip(params, outs):
        kind = o["meta_info"]["finish_reason"]["type"]
        assert kind in ("stop", "length"), o["meta_info"]
        if kind == "stop":
            finished += 1
            assert validator(p["json_schema"]).is_valid(json.loads(o["text"])), o["text"]
    assert finished >= len(outs) // 3
