"""Numeric keywords the regex translation enforces exactly: non-integral bounds on
``number`` (draft-4 boolean exclusive forms too) and ``multipleOf`` (integers, binary
fractions such as 0.5 / 0.25 / 2.5, with or without bounds).

Each form is checked against brute force: many candidate texts (boundaries, values
just inside and outside, digit counts, trailing zeros, negative zero, malformed
numbers) and ``regex fullmatch`` <=> (the text is one of the number forms the
translation writes AND ``jsonschema`` accepts its parse AND the value, read as an exact
decimal, satisfies the schema as written). Where the text has at most 15 significant
digits the last condition is implied (a float tells such decimals apart), and that is
asserted too. Then outputs of a tiny random model through the engine validate."""

from __future__ import annotations

import json
import re
from decimal import Decimal
from fractions import Fraction

import jsonschema
import pytest

from plait.runtime.constrained.json_schema import SchemaError, schema_decimal, schema_to_regex
from regex_sampling import sample

NUMBER_TEXT = re.compile(r"-?(0|[1-9][0-9]*)(?:\.([0-9]+))?")


def form_ok(text: str, int_digits: int, frac_digits: int) -> bool:
    """``text`` is a number as the translation writes it: no exponent, a canonical
    integer part of at most ``int_digits`` digits, 1 to ``frac_digits`` fraction digits
    (0: none), not negative zero."""
    m = NUMBER_TEXT.fullmatch(text)
    if not m or len(m.group(1)) > int_digits:
        return False
    if m.group(2) is not None and len(m.group(2)) > frac_digits:
        return False
    return not (text.startswith("-") and Fraction(text) == 0)


def decimal_ok(text: str, schema: dict) -> bool:
    """The schema read with exact decimals (the bounds and step as written)."""
    v = Fraction(text)
    ex_min, ex_max = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    if "minimum" in schema:
        lo = schema_decimal(schema["minimum"])
        if not (v > lo if ex_min is True else v >= lo):
            return False
    if "maximum" in schema:
        hi = schema_decimal(schema["maximum"])
        if not (v < hi if ex_max is True else v <= hi):
            return False
    if ex_min is not None and not isinstance(ex_min, bool) and not v > schema_decimal(ex_min):
        return False
    if ex_max is not None and not isinstance(ex_max, bool) and not v < schema_decimal(ex_max):
        return False
    if "multipleOf" in schema and (v / schema_decimal(schema["multipleOf"])).denominator != 1:
        return False
    return schema.get("type") != "integer" or v.denominator == 1


def significant_digits(text: str) -> int:
    digits = text.lstrip("-").replace(".", "").lstrip("0")
    return len(digits) or 1


def candidates(schema: dict) -> set[str]:
    """Texts around every number the schema names, and a spread of others."""
    anchors = [Fraction(0), Fraction(1), Fraction(5, 2), Fraction(100), Fraction(-1), Fraction(-7, 4)]
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        v = schema.get(key)
        if v is not None and not isinstance(v, bool):
            anchors += [schema_decimal(v), -schema_decimal(v)]
            if key == "multipleOf":
                anchors += [schema_decimal(v) * j * sign for j in (2, 3, 7, 33, 34, 35, 400) for sign in (1, -1)]
    out = set()
    for a in anchors:
        for k in range(0, 18):  # steps of 10**-k either side
            for d in (-1, 0, 1):
                out.add(_text(a + d * Fraction(1, 10**k)))
        for d in (-2, -1, 1, 2):  # next to the anchor at its own precision
            out.add(_text(a + Fraction(d, 4)))
    for text in list(out):
        if "." in text:
            out.add(text + "0")  # trailing zeros
            out.add(text + "00000")
        else:
            out.update({text + ".0", text + ".00", text + ".5"})
    ints = [0, 1, 2, 3, 4, 6, 9, 10, 12, 25, 30, 33, 99, 100, 101, 102, 1000, 10**15 - 1, 10**15, 10**16 - 1, 10**16]
    for i in ints:
        for frac in ("", ".0", ".00", ".1", ".10", ".01", ".05", ".09", ".099999", ".1000001", ".25", ".250", ".5",
                     ".50", ".75", ".125", ".999999", ".9999999999999999", ".0000000000000001", ".00000000000000001"):
            out.update({f"{i}{frac}", f"-{i}{frac}"})
    out.update({"-0", "-0.0", "-0.00", "00", "01", "0.", ".5", "1e1", "1E-2", "+1", "-", "", "0.1e0", "- 1"})
    return out


def _text(v: Fraction) -> str:
    d = Decimal(v.numerator) / Decimal(v.denominator)
    return format(d, "f")


def validator(schema: dict):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema)


def check_exact(schema: dict, int_digits: int, frac_digits: int) -> None:
    rx = re.compile(schema_to_regex(schema))
    v = validator(schema)
    matched = 0
    for text in sorted(candidates(schema)):
        form = form_ok(text, int_digits, frac_digits)
        valid = form and v.is_valid(json.loads(text))
        expected = valid and decimal_ok(text, schema)
        got = bool(rx.fullmatch(text))
        assert got == expected, (schema, text, got)
        if form and significant_digits(text) <= 15:
            assert got == valid, (schema, text, got)  # the float reading alone, where a float is exact enough
        matched += got
    assert matched >= 5, (schema, matched)
    for text in sample(rx.pattern, 300, seed=len(json.dumps(schema))):
        assert v.is_valid(json.loads(text)) and decimal_ok(text, schema), (schema, text)


# (schema, integer digits, fraction digits written)
BOUNDS = [
    ({"type": "number", "exclusiveMinimum": 0.1}, 16, 6),  # pydantic confloat(gt=0.1)
    ({"type": "number", "exclusiveMaximum": 10.5}, 16, 6),  # Field(lt=10.5)
    ({"type": "number", "minimum": 0.5, "maximum": 99.99}, 16, 16),  # Field(ge=0.5, le=99.99)
    ({"type": "number", "minimum": 0.1}, 16, 16),
    ({"type": "number", "maximum": -0.25}, 16, 16),
    ({"type": "number", "minimum": -1.5, "maximum": 0}, 16, 16),
    ({"type": "number", "minimum": -0.001, "exclusiveMaximum": 0.001}, 16, 6),
    ({"type": "number", "minimum": 1234.5678, "maximum": 1234.5679}, 16, 16),
    ({"type": "number", "exclusiveMinimum": 0.30000000000000004}, 16, 6),  # a float's shortest decimal
    ({"type": "number", "minimum": 0.1234567890123456789}, 16, 16),  # more digits than a float holds
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 2.5,
      "exclusiveMinimum": True, "maximum": 3.75, "exclusiveMaximum": True}, 16, 6),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "number", "minimum": 0.2,
      "exclusiveMinimum": False, "maximum": 7.5, "exclusiveMaximum": True}, 16, 6),
    ({"type": "number", "minimum": 1e-7}, 16, 16),
    ({"type": "number", "maximum": 1e300, "minimum": 0.5}, 16, 16),
    ({"type": "integer", "minimum": 0.5, "exclusiveMaximum": 10.5}, 16, 0),
]

MULTIPLES = [
    ({"type": "number", "multipleOf": 0.5}, 15, 1),
    ({"type": "number", "multipleOf": 0.25}, 15, 2),
    ({"type": "number", "multipleOf": 0.25, "minimum": 0}, 15, 2),
    ({"type": "number", "multipleOf": 2.5}, 15, 1),
    ({"type": "number", "multipleOf": 0.125, "exclusiveMinimum": 0}, 15, 3),
    ({"type": "number", "multipleOf": 0.5, "minimum": 0.5, "maximum": 100}, 15, 1),
    ({"type": "number", "multipleOf": 0.75, "minimum": -3, "maximum": 30}, 15, 2),
    ({"type": "number", "multipleOf": 0.25, "exclusiveMinimum": 0.1, "exclusiveMaximum": 99.9}, 15, 2),
    ({"type": "number", "multipleOf": 20}, 16, 0),  # an integer step: written as integers
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100}, 16, 0),
    ({"type": "integer", "multipleOf": 7, "minimum": -50, "exclusiveMaximum": 500}, 16, 0),
    ({"type": "integer", "multipleOf": 4}, 16, 0),
    ({"type": "integer", "multipleOf": 250, "minimum": 0}, 16, 0),
    ({"type": "integer", "multipleOf": 1000, "exclusiveMaximum": 0}, 16, 0),
    ({"type": "integer", "multipleOf": 5, "maximum": 0}, 16, 0),
    ({"type": "integer", "multipleOf": 2.5}, 15, 0),  # integers: the multiples of 5
    ({"type": "integer", "multipleOf": 0.5, "minimum": 3, "maximum": 9}, 16, 0),  # any integer
    ({"type": "integer", "multipleOf": 12.0, "minimum": 0, "maximum": 600}, 15, 0),
]


@pytest.mark.parametrize("schema, int_digits, frac_digits", BOUNDS, ids=[json.dumps(c[0]) for c in BOUNDS])
def test_decimal_bounds_are_exact(schema, int_digits, frac_digits):
    check_exact(schema, int_digits, frac_digits)


@pytest.mark.parametrize("schema, int_digits, frac_digits", MULTIPLES, ids=[json.dumps(c[0]) for c in MULTIPLES])
def test_multiple_of_is_exact(schema, int_digits, frac_digits):
    check_exact(schema, int_digits, frac_digits)


def test_a_bound_is_read_as_written_not_as_its_binary_value():
    rx = re.compile(schema_to_regex({"type": "number", "minimum": 0.1, "maximum": 0.3}))
    # 0.1 and 0.3 themselves are inside (their floats are 0.1000000000000000055... and
    # 0.299999999999999988...): compared as decimals, not as binary expansions
    assert rx.fullmatch("0.1") and rx.fullmatch("0.3") and rx.fullmatch("0.10") and rx.fullmatch("0.3000")
    assert not rx.fullmatch("0.0999999999999999") and not rx.fullmatch("0.3000000000000001")
    # an open bound: fractions of at most 6 digits, so no admitted text parses onto it
    rx = re.compile(schema_to_regex({"type": "number", "exclusiveMinimum": 0.1}))
    assert rx.fullmatch("0.100001") and not rx.fullmatch("0.1") and not rx.fullmatch("0.1000001")


@pytest.mark.parametrize("schema, words", [
    ({"type": "number", "multipleOf": 0.01}, ["0.01", "binary fraction", "0.07 / 0.01 is 7.000000000000001"]),
    ({"type": "number", "multipleOf": 0.1, "minimum": 0}, ["0.1", "0.3 / 0.1 is 2.9999999999999996"]),
    ({"type": "number", "multipleOf": 1e-3}, ["0.001", "binary fraction"]),
    ({"type": "integer", "multipleOf": 3}, ["'multipleOf' 3", "the factor 3", "at most 1000 multiples"]),
    ({"type": "integer", "multipleOf": 7, "minimum": 0}, ["'multipleOf' 7", "the factor 7"]),
    ({"type": "integer", "multipleOf": 5, "minimum": 10}, ["'multipleOf' 5", "with these bounds", "10 to unbounded"]),
    ({"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 10000}, ["'multipleOf' 3", "at most 1000"]),
    ({"type": "integer", "multipleOf": 2**12}, ["'multipleOf' 4096", "endings"]),
    ({"type": "number", "multipleOf": 0.5, "minimum": 0.6, "maximum": 0.9}, ["admit no multiple"]),
])
def test_what_cannot_be_exact_is_refused_by_name(schema, words):
    with pytest.raises(SchemaError) as e:
        schema_to_regex(schema)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_money_and_ratios_in_an_object_through_the_engine(tiny_model_factory):
    from plait.runtime import Engine

    schema = {"type": "object", "properties": {
        "price": {"type": "number", "exclusiveMinimum": 0.1, "maximum": 999.99},
        "ratio": {"type": "number", "multipleOf": 0.25, "minimum": 0, "maximum": 1},
        "count": {"type": "integer", "multipleOf": 3, "minimum": 0, "maximum": 100},
        "step": {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 0},
    }, "required": ["price", "ratio", "count", "step"], "additionalProperties": False}
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4) as engine:
        outs = engine.generate(["Return a JSON record:"],
                               {"json_schema": schema, "temperature": 1.0, "seed": 2, "n": 3, "max_new_tokens": 200})
    assert len(outs) == 3
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        value = json.loads(o["text"])
        jsonschema.validate(value, schema)
        assert decimal_ok(json.dumps(value["ratio"]), schema["properties"]["ratio"])
