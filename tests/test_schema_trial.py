"""JSON Schemas the corpus does not hold (tests/schema_trial_cases.py: pydantic and OpenAI
strict outputs, SchemaStore copies, JSON-Schema-Test-Suite-style edge cases, the draft
metaschemas) through ``SamplingParams.constraint()`` on every backend: each compiles or
is refused with a ``RequestError`` that names where; what compiles admits only values
``jsonschema`` accepts (formats checked). Then the bugs this sweep found, one test each."""

from __future__ import annotations

import json
import pathlib
import re

import jsonschema
import pytest

from plait.errors import RequestError
from plait.runtime.sampling_params import SamplingParams
from regex_sampling import sample
from schema_trial_cases import CASES
from test_llguidance import compiled, grammars, random_output, tokenizer, vocab  # noqa: F401 (fixtures)

BACKENDS = ("auto", "llguidance", "outlines")


def metaschemas() -> list[tuple[str, str, object]]:
    import jsonschema_specifications

    root = pathlib.Path(jsonschema_specifications.__file__).parent / "schemas"
    return [(f"meta-{d}", "jsonschema_specifications", json.loads((root / d / "metaschema.json").read_text()))
            for d in ("draft3", "draft4", "draft6", "draft7", "draft201909", "draft202012")]


ALL = CASES + metaschemas()


def constraint(schema: object, backend: str):
    return SamplingParams.from_dict({"json_schema": schema, "grammar_backend": backend}).constraint()


def validator(schema: object):
    """``jsonschema``'s validator of ``schema``, formats checked, with ``pattern`` read by
    the ``regex`` module where it holds a Unicode property class (``\\p{L}``: ECMA-262,
    the dialect JSON Schema names, reads it; Python's ``re`` does not)."""
    import regex

    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    plain = cls.VALIDATORS["pattern"]

    def pattern(v, patrn, instance, s):
        if not re.search(r"\\[pP]\{", patrn):
            yield from plain(v, patrn, instance, s)
        elif v.is_type(instance, "string") and not regex.search(patrn, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    cls = jsonschema.validators.extend(cls, {"pattern": pattern})
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def assert_valid(schema: object, texts: list[str]) -> None:
    v = validator(schema)
    for text in texts:
        errors = list(v.iter_errors(json.loads(text)))
        assert not errors, (text, errors[0].message)


def case(name: str) -> object:
    return next(s for n, _, s in CASES if n == name)


def outputs(grammars, vocab, c, n: int, cap: int = 30, limit: int = 300) -> list[str]:  # noqa: F811
    """``n`` outputs the compiled constraint ``c`` admits: drawn from the regex's parse
    tree (outlines) or random walks of llguidance's matcher over SmolLM2's tokens (a
    walk closes values after ``cap`` tokens; one that does not end in ``limit`` is dropped)."""
    if c.backend == "outlines":
        texts = sample(c.grammar, n, seed=3)
        assert all(re.fullmatch(c.grammar, t) for t in texts)
        return texts
    fut = grammars.request(c)
    while not fut.done:
        grammars.wait(0.2)
    assert fut.error is None, fut.error
    texts = []
    for seed in range(n):
        m = grammars.matcher(fut, c, jump_forward=False, heal=False)
        m.start([1])
        out = random_output(m, vocab, seed, cap=cap, limit=limit)
        if out is not None:
            texts.append(out.decode())
    return texts


# -- the sweep -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name, source, schema", ALL, ids=[c[0] for c in ALL])
def test_trial_schema_compiles_soundly_or_is_refused_by_place(name, source, schema, grammars, vocab):  # noqa: F811
    walked: set[tuple[str, str]] = set()
    for backend in BACKENDS:
        try:
            c = constraint(schema, backend)
        except RequestError as e:
            assert e.param == "json_schema"
            # the keyword and where, or a limit of the whole schema
            # (llguidance names some places itself: "while processing json-schema:///#/$defs/b")
            where = r"at #|processing json-schema:///#|characters|expands to more|nested too deeply|no finite value for: '#"
            assert re.search(where, str(e)), (backend, str(e))
            continue
        if (c.backend, c.grammar) not in walked:  # auto gives what one of the others gives
            walked.add((c.backend, c.grammar))
            assert_valid(schema, outputs(grammars, vocab, c, 2))


# -- the bugs found, each fixed --------------------------------------------------------------------
def test_llguidance_refuses_integer_bounds_it_would_move():
    # llguidance reads bounds as doubles within the 64-bit integers: minimum 2**64 - 16
    # became 2**63 - 1 and admitted 9223372036854775807; 2**53 + 1 became 2**53
    for schema, keyword in (({"type": "integer", "minimum": 2**64 - 16, "maximum": 2**64 - 1}, "minimum"),
                            ({"type": "integer", "minimum": 2**53 + 1}, "minimum"),
                            ({"type": "integer", "exclusiveMaximum": -(2**53) - 1}, "exclusiveMaximum")):
        with pytest.raises(RequestError, match=rf"{keyword}: .* at # is not supported by the llguidance"):
            constraint(schema, "llguidance")
        c = constraint(schema, "auto")  # the regex translation keeps the exact range
        assert c.backend == "outlines"
        assert_valid(schema, sample(c.grammar, 20, seed=1))
    # bounds llguidance reads exactly, or moves inward, still compile there
    for schema in ({"type": "integer", "minimum": 5, "maximum": 2**53}, {"type": "integer", "maximum": 1e300},
                   {"type": "number", "minimum": 0.1, "maximum": 2.5}):
        assert constraint(schema, "llguidance").backend == "llguidance"


def test_number_bounds_a_float_does_not_hold_are_refused_on_both():
    # '9223372036854775807.000000000000' is within maximum 2**63 - 1 as text, but parses to
    # the float 2**63, past it: the regex translation admitted it
    schema = {"type": "number", "maximum": 2**63 - 1}
    with pytest.raises(RequestError, match=r"'maximum' at # is not supported for 'number' \(9223372036854775807\)"):
        constraint(schema, "auto")
    exact = {"type": "number", "minimum": -(2**63), "maximum": 2**63}  # floats hold these
    assert_valid(exact, sample(constraint(exact, "outlines").grammar, 40, seed=5))


def test_a_ref_inside_a_nested_id_is_not_read_against_the_root(grammars, vocab):  # noqa: F811
    # '#/$defs/inner' inside foo's own $id names foo's $defs (a string), not the root's
    # (an integer): the regex translation wrote integers, which jsonschema rejects (then
    # it refused the nested $id; since round 7 it resolves it as jsonschema does)
    schema = {**case("ts-nested-id-scope"), "type": "object"}
    for backend in ("outlines", "auto"):
        c = constraint(schema, backend)
        texts = outputs(grammars, vocab, c, 6)
        assert texts and all(isinstance(json.loads(t)["foo"], str) for t in texts)
        assert_valid(schema, texts)


def test_a_pointer_is_percent_decoded_before_it_is_split():
    # '%2F' decodes to '/', a separator (RFC 6901 over RFC 3986, as jsonschema reads it):
    # '#/definitions/c%2Fd' points nowhere, it does not name the definition 'c/d'
    schema = {"definitions": {"c/d": {"type": "integer"}}, "properties": {"x": {"$ref": "#/definitions/c%2Fd"}}}
    with pytest.raises(RequestError, match=r"points nowhere: '#/definitions/c%2Fd'"):
        constraint(schema, "outlines")
    escaped = {"definitions": {"c/d": {"type": "integer"}, "p%q": {"type": "boolean"}},
               "properties": {"x": {"$ref": "#/definitions/c~1d"}, "y": {"$ref": "#/definitions/p%25q"}}}
    c = constraint(escaped, "outlines")
    assert_valid(escaped, sample(c.grammar, 20, seed=2))


def test_pydantic_recursive_model_with_default_null_compiles_on_the_regex_path():
    # Optional["Node"] = None is anyOf [$ref, null] beside 'default': merging the branch
    # with the annotation inlined the $ref past the recursion count (RecursionError,
    # reported as 'nested too deeply' for a 353-character schema)
    schema = case("pyd-Node")
    c = constraint(schema, "outlines")
    texts = sample(c.grammar, 30, seed=4)
    assert any('"parent":{' in t for t in texts)  # the recursion is unrolled, then ended
    assert_valid(schema, texts)


def test_unique_items_false_compiles_on_llguidance():
    schema = {"type": "array", "items": {"type": "string"}, "uniqueItems": False}
    assert constraint(schema, "llguidance").backend == "llguidance"
    assert constraint(schema, "auto").backend == "llguidance"


def test_llguidance_compile_errors_name_the_place():
    cases = [({"type": "object", "properties": {"a": {"type": "object", "propertyNames": {"maxLength": 3}}}},
              r"Unimplemented keys: \[\"propertyNames\"\] \(first at #/properties/a\)"),
             ({"type": "object", "properties": {"x": {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
                                                      "minProperties": 2, "additionalProperties": False}}},
              r"min/maxProperties .* \(first at #/properties/x\)"),
             ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"],
               "additionalProperties": False},
              r"'zz' is unsatisfiable \(first at #\)")]
    for schema, words in cases:
        with pytest.raises(RequestError, match=words):
            constraint(schema, "llguidance")
