"""Real-world JSON Schemas the authors did not write (pydantic v2 output, OpenAI strict
schemas, draft-4/7 and 2020-12 idioms, hostile inputs) through
``SamplingParams.constraint()``: each compiles to something whose outputs ``jsonschema``
accepts, or is refused with a ``RequestError`` naming the place. Then the bugs this
probe found, one test each."""

from __future__ import annotations

import json

import jsonschema
import pytest

from plait.errors import RequestError
from plait.runtime.constrained import json_schema as js
from plait.runtime.sampling_params import SamplingParams
from regex_sampling import sample


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
