"""Round 8 of the schema probes (real-world schemas: SchemaStore's third-party schemas,
pydantic models, agent tool schemas). What it found, one test each:

- a definition named like a keyword (buildkite's ``#/definitions/common/if``) was folded
  away as an ``if`` without ``then``/``else``, and its ``$ref`` then "pointed nowhere";
- ``$schema: "https://json-schema.org/draft-04/schema#"`` (https, common in the wild) was
  an unknown dialect: read as 2020-12, and llguidance's registry tried to fetch the URI;
- ``additionalItems`` beside a single ``items`` schema was refused, where every draft
  ignores it.
"""

from __future__ import annotations

import pytest

from plait.errors import RequestError

from test_llguidance import engine, grammars, tokenizer, vocab  # noqa: F401 (fixtures)
from test_schema_probe16 import admitted, constraint
from test_schema_probe18 import BACKENDS, assert_sound

BUILDKITE = {  # the shape of buildkite's pipeline schema: definitions grouped under 'common'
    "$schema": "http://json-schema.org/draft-07/schema#",
    "definitions": {"common": {"if": {"type": "string", "maxLength": 5}, "key": {"type": "string", "maxLength": 5}}},
    "type": "object", "properties": {"cond": {"$ref": "#/definitions/common/if"}, "k": {"$ref": "#/definitions/common/key"}},
    "required": ["cond", "k"], "additionalProperties": False,
}


def test_a_definition_named_like_a_keyword_is_not_folded_away(grammars, vocab):  # noqa: F811
    assert_sound(grammars, vocab, BUILDKITE)
    for backend in BACKENDS:
        assert admitted(grammars, vocab, BUILDKITE, backend, '{"cond":"ab","k":"c"}'), backend
        assert not admitted(grammars, vocab, BUILDKITE, backend, '{"cond":"abcdef","k":"c"}'), backend
    # a node that holds referenced definitions still has its own keywords read: a later
    # draft's boolean bound at the root is refused as before (not skipped for the refs)
    bounded = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$defs": {"n": {"type": "integer"}},
               "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}, "minimum": 1, "exclusiveMinimum": True}
    with pytest.raises(RequestError, match="exclusiveMinimum"):
        constraint(bounded, "outlines")
    # a real 'if' without then/else still constrains nothing
    plain = {"type": "object", "properties": {"a": {"if": {"type": "string"}, "type": "integer"}},
             "required": ["a"], "additionalProperties": False}
    assert admitted(grammars, vocab, plain, "outlines", '{"a":3}')


@pytest.mark.parametrize("uri", ["https://json-schema.org/draft-04/schema#", "https://json-schema.org/draft-04/schema",
                                 "http://json-schema.org/draft-04/schema", "HTTP://JSON-SCHEMA.ORG/draft-04/schema#"])
def test_a_draft_named_with_the_other_scheme_is_that_draft(grammars, vocab, uri):  # noqa: F811
    """Draft 4's boolean exclusiveMaximum: read as draft 4 (the bound excluded), not as
    an unknown dialect (2020-12, which refused it, or llguidance fetching the URI)."""
    schema = {"$schema": uri, "type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3, "exclusiveMaximum": True}}}
    for backend in BACKENDS:
        assert admitted(grammars, vocab, schema, backend, '{"n":2}'), backend
        assert not admitted(grammars, vocab, schema, backend, '{"n":3}'), backend


@pytest.mark.parametrize("uri", ["https://json-schema.org/draft-07/schema#", "http://json-schema.org/draft-04/schema#",
                                 "https://json-schema.org/draft/2020-12/schema"])
def test_additional_items_beside_one_items_schema_is_ignored(grammars, vocab, uri):  # noqa: F811
    schema = {"$schema": uri, "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
              "additionalItems": False, "maxItems": 3}
    assert_sound(grammars, vocab, schema)
    for backend in BACKENDS:
        assert admitted(grammars, vocab, schema, backend, "[1,2]"), backend
        assert constraint(schema, backend) is not None


OPENAPI30 = {"type": "object", "required": ["query", "k"], "additionalProperties": False,
             "properties": {"query": {"type": "string", "maxLength": 3},
                            "k": {"type": "integer", "minimum": 1, "maximum": 50, "exclusiveMaximum": True}}}


@pytest.mark.parametrize("schema", [OPENAPI30, {**OPENAPI30, "$schema": "https://json-schema.org/draft-04/schema#"}],
                         ids=["openapi30", "https-draft4"])
def test_a_tools_draft4_bounds_are_read_as_response_format_reads_them(grammars, vocab, schema):  # noqa: F811
    """A tool's parameters with OpenAPI 3.0's boolean bound (LangChain sends it), or
    with draft 4 named over https: the tool check refused them against draft 2020-12's
    metaschema, where response_format read them as draft 4 (docs/constrained.md)."""
    from plait.tool_parsers import check_tools

    (fn,) = check_tools([{"type": "function", "function": {"name": "search", "parameters": schema}}], "tools")
    assert fn["name"] == "search"
    assert admitted(grammars, vocab, schema, "outlines", '{"query":"ab","k":49}')
    assert not admitted(grammars, vocab, schema, "outlines", '{"query":"ab","k":50}')


@pytest.mark.parametrize("pattern, reason", [(r"^\p{Script=Latin}+$", "is not supported"), (r"^(?=a)b$", "look-ahead")])
def test_a_refusal_both_backends_give_alike_is_said_once(pattern, reason):
    """A pydantic model's pattern under auto: both backends refuse it for the same
    reason (plait's own check of the pattern); the 400 said the long explanation twice."""
    import json

    from plait.runtime.sampling_params import SamplingParams

    schema = {"type": "object", "properties": {"c": {"type": "string", "pattern": pattern}}, "required": ["c"]}
    with pytest.raises(RequestError) as e:
        SamplingParams(json_schema=json.dumps(schema)).constraint()
    assert e.value.message.count(reason) == 1 and "#/properties/c" in e.value.message, e.value.message
    # reasons that differ are both kept (the regex translation's, then llguidance's)
    multiple = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.1}}, "required": ["x"]}
    with pytest.raises(RequestError) as e:
        SamplingParams(json_schema=json.dumps(multiple)).constraint()
    assert "not a binary fraction" in e.value.message and "llguidance backend reads multipleOf only" in e.value.message
