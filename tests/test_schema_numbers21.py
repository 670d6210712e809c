"""An integer past a 64-bit float's range anywhere in a JSON Schema is refused by the one
walk every path runs first (``check_schema_size``): ``/generate`` and ``SamplingParams``,
the language's ``gen(json_schema=...)`` and tool schemas (``schema_problem``). Before,
only the OpenAI front checked it; elsewhere a 400-digit bound was an ``OverflowError``
inside a translator (a 400 blaming the backend, a traceback in the log) and an ``enum``
member of 400 digits built a grammar."""

from __future__ import annotations

import sys

import pytest

from plait.errors import RequestError
from plait.ir import check_json_schema
from plait.tool_parsers import schema_problem
from plait.runtime.constrained.json_schema import SchemaError, check_schema_size
from plait.runtime.sampling_params import SamplingParams

BIG = int("9" * 400)

CASES = [
    ({"type": "integer", "maximum": BIG}, "#/maximum"),
    ({"type": "object", "properties": {"a/b": {"type": "number", "multipleOf": -BIG}}}, "#/properties/a~1b/multipleOf"),
    ({"enum": [1, BIG]}, "#/enum/1"),
    ({"type": "object", "examples": [{"n": BIG}]}, "#/examples/0/n"),
]


@pytest.mark.parametrize("schema,where", CASES)
def test_the_walk_names_the_integer_and_its_place(schema, where):
    with pytest.raises(SchemaError) as e:
        check_schema_size(schema)
    assert f"at {where}," in str(e.value) and "10**400" in str(e.value)


@pytest.mark.parametrize("schema,where", CASES)
def test_generate_the_language_and_tools_all_refuse_it(schema, where):
    import json

    with pytest.raises(RequestError) as e:
        SamplingParams(json_schema=json.dumps(schema), max_new_tokens=4).constraint()
    assert e.value.param == "json_schema" and where in e.value.message and "OverflowError" not in e.value.message
    with pytest.raises(ValueError, match="10\\*\\*400"):
        check_json_schema(schema)
    obj = {"type": "object", "properties": {"x": schema}}
    problem = schema_problem(obj)
    assert problem is not None and "#/properties/x/" + where[2:] in problem


def test_numbers_within_a_double_and_other_values_pass():
    check_schema_size({"maximum": 10 ** 308, "minimum": -1.5e308, "enum": [True, None, "9" * 400, 2 ** 1023]})
    assert 2 ** 1024 > sys.float_info.max  # the first power of two past the range
    with pytest.raises(SchemaError, match="10\\*\\*308"):
        check_schema_size({"maximum": 2 ** 1024})
    # and a schema whose bounds fit is served as before
    params = SamplingParams(json_schema='{"type": "integer", "minimum": -1e300, "maximum": 1e300}', max_new_tokens=4)
    assert params.constraint() is not None
