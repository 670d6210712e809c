"""How a user's JSON Schema is taken: as a dict, a bool, its JSON text (parsed once, and
only an object or a boolean is a schema), or in the language a pydantic model class."""

from __future__ import annotations

import json
import re

import pytest

import plait as sgl
from plait.errors import RequestError
from plait.runtime.constrained.json_schema import SchemaError, schema_to_regex
from plait.runtime.sampling_params import SamplingParams

BACKENDS = ["auto", "outlines", "llguidance"]


def constraint(schema, backend: str = "outlines"):
    return SamplingParams.from_dict({"json_schema": schema, "grammar_backend": backend}).constraint()


# -- JSON text: parsed once, an object or a boolean ------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("text,found", [
    ('"x"', "a JSON string"),  # valid JSON: was reported as "not valid JSON" (parsed twice)
    ("[1, 2]", "a JSON array"),
    ("3", "a JSON number"),
    ("null", "null"),
])
def test_schema_text_that_is_not_a_schema_says_what_it_holds(backend, text, found):
    with pytest.raises(RequestError) as info:
        constraint(text, backend)
    assert info.value.param == "json_schema"
    message = info.value.message
    assert message.startswith(f"json_schema is {found}, not a schema"), message
    assert "not valid JSON" not in message and message.count("not a schema") == 1, message


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_double_encoded_schema_is_refused_not_unwrapped(backend):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    text = json.dumps(json.dumps(schema))  # the JSON text of a string holding the schema's text
    with pytest.raises(RequestError) as info:
        constraint(text, backend)  # was accepted: the translators parsed the string again
    assert info.value.param == "json_schema"
    assert "a JSON string, not a schema" in info.value.message
    assert "encoded twice" in info.value.message
    assert constraint(json.dumps(schema), backend).grammar  # encoded once: a schema


def test_schema_to_regex_reads_text_by_the_same_rule():
    with pytest.raises(SchemaError, match="a JSON string, not a schema"):
        schema_to_regex('"x"')
    assert re.fullmatch(schema_to_regex('{"type": "integer"}'), "12")


# -- booleans: Python's and the text's are the same schema ---------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_true_as_a_bool_is_the_schema_any_value_satisfies(backend):
    # json_schema=True (a JSON body's "json_schema": true) was refused while "true" passed
    c = constraint(True, backend)
    assert c == constraint("true", backend)
    if c.backend == "outlines":
        for value in ({"a": [1, None]}, "s", 3.5, True, None, []):
            assert re.fullmatch(c.grammar, json.dumps(value, separators=(",", ":"))), value


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schema", [False, "false"])
def test_false_is_refused_once_as_unsatisfiable(backend, schema):
    with pytest.raises(RequestError) as info:
        constraint(schema, backend)
    assert info.value.param == "json_schema"
    # once, not once per backend tried
    assert info.value.message.count("no value can satisfy it") == 1, info.value.message
    assert info.value.message.startswith("json_schema at # is false")


def test_a_bool_schema_is_type_checked_with_the_others():
    SamplingParams.from_dict({"json_schema": True}).validate()
    with pytest.raises(RequestError, match=r"json_schema=5 is invalid; allowed: .*true/false") as info:
        SamplingParams.from_dict({"json_schema": 5})
    assert info.value.param == "json_schema"


# -- the language: gen(json_schema=...) ----------------------------------------------------------
def _sent(schema) -> object:
    """The schema a gen sends the runtime, read back as the runtime reads it."""
    return json.loads(sgl.gen("x", json_schema=schema).params["json_schema"])


def test_gen_takes_a_pydantic_model_class():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    assert _sent(Person) == Person.model_json_schema()
    regex = schema_to_regex(_sent(Person))
    assert re.fullmatch(regex, '{"name":"Ada","age":36}')
    assert not re.fullmatch(regex, '{"name":"Ada","age":"36"}')
    assert _sent(pydantic.TypeAdapter(list[int])) == pydantic.TypeAdapter(list[int]).json_schema()


def test_gen_refuses_a_pydantic_instance_by_name():
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str

    with pytest.raises(TypeError, match=r"json_schema=.* is a pydantic model instance; allowed: .*model class"):
        sgl.gen("x", json_schema=Person(name="Ada"))


@pytest.mark.parametrize("schema", [5, [1, 2], object()])
def test_gen_refuses_other_objects_by_name(schema):
    with pytest.raises(TypeError, match=rf"json_schema=.* \({type(schema).__name__}\) is invalid"):
        sgl.gen("x", json_schema=schema)


def test_gen_takes_booleans_as_the_runtime_does():
    assert _sent(True) is True and _sent("true") is True
    for schema in (False, "false"):
        with pytest.raises(ValueError, match="json_schema at # is false"):
            sgl.gen("x", json_schema=schema)


@pytest.mark.parametrize("text,found", [('"x"', "a JSON string"), ('"{\\"type\\": \\"object\\"}"', "encoded twice")])
def test_gen_refuses_schema_text_that_is_not_a_schema(text, found):
    with pytest.raises(ValueError, match=found):
        sgl.gen("x", json_schema=text)
