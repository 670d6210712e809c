"""Round 8 of the schema probes: pydantic 2 ``model_json_schema()`` (discriminated unions,
``Optional``, ``Literal``, enums, dates / uuids / URLs, ``conint`` / ``constr`` /
``conlist``, ``Decimal``, recursive models, ``Dict`` / ``Tuple``, ``Annotated`` fields with
examples), OpenAI structured-output examples (recursive UI, linked list, moderation),
Instructor / LangChain / Outlines / Marvin schemas, SchemaStore subsets and 2020-12
keywords, each through ``SamplingParams.constraint()`` on every backend, outputs checked
with ``jsonschema`` against the original schema. What this probe found, one test each:

- ``multipleOf`` whose multiples have more integer digits than a number is written with
  (``{"type": "integer", "multipleOf": 1e20}``) translated to ``-(?:)|0|(?:)``: the
  regex admitted ``-`` and the empty text, neither of them JSON; a step such as ``4e16``
  admitted multiples past the 16-digit cap;
- the ``uniqueItems`` guard let a token complete the last distinct item and go on into
  the next one (``",`` or ``","`` after ``["c","b","a"`` with items ``a``/``b``/``c``, a
  ``,`` after ``[3,2,1`` with integers 1..3, ``[true,false,``): every way on then
  repeated an item and the request ended with an error although ``]`` was allowed
  (about one sampled walk in four on these schemas, ``auto`` included for integer
  ranges and booleans);
- a ``pattern`` of a megabyte (a 100 000-word alternation) was parsed and translated for
  seconds before its size was refused (4 s on the regex path, 7 s more in llguidance on
  ``auto``); its length is now checked first, the limit of a ``regex``.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import re
import uuid
from typing import Annotated, Literal, Optional, Union

import numpy as np
import pytest
from pydantic import AnyUrl, BaseModel, Field, conint, conlist, constr

from plait.errors import RequestError
from plait.regex import MAX_PATTERN_CHARS
from test_llguidance import EOS, compiled, grammars, random_output, tokenizer, vocab  # noqa: F401 (fixtures)
from test_schema_probe16 import admitted, constraint, validator
from test_schema_probe18 import assert_sound


# -- real-world schemas stay sound -----------------------------------------------------------------
class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Prio(enum.IntEnum):
    low = 1
    high = 2


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Union[Cat, Dog] = Field(discriminator="pet_type")
    n: int


class Node(BaseModel):
    value: int
    children: list[Node] = []


class Everything(BaseModel):
    id: uuid.UUID
    when: dt.datetime
    day: dt.date
    color: Color
    prio: Prio
    tags: dict[str, int]
    pair: tuple[int, str]
    maybe: Optional[str] = None
    score: Annotated[float, Field(gt=0, lt=1)]
    count: conint(ge=0, le=100, multiple_of=5)
    code: constr(pattern=r"^[A-Z]{3}-\d{3}$")
    nums: conlist(int, min_length=1, max_length=3)
    url: AnyUrl
    kind: Literal["a", 1, None, True] = "a"


class Money(BaseModel):
    amount: decimal.Decimal
    name: Annotated[str, Field(title="Name", description="who", examples=["bob"], min_length=2, max_length=8)] = "bob"


OPENAI_UI = {  # OpenAI's structured-outputs guide: a UI tree, recursive through "#"
    "type": "object", "additionalProperties": False, "required": ["type", "label", "children", "attributes"],
    "properties": {
        "type": {"type": "string", "enum": ["div", "button", "header", "section", "field", "form"]},
        "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#"}},
        "attributes": {"type": "array", "items": {
            "type": "object", "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
            "required": ["name", "value"], "additionalProperties": False}}}}
MODERATION = {"type": "object", "additionalProperties": False,
              "required": ["is_violating", "category", "explanation_if_violating"],
              "properties": {"is_violating": {"type": "boolean"},
                             "category": {"type": ["string", "null"], "enum": ["violence", "sexual", None]},
                             "explanation_if_violating": {"type": ["string", "null"]}}}
INSTRUCTOR_MAYBE = {"$defs": {"User": {"properties": {"name": {"type": "string"}}, "required": ["name"], "type": "object"}},
                    "type": "object",
                    "properties": {"result": {"anyOf": [{"$ref": "#/$defs/User"}, {"type": "null"}], "default": None},
                                   "error": {"default": False, "type": "boolean"}}}
POSTAL = {"type": "object", "required": ["country", "postal"],
          "properties": {"country": {"enum": ["US", "CA"]}, "postal": {"type": "string"}},
          "if": {"properties": {"country": {"const": "US"}}},
          "then": {"properties": {"postal": {"pattern": "^[0-9]{5}$"}}},
          "else": {"properties": {"postal": {"pattern": "^[A-Z][0-9][A-Z] [0-9][A-Z][0-9]$"}}}}

REAL = {"owner": Owner.model_json_schema(), "node": Node.model_json_schema(),
        "everything": Everything.model_json_schema(), "money": Money.model_json_schema(),
        "openai_ui": OPENAI_UI, "moderation": MODERATION, "instructor_maybe": INSTRUCTOR_MAYBE, "postal": POSTAL}


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_world_schemas_generate_only_valid_documents(grammars, vocab, name):  # noqa: F811
    schema = REAL[name]
    backends = ["auto", "outlines"]
    try:
        constraint(schema, "llguidance")
        backends.append("llguidance")
    except RequestError as e:  # refused by name (a non-integer exclusive bound): auto takes the regex path
        assert "exclusiveMinimum" in str(e), e
    assert_sound(grammars, vocab, schema, backends=tuple(backends))


# -- multipleOf with no multiple inside the digit cap ------------------------------------------------
@pytest.mark.parametrize("schema", [{"type": "integer", "multipleOf": 1e20}, {"type": "number", "multipleOf": 1e308}])
def test_a_step_past_the_digit_cap_writes_zero_only(grammars, vocab, schema):  # noqa: F811
    rx = constraint(schema, "outlines").grammar
    assert not re.fullmatch(rx, "-") and not re.fullmatch(rx, "")
    assert re.fullmatch(rx, "0")
    assert_sound(grammars, vocab, schema, backends=("auto", "outlines"))


def test_multiples_stay_within_the_digit_cap():
    rx = constraint({"type": "integer", "multipleOf": 4e16}, "outlines").grammar
    assert not re.fullmatch(rx, "40000000000000000") and re.fullmatch(rx, "0")


def test_a_step_past_the_cap_on_one_side_of_zero_is_a_400_naming_it():
    with pytest.raises(RequestError, match=r"'multipleOf' 1e\+20 at # is not supported: no multiple"):
        constraint({"type": "integer", "multipleOf": 1e20, "exclusiveMinimum": 0}, "outlines")


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_an_if_whose_else_case_cannot_be_written_names_if(backend):
    # (found by a new-user trial: the 400 named 'not' at #/anyOf/1/properties/a, keywords
    # and a path the rewrite of if/then wrote, not the client)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}}
    with pytest.raises(RequestError, match=r"keyword 'if' (at # )?is not supported: .*'else' case") as e:
        constraint(schema, backend)
    assert "anyOf" not in str(e.value)
    # a 'not' the client wrote is still named as theirs
    own = {**schema, "properties": {"a": {"type": "integer", "not": {"const": 3}}}}
    with pytest.raises(RequestError, match=r"keyword 'not' at|keys: \[\"not\"\]"):
        constraint(own, backend)


# -- uniqueItems: a token that completes the last new item and goes on ---------------------------------
ABC = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True, "minItems": 3}
ONE_TO_THREE = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "uniqueItems": True}
BOOLS = {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}
IN_OBJECT = {"type": "object", "required": ["t"],
             "properties": {"t": {"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True}}}


def allowed_after(grammars, vocab, schema, text: str) -> list[bytes]:  # noqa: F811
    c, fut = compiled(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    m = grammars.matcher(fut, c, jump_forward=False, heal=False)
    m.start([1])
    for t in vocab.encode(text):
        assert m.advance(t), text
    bits = np.unpackbits(m.allowed(eos_ok=True).view(np.uint8), bitorder="little")
    return [vocab.token_bytes[i] for i in np.flatnonzero(bits) if i not in EOS]


@pytest.mark.parametrize("schema, text", [(ABC, '["c","b","a'), (ONE_TO_THREE, "[3,2,1"), (BOOLS, "[true,false"),
                                          (IN_OBJECT, '{"t":["y","x')])
def test_the_last_distinct_item_is_not_followed_by_another(grammars, vocab, schema, text):  # noqa: F811
    allowed = allowed_after(grammars, vocab, schema, text)
    assert allowed, text
    # each token left closes the item and the array (or just the item), never opens the next
    for tok in allowed:
        assert b"," not in tok, (text, allowed)


@pytest.mark.parametrize("schema", [ABC, ONE_TO_THREE, BOOLS, IN_OBJECT])
def test_sampled_walks_of_small_domains_always_finish_valid(grammars, vocab, schema):  # noqa: F811
    c, fut = compiled(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    v = validator(schema)
    for seed in range(16):
        m = grammars.matcher(fut, c, jump_forward=False, heal=False)
        m.start([1])
        text = random_output(m, vocab, seed, cap=24, limit=200)  # asserts a token is left at every step
        assert text is not None and v.is_valid(json.loads(text)), text


# -- a huge pattern is refused before it is parsed ---------------------------------------------------------
@pytest.mark.parametrize("backend", ["auto", "llguidance", "outlines"])
def test_a_pattern_over_the_regex_limit_is_a_400_before_any_work(backend):
    words = "|".join(f"word{i}" for i in range(20000))
    schema = {"type": "object", "properties": {"w": {"type": "string", "pattern": f"^({words})$"}}, "required": ["w"]}
    assert len(words) > MAX_PATTERN_CHARS
    with pytest.raises(RequestError, match=rf"'pattern' at #/properties/w(/pattern)? has \d+ characters; allowed: "
                                           rf"at most {MAX_PATTERN_CHARS}"):
        constraint(schema, backend)


def test_a_pattern_within_the_limit_still_compiles(grammars, vocab):  # noqa: F811
    schema = {"type": "string", "pattern": "^(" + "|".join(f"w{i}" for i in range(200)) + ")$"}
    for backend in ("auto", "outlines"):
        assert admitted(grammars, vocab, schema, backend, '"w199"'), backend
        assert not admitted(grammars, vocab, schema, backend, '"w200"'), backend


def test_a_length_bound_past_u32_is_no_bound_on_the_regex_path():
    """maxLength / maxItems of 2**40 (no output reaches them) were written as counted
    repetitions past u32, which the regex checks refuse: a forced tool call's schema got
    a 400 naming tool_choice and quoting the translated regex. Now they are unbounded,
    and the regex matches what the schema allows."""
    import json
    import re

    import jsonschema

    from plait.regex import check_regex
    from plait.runtime.constrained.unique_items import guarded_regex

    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2**40},
                                               "b": {"type": "array", "items": {"type": "integer"}, "maxItems": 2**40}},
              "required": ["a", "b"], "additionalProperties": False}
    rx, _ = guarded_regex(schema)
    check_regex(rx)  # raised "a repetition count above 4294967295"
    doc = json.dumps({"a": "x" * 300, "b": list(range(50))}, separators=(",", ":"))
    assert re.fullmatch(rx, doc) and not re.fullmatch(rx, doc.replace('"x', '"\n'))
    jsonschema.validate(json.loads(doc), schema)
    bounded, _ = guarded_regex({"type": "string", "maxLength": 2**32 - 1})
    assert "{0,4294967295}" in bounded  # the largest count a backend reads is kept
