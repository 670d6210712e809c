"""Round 7 of the schema probes: references as JSON Schema resolves them, and schemas as
tools write them (SchemaStore, GitHub workflows, OpenAPI 3.1 documents, typescript-json-
schema, Vercel AI SDK / LangChain tools), each through ``SamplingParams.constraint()`` on
``auto`` and on each backend, outputs checked with ``jsonschema`` against the original
schema. What this probe found, one test each:

- the regex translation refused a ``$ref`` to a plain-name fragment (``$anchor``, a
  draft-6/7 ``$id: "#name"``) and every ``$ref`` under a nested ``$id`` (``"a.json"``
  resolved against the root's ``https://x/root``, ``#/$defs/b`` inside it naming *its*
  ``$defs``): a schema llguidance refuses too (a ``multipleOf: 0.5``) was a 400;
- llguidance misread a ``pattern`` with a place only U+007F fits: ``a\\x7fb`` admitted
  ``"ab"`` (which ``jsonschema`` rejects), ``^\\x7f$`` compiled to a grammar with no output
  (a failure after admission, where ``auto`` could have used the regex translation), a
  ``patternProperties`` key ``^x\\x7f$`` wrote the key ``"x"``;
- a ``$ref`` into a place outside the subschema keywords (an OpenAPI document's
  ``#/components/schemas/...``) reached a subschema none of llguidance's rewrites and
  refusals looked at: its own ``date`` admitted 2021-02-29, a ``const`` lost its control
  character, a listed integer past a float was rounded; and llguidance refused pointers
  that are not URI text (typescript-json-schema's ``#/definitions/Record<string,number>``,
  non-ASCII names) as "Invalid URI reference";
- llguidance counted a free-form key written twice toward ``minProperties``:
  ``{"x":1,"x":2}`` met ``minProperties: 2``, but JSON parsers read one property;
- ``maxLength: 9007199254740991`` (``Number.MAX_SAFE_INTEGER``) failed llguidance's regex
  parser ("decimal literal invalid"), and on the regex path slipped past the counted-
  repetition guard (it read at most 10 digits): the build failed after admission saying
  "repetition bounds must be ordered";
- a chain of ``$ref``s 1000 object levels deep (each level within the document's depth
  limit) crashed the process in llguidance's compiler (a segmentation fault: the server
  with it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from plait.errors import RequestError
from plait.runtime.constrained.worker import counted_repetition_too_large
from test_llguidance import engine, grammars, tokenizer, vocab  # noqa: F401 (fixtures)
from test_schema_probe16 import admitted, constraint, validator
from test_schema_probe18 import BACKENDS, D7, assert_sound

D4 = "http://json-schema.org/draft-04/schema#"


# -- plain-name fragments and nested $id on the regex path ------------------------------------------
ANCHORED = {  # llguidance refuses the decimal step: auto needs the regex translation
    "$defs": {"half": {"$anchor": "half", "type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 4}},
    "type": "object", "properties": {"x": {"$ref": "#half"}}, "required": ["x"], "additionalProperties": False,
}
NESTED_ID = {  # 'a.json' is https://x/a.json; '#/$defs/b' inside it names a.json's b (a string)
    "$id": "https://x/root", "type": "object", "required": ["v"], "additionalProperties": False,
    "$defs": {"b": {"type": "integer"},
              "a": {"$id": "a.json", "$defs": {"b": {"type": "string", "maxLength": 3}}, "$ref": "#/$defs/b"}},
    "properties": {"v": {"$ref": "a.json"}},
}
DRAFT7_NAME = {"$schema": D7, "definitions": {"n": {"$id": "#small", "type": "integer", "minimum": 1, "maximum": 9}},
               "type": "object", "properties": {"n": {"$ref": "#small"}}, "required": ["n"],
               "additionalProperties": False}
DRAFT4_ID = {"$schema": D4, "id": "http://x/root.json", "$ref": "sub/a.json",
             "definitions": {"b": {"enum": ["root"]},
                             "a": {"id": "sub/a.json", "type": "object", "required": ["v"], "additionalProperties": False,
                                   "properties": {"v": {"$ref": "#/definitions/b"}},
                                   "definitions": {"b": {"enum": ["in-a"]}}}}}


@pytest.mark.parametrize("schema", [ANCHORED, NESTED_ID, DRAFT7_NAME, DRAFT4_ID],
                         ids=["anchor", "nested-id", "draft7-name", "draft4-id"])
def test_anchors_and_nested_ids_resolve_on_the_regex_path(grammars, vocab, schema):  # noqa: F811
    assert_sound(grammars, vocab, schema, backends=("outlines", "auto"))
    if schema is ANCHORED:
        assert constraint(schema, "auto").backend == "outlines"
        assert admitted(grammars, vocab, schema, "auto", '{"x":1.5}')
        assert not admitted(grammars, vocab, schema, "auto", '{"x":1.25}')
    if schema is NESTED_ID:
        for backend in BACKENDS:
            assert admitted(grammars, vocab, schema, backend, '{"v":"ab"}'), backend
            assert not admitted(grammars, vocab, schema, backend, '{"v":7}'), backend
    if schema is DRAFT4_ID:
        assert admitted(grammars, vocab, schema, "outlines", '{"v":"in-a"}')
        assert not admitted(grammars, vocab, schema, "outlines", '{"v":"root"}')


def test_an_anchor_no_subschema_has_is_a_400_naming_it():
    schema = {"$defs": {"a": {"$anchor": "foo", "type": "integer"}}, "$ref": "#bar"}
    with pytest.raises(RequestError, match=r"'\$ref' at # points nowhere: '#bar' \(no '\$anchor'"):
        constraint(schema, "outlines")
    with pytest.raises(RequestError, match=r"Anchor 'bar' does not exist \(first at #\)"):
        constraint(schema, "llguidance")


# -- U+007F in patterns on llguidance --------------------------------------------------------------
@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "string", "pattern": "^a\\x7fb$"}, '"a\x7fb"', '"ab"'),
    ({"type": "string", "pattern": "^[\\x7f]{2}$"}, '"\x7f\x7f"', '""'),
    ({"type": "object", "patternProperties": {"^x\\x7f$": {"type": "integer"}}, "additionalProperties": False,
      "minProperties": 1}, '{"x\x7f":1}', '{"x":1}'),
])
def test_a_pattern_place_only_delete_fits_goes_to_the_regex_translation(grammars, vocab, schema, good, bad):  # noqa: F811
    v = validator(schema)
    assert v.is_valid(json.loads(good)) and not v.is_valid(json.loads(bad))
    with pytest.raises(RequestError, match=r"(pattern|patternProperties) at #: '.*x7f.*' has a place only U\+007F"):
        constraint(schema, "llguidance")
    assert constraint(schema, "auto").backend == "outlines"
    assert admitted(grammars, vocab, schema, "auto", good)
    assert not admitted(grammars, vocab, schema, "auto", bad)


def test_a_class_with_delete_among_others_stays_on_llguidance(grammars, vocab):  # noqa: F811
    schema = {"type": "string", "pattern": "^k[a\\x7f]$"}  # llguidance writes "ka": a narrowing
    assert constraint(schema, "auto").backend == "llguidance"
    assert admitted(grammars, vocab, schema, "auto", '"ka"')
    assert not admitted(grammars, vocab, schema, "auto", '"k"')


# -- $refs into OpenAPI components -------------------------------------------------------------------
def components(target: object, name: str = "X") -> dict:
    return {"$ref": f"#/components/schemas/{name}", "components": {"schemas": {name: target}}}


def test_a_ref_into_components_gets_the_llguidance_rewrites(grammars, vocab):  # noqa: F811
    dated = components({"type": "string", "format": "date"})
    assert not validator(dated).is_valid("2021-02-29")
    for backend in BACKENDS:
        assert not admitted(grammars, vocab, dated, backend, '"2021-02-29"'), backend
        assert admitted(grammars, vocab, dated, backend, '"2021-03-01"'), backend
    for target, words in [({"const": "a\u0001b"}, "const at #/components/schemas/X holds the control character"),
                          ({"enum": [12345678901234567891]}, "enum at #/components/schemas/X holds the integer")]:
        schema = components(target)
        with pytest.raises(RequestError, match=re.escape(words)):
            constraint(schema, "llguidance")
        assert constraint(schema, "auto").backend == "outlines"
    assert not admitted(grammars, vocab, components({"const": "a\u0001b"}), "auto", '"ab"')


OPENAPI = {  # an OpenAPI 3.1 document as a tool's parameters: $ref chains through components
    "$ref": "#/components/schemas/NewPet",
    "components": {"schemas": {
        "NewPet": {"allOf": [{"$ref": "#/components/schemas/PetBase"},
                             {"type": "object", "required": ["tag"], "properties": {"tag": {"$ref": "#/components/schemas/Tag"}}}]},
        "PetBase": {"type": "object", "required": ["name"],
                    "properties": {"name": {"type": "string", "maxLength": 6}, "status": {"$ref": "#/components/schemas/Status"}}},
        "Status": {"type": "string", "enum": ["available", "pending", "sold"]},
        "Tag": {"oneOf": [{"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 1, "maximum": 99}]},
    }},
}
TS_JSON_SCHEMA = {  # typescript-json-schema: generic instantiations name their definitions
    "$schema": D7, "$ref": "#/definitions/Order",
    "definitions": {
        "Order": {"type": "object", "additionalProperties": False, "required": ["id", "meta"],
                  "properties": {"id": {"type": "string", "maxLength": 5}, "meta": {"$ref": "#/definitions/Record<string,number>"},
                                 "état": {"$ref": "#/definitions/État"}}},
        "Record<string,number>": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 2},
        "État": {"enum": ["ouvert", "fermé"]},
    },
}


@pytest.mark.parametrize("schema", [OPENAPI, TS_JSON_SCHEMA], ids=["openapi", "typescript-json-schema"])
def test_tool_documents_compile_on_llguidance_and_stay_sound(grammars, vocab, schema):  # noqa: F811
    assert constraint(schema, "auto").backend == "llguidance"
    assert_sound(grammars, vocab, schema)


# -- minProperties beside free-form keys on llguidance -----------------------------------------------
@pytest.mark.parametrize("schema, twice", [
    ({"type": "object", "patternProperties": {"^x$": {"type": "integer"}}, "additionalProperties": False,
      "minProperties": 2}, '{"x":1,"x":2}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2, "maxProperties": 3},
     '{"b":1,"b":2}'),
    ({"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}},
      "additionalProperties": {"type": "integer"}, "minProperties": 3}, '{"a":1,"b":1,"b":2}'),
])
def test_min_properties_is_not_met_by_a_key_written_twice(grammars, vocab, schema, twice):  # noqa: F811
    assert not validator(schema).is_valid(json.loads(twice))
    with pytest.raises(RequestError, match=r"minProperties: [23] at # is not supported by the llguidance backend "
                                           r"beside free-form keys"):
        constraint(schema, "llguidance")
    with pytest.raises(RequestError):  # the regex translation writes no key twice toward it either
        constraint(schema, "auto")
    one_more = {**schema, "minProperties": schema["minProperties"] - 1}  # one free-form key needed: cannot repeat
    if "required" in schema:
        assert_sound(grammars, vocab, one_more, backends=("llguidance",))


def test_min_properties_past_the_listed_ones_says_why_on_the_regex_path():
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}},
              "additionalProperties": {"type": "integer"}, "minProperties": 2}
    assert validator(schema).is_valid({"a": 1, "b": 2})  # not unsatisfiable: the regex writes only listed keys
    with pytest.raises(RequestError, match=r"writes only the 1 listed properties here"):
        constraint(schema, "outlines")
    assert constraint(schema, "auto").backend == "llguidance"


# -- lengths past 32 bits --------------------------------------------------------------------------
def test_a_max_length_past_32_bits_compiles_and_a_min_length_is_a_400(grammars, vocab):  # noqa: F811
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 2**53 - 1}}, "required": ["s"]}
    for backend in ("auto", "llguidance"):
        assert constraint(schema, backend).backend == "llguidance"
        assert admitted(grammars, vocab, schema, backend, '{"s":"abc"}'), backend
    # the regex path reads a bound past u32 as none (no output reaches it; test_schema_probe20)
    assert constraint(schema, "outlines").backend == "outlines"
    assert admitted(grammars, vocab, schema, "outlines", '{"s":"abc"}')
    assert counted_repetition_too_large("a{12345678901}") is not None
    with pytest.raises(RequestError, match=r"minLength: 9007199254740991 at #/properties/s is past the lengths the "
                                           r"llguidance backend reads; allowed: at most 4294967295"):
        constraint({**schema, "properties": {"s": {"type": "string", "minLength": 2**53 - 1}}}, "llguidance")


# -- a $ref chain past llguidance's native stack ---------------------------------------------------
CHAIN = """
import json, sys
from plait.errors import RequestError
from plait.runtime.sampling_params import SamplingParams
n = 1000
schema = {"$defs": {f"a{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/a{i + 1}"}}} for i in range(n)},
          "$ref": "#/$defs/a0"}
schema["$defs"][f"a{n}"] = {"type": "integer"}
try:
    SamplingParams.from_dict({"json_schema": schema, "grammar_backend": sys.argv[1]}).constraint()
    print("compiled")
except RequestError as e:
    print(e.status, e.message)
"""


@pytest.mark.parametrize("backend", ["llguidance", "auto"])
def test_a_ref_chain_past_the_native_stack_is_a_400_not_a_crash(backend):
    # in a child process: the crash this guards against takes the process with it
    out = subprocess.run([sys.executable, "-c", CHAIN, backend], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("400 "), out.stdout
    assert re.search(r"nests more than 400 subschemas deep with its \$refs expanded \(past the limit at "
                     r"#/\$defs/a\d+/properties/x\)", out.stdout), out.stdout


# -- generation on a tiny model: finished outputs validate -----------------------------------------
GENERATED = [NESTED_ID, DRAFT7_NAME, OPENAPI, TS_JSON_SCHEMA, {"type": "string", "pattern": "^a\\x7fb[0-9]$"}]


def test_tiny_model_generations_validate_against_the_original_schemas(engine):  # noqa: F811
    prompts, params = [], []
    for schema in GENERATED:
        for seed in (1, 2):
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
