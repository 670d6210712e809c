"""Constraints with no finite output (runtime/constrained/finite.py) are refused before
decoding; every constraint with a finite output still compiles.

The reference for "has a finite output" is twofold: an instance the test writes by hand
that ``jsonschema`` (or the grammar, by llguidance's own matcher) accepts, for the
constraints that must be kept; and, for the refused ones, llguidance's matcher itself,
walked token by token at random for a few hundred tokens without ever reaching an
accepting state (what decoding would have done).
"""

from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher, grammar_from

from plait.errors import RequestError
from plait.runtime.constrained.finite import Productive, lark_unending, schema_unending
from plait.runtime.constrained.llguidance_backend import build_tokenizer, parser_limits
from plait.runtime.constrained.vocab import TokenVocab

EOS = [0]

NODE = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#"}}}
UNENDING_SCHEMAS = {
    "linked_list_required_next": {**NODE, "required": ["value", "next"]},
    "array_of_itself_min_one": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "mutual_defs": {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                              "b": {"type": "array", "prefixItems": [{"$ref": "#/$defs/a"}], "minItems": 1}},
                    "$ref": "#/$defs/a"},
    "every_branch_recurses": {"anyOf": [{"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
                                        {"type": "array", "items": {"$ref": "#"}, "minItems": 2}]},
    "all_of_itself": {"type": "object", "allOf": [{"$ref": "#/$defs/n"}],
                      "$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#"}}, "required": ["k"]}}},
    "contains_itself": {"type": "array", "contains": {"$ref": "#"}},
    # allOf parts apply to the same instance: required names, types and item counts
    # combine with the properties and items of the schema beside them
    "all_of_required": {"type": "object", "properties": {"next": {"$ref": "#"}}, "allOf": [{"required": ["next"]}]},
    "all_of_type_and_required": {"properties": {"next": {"$ref": "#"}},
                                 "allOf": [{"type": "object"}, {"required": ["next"]}]},
    "all_of_property_in_a_part": {"type": "object", "required": ["next"],
                                  "allOf": [{"properties": {"next": {"$ref": "#"}}}]},
    "ref_beside_required": {"$defs": {"base": {"type": "object", "properties": {"child": {"$ref": "#/$defs/derived"}}},
                                      "derived": {"$ref": "#/$defs/base", "required": ["child"]}},
                            "$ref": "#/$defs/derived"},
    "all_of_min_items": {"type": "array", "allOf": [{"minItems": 1}, {"items": {"$ref": "#"}}]},
    "all_of_prefix_items": {"allOf": [{"type": "array", "prefixItems": [{"$ref": "#"}]}, {"minItems": 2}]},
    # the property's value: an object (the schema's properties) and the part's required
    # recursion (the part's properties): neither alone is unending
    "property_schemas_meet": {"required": ["n"], "properties": {"n": {"type": "object"}},
                              "allOf": [{"type": "object", "properties": {"n": {"properties": {"n": {"$ref": "#"}},
                                                                                 "required": ["n"]}}}]},
    "dependent_required_recursion": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#"}},
                                     "required": ["v"], "dependentRequired": {"v": ["next"]}},
    "any_of_required_beside_properties": {"type": "object", "properties": {"l": {"$ref": "#"}, "r": {"$ref": "#"}},
                                          "anyOf": [{"required": ["l"]}, {"required": ["r"]}]},
}
# each with a finite instance written by hand
FINITE_SCHEMAS = {
    "linked_list_optional_next": ({**NODE, "required": ["value"]}, {"value": 1, "next": {"value": 2}}),
    "nullable_next": ({"type": ["object", "null"], "properties": {"next": {"$ref": "#"}}, "required": ["next"]},
                      {"next": None}),
    "any_of_with_an_end": ({"anyOf": [{"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},
                                      {"type": "string"}]}, {"x": "end"}),
    "array_may_be_empty": ({"type": "array", "items": {"$ref": "#"}}, [[], [[]]]),
    "tree": ({"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}},
              "required": ["children"]}, {"children": [{"children": []}]}),
    "untyped_object_keywords": ({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}, 3),
    "enum_beside_the_recursion": ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"],
                                   "enum": [{"a": 1}]}, None),  # no instance: the enum is the compiler's to check
    "contains_none_needed": ({"type": "array", "contains": {"$ref": "#"}, "minContains": 0}, []),
    "external_ref": ({"type": "object", "properties": {"a": {"$ref": "other.json"}}, "required": ["a"]}, None),
    "dangling_ref": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}, None),
    # no value at all but no recursion either: left to the compiler, which names the keyword
    "false_item_needed": ({"type": "array", "items": False, "minItems": 1}, None),
    "ref_to_false": ({"$ref": "#/$defs/b", "$defs": {"b": False}}, None),
    "required_ref_to_false": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/no"}}, "required": ["a"],
                               "$defs": {"no": False}}, None),
    "types_no_value_has": ({"allOf": [{"type": "integer"}, {"type": "string"}]}, None),
    # allOf read together, with an end
    "all_of_required_or_null": ({"type": ["object", "null"], "properties": {"next": {"$ref": "#"}},
                                 "allOf": [{"required": ["next"]}]}, {"next": {"next": None}}),
    "all_of_required_nullable_value": ({"type": "object",
                                        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
                                        "allOf": [{"required": ["next"]}]}, {"next": {"next": None}}),
    "all_of_min_items_zero": ({"type": "array", "allOf": [{"minItems": 0}, {"items": {"$ref": "#"}}]}, [[], [[]]]),
    "all_of_prefix_shorter_than_min": ({"type": "array", "allOf": [{"prefixItems": [{"type": "integer"}]},
                                                                   {"minItems": 2}], "items": {"type": ["integer", "string"]}},
                                       [1, "a"]),
    "all_of_integer_within_number": ({"allOf": [{"type": ["number", "object"]}, {"type": ["integer", "object"]}],
                                      "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, 3),
    "all_of_required_in_an_other_property": ({"type": "object", "properties": {"next": {"$ref": "#"}},
                                              "allOf": [{"properties": {"next": {"required": ["x"]}}}]},
                                             {"next": {"x": 1}}),
    "dependent_required_on_an_optional_name": ({"type": "object", "properties": {"next": {"$ref": "#"}},
                                                "dependentRequired": {"v": ["next"]}}, {}),
    "draft7_dependencies_with_an_end": ({"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["v"],
                                         "dependencies": {"v": ["w"]}}, {"v": 1, "w": 2}),
    "any_of_a_branch_without_recursion": ({"type": "object", "properties": {"l": {"$ref": "#"}},
                                           "anyOf": [{"required": ["l"]}, {"required": ["x"]}]}, {"x": 1}),
    "any_of_true_branch": ({"type": "object", "properties": {"l": {"$ref": "#"}},
                            "anyOf": [True, {"required": ["l"]}]}, {}),
    "two_lists_of_branches": ({"type": "object", "properties": {"l": {"$ref": "#"}},
                               "anyOf": [{"required": ["l"]}, {}], "oneOf": [{"required": ["l"]}, {"required": ["m"]}]},
                              {"m": 1}),
    "pydantic_v1_all_of_ref": ({"$ref": "#/definitions/Node", "definitions": {"Node": {
        "title": "Node", "type": "object", "properties": {
            "next": {"title": "Next", "description": "the rest", "allOf": [{"$ref": "#/definitions/Node"}]}}}}},
                               {"next": {}}),
}

UNENDING_GRAMMARS = {
    "self_only": 'root ::= "x" root',
    "chain_to_self": 'root ::= a\na ::= "(" b ")"\nb ::= a',
    "plus_of_unending": 'root ::= x+\nx ::= "y" x',
    "every_alternative": 'root ::= "a" b | "c" b\nb ::= b "x"',
    "lark_start": 'start: "a" start | "(" start ")"',
}
FINITE_GRAMMARS = {
    "alternative_ends": ('root ::= "x" root | "y"', "xxy"),
    "star": ('root ::= "x"*', ""),
    "optional_recursion": ('root ::= ("x" root)?', "xx"),
    "unending_rule_not_needed": ('root ::= "a" | "b" loop\nloop ::= "z" loop', "a"),
    "lark_left_recursion": ('start: "a" | start "b"', "abb"),
    "lark_json": ('start: "v=" obj\nobj: %json { "type": "integer" }', "v=3"),
    "lark_terminals": ('start: WORD (" " WORD)*\nWORD: /[a-z]+/', "ab cd"),
}


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return build_tokenizer(TokenVocab.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), EOS, 49152))


def never_accepts(grammar: str, llg_tokenizer, steps: int = 300) -> bool:
    """llguidance's own matcher, fed random allowed tokens: never in an accepting state."""
    for seed in range(3):
        m = LLMatcher(llg_tokenizer, grammar, log_level=0, limits=parser_limits())
        rng = random.Random(seed)
        for _ in range(steps):
            if m.is_accepting():
                return False
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            ids = [int(i) for i in np.flatnonzero(bits) if i not in EOS]
            if not ids or not m.consume_token(rng.choice(ids)):
                break  # a dead end, or the parser's limits (deep nesting): no accepting state either
    return True


@pytest.mark.parametrize("name", sorted(UNENDING_SCHEMAS))
def test_schemas_without_a_finite_value_are_found(name, llg_tokenizer):
    schema = UNENDING_SCHEMAS[name]
    why = schema_unending(schema)
    assert why is not None and "goes on forever" in why and "'#" in why, why
    assert never_accepts(LLMatcher.grammar_from_json_schema(json.dumps(schema)), llg_tokenizer)


@pytest.mark.parametrize("name", sorted(FINITE_SCHEMAS))
def test_schemas_with_a_finite_value_are_kept(name):
    schema, instance = FINITE_SCHEMAS[name]
    assert schema_unending(schema) is None
    if instance is not None:
        jsonschema.validate(instance, schema)


@pytest.mark.parametrize("name", sorted(UNENDING_GRAMMARS))
def test_grammars_without_a_finite_text_are_found(name, llg_tokenizer):
    grammar = grammar_from("ebnf", UNENDING_GRAMMARS[name])
    why = lark_unending(grammar)
    assert why is not None and "no finite expansion of" in why and "start" in why, why
    assert never_accepts(grammar, llg_tokenizer)


@pytest.mark.parametrize("name", sorted(FINITE_GRAMMARS))
def test_grammars_with_a_finite_text_are_kept(name, llg_tokenizer):
    text, sample = FINITE_GRAMMARS[name]
    grammar = grammar_from("ebnf", text)
    assert lark_unending(grammar) is None
    m = LLMatcher(llg_tokenizer, grammar, log_level=0, limits=parser_limits())
    assert all(m.consume_token(b) for b in llg_tokenizer.tokenize_str(sample)) and m.is_accepting()


def test_a_long_ref_chain_is_solved_in_one_pass():
    # 3000 definitions, each requiring the next; the last one ends (or, second case, loops
    # back): a fixpoint iterated definition by definition would take 3000 rounds
    n = 3000
    defs = {f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}, "required": ["n"]}
            for i in range(n)}
    assert schema_unending({"$defs": {**defs, f"d{n}": {"type": "string"}}, "$ref": "#/$defs/d0"}) is None
    looped = {"$defs": {**defs, f"d{n}": {"$ref": "#/$defs/d0"}}, "$ref": "#/$defs/d0"}
    assert "goes on forever" in schema_unending(looped)


def test_conjunctions_past_the_limit_count_as_finite(monkeypatch):
    # a chain of $ref-only definitions, each a required property's schema: each property's
    # conjunction holds the rest of the chain (quadratic); past the limit nothing is refused
    from plait.runtime.constrained import finite

    n = 60
    defs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "required": ["x"]}
    props = {f"p{i}": {"$ref": f"#/$defs/a{i}"} for i in range(n)}
    schema = {"$defs": defs, "type": "object", "properties": props, "required": list(props)}
    assert "goes on forever" in schema_unending(schema)
    monkeypatch.setattr(finite, "MAX_CONJUNCTS", 1000)
    assert schema_unending(schema) is None


def test_the_and_or_solver_on_a_hand_built_graph():
    g = Productive()
    a, b, c = g.node(True), g.node(False), g.node(True)
    g.kids[a] = [b, g.true]  # a = b and true
    g.kids[b] = [a, c]  # b = a or c
    g.kids[c] = [g.true, g.true]  # c = true
    loop_and, loop_or = g.node(True), g.node(False)
    g.kids[loop_and] = [loop_or]
    g.kids[loop_or] = [loop_and, g.false]
    v = g.solve()
    assert v[a] and v[b] and v[c] and v[g.true]
    assert not v[loop_and] and not v[loop_or] and not v[g.false]


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from plait.runtime import Engine

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4) as e:
        yield e
        e.check_invariants()


@pytest.mark.parametrize("params, param", [
    ({"json_schema": UNENDING_SCHEMAS["linked_list_required_next"]}, "json_schema"),
    ({"json_schema": UNENDING_SCHEMAS["array_of_itself_min_one"], "grammar_backend": "llguidance"}, "json_schema"),
    ({"ebnf": UNENDING_GRAMMARS["self_only"]}, "ebnf"),
])
def test_an_unending_constraint_is_a_400_before_decoding(engine, params, param):
    # llguidance compiled these and decoding ran into its limit or an empty mask: a
    # 200 "abort" (or a "length" result with a prefix that can never be completed)
    with pytest.raises(RequestError) as info:
        engine.generate("x", {**params, "max_new_tokens": 8})
    assert info.value.status == 400 and info.value.param == param
    assert "finite" in info.value.message, info.value.message
    ok = engine.generate("Go", {"json_schema": FINITE_SCHEMAS["tree"][0], "max_new_tokens": 8})
    assert ok["meta_info"]["finish_reason"]["type"] in ("stop", "length")


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"allOf": [{"$ref": "#"}]},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"$ref": "#/$defs/a", "$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}},
])
def test_a_reference_loop_with_nothing_else_is_refused(schema):
    """An instance that must satisfy itself before anything else (validators recurse
    forever; llguidance refuses it only after admission, as an error event mid-stream).
    Reading a $ref target together with its referrer made such a loop one conjunction
    with nothing in it, taken as 'any value'; the loop itself now keeps it unending."""
    why = schema_unending(schema)
    assert why is not None and "goes on forever" in why, why


def test_two_references_to_one_target_are_no_loop():
    schema = {"allOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "string"}}}
    assert schema_unending(schema) is None
    jsonschema.validate("x", schema)
