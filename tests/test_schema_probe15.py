"""Real-world JSON Schema idioms the earlier sweeps did not hold (tests/data/schemas15/:
MCP server tool inputSchemas, OpenAI structured-output / Agents SDK strict schemas,
LangChain / AutoGen / Anthropic tool parameters, SchemaStore excerpts (package.json,
tsconfig, docker-compose, github-workflow, eslintrc), Kubernetes int-or-string and
quantities, pydantic 2 ``model_json_schema()`` outputs, JSON-Schema-Test-Suite and
2020-12 ``unevaluated*`` idioms), each written small in our own form, through
``SamplingParams.constraint()`` on every backend: each compiles to something whose
outputs ``jsonschema`` accepts, or is refused with a ``RequestError`` naming the keyword
and where. Then the bugs this probe found, one test each, and finished generations of a
tiny model validated against the original schemas."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

from plait.errors import RequestError
from plait.runtime.constrained.json_schema import fold_unevaluated
from plait.runtime.sampling_params import SamplingParams
from test_llguidance import engine, grammars, tokenizer, vocab  # noqa: F401 (fixtures)
from test_schema_trial import outputs as trial_outputs, validator

DATA = pathlib.Path(__file__).parent / "data" / "schemas15"
SCHEMAS = {p.stem: json.loads(p.read_text())["schema"] for p in sorted(DATA.glob("*.json"))}

# refused on every backend, and why: (a word of the keyword or feature, where)
REFUSED = {
    "ts_contains": ("contains", "#"),  # contains with maxItems
    "ts_multipleof_float": ("multipleOf", "#/properties/price"),  # 0.07 / 0.01 != 7 in floats
    # minProperties 2 over free integer properties: llguidance let one key repeat
    # ({"b":1,"b":2}); the regex writes only listed properties (probe round 7)
    "ts_min_properties_open": ("minProperties", "#"),
}


def constraint(schema: object, backend: str):
    return SamplingParams.from_dict({"json_schema": schema, "grammar_backend": backend}).constraint()


def assert_valid(schema: object, texts: list[str]) -> None:
    v = validator(schema)
    for text in texts:
        errors = list(v.iter_errors(json.loads(text)))
        assert not errors, (text, errors[0].message)


def outputs(grammars, vocab, c, n: int) -> list[str]:  # noqa: F811
    """Up to ``n`` texts the compiled constraint ``c`` admits (test_schema_trial's, with
    short walks of llguidance's matcher: one that does not end in 80 tokens is dropped)."""
    return trial_outputs(grammars, vocab, c, n, cap=16, limit=80)


# uniqueItems over strings / numbers (were refused everywhere): compiled without it, the
# matcher keeping the items distinct (plait.runtime.constrained.unique_items); instance
# path of each kept array
UNIQUE_KEPT = {
    "pyd_tuples_sets": ["frozen"],  # set[int]: distinct numbers
    "ss_docker_compose_service": ["services", "*", "environment"],  # distinct strings, under patternProperties
    "ss_tsconfig_target": ["compilerOptions", "lib"],
}


def test_the_collection_is_what_the_sweep_expects():
    assert len(SCHEMAS) >= 40
    assert set(REFUSED) <= set(SCHEMAS) and set(UNIQUE_KEPT) <= set(SCHEMAS)


@pytest.mark.parametrize("name", sorted(UNIQUE_KEPT))
def test_unique_items_over_strings_and_numbers_are_kept_by_the_matcher(name, grammars, vocab):  # noqa: F811
    schema = SCHEMAS[name]
    c = constraint(schema, "auto")
    assert UNIQUE_KEPT[name] in json.loads(c.unique)
    assert "uniqueItems" not in c.grammar  # the grammar has none of them: the matcher keeps them
    if c.backend == "llguidance":  # random walks of the guarded matcher validate against the schema as given
        assert_valid(schema, outputs(grammars, vocab, c, 6))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_compiles_soundly_or_is_refused_by_name(name, grammars, vocab):  # noqa: F811
    schema = SCHEMAS[name]
    if name in REFUSED:
        word, where = REFUSED[name]
        with pytest.raises(RequestError) as e:
            constraint(schema, "auto")
        assert e.value.param == "json_schema"
        assert word in str(e.value) and f"at {where}" in str(e.value), str(e.value)
        return
    auto = constraint(schema, "auto")  # every other one is served by default
    for backend in ("llguidance", "outlines"):  # each backend: sound, or refused by keyword and place
        try:
            c = constraint(schema, backend)
        except RequestError as e:
            assert auto.backend != backend
            assert e.param == "json_schema" and re.search(r"at #|'[A-Za-z$]+'", str(e)), str(e)
            continue
        if backend == auto.backend:
            assert c.grammar == auto.grammar
        if c.unique and backend == "outlines":
            continue  # drawn from the regex alone, without the matcher that keeps the items distinct
        assert_valid(schema, outputs(grammars, vocab, c, 2 if backend == "llguidance" else 6))


# -- unevaluatedProperties / unevaluatedItems (were refused everywhere) ------------------
UNEVALUATED = ["ts_unevaluated_false_plain", "ts_unevaluated_false_allof", "ue_ref_inheritance", "ue_items",
               "ue_oneof_tagged_openapi31", "ue_anyof_tagged", "ue_in_defs_ref"]


@pytest.mark.parametrize("name", UNEVALUATED)
@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_unevaluated_keywords_with_a_fixed_reach_compile_on_both_backends(name, backend, grammars, vocab):  # noqa: F811
    schema = SCHEMAS[name]
    c = constraint(schema, backend)
    texts = outputs(grammars, vocab, c, 3)
    assert texts
    assert_valid(schema, texts)


def test_unevaluated_properties_language_is_the_evaluated_names_only():
    # allOf branches' names are evaluated: a and b are written, anything else is not
    regex = constraint(SCHEMAS["ts_unevaluated_false_allof"], "outlines").grammar
    assert re.fullmatch(regex, '{"a":"x","b":1}') and re.fullmatch(regex, '{"b":2}')
    assert not re.fullmatch(regex, '{"c":1}') and not re.fullmatch(regex, '{"a":"x","b":"y"}')
    # a $ref'd base (inheritance): its properties are evaluated, its rules kept
    regex = constraint(SCHEMAS["ue_ref_inheritance"], "outlines").grammar
    assert re.fullmatch(regex, '{"id":1,"kind":"k","name":"n"}')
    assert not re.fullmatch(regex, '{"name":"n"}')  # Base requires id
    # a tagged oneOf: the branch that validates brings its names, the others do not
    regex = constraint(SCHEMAS["ue_oneof_tagged_openapi31"], "outlines").grammar
    assert re.fullmatch(regex, '{"petType":"dog","barks":3,"name":"x"}')
    assert re.fullmatch(regex, '{"petType":"cat","meows":true,"name":"x"}')
    assert not any(re.fullmatch(regex, t) for t in ('{"petType":"cat","barks":3,"name":"x"}',
                                                    '{"petType":"dog","meows":true,"barks":3,"name":"x"}',
                                                    '{"petType":"dog","barks":3,"meows":true,"name":"x"}'))


def test_unevaluated_keywords_out_of_reach_stay_refused_by_name():
    schema = {"type": "object", "properties": {"k": {"type": "string"}}, "unevaluatedProperties": False,
              "if": {"properties": {"k": {"const": "a"}}}, "then": {"properties": {"x": {"type": "integer"}}}}
    assert fold_unevaluated(schema) is not schema and "unevaluatedProperties" in fold_unevaluated(schema)
    with pytest.raises(RequestError, match=r"'unevaluatedProperties' at # is not supported"):
        constraint(schema, "auto")
    # a property named like the keyword is not the keyword; data values are not schemas
    named = {"type": "object", "properties": {"unevaluatedProperties": {"type": "integer"}},
             "default": {"unevaluatedProperties": False}}
    assert fold_unevaluated(named) == named
    # $refs reaching the same branches over and over: a budget, not 2**40 walks
    defs = {f"D{i}": {"allOf": [{"$ref": f"#/$defs/D{i + 1}"}, {"$ref": f"#/$defs/D{i + 1}"}]} for i in range(40)}
    defs["D40"] = {"properties": {"z": {"type": "string"}}}
    deep = {"$defs": defs, "allOf": [{"$ref": "#/$defs/D0"}], "unevaluatedProperties": False}
    with pytest.raises(RequestError, match="unevaluatedProperties"):
        constraint(deep, "outlines")


# -- the other bugs this probe found -----------------------------------------------------
def test_llguidance_root_properties_beside_an_any_of_listing_more(grammars, vocab):  # noqa: F811
    # the root closed to its own names refused every name the branches list
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
              "anyOf": [{"properties": {"kind": {"const": "a"}, "x": {"type": "string"}}, "required": ["kind"]},
                        {"properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}}, "required": ["kind", "y"]}]}
    texts = outputs(grammars, vocab, constraint(schema, "llguidance"), 8)
    assert texts and all('"kind":' in t and '"id":' in t for t in texts)
    assert_valid(schema, texts)


def test_all_of_many_if_then_on_one_free_string_compiles_on_outlines(grammars, vocab):  # noqa: F811
    # each 'if' false adds a 'not: {const}' to k; two of them "could not be merged",
    # so auto refused 30 conditions (llguidance: schema too large) - now merged to one enum
    schema = {"type": "object", "properties": {"k": {"type": "string"}, "v": {}},
              "allOf": [{"if": {"properties": {"k": {"const": f"c{i}"}}},
                         "then": {"properties": {"v": {"type": "integer", "minimum": i}}}} for i in range(30)]}
    c = constraint(schema, "auto")
    assert c.backend == "outlines"
    regex = c.grammar
    assert re.fullmatch(regex, '{"k":"c7","v":7}') and not re.fullmatch(regex, '{"k":"c7","v":6}')
    assert re.fullmatch(regex, '{"k":"zz","v":"any"}') and not re.fullmatch(regex, '{"k":"c3","v":"s"}')
    assert_valid(schema, outputs(grammars, vocab, c, 8))


def test_many_optional_properties_refused_by_size_before_the_regex_is_built():
    # 1000 optional properties: the outlines layout is quadratic; the size is now known
    # before the strings are built (it ran into the 5 s time limit instead)
    schema = {"type": "object", "properties": {f"field_{i}": {"enum": ["a", "b", "c"]} for i in range(1000)}}
    with pytest.raises(RequestError, match="characters") as e:
        constraint(schema, "outlines")
    assert "longer than" not in str(e.value)
    assert constraint(schema, "auto").backend == "llguidance"
    # the prediction is the built length: a small object still compiles and matches
    small = {"type": "object", "properties": {f"f{i}": {"type": "boolean"} for i in range(6)}, "required": ["f2"]}
    regex = constraint(small, "outlines").grammar
    assert re.fullmatch(regex, '{"f0":true,"f2":false,"f5":true}') and not re.fullmatch(regex, '{"f0":true}')


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_a_unicode_property_class_is_read_as_its_general_category(backend):
    """ECMA-262's ``\\p{...}`` (pydantic writes ``constr(pattern=r"^\\p{L}+$")``; it was a
    400): the explicit class of the category's code points on both backends; a script
    or another property is refused saying which are read."""
    import regex

    schema = {"type": "object", "properties": {"n": {"type": "string", "pattern": "^[\\p{Lu}][\\p{Ll}\\p{M}-]*$"}},
              "required": ["n"], "additionalProperties": False}
    c = constraint(schema, backend)
    assert c.backend == backend
    if backend == "outlines":  # the regex itself: letters of every script, by case
        for name, ok in [("Zoë", True), ("Ωμέγα", True), ("Élodie-ann", True), ("Élodie-Ann", False), ("zoë", False), ("Zo1", False),
                         ("Ж", True), ("日本", False)]:  # Lo is neither Lu nor Ll
            text = json.dumps({"n": name}, ensure_ascii=False, separators=(",", ":"))
            assert bool(regex.fullmatch(c.grammar, text)) == ok, name
    with pytest.raises(RequestError, match=r"at #/properties/n.*\\p\{Script=Latin\} is not supported; allowed: "
                                           r"General_Category"):
        constraint({"type": "object", "properties": {"n": {"type": "string", "pattern": "^\\p{Script=Latin}+$"}}},
                   backend)


# -- generation on a tiny model (real tokenizer): finished outputs validate --------------
GENERATED = ["mcp_fs_edit_file", "oai_strict_nullable_enum", "pyd_discriminated_serialization", "ss_eslintrc_rules",
             "ts_if_then_else_country", "ue_oneof_tagged_openapi31", "ts_unevaluated_false_allof",
             "pyd_task_decimal_intenum", "ts_required_not_in_props_closed"]  # the last: auto falls back to outlines


def test_tiny_model_generations_validate_against_the_original_schemas(engine):  # noqa: F811
    prompts, params = [], []
    for name in GENERATED:
        for seed in (1, 2):
            prompts.append(f"JSON for {name}:")
            params.append({"json_schema": SCHEMAS[name], "temperature": 0.7, "seed": seed, "max_new_tokens": 64})
    outs = engine.generate(prompts, params)
    finished = 0
    for p, o in zip(params, outs):
        kind = o["meta_info"]["finish_reason"]["type"]
        assert kind in ("stop", "length"), o["meta_info"]
        if kind == "stop":
            finished += 1
            assert_valid(p["json_schema"], [o["text"]])
    assert finished >= len(outs) // 3


@pytest.mark.parametrize("pattern, matches, refuses", [
    (r"^\pL+$", "Zoë", "a1"),  # Rust's one-letter form (pydantic's regex reads it)
    (r"^[\p{L&}]+$", "aBǅ", "日"),  # cased letters
    (r"^x\\p{L}$", "x\\p{L}", "xa"),  # an escaped backslash: p{L} is literal text
    (r"^\P{L}+$", "1-2", "1a"),
    (r"^[\p{Nd}_-]+$", "٣_-", "a"),  # a hyphen beside a property class inside a class is literal
    (r"^\p{gc=Lu}\p{Ll}*$", "Ωmega", "ωmega"),
])
def test_unicode_property_spellings_read_as_ecma_and_rust_read_them(pattern, matches, refuses):
    from plait.runtime.constrained.json_schema import ecma_to_python

    python = ecma_to_python(pattern)
    assert re.search(python, matches) and not re.search(python, refuses)
