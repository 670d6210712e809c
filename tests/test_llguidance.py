"""The llguidance backend: the tokenizer adapter, soundness on both backends (random
valid outputs validated by ``jsonschema``, hand-made invalid instances refused by the
matcher), recursive schemas, ``ebnf`` grammars (arithmetic, a tool-call DSL) checked by
parsers written here, ``grammar_backend`` selection, the 400s, and a compile past its
time limit while another request streams."""

from __future__ import annotations

import json
import random
import re
import threading

import jsonschema
import numpy as np
import pytest

from plait.errors import RequestError
from plait.runtime.constrained.backend import Grammars
from plait.runtime.constrained.llguidance_backend import MAX_GRAMMAR_CHARS, LLGuidanceCompiler, build_tokenizer
from plait.runtime.constrained.vocab import TokenVocab
from plait.runtime.sampling_params import SamplingParams
from constrained_cases import REGEXES, SCHEMAS

EOS = (0, 2)

LINKED_LIST = {"$defs": {"node": {"type": "object", "properties": {"value": {"type": "integer"},
                                                                    "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                                                       {"type": "null"}]}},
                                  "required": ["value", "next"]}},
               "$ref": "#/$defs/node"}
TREE = {"$defs": {"tree": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 8},
            "children": {"type": "array", "items": {"$ref": "#/$defs/tree"}, "maxItems": 3}},
            "required": ["name", "children"], "additionalProperties": False}},
        "$ref": "#/$defs/tree"}
JSON_VALUE = {"$defs": {"v": {"anyOf": [{"type": "null"}, {"type": "boolean"}, {"type": "integer"},
                                        {"type": "string", "maxLength": 6},
                                        {"type": "array", "items": {"$ref": "#/$defs/v"}, "maxItems": 3},
                                        {"type": "object", "additionalProperties": {"$ref": "#/$defs/v"},
                                         "maxProperties": 2}]}},
              "$ref": "#/$defs/v"}
FIXED_FORMATS = {"type": "object", "properties": {k: {"type": "string", "format": k} for k in ("date", "uuid", "ipv4")},
                 "required": ["date", "uuid", "ipv4"]}
RECURSIVE = {"linked_list": LINKED_LIST, "tree": TREE, "json_value": JSON_VALUE}

ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term (("+" | "-") term)*
term   ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num    ::= [0-9] [0-9]? [0-9]?
"""
TOOL_DSL_LARK = r"""
start: call (";" " " call)*
call: FN "(" [arg ("," " " arg)*] ")"
arg: KEY "=" (NUMBER | STRING)
FN: "get_weather" | "search" | "send_email"
KEY: /[a-z]{1,8}/
NUMBER: /[0-9]{1,4}/
STRING: /"[a-z ]{0,12}"/
"""


def parses_arithmetic(text: str) -> bool:
    """Recursive descent over the grammar above (no regex)."""
    pos = 0

    def num() -> bool:
        nonlocal pos
        start = pos
        while pos < len(text) and text[pos].isdigit() and pos - start < 3:
            pos += 1
        return pos > start

    def factor() -> bool:
        nonlocal pos
        if pos < len(text) and text[pos] == "(":
            pos += 1
            if not expr() or pos >= len(text) or text[pos] != ")":
                return False
            pos += 1
            return True
        return num()

    def chain(item, ops: str) -> bool:
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


_ARG = r'[a-z]{1,8}=(?:[0-9]{1,4}|"[a-z ]{0,12}")'
_CALL = rf"(?:get_weather|search|send_email)\((?:{_ARG}(?:, {_ARG})*)?\)"


def parses_tool_calls(text: str) -> list[str] | None:
    """The calls' names, or None if ``text`` is not a call list of the DSL."""
    if not re.fullmatch(rf"{_CALL}(?:; {_CALL})*", text):
        return None
    return re.findall(r"(get_weather|search|send_email)\(", text)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, EOS, 49152)


@pytest.fixture(scope="module")
def grammars(vocab):
    g = Grammars(lambda: vocab, timeout_s=60, memory_mb=4096, cache_size=64, jump_forward=True)
    yield g
    g.close()


def compiled(grammars: Grammars, params: dict):
    c = SamplingParams.from_dict(params).constraint()
    fut = grammars.request(c)
    while not fut.done:
        grammars.wait(0.2)
    assert fut.error is None, fut.error
    return c, fut


def new_matcher(grammars: Grammars, params: dict):
    c, fut = compiled(grammars, params)
    m = grammars.matcher(fut, c, jump_forward=False, heal=False)
    m.start([1])
    return m


CLOSERS = [ord(c) for c in '"}])0']


def random_output(m, vocab: TokenVocab, seed: int, cap: int = 40, limit: int = 300) -> bytes | None:
    """A random output the matcher admits: each step takes a random allowed token (after
    ``cap`` tokens, a single-byte closer when one is allowed) and stops in a final state
    with some chance (always after ``cap``). None if it did not end within ``limit``."""
    rng = random.Random(seed)
    out: list[int] = []
    for step in range(limit):
        mask = m.allowed(eos_ok=True)
        if m.is_final and (m.terminated or step > cap or rng.random() < 0.2):
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
            assert all(bits[e] for e in EOS)  # EOS is offered in final states
            return vocab.join(out)
        ids = [int(i) for i in np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))]
        assert m.is_final or not any(i in EOS for i in ids)  # ... and only there
        ids = [i for i in ids if i not in EOS]
        if step > cap:
            for b in CLOSERS:
                close = [i for i in ids if vocab.token_bytes[i] == bytes([b])]
                if close:
                    ids = close
                    break
        assert ids, vocab.join(out)
        tok = rng.choice(ids)
        assert m.advance(tok)
        out.append(tok)
    return None


def admits(m, vocab: TokenVocab, text: str) -> bool:
    """Feed the tokenizer's tokens of ``text``: True if every one is taken and the
    output is complete."""
    for t in vocab.encode(text):
        if not m.advance(t):
            return False
    return m.is_final


# -- the tokenizer -------------------------------------------------------------------------------
def test_tokenizer_adapter_keeps_plaits_bytes_and_eos(vocab):
    tok = build_tokenizer(vocab)
    assert tok.vocab_size == vocab.size and sorted(tok.eos_tokens) == list(EOS)
    rng = random.Random(0)
    for i in rng.sample(range(vocab.size), 300):
        if vocab.token_bytes[i] is not None:
            assert tok.decode_bytes([i]) == vocab.token_bytes[i]
            assert not tok.is_special_token(i)
    assert tok.is_special_token(2)  # <|im_end|>: never written as text
    # a vocabulary without EOS (sentencepiece spelling, as a tiny test tokenizer) gets one past its logits
    small = TokenVocab([b"a", b"b", b" ", b"ab", None], (), 5, encode=lambda s: [[b"a", b"b", b" "].index(c.encode())
                                                                                  for c in s])
    t2 = build_tokenizer(small)
    assert t2.vocab_size == 6 and t2.eos_tokens == [5] and small.mask_words == 1
    assert t2.decode_bytes([3, 2]) == b"ab "


# -- soundness on both backends ------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
@pytest.mark.parametrize("name", ["nested", "arrays_enums", "numbers", "refs_and_combinators", "formats"])
def test_both_backends_admit_only_valid_json(grammars, vocab, backend, name):
    # formats of bounded length (a random walk through an email address rarely ends)
    schema = FIXED_FORMATS if name == "formats" else SCHEMAS[name]
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    done = 0
    for seed in range(6):
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": backend})
        out = random_output(m, vocab, seed)
        if out is None:
            continue
        checker.validate(json.loads(out))
        done += 1
    assert done >= 3


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_llguidance_regexes_match_fully(grammars, vocab, name):
    for seed in range(4):
        m = new_matcher(grammars, {"regex": REGEXES[name], "grammar_backend": "llguidance"})
        out = random_output(m, vocab, seed)
        assert out is not None and re.fullmatch(REGEXES[name], out.decode()), out


INVALID = [
    (SCHEMAS["nested"], '{"name":"","address":{"city":"x"}}'),  # minLength
    (SCHEMAS["nested"], '{"name":"a","address":{"city":"x","zip":"123"}}'),  # pattern
    (SCHEMAS["nested"], '{"name":"a","address":{"city":"x"},"age":131}'),  # maximum
    (SCHEMAS["arrays_enums"], '{"tags":["pink"],"point":[1,2],"mode":"fast"}'),  # enum
    (SCHEMAS["arrays_enums"], '{"tags":[],"point":[1,2],"mode":"fast"}'),  # minItems
    (SCHEMAS["arrays_enums"], '{"tags":["red"],"point":[1,2,3],"mode":"fast"}'),  # items: false
    (SCHEMAS["numbers"], '{"price":-1,"score":0,"count":1,"x":0}'),  # minimum
    (SCHEMAS["numbers"], '{"price":1,"score":0,"count":50,"x":0}'),  # exclusiveMaximum
    (SCHEMAS["refs_and_combinators"], '{"items":[{"id":1,"kind":"c"}],"either":1,"one":true,"both":{"a":1,"b":true}}'),
    (SCHEMAS["refs_and_combinators"], '{"items":[],"either":1,"one":true,"both":{"a":1}}'),  # allOf's required
    (TREE, '{"name":"a","children":[{"name":"b"}]}'),  # a child without children
    (TREE, '{"name":"a","children":[{"name":"b","children":[],"x":1}]}'),  # additionalProperties deep down
    (LINKED_LIST, '{"value":1,"next":{"value":"two","next":null}}'),
    (JSON_VALUE, '[[[1,2,3,4]]]'),  # maxItems three levels down
]


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
@pytest.mark.parametrize("case", range(len(INVALID)))
def test_hand_made_invalid_instances_are_refused(grammars, vocab, backend, case):
    schema, text = INVALID[case]
    assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
    try:
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": backend})
    except RequestError as e:
        assert backend == "outlines" and "recursive" in e.message  # outlines-core cannot express these
        return
    except AssertionError as e:  # the build failed: outlines-core's whole index is too costly for a
        # top-level value whose matches go on (its partial one would cut a top-level integer short)
        assert backend == "outlines" and "cutting replies short" in str(e), e
        return
    assert not admits(m, vocab, text)


@pytest.mark.parametrize("name", sorted(RECURSIVE))
def test_recursive_schemas_compile_on_llguidance_and_nest(grammars, vocab, name):
    schema = RECURSIVE[name]
    c = SamplingParams.from_dict({"json_schema": schema}).constraint()
    assert c.backend == "llguidance"  # auto: the regex translation refuses recursion
    checker = jsonschema.Draft202012Validator(schema)
    depths = []
    for seed in range(8):
        out = random_output(new_matcher(grammars, {"json_schema": schema}), vocab, seed, cap=60, limit=400)
        if out is not None:
            value = json.loads(out)
            checker.validate(value)
            depths.append(_depth(value))
    assert len(depths) >= 4
    # a valid nested instance is admitted in full
    nested = {"linked_list": '{"value":1,"next":{"value":2,"next":{"value":3,"next":null}}}',
              "tree": '{"name":"r","children":[{"name":"a","children":[{"name":"b","children":[]}]}]}',
              "json_value": '{"a":[1,{"b":[true,null]}],"c":"x"}'}[name]
    checker.validate(json.loads(nested))
    assert admits(new_matcher(grammars, {"json_schema": schema}), vocab, nested)


def _depth(v) -> int:
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=0)
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=0)
    return 0


# -- ebnf ----------------------------------------------------------------------------------------
def test_ebnf_arithmetic_gbnf_and_tool_dsl_lark(grammars, vocab):
    for seed in range(6):
        out = random_output(new_matcher(grammars, {"ebnf": ARITHMETIC_GBNF}), vocab, seed)
        assert out is not None and parses_arithmetic(out.decode()), out
        out = random_output(new_matcher(grammars, {"ebnf": TOOL_DSL_LARK}), vocab, seed)
        assert out is not None and parses_tool_calls(out.decode()), out
    assert admits(new_matcher(grammars, {"ebnf": ARITHMETIC_GBNF}), vocab, "(12+3)*4-5/6")
    assert not admits(new_matcher(grammars, {"ebnf": ARITHMETIC_GBNF}), vocab, "(12+3")
    assert not admits(new_matcher(grammars, {"ebnf": ARITHMETIC_GBNF}), vocab, "1234")
    assert admits(new_matcher(grammars, {"ebnf": TOOL_DSL_LARK}), vocab, 'search(q="cats", n=3); get_weather()')
    assert not admits(new_matcher(grammars, {"ebnf": TOOL_DSL_LARK}), vocab, 'delete(all=1)')


def test_jump_forward_writes_forced_text_in_canonical_tokens(grammars, vocab, tokenizer):
    c, fut = compiled(grammars, {"json_schema": {"type": "object", "properties": {
        "first_name": {"type": "string"}, "last_name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["first_name", "last_name", "age"]}})
    m = grammars.matcher(fut, c, jump_forward=True, heal=True)
    assert m.start([1, 2]) == 0  # llguidance declines healing
    target = tokenizer.encode('{"first_name":"Ada","last_name":"Lovelace","age":36}', add_special_tokens=False)
    out = m.jump_start(16)
    assert out and target[: len(out)] == out  # the forced opening text, as the tokenizer writes it
    jumped = 0
    while not m.terminated:
        t = target[len(out)]
        assert m.advance(t)
        j = m.jump_forward(t, 32)
        out += j if j else [t]
        jumped += len(j) - 1 if j else 0
        assert target[: len(out)] == out, vocab.join(out)
    assert out == target and jumped >= 4


# -- selection and errors ------------------------------------------------------------------------
def test_auto_picks_a_backend_per_constraint():
    def backend(params: dict, default: str = "auto") -> str:
        return SamplingParams.from_dict(params).constraint(default).backend

    assert backend({"regex": "a+"}) == "outlines"
    assert backend({"ebnf": ARITHMETIC_GBNF}) == "llguidance"
    assert backend({"json_schema": SCHEMAS["nested"]}) == "llguidance"
    assert backend({"json_schema": TREE}) == "llguidance"
    # llguidance refuses these; the regex translation enforces them
    for schema in ({"type": "array", "items": {"enum": ["a"]}, "uniqueItems": True, "maxItems": 1},
                   {"type": "number", "exclusiveMinimum": 0},
                   {"type": "number", "not": {"type": "integer"}}):
        c = SamplingParams.from_dict({"json_schema": schema}).constraint()
        assert c.backend == "outlines", schema
    assert backend({"json_schema": SCHEMAS["nested"]}, "outlines") == "outlines"  # the engine's option
    assert backend({"json_schema": SCHEMAS["nested"], "grammar_backend": "outlines"}, "llguidance") == "outlines"
    assert backend({"regex": "a+", "grammar_backend": "llguidance"}) == "llguidance"


@pytest.mark.parametrize("params, param, words", [
    ({"regex": "a", "ebnf": "root ::= \"a\""}, "regex", "at most one constraint"),
    ({"json_schema": {}, "ebnf": "root ::= \"a\""}, "json_schema", "at most one constraint"),
    ({"ebnf": 5}, "ebnf", "a grammar as a string"),
    ({"ebnf": "root ::= \"a\"", "grammar_backend": "outlines"}, "grammar_backend", "cannot enforce an ebnf"),
    ({"regex": "a", "grammar_backend": "xgrammar"}, "grammar_backend", "auto, outlines, llguidance"),
    ({"ebnf": "root ::= missing"}, "ebnf", "missing"),
    ({"ebnf": "start: \"a\" ("}, "ebnf", "ebnf is invalid"),
    ({"ebnf": "root ::= \"" + "a" * MAX_GRAMMAR_CHARS + "\""}, "ebnf", f"at most {MAX_GRAMMAR_CHARS}"),
    ({"json_schema": {"type": "number", "exclusiveMaximum": 1}, "grammar_backend": "llguidance"}, "json_schema",
     "exclusiveMaximum"),
    ({"json_schema": {"type": "number", "multipleOf": 0.1}, "grammar_backend": "llguidance"}, "json_schema",
     "multipleOf"),
    ({"json_schema": {"type": "integer", "divisibleBy": 3}, "grammar_backend": "llguidance"}, "json_schema",
     "divisibleBy"),
    # found unsound on the real-world corpus (benchmarks/schema_corpus): refused by name
    ({"json_schema": {"type": "object", "patternProperties": {".*": {"type": "integer"}, "^a": {"minimum": 3}}},
      "grammar_backend": "llguidance"}, "json_schema", "patternProperties"),
    # a word boundary: llguidance does not read it as Python does
    ({"json_schema": {"type": "object", "patternProperties": {"\\bx": {"type": "integer"}}},
      "grammar_backend": "llguidance"}, "json_schema", "word boundary"),
    ({"json_schema": {"oneOf": [{"type": "string", "pattern": "\\bx"}, {"type": "integer"}]},
      "grammar_backend": "llguidance"}, "json_schema", "word boundary"),
    ({"json_schema": {"properties": {"a": {"required": True}}}, "grammar_backend": "llguidance"}, "json_schema",
     "required"),
    ({"json_schema": {"type": "array", "contains": {"const": 1}}, "grammar_backend": "llguidance"}, "json_schema",
     "contains"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "uniqueItems"),
])
def test_bad_constraints_are_400s_naming_the_field(params, param, words):
    with pytest.raises(RequestError) as info:
        SamplingParams.from_dict(params).constraint()
    assert info.value.status == 400 and info.value.param == param
    assert words in info.value.message, info.value.message


def test_compiled_grammars_are_cached_per_tokenizer_backend_and_constraint(grammars):
    c1, f1 = compiled(grammars, {"json_schema": TREE})
    _, f2 = compiled(grammars, {"json_schema": json.dumps(TREE)})
    assert f2 is f1 and f1.key[0] == grammars.vocab.fingerprint
    c3, f3 = compiled(grammars, {"json_schema": SCHEMAS["nested"], "grammar_backend": "outlines"})
    _, f4 = compiled(grammars, {"json_schema": SCHEMAS["nested"], "grammar_backend": "llguidance"})
    assert f3 is not f4 and type(f3.grammar) is not type(f4.grammar)


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    from plait.runtime import Engine

    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, max_running_requests=8) as e:
        yield e
        e.check_invariants()


def test_engine_follows_recursive_schemas_and_ebnf(engine):
    outs = engine.generate(
        ["A tree:", "A list:", "Compute:", "Call tools:"],
        [{"json_schema": TREE, "temperature": 0.8, "seed": 1, "max_new_tokens": 300},
         {"json_schema": LINKED_LIST, "temperature": 0.0, "max_new_tokens": 300},
         {"ebnf": ARITHMETIC_GBNF, "temperature": 0.9, "seed": 2, "max_new_tokens": 40},
         {"ebnf": TOOL_DSL_LARK, "temperature": 0.0, "max_new_tokens": 60}],
    )
    for o, schema in zip(outs[:2], (TREE, LINKED_LIST)):
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            jsonschema.validate(json.loads(o["text"]), schema)
        else:  # a random model may nest until max_new_tokens: the text is then a prefix of valid JSON
            assert o["meta_info"]["finish_reason"]["type"] == "length"
    for o, check in zip(outs[2:], (parses_arithmetic, parses_tool_calls)):
        if o["meta_info"]["finish_reason"]["type"] == "stop":
            assert check(o["text"]), o["text"]
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs)
    with pytest.raises(RequestError, match="ebnf"):
        engine.generate("x", {"ebnf": "root ::= nowhere"})
    assert engine.generate("Still?", {"regex": "(yes|no)", "temperature": 0.0})["text"] in ("yes", "no")


@pytest.mark.parametrize("backend", ["outlines", "llguidance"])
def test_min_tokens_past_a_complete_constraint_is_a_400_naming_min_tokens(engine, backend):
    """A constraint complete after 1 token ('x') with min_new_tokens 5: the 400 said the
    regex 'cannot be followed' as if no token could write it; it names min_new_tokens."""
    with pytest.raises(RequestError) as info:
        engine.generate("x", {"regex": "x", "grammar_backend": backend, "min_new_tokens": 5, "max_new_tokens": 8})
    assert info.value.status == 400 and info.value.param == "min_new_tokens", info.value.message
    assert "complete after 1 output token" in info.value.message, info.value.message
    assert engine.generate("x", {"regex": "x", "grammar_backend": backend, "max_new_tokens": 8})["text"] == "x"


@pytest.mark.parametrize("params, param", [
    ({"json_schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "json_schema"),
    ({"json_schema": {"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}, "$ref": "#/$defs/a"}}, "json_schema"),
    ({"regex": "[^\\s\\S]", "grammar_backend": "llguidance"}, "regex"),
    ({"ebnf": "root ::= a\na ::= a"}, "ebnf"),
])
def test_a_constraint_without_any_output_is_a_400_not_an_aborted_result(engine, params, param):
    # llguidance compiles these without an error; they used to come back as an empty
    # "abort" result after one rejected token
    with pytest.raises(RequestError) as info:
        engine.generate("x", {**params, "max_new_tokens": 4})
    assert info.value.status == 400 and info.value.param == param
    assert "admits no" in info.value.message, info.value.message  # no output, or no finite one
    assert engine.generate("Still?", {"regex": "(yes|no)", "temperature": 0.0})["text"] in ("yes", "no")


@pytest.mark.parametrize("backend", ["llguidance", "outlines"])
def test_special_token_text_in_a_constraint_is_written_as_plain_text(engine, backend):
    # the forced text "<|im_end|>" was re-tokenized as the special token, which no
    # constraint allows: llguidance's mask came back empty and the request an empty abort
    schema = {"const": "a<|im_end|>b"}
    o = engine.generate("Output:", {"json_schema": schema, "max_new_tokens": 24, "temperature": 0.0,
                                    "grammar_backend": backend})
    assert json.loads(o["text"]) == "a<|im_end|>b", o
    assert o["meta_info"]["finish_reason"]["type"] == "stop"
    o = engine.generate("Output:", {"regex": "x<\\|endoftext\\|>y", "max_new_tokens": 24, "temperature": 0.0,
                                    "grammar_backend": backend})
    assert o["text"] == "x<|endoftext|>y", o


def test_a_constraint_that_allows_no_next_token_fails_as_a_400_naming_it(engine, monkeypatch):
    # a dead end after admission (no ordinary token writes what the constraint needs next):
    # a client error naming the field, not an empty 200-style "abort" result
    from plait.runtime.constrained.llguidance_backend import LLGuidanceMatcher

    real = LLGuidanceMatcher.advance

    def refuse_the_second(self, token):
        if self.num_advanced >= 1:
            self.rejected = token
            return False
        return real(self, token)

    monkeypatch.setattr(LLGuidanceMatcher, "advance", refuse_the_second)
    with pytest.raises(RequestError) as info:
        engine.generate("x", {"regex": "[a-z]{64}", "max_new_tokens": 64, "grammar_backend": "llguidance",
                              "temperature": 0.0})
    assert info.value.status == 400 and info.value.param == "regex", info.value
    assert "cannot be followed after 1 output token:" in info.value.message, info.value.message
    monkeypatch.undo()
    assert engine.generate("Still?", {"regex": "(yes|no)", "temperature": 0.0})["text"] in ("yes", "no")


@pytest.mark.parametrize("params, param", [
    ({"regex": "a{1000000}", "grammar_backend": "llguidance"}, "regex"),
    ({"json_schema": {"type": "string", "pattern": "^a{1000000}$"}}, "json_schema"),
])
def test_a_grammar_past_llguidance_limits_after_admission_is_a_400_saying_why(engine, params, param):
    # it passes validation and the first mask, then the lexer gives up ("too many
    # expressions"): that was an empty 200-style "abort" result with nothing in the log
    with pytest.raises(RequestError) as info:
        engine.generate("x", {**params, "max_new_tokens": 4, "temperature": 0.0})
    assert info.value.status == 400 and info.value.param == param, info.value
    assert "llguidance stopped: lexer error" in info.value.message, info.value.message
    assert engine.generate("Still?", {"regex": "(yes|no)", "temperature": 0.0})["text"] in ("yes", "no")


def test_a_compile_over_its_limit_fails_while_another_request_streams(tiny_model_factory, monkeypatch):
    from plait.runtime import Engine

    release = threading.Event()
    real = LLGuidanceCompiler._build

    def slow_build(self, grammar):
        if "slowly" in grammar:
            release.wait(60)  # a compile that never finishes within the limit
        return real(self, grammar)

    monkeypatch.setattr(LLGuidanceCompiler, "_build", slow_build)
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048, max_running_requests=4,
                grammar_compile_timeout=1.0) as e:
        try:
            slow = e.add_request(e.tokenizer.encode("Say:", add_special_tokens=False),
                                 {"ebnf": 'root ::= "slowly"', "max_new_tokens": 4})[0]
            free = e.add_request(e.tokenizer.encode("Hello", add_special_tokens=False),
                                 {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64})[0]
            streamed_while_compiling = 0
            while not slow.finished:
                for o in e.step():
                    if o.rid == free.rid and not slow.finished:
                        streamed_while_compiling += 1
            assert streamed_while_compiling >= 1  # the engine loop kept decoding the other request
            err = slow.finish_reason.error
            assert slow.finish_reason.type == "abort" and err.status == 400 and err.param == "ebnf"
            assert "grammar_compile_timeout" in err.message
            while not free.finished:
                e.step()
            assert free.output_len == 64
            assert e.generate("Ok?", {"ebnf": 'root ::= "yes" | "no"', "temperature": 0.0})["text"] in ("yes", "no")
        finally:
            release.set()
        e.check_invariants()


def test_default_model_writes_a_recursive_schema():
    from conftest import smollm2_gguf_path
    from plait.runtime import Engine

    target = '{"value":1,"next":{"value":2,"next":{"value":3,"next":null}}}'
    with Engine(smollm2_gguf_path(), kv_cache_tokens=2048, max_running_requests=2) as e:
        prompt = e.tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Repeat this JSON exactly: {target}"}], tokenize=False,
            add_generation_prompt=True)
        out = e.generate(prompt, {"json_schema": LINKED_LIST, "temperature": 0.0, "max_new_tokens": 48})
    assert out["meta_info"]["finish_reason"]["type"] == "stop", out["text"]
    value = json.loads(out["text"])
    jsonschema.validate(value, LINKED_LIST)
    assert _depth(value) >= 2, out["text"]  # nested, through the recursive $ref


def test_ebnf_over_http_native_and_openai_extra_body(tiny_model_factory):
    import httpx
    import openai

    from plait.runtime.server import launch

    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=2048, served_model_name="tiny") as rt, \
            httpx.Client(base_url=rt.url, timeout=120) as c:
        r = c.post("/generate", json={"text": "Compute:", "sampling_params": {
            "ebnf": ARITHMETIC_GBNF, "temperature": 0.0, "max_new_tokens": 30}})
        assert r.status_code == 200, r.text
        if r.json()["meta_info"]["finish_reason"]["type"] == "stop":
            assert parses_arithmetic(r.json()["text"]), r.json()["text"]
        r = c.post("/generate", json={"text": "x", "sampling_params": {"ebnf": "root ::= nowhere"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ebnf"
        oai = openai.OpenAI(base_url=rt.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = oai.completions.create(model="tiny",
                                     prompt="Call:", max_tokens=40, temperature=0.0,
                                     extra_body={"ebnf": 'root ::= "search(q=" [0-9] ")"'})
        assert re.fullmatch(r"search\(q=[0-9]\)", out.choices[0].text), out.choices[0].text
        with pytest.raises(openai.BadRequestError, match="at most one constraint"):
            oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                        extra_body={"ebnf": 'root ::= "a"', "regex": "a"})


def test_language_gen_passes_ebnf_and_grammar_backend():
    from plait.api import gen

    g = gen("calc", ebnf=ARITHMETIC_GBNF, grammar_backend="llguidance", max_tokens=20)
    assert g.params["ebnf"] == ARITHMETIC_GBNF and g.params["grammar_backend"] == "llguidance"
    SamplingParams.from_dict({k: v for k, v in g.params.items() if k != "max_new_tokens"}).constraint()
    with pytest.raises(ValueError, match="at most one constraint"):
        gen("x", ebnf=ARITHMETIC_GBNF, regex="a")
    with pytest.raises(ValueError, match="grammar_backend"):
        gen("x", ebnf=ARITHMETIC_GBNF, grammar_backend="xgrammar")


def test_llguidance_takes_oneof_branches_narrowed_by_type(grammars, vocab):
    """llguidance refuses a oneOf it cannot prove exclusive; branches that plait narrows
    by type alone reach it as an anyOf of the narrowed branches: null satisfies both
    branches below, so oneOf refuses it, and strings and numbers satisfy one each."""
    schema = {"type": "object", "properties": {"q": {"oneOf": [{"type": ["string", "null"]},
                                                              {"type": ["number", "null"]}]}},
              "required": ["q"]}
    m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    assert admits(m, vocab, '{"q":"1Gi"}')
    m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    assert admits(m, vocab, '{"q":2.5}')
    m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    assert not admits(m, vocab, '{"q":null}')
    for seed in range(5):
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
        out = random_output(m, vocab, seed)
        assert out is not None and jsonschema.Draft202012Validator(schema).is_valid(json.loads(out))


def test_llguidance_pattern_properties_apply_every_matching_schema(grammars, vocab):
    """patternProperties on llguidance: a listed property also satisfies each pattern
    its name contains a match of; other keys get their pattern's schema (patterns no
    key can match two of), or additionalProperties'."""
    schema = {"type": "object", "properties": {"ab": {"type": "number"}},
              "patternProperties": {"^a": {"type": "integer"}, "^z[0-9]$": {"type": "string"}},
              "additionalProperties": False}
    good = ['{"ab":1}', '{"ax":2}', '{"z1":"s"}', '{}']
    bad = ['{"ab":1.5}', '{"ax":"s"}', '{"z1":1}', '{"q":1}', '{"z12":"s"}']
    for text in good + bad:
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
        assert admits(m, vocab, text) == (text in good), text
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)) == (text in good), text
    for seed in range(8):
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
        out = random_output(m, vocab, seed)
        assert out is not None and jsonschema.Draft202012Validator(schema).is_valid(json.loads(out)), out


def _sound_on_llguidance(grammars, vocab, schema, good, bad, validator=None, outputs=6):
    """The schema compiles on llguidance under ``auto``; each of ``good`` is admitted,
    each of ``bad`` (invalid: checked here) refused, and random outputs validate."""
    assert SamplingParams.from_dict({"json_schema": schema}).constraint().backend == "llguidance"
    validator = validator or jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)(
        schema, format_checker=jsonschema.FormatChecker())
    for text in good + bad:
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
        assert validator.is_valid(json.loads(text)) == (text in good), text
        assert admits(m, vocab, text) == (text in good), text
    done = 0
    for seed in range(outputs):
        out = random_output(new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"}), vocab, seed)
        if out is not None:
            assert validator.is_valid(json.loads(out)), out
            done += 1
    assert done >= outputs // 2


def test_llguidance_narrows_shorthand_patterns_and_reads_formats_it_lacks(grammars, vocab):
    """``\\d`` ``\\w`` ``\\s`` (and negations) in ``pattern`` are narrowed to ASCII as the
    outlines backend writes them (Python's are Unicode-aware, llguidance's are not the
    same sets); a draft format llguidance lacks becomes plait's sound regex for it; a
    format no draft defines is an annotation."""
    schema = {"type": "object", "properties": {
        "v": {"type": "string", "pattern": r"^\d{2}-\w+$"},
        "s": {"type": "string", "pattern": r"^[^\s-]+$", "maxLength": 4},
        "t": {"type": "string", "format": "regex"},
        "n": {"type": "integer", "format": "int64", "minimum": 0, "maximum": 9}},
        "required": ["v", "s", "n"]}
    good = ['{"v":"12-ab_1","s":"x:y","n":3}', '{"v":"00-Z","s":"a","t":"ab c","n":0}']
    bad = ['{"v":"1-ab","s":"x","n":3}', '{"v":"12-a b","s":"x","n":3}', '{"v":"12-a","s":"a b","n":3}',
           '{"v":"12-a","s":"abcde","n":3}', '{"v":"12-a","s":"a","t":"a(","n":3}', '{"v":"12-a","s":"a","n":10}']
    _sound_on_llguidance(grammars, vocab, schema, good, bad)
    # valid, but narrowed away: an Arabic-Indic digit, which Python's \d matches
    m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    assert not admits(m, vocab, '{"v":"١٢-a","s":"a","n":1}')


def test_llguidance_takes_not_if_dependencies_and_oneof_written_with_anyof(grammars, vocab):
    """``not: {required}``, ``dependencies``/``dependentRequired``, the common ``if``
    form and ``oneOf`` branches narrowed on objects reach llguidance (which implements
    none of them) written with ``anyOf``, ``required`` and ``properties: {name: false}``."""
    props = {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in ("a", "b", "c")}
    schema = {"type": "object", "properties": props, "not": {"required": ["a", "b"]},
              "dependencies": {"c": ["a"]}}
    _sound_on_llguidance(grammars, vocab, schema, ['{"a":1}', '{"a":1,"c":2}', '{"b":1}', '{}'],
                         ['{"a":1,"b":2}', '{"c":1}', '{"b":1,"c":2}'], jsonschema.Draft7Validator(schema))
    schema = {"type": "object", "properties": {"kind": {"enum": ["file", "url"]}, "path": {"type": "string",
                                                                                         "maxLength": 4}},
              "required": ["kind"], "if": {"properties": {"kind": {"const": "file"}}},
              "then": {"required": ["path"]}, "else": {"properties": {"path": False}}}
    _sound_on_llguidance(grammars, vocab, schema, ['{"kind":"file","path":"a"}', '{"kind":"url"}'],
                         ['{"kind":"file"}', '{"kind":"url","path":"a"}'])
    # an open branch: the other branch's objects must lack its required name
    schema = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}
    _sound_on_llguidance(grammars, vocab, schema, ['{"b":1}', '{}'], ['[]', '{"a":1}', '{"b":"x"}'])


def test_llguidance_keeps_patterns_exact_where_a_narrowing_would_widen(grammars, vocab):
    """Under a ``oneOf`` llguidance checks itself (distinct types), and in what a
    ``$ref`` there reaches, a narrower pattern would admit values that satisfy two
    branches: such patterns (and ``patternProperties`` keys, which pick a key's schema)
    get Python's exact shorthand sets instead of the ASCII narrowing."""
    defs = {"d": {"type": "string", "pattern": r"^\d+$"}}
    narrowed = {"definitions": defs, "type": "object", "properties": {"x": {"$ref": "#/definitions/d"}}}
    _sound_on_llguidance(grammars, vocab, narrowed, ['{"x":"12"}', '{}'], ['{"x":"1a"}', '{"x":"١٢a"}'])
    m = new_matcher(grammars, {"json_schema": narrowed, "grammar_backend": "llguidance"})
    assert not admits(m, vocab, '{"x":"١٢"}')  # valid (Python's \d), narrowed away
    # a oneOf plait cannot prove exclusive stays (llguidance refuses it); what it reaches is not narrowed
    from plait.runtime.constrained.llguidance_backend import llguidance_schema

    under = {"type": "object", "properties": {"x": {"$ref": "#/definitions/d"}}, "definitions": {
        "d": {"oneOf": [{"$ref": "#/definitions/digits"}, {"type": "string", "maxLength": 2}]},
        "digits": {"type": "string", "pattern": r"^\d+$"}}}
    exact = llguidance_schema(under)["definitions"]["digits"]["pattern"]
    assert re.fullmatch(exact, "١٢") and not re.search(exact, "1a")
    assert re.fullmatch(llguidance_schema(narrowed)["definitions"]["d"]["pattern"], "١٢") is None
    keys = {"type": "object", "patternProperties": {r"^\d+$": {"type": "integer"}, r"^\s": {"type": "string"}},
            "additionalProperties": {"type": "boolean"}}
    _sound_on_llguidance(grammars, vocab, keys, ['{"12":1}', '{"١٢":1}', '{" a":"s"}', '{"a":true}'],
                         ['{"١٢":true}', '{"\u0085":true}', '{"1a":1}'])


def test_llguidance_takes_a_schema_text_over_the_ebnf_size_limit(grammars, vocab):
    """A JSON Schema's text has the translation's limit (1 MiB) on both backends; the
    100 000-character limit is the ebnf text's."""
    words = [f"w{i:06d}" + "x" * 40 for i in range(2500)]
    schema = {"type": "object", "properties": {"w": {"enum": words}}, "required": ["w"]}
    assert len(json.dumps(schema)) > MAX_GRAMMAR_CHARS
    _sound_on_llguidance(grammars, vocab, schema, [json.dumps({"w": words[7]}, separators=(",", ":"))],
                         ['{"w":"w000007"}'], outputs=2)


def test_llguidance_writes_no_unicode_escapes_that_would_hide_a_key(grammars, vocab):
    """Found on the corpus (packer.json): llguidance matches a key written with a
    ``\\uXXXX`` escape against neither the listed names nor the patterns, so the key
    got additionalProperties' schema where jsonschema applies the named one. Such
    escapes are not written at all (as in the outlines layout)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}},
              "patternProperties": {"[b-z]": {"type": "string"}}, "additionalProperties": {"type": "integer"}}
    good = ['{"a":"s"}', '{"q":"s"}', '{"1":2}', '{"a":"t\\tx"}']
    bad = ['{"\\u0061":1}', '{"\\u0071":1}', '{"a":1}', '{"q":1}']
    _sound_on_llguidance(grammars, vocab, schema, good, bad)
    m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
    assert not admits(m, vocab, '{"a":"\\u00e9"}')  # valid, but written as "é" or not at all


def test_llguidance_takes_unlisted_if_values_not_enum_and_schema_dependencies(grammars, vocab):
    """Found on the corpus (minecraft, github-action/-workflow, prometheus, netlify):
    ``if`` on a property's const/enum whose values nothing beside it lists (failing it:
    the property present with another value, written ``not: {enum}``, which reaches
    llguidance as another type or a string ``pattern`` of the other strings), the
    nested and ``if: {not: ...}`` forms, and schema dependencies as ``anyOf``."""
    schema = {"type": "object", "properties": {"kind": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": -9, "maximum": 9}},
              "if": {"properties": {"kind": {"const": "a"}}}, "then": {"required": ["n"]},
              "else": {"properties": {"n": {"maximum": 0}}}}
    _sound_on_llguidance(grammars, vocab, schema, ['{"kind":"a","n":5}', '{"kind":"ab","n":-1}', '{"n":3}',
                                                   '{"kind":"","n":0}'],
                         ['{"kind":"a"}', '{"kind":"b","n":1}', '{}', '{"kind":"ab","n":2}'])
    schema = {"type": "object", "properties": {"k": {"not": {"enum": ["a", "bc", None, True]}}}, "required": ["k"]}
    _sound_on_llguidance(grammars, vocab, schema, ['{"k":"b"}', '{"k":"bcd"}', '{"k":false}', '{"k":1}',
                                                   '{"k":[]}', '{"k":""}'],
                         ['{"k":"a"}', '{"k":"bc"}', '{"k":null}', '{"k":true}'])
    schema = {"type": "object", "properties": {"runs": {"type": "object", "properties": {"using": {"type": "string"}},
                                                        "additionalProperties": False},
                                               "out": {"type": "integer", "minimum": -9, "maximum": 9}},
              "if": {"properties": {"runs": {"properties": {"using": {"const": "c"}}}}},
              "then": {"properties": {"out": {"minimum": 1}}}, "else": {"properties": {"out": {"maximum": -1}}}}
    _sound_on_llguidance(grammars, vocab, schema, ['{"runs":{"using":"c"},"out":1}', '{"runs":{"using":"d"},"out":-1}',
                                                   '{"runs":{},"out":1}'],
                         ['{"runs":{"using":"c"},"out":-1}', '{"runs":{"using":"d"},"out":1}'])
    schema = {"type": "object", "properties": {"a": {"type": ["string", "null"], "maxLength": 3},
                                               "b": {"type": ["string", "null"], "maxLength": 3}},
              "allOf": [{"if": {"not": {"properties": {"a": {"const": None}}}},
                         "then": {"properties": {"b": {"const": None}}}}]}
    _sound_on_llguidance(grammars, vocab, schema, ['{"a":"x","b":null}', '{"a":null,"b":"y"}', '{"b":"y"}', '{}'],
                         ['{"a":"x","b":"y"}'])
    # not of such a condition (hemtt), not of a $ref to a typed enum (avro)
    schema = {"definitions": {"par": {"properties": {"parallel": {"enum": [True]}}}},
              "type": "object", "properties": {"parallel": {"type": "boolean"}, "foreach": {"type": "boolean"}},
              "anyOf": [{"not": {"$ref": "#/definitions/par"}},
                        {"properties": {"foreach": {"enum": [True]}}, "required": ["foreach"]}]}
    _sound_on_llguidance(grammars, vocab, schema, ['{"parallel":false}', '{"foreach":true}'],
                         ['{}', '{"parallel":true}', '{"parallel":true,"foreach":false}'])
    schema = {"definitions": {"prim": {"type": "string", "enum": ["int", "long"]}}, "type": "object",
              "properties": {"t": {"type": "string", "maxLength": 5, "not": {"$ref": "#/definitions/prim"}}},
              "required": ["t"]}
    _sound_on_llguidance(grammars, vocab, schema, ['{"t":"in"}', '{"t":"longs"}', '{"t":""}'],
                         ['{"t":"int"}', '{"t":"long"}'])
    schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "abc"},
              "dependentSchemas": {"a": {"required": ["b"], "properties": {"b": {"minimum": 5}}}, "c": False},
              "dependencies": {}}
    _sound_on_llguidance(grammars, vocab, schema, ['{"a":1,"b":5}', '{"b":1}', '{}'],
                         ['{"a":1}', '{"a":1,"b":4}', '{"c":1}'])


def test_llguidance_reads_a_ref_alone_in_drafts_that_ignore_its_siblings(grammars, vocab):
    """Drafts 3 to 7 ignore the keywords beside a ``$ref`` (found on the corpus:
    recursive ``$ref``s beside ``type``, which llguidance cannot intersect); 2019-09 and
    later apply them."""
    defs = {"n": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "next": {"$ref": "#/definitions/n", "type": ["object", "integer"],
                                                            "required": ["w"]}},
                  "required": ["v"], "additionalProperties": False}}
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": defs, "$ref": "#/definitions/n"}
    _sound_on_llguidance(grammars, vocab, schema, ['{"v":1}', '{"v":1,"next":{"v":2,"next":{"v":3}}}'],
                         ['{"v":1,"next":3}', '{"next":{"v":1}}', '{"v":1,"next":{}}'],
                         jsonschema.Draft7Validator(schema))
    from plait.runtime.constrained.llguidance_backend import schema_grammar

    # under a oneOf: the branch is what the $ref alone admits, so {"kind": "b"} satisfies both
    one_of = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"o": {"type": "object"}},
              "oneOf": [{"$ref": "#/definitions/o", "properties": {"kind": {"const": "a"}}, "required": ["kind"]},
                        {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]}
    _sound_on_llguidance(grammars, vocab, one_of, ['{}', '{"x":1}'], ['{"kind":"b"}', '[]'],
                         jsonschema.Draft7Validator(one_of))
    # 2020-12 applies them: llguidance cannot intersect them with the recursive $ref
    later = {**schema, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    with pytest.raises(ValueError, match="circular references with sibling keys"):
        schema_grammar(later, None)


@pytest.mark.parametrize("schema", [{"type": "number"}, {"type": "object", "properties": {"h": {"type": "number"}},
                                                          "required": ["h"]}])
def test_llguidance_numbers_have_bounded_digits(grammars, vocab, schema):
    """A number without bounds or a step is written with at most 16 integer and 10
    fraction digits on llguidance too (a small model wrote a 100-digit number until
    max_tokens); shorter numbers, signs and zero are still admitted."""
    def wrap(v: str) -> str:
        return v if schema.get("type") == "number" else '{"h":' + v + "}"

    for value, ok in (("3.14", True), ("-2.5", True), ("0", True), ("1234567890123456", True),
                      ("0." + "3" * 10, True), ("12345678901234567", False), ("0." + "3" * 11, False),
                      ("1" * 40, False)):
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
        assert admits(m, vocab, wrap(value)) == ok, value
    # the schema's own bounds stay as they are
    m = new_matcher(grammars, {"json_schema": {"type": "number", "minimum": 0.5, "maximum": 2.25},
                               "grammar_backend": "llguidance"})
    assert admits(m, vocab, "2.25") and not admits(new_matcher(grammars, {
        "json_schema": {"type": "number", "minimum": 0.5, "maximum": 2.25}, "grammar_backend": "llguidance"}), vocab, "3")


def test_a_required_name_the_object_does_not_list_holds_any_value(grammars, vocab):
    """``required`` names a property ``properties`` does not list (and nothing closes the
    object): it may hold any value, after the listed ones. llguidance called this
    satisfiable schema unsatisfiable (plait closes objects to their listed names)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}
    for text, ok in (('{"a":1,"zz":"x"}', True), ('{"a":1,"zz":[1,{"b":null}]}', True), ('{"a":1}', False),
                     ('{"zz":2}', False), ('{"a":1,"zz":2,"q":3}', False)):
        m = new_matcher(grammars, {"json_schema": schema, "grammar_backend": "llguidance"})
        assert admits(m, vocab, text) == ok, text
        if ok:
            jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("bounds", [{"minimum": -(2**63), "maximum": 2**63 - 1}, {"minimum": -(10**30)},
                                    {"exclusiveMinimum": -(2**63)}, {"minimum": -(2**63) + 1}])
def test_int64_lower_bounds_compile_on_llguidance_and_every_digit_is_written(grammars, vocab, bounds):
    """An integer whose lower bound llguidance reads as the smallest 64-bit integer
    (an int64 range, as code generators write, or -1e30) failed its compile, and auto
    then served it on outlines, whose index for that range could not be built with the
    end sentinel: the reply was one digit. It is narrowed to I64_FLOOR and compiled on
    llguidance: long numbers of either sign are written, below the floor is not."""
    from plait.runtime.constrained.llguidance_backend import I64_FLOOR

    for schema in ({"type": "integer", **bounds}, {"type": ["integer", "null"], **bounds},
                   {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"]}):
        assert SamplingParams.from_dict({"json_schema": schema}).constraint().backend == "llguidance"
        wrap = (lambda v: '{"n":' + v + "}") if schema["type"] == "object" else (lambda v: v)
        for value, ok in (("123456789", True), ("-1234567890123", True), ("0", True), (str(I64_FLOOR), True),
                          (str(I64_FLOOR - 1), False), (str(-(2**63)), False), ("1" + "0" * 30, None),
                          *(((str(2**63 - 1), True), (str(2**63), False)) if "maximum" in bounds else ())):
            m = new_matcher(grammars, {"json_schema": schema})
            got = admits(m, vocab, wrap(value))
            assert got == ok or ok is None, (schema, value)  # None: either (valid without a maximum)
            if got:
                jsonschema.validate(json.loads(wrap(value)), schema)
