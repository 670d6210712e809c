"""Constrained decoding without a model: vocabulary bytes, JSON Schema -> regex (with
its keyword rules), the jump-forward automaton, index compilation with limits, the
per-request matcher (healing, jump-forward) and the batched mask."""

from __future__ import annotations

import json
import random
import re
import time

import jsonschema
import numpy as np
import pytest
import torch

from plait.runtime.constrained.compiler import GrammarCompiler
from plait.runtime.constrained.json_schema import SchemaError, int_range_regex, number_range_regex, schema_to_regex
from plait.runtime.constrained.jump_forward import CharAutomaton
from plait.runtime.constrained.mask import apply_grammar_masks, unpack_bits
from plait.runtime.constrained.matcher import GrammarMatcher
from plait.runtime.constrained.regexes import escape
from constrained_cases import REGEXES, SCHEMAS
from plait.runtime.constrained.vocab import (
    BYTE_LEVEL,
    SENTENCEPIECE,
    TokenVocab,
    detect_kind,
    gpt2_byte_table,
)

EOS = (0, 2)  # SmolLM2: <|endoftext|>, <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def vocab(tokenizer):
    return TokenVocab.from_tokenizer(tokenizer, EOS, 49152)


@pytest.fixture(scope="module")
def compiler(vocab):
    c = GrammarCompiler(vocab, timeout_s=60)
    yield c
    c.close()


def build(c: GrammarCompiler, regex: str):
    fut = c.request(regex)
    while not fut.done:
        c.wait(0.5)
    return fut


def sample_strings(regex: str, n: int, seed: int = 0, cap: int = 60) -> list[str]:
    """Random strings of the regex's language (random walks on its automaton that head
    for a final state once ``cap`` characters are written)."""
    auto = CharAutomaton.from_regex(regex)
    assert auto is not None, regex
    rng = random.Random(seed)
    by_class: dict[int, list[str]] = {}
    for ch, k in auto.classes.items():
        by_class.setdefault(k, []).append(ch)
    others = [c for c in "qZé日~ 7" if c not in auto.classes]
    # distance to a final state, for finishing walks
    dist = {s: 0 for s in auto.finals}
    changed = True
    while changed:
        changed = False
        for s, row in auto.transitions.items():
            best = min((dist[t] + 1 for t in row.values() if t in dist), default=None)
            if best is not None and dist.get(s, 1 << 30) > best:
                dist[s] = best
                changed = True
    out = []
    for _ in range(n):
        s, text = auto.initial, []
        while True:
            row = auto.transitions[s]
            if s in auto.finals and (not row or rng.random() < (0.5 if len(text) > cap else 0.15)):
                break
            if len(text) > cap:
                k, t = min(row.items(), key=lambda kv: dist[kv[1]])
            else:
                k, t = rng.choice(sorted(row.items()))
            text.append(rng.choice(by_class[k]) if k in by_class else rng.choice(others))
            s = t
        out.append("".join(text))
    return out


# -- vocabulary -----------------------------------------------------------------------------
def test_gpt2_byte_table_is_a_bijection():
    table = gpt2_byte_table()
    assert sorted(table.values()) == list(range(256))
    assert table["\u0120"] == 0x20 and table["\u010a"] == 0x0A and table["A"] == 0x41


def test_byte_level_vocabulary_of_the_real_tokenizer(tokenizer, vocab):
    assert detect_kind(tokenizer) == BYTE_LEVEL and vocab.kind == BYTE_LEVEL
    (yes,) = tokenizer.encode(" yes", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(yes) == "\u0120yes" and vocab.token_bytes[yes] == b" yes"
    for i, tok in tokenizer.added_tokens_decoder.items():
        if tok.special:
            assert vocab.token_bytes[i] is None, tok.content  # <|im_end|> can never be written
    text = 'Héllo 日本語 {"a": [1, 2.5]}\n\tend'
    assert vocab.join(tokenizer.encode(text, add_special_tokens=False)) == text.encode()
    printable = bytes([9, 10, *range(0x20, 0x7F)])
    assert vocab.join([vocab.byte_token(b) for b in printable]) == printable
    assert all(vocab.token_bytes[t].startswith(b' "') and len(vocab.token_bytes[t]) > 2 for t in vocab.tokens_with_prefix(b' "'))


def test_sentencepiece_vocabulary():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x0A>": 3, "<0xC3>": 4, "<0xA9>": 5, "\u2581": 6,
              "\u2581yes": 7, "y": 8, "es": 9, "yes": 10}
    tok = Tokenizer(models.BPE(vocab=pieces, merges=[("y", "es")], byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    v = TokenVocab.from_tokenizer(hf, [2])
    assert detect_kind(hf) == SENTENCEPIECE
    assert v.token_bytes[:8] == [None, None, None, b"\n", b"\xc3", b"\xa9", b" ", b" yes"]
    assert v.join([4, 5]).decode() == "é"
    assert v.outlines_eos_id == 2 and b"</s>" not in v.outlines_map()


# -- regex helpers and JSON Schema -------------------------------------------------------------
def test_escape_and_enum_regexes():
    for text in ["a.b*c", "(x|y)?", "$100 [ok] {1,2} ^ \\ +", "naïve 日本"]:
        assert re.fullmatch(escape(text), text)
    # one of a list of literals: an enum, whose members are escaped
    rx = schema_to_regex({"enum": ["yes", "no", "a.b"]})
    assert re.fullmatch(rx, '"a.b"') and not re.fullmatch(rx, '"axb"') and not re.fullmatch(rx, '"yes""no"')
    with pytest.raises(SchemaError, match="'enum'"):
        schema_to_regex({"enum": []})


def test_integer_ranges_are_exact():
    for lo, hi in [(0, 0), (0, 120), (7, 7), (13, 987), (-45, 3), (-300, -12), (1, None), (250, None),
                   (None, 77), (None, -5), (None, None), (-9, 1000)]:
        rx = re.compile(int_range_regex(lo, hi))
        for v in range(-1100, 1100):
            ok = (lo is None or v >= lo) and (hi is None or v <= hi)
            assert bool(rx.fullmatch(str(v))) == ok, (lo, hi, v)
        assert not rx.fullmatch("007") and not rx.fullmatch("-0")
        if hi is None:
            assert rx.fullmatch("1234567890123456") and not rx.fullmatch("12345678901234567")
    rx = re.compile(number_range_regex(-2, 5))
    for v, ok in [("-2", True), ("-2.0", True), ("-2.5", False), ("-1.99", True), ("0.5", True), ("4.999", True),
                  ("5", True), ("5.00", True), ("5.01", False), ("6", False), ("-0.3", True)]:
        assert bool(rx.fullmatch(v)) == ok, v


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_regex_admits_only_valid_json(name):
    schema = SCHEMAS[name]
    for ws in (None, r"[ ]?"):
        rx = schema_to_regex(schema, ws)
        for text in sample_strings(rx, 25, seed=hash(name) % 1000):
            jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_optional_properties_appear_and_disappear():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}}, "required": ["b"]}
    seen = {tuple(json.loads(t)) for t in sample_strings(schema_to_regex(schema), 200, seed=3)}
    assert {("b",), ("a", "b"), ("b", "c"), ("a", "b", "c")} <= seen


def test_whitespace_is_compact_by_default_and_configurable():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}}, "required": ["a", "b"]}
    rx = schema_to_regex(schema)
    assert re.fullmatch(rx, '{"a":1,"b":[2,3]}') and not re.fullmatch(rx, '{"a": 1,"b":[2,3]}')
    rx = schema_to_regex(schema, r"[ ]?")
    assert re.fullmatch(rx, '{ "a": 1, "b": [2, 3] }') and not re.fullmatch(rx, '{"a":  1,"b":[]}')
    with pytest.raises(ValueError, match="whitespace_pattern"):
        schema_to_regex(schema, r"[ x]*")


@pytest.mark.parametrize(
    "schema, keyword",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
        ({"type": "object", "patternProperties": {"^x": {"type": "string"}, "^xy": {"type": "integer"}}},
         "patternProperties"),
        ({"type": "number", "exclusiveMinimum": 1e12 + 0.5}, "exclusiveMinimum"),  # open bounds past 1e9
        ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
        ({"allOf": [{"type": "string", "pattern": "^a+$"}, {"type": "string", "pattern": "^b+$"}]}, "allOf"),
        ({"type": "integer", "multipleOf": 3}, "multipleOf"),
        ({"not": {"required": ["x"]}}, "not"),
        ({"type": "object", "minProperties": 2}, "minProperties"),
        ({"type": "string", "format": "color"}, "format"),
        ({"type": "string", "pattern": "^[a-z](?!a)[a-z]$"}, "pattern"),  # (right after ^ is read: coverage)
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
        ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
          "$ref": "#/$defs/n"}, "$ref"),
        ({"$ref": "#/$defs/missing"}, "$ref"),
        ({"type": "strin"}, "type"),
        ({"type": "object", "required": ["x"], "additionalProperties": False}, "additionalProperties"),
    ],
)
def test_unenforceable_keywords_are_rejected_by_name(schema, keyword):
    with pytest.raises(SchemaError, match=re.escape(keyword)):
        schema_to_regex(schema)


def test_unknown_keywords_are_annotations_and_do_not_constrain():
    """Per the JSON Schema specification, keywords a draft does not define (and vendor
    keys) are ignored: the constraint is the one of the schema without them."""
    plain = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "b": {"type": "string", "maxLength": 3}}, "required": ["a"]}
    noisy = {"id": "http://example.com/s#", "readonly": True, "self": {"href": "x"}, "javaType": "com.x.Y",
             "preferredOrder": ["a"], "frobnicate": 1, **plain,
             "properties": {"a": {**plain["properties"]["a"], "example": 3, "name": "a", "_format": "int"},
                            "b": {**plain["properties"]["b"], "x-nullable": True, "nullable": True}}}
    assert schema_to_regex(noisy) == schema_to_regex(plain)
    # known validation keywords that cannot be enforced are still refused by name
    with pytest.raises(SchemaError, match="'not'"):
        schema_to_regex({**noisy, "not": {"enum": [{"a": 1}]}})


def test_schema_errors_are_value_errors_with_the_path():
    with pytest.raises(ValueError, match=r"#/properties/tags"):
        schema_to_regex({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
    with pytest.raises(ValueError, match="not valid JSON"):
        schema_to_regex("{nope")


@pytest.mark.parametrize("backend", ["auto", "llguidance", "outlines"])
def test_a_schema_string_that_is_not_json_is_reported_once(backend):
    # auto tries two backends; each used to add its own "not valid JSON" to the message
    from plait.errors import RequestError
    from plait.runtime.sampling_params import SamplingParams

    with pytest.raises(RequestError) as info:
        SamplingParams.from_dict({"json_schema": '{"type": "object",', "grammar_backend": backend}).constraint()
    assert info.value.param == "json_schema" and info.value.message.count("not valid JSON") == 1, info.value.message
    assert info.value.message.startswith("json_schema is not valid JSON: Expecting")


# -- jump-forward automaton ----------------------------------------------------------------------
def test_char_automaton_forced_text():
    auto = CharAutomaton.from_regex(r'\{"name":"[a-z]{1,3}","age":[0-9]\}')
    assert auto.forced[auto.initial] == '{"name":"'
    s = auto.walk(auto.initial, '{"name":"ab')
    assert s not in auto.forced  # a letter or the closing quote may follow
    s = auto.walk(auto.initial, '{"name":"abc')
    assert auto.forced[s] == '","age":'
    s = auto.walk(auto.initial, '{"name":"abc","age":7')
    assert auto.forced[s] == "}"
    assert auto.walk(auto.initial, '{"nome"') is None
    auto = CharAutomaton.from_regex(r"(yes|no)")
    assert auto.initial not in auto.forced and auto.forced[auto.walk(auto.initial, "y")] == "es"


# -- compilation -------------------------------------------------------------------------------------
def test_compiler_caches_by_pattern_and_tokenizer(compiler, vocab):
    a = build(compiler, r"(yes|no)")
    assert a.grammar is not None and a.key == (vocab.fingerprint, r"(yes|no)")
    hits = compiler.cache_hits
    assert compiler.request(r"(yes|no)") is a and compiler.cache_hits == hits + 1
    bad = build(compiler, r"a{3,1}")
    assert bad.error is not None and "cannot be compiled" in bad.error
    assert build(compiler, r"(?<=a)b").error is not None
    assert build(compiler, r"[0-9]{2}").grammar is not None  # the worker goes on
    # an integer bound of 309 digits is 277 nested groups, past outlines-core's parser: said so
    # (it was put down to look-around or unordered repetition bounds)
    deep = build(compiler, schema_to_regex({"type": "integer", "minimum": 1e308}, None))
    assert "nests groups 277 levels deep" in deep.error and "repetition bounds" not in deep.error, deep.error


def test_compiler_time_and_memory_limits(vocab):
    c = GrammarCompiler(vocab, timeout_s=0.3, memory_mb=300)
    try:
        slow = build(c, r'"[^"\\]{0,300}"')
        assert "grammar_compile_timeout" in slow.error and "0.3 s" in slow.error
        big = GrammarCompiler(vocab, timeout_s=60, memory_mb=300)
        try:
            huge = build(big, r"[a-z]*a[a-z]{14}")  # a DFA of 2^15 states times the vocabulary
            assert "grammar_compile_memory_mb" in huge.error and "300 MiB" in huge.error
            assert build(big, r"(yes|no)").grammar is not None  # a fresh worker takes the next build
        finally:
            big.close()
        assert build(c, r"[a-c]").grammar is not None
        assert c.request(r'"[^"\\]{0,300}"').error == slow.error  # failures are cached too
        # ... a build past its time only for TIMEOUT_RETRY_S: it may have been slow because the
        # machine was busy (it was a lasting refusal); other failures stay
        cached = c.request(r'"[^"\\]{0,300}"')
        assert cached.retry_at is not None and bad_is_kept(c)
        cached.retry_at = time.monotonic() - 1
        again = c.request(r'"[^"\\]{0,300}"')
        assert again is not cached and c.cached(r'"[^"\\]{0,300}"') is again
    finally:
        c.close()


def bad_is_kept(c) -> bool:
    """A failure that is the pattern's (not its time) stays cached without a retry time."""
    bad = build(c, r"(?<=a)b")
    return bad.error is not None and bad.retry_at is None and c.request(r"(?<=a)b") is bad


def test_a_pattern_whose_whole_index_cannot_be_built_is_refused_not_cut_short(vocab):
    """outlines-core's index drops the tokens that continue a match past a point where it
    could end; the index built with the end sentinel has no such gap, but on some patterns
    it runs out of memory (long digit runs in alternatives: an int64 range). The plain
    index then wrote '1' for '1' followed by 17 more digits: now the constraint is refused,
    naming the backend that compiles it."""
    c = GrammarCompiler(vocab, timeout_s=120, memory_mb=300, jump_forward=True)  # (the whole build: 20 s)
    try:
        cut = build(c, "1[0-9]{17}|2[0-9]{1,17}")
        assert cut.error is not None and "cutting replies short" in cut.error and "llguidance" in cut.error
        assert build(c, "[0-9]+([.][0-9]+)?").grammar.sentinel is not None  # the worker goes on
    finally:
        c.close()


def test_a_slow_outlines_build_does_not_hold_up_other_constraints(vocab, monkeypatch):
    """One worker built one index at a time: a regex whose build runs to the time limit
    held every new regex of every client behind it. Once the build in flight has run past
    SLOW_BUILD_S, a new constraint goes to another worker (and is found there again)."""
    from plait.runtime.constrained import backend
    from plait.runtime.sampling_params import Constraint

    monkeypatch.setattr(backend, "SLOW_BUILD_S", 0.5)
    g = backend.Grammars(lambda: vocab, timeout_s=120, memory_mb=2048, cache_size=16, jump_forward=False)
    try:
        slow = g.request(Constraint("regex", r'"[^"\\]{0,1000}"'))  # seconds of outlines-core's walk
        queued = g.request(Constraint("regex", "[a-c]{3}"))  # just after: behind it, on the same worker
        while not g.compiler(backend.OUTLINES).stalled(0.5):
            g.wait(0.1)
        quick = g.request(Constraint("regex", "[0-9]{2}"))
        while not quick.done:
            g.wait(0.1)
        assert quick.grammar is not None and not slow.done and not queued.done
        assert sorted(g.compilers) == [backend.OUTLINES, f"{backend.OUTLINES}#2"]
        assert g.request(Constraint("regex", "[0-9]{2}")) is quick
        while g.busy:
            g.wait(0.5)
        assert slow.done and queued.grammar is not None
    finally:
        g.close()


# -- matcher ---------------------------------------------------------------------------------------
def allowed_ids(m: GrammarMatcher, eos_ok: bool = True) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(m.allowed(eos_ok).view(np.uint8), bitorder="little"))


@pytest.mark.parametrize("name", sorted(REGEXES))
def test_random_decoding_matches_the_regex(compiler, vocab, name):
    rx = REGEXES[name]
    g = build(compiler, rx)
    rng = random.Random(7)
    for trial in range(6):
        m = GrammarMatcher(g, jump_forward=trial % 2 == 0)
        assert m.start([5000]) == 0
        out: list[int] = []
        while not m.terminated:
            ids = allowed_ids(m)
            assert len(ids) and all(vocab.token_bytes[i] is not None or i in EOS for i in ids)
            t = int(rng.choice(ids))
            if t in EOS:
                assert m.is_final
                break
            assert m.advance(t)
            out.append(t)
            jumped = m.jump_forward(t, 100)
            if jumped:
                out[-1:] = jumped
        text = vocab.join(out).decode()
        assert re.fullmatch(rx, text), (name, text)


def test_final_states_allow_every_eos_id(compiler):
    g = build(compiler, r"[0-9]{1,2}")
    m = GrammarMatcher(g)
    m.start([5000])
    assert not set(EOS) & set(allowed_ids(m))
    (one,) = g.grammar.vocab.ids_of(b"1")
    assert m.advance(one) and m.is_final and not m.terminated
    assert set(EOS) <= set(allowed_ids(m)) and not set(EOS) & set(allowed_ids(m, eos_ok=False))


def test_healing_lets_the_model_write_its_own_token(compiler, tokenizer):
    g = build(compiler, r"(yes|no)")
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in (" yes", " no"))
    plain_yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    prompt = tokenizer.encode("Is it raining? Answer: ", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(prompt[-1]) == "\u0120"  # the prompt ends on a lone space
    m = GrammarMatcher(g)
    assert m.start(prompt) == 1 and m.healed_text == " "
    ids = set(allowed_ids(m))
    assert {yes, no} <= ids and plain_yes not in ids  # ' yes' is allowed, 'yes' after a lone ' ' is not
    assert m.advance(yes) and m.terminated
    # no token crosses 'Answer:' + (yes|no) other than by itself: nothing is healed
    m2 = GrammarMatcher(g)
    assert m2.start(tokenizer.encode("Answer:", add_special_tokens=False)) == 0
    assert plain_yes in set(allowed_ids(m2))


def test_jump_forward_retokenizes_at_the_boundary(compiler, tokenizer, vocab):
    rx = r'\{"name":"[A-Za-z]{1,8}","city":"(Paris|Rome)"\}'
    g = build(compiler, rx)
    m = GrammarMatcher(g)
    m.start([5000])
    (brace,) = vocab.ids_of(b"{")
    assert m.advance(brace)
    jumped = m.jump_forward(brace, 100)
    # '{' + '"name":"' written as the tokenizer writes it, minus the last token when a longer
    # one could continue into the value
    text = vocab.join(jumped).decode()
    assert '{"name":"'.startswith(text) and len(text) > 1
    assert jumped == tokenizer.encode(text, add_special_tokens=False)
    assert m.jump_forward(brace, 0) is None


# -- masks -------------------------------------------------------------------------------------------
def test_mask_unpacking_and_mixed_batches(compiler):
    rng = np.random.default_rng(0)
    bits = rng.random((3, 100)) < 0.3
    words = np.packbits(np.pad(bits, ((0, 0), (0, 28))), axis=1, bitorder="little").view(np.int32)
    assert torch.equal(unpack_bits(torch.from_numpy(words), 100), torch.from_numpy(bits))

    class R:  # the two attributes apply_grammar_masks reads
        def __init__(self, grammar, ignore_eos=False):
            self.grammar = grammar
            self.params = type("P", (), {"ignore_eos": ignore_eos})()

    g = build(compiler, r"(yes|no)")
    m = GrammarMatcher(g)
    m.start([5000])
    logits = torch.randn(3, 49152)
    before = logits.clone()
    apply_grammar_masks(logits, [R(None), R(m), R(None)])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = set(torch.isfinite(logits[1]).nonzero().flatten().tolist())
    assert finite == set(allowed_ids(m).tolist()) and len(finite) >= 2



def test_forced_opening_text_is_written_before_the_first_step(compiler, tokenizer, vocab):
    g = build(compiler, r'\{"name":"[A-Za-z]{1,8}"\}')
    m = GrammarMatcher(g)
    m.start([5000])
    opening = m.jump_start(100)
    text = vocab.join(opening).decode()
    assert text and '{"name":"'.startswith(text) and opening == tokenizer.encode(text, add_special_tokens=False)
    rest = '{"name":"'[len(text):] + "Ada"
    for t in tokenizer.encode(rest, add_special_tokens=False):
        assert m.advance(t)
    assert not m.is_final and m.advance(vocab.ids_of(b'"}')[0]) and m.terminated
    m2 = GrammarMatcher(g, jump_forward=False)
    m2.start([5000])
    assert m2.jump_start(100) == []


def test_sampling_params_validate_constraints_naming_the_field():
    from plait.errors import RequestError
    from plait.runtime.sampling_params import Constraint, SamplingParams

    p = SamplingParams.from_dict({"json_schema": json.dumps({"type": "integer", "minimum": 1, "maximum": 9})})
    assert p.constraint("outlines").grammar == "[1-9]" and SamplingParams.from_dict(p).constraint("outlines").grammar == "[1-9]"
    assert p.constraint().kind == "json_schema"
    auto = SamplingParams.from_dict({"regex": "a+"}).constraint()
    assert (auto.kind, auto.grammar, auto.backend, auto.unique) == ("regex", "a+", "outlines", "")
    # auto's choice is marked (a regex whose outlines-core build fails for time or memory is then built on
    # llguidance); a backend named is not
    assert auto.auto and not SamplingParams.from_dict({"regex": "a+"}).constraint("outlines").auto
    assert SamplingParams.from_dict({"regex": "a+"}).constraint("outlines") == Constraint("regex", "a+")
    assert SamplingParams().constraint() is None
    for bad, field in [({"regex": "(a"}, "regex"), ({"regex": 5}, "regex"), ({"json_schema": 5}, "json_schema"),
                       ({"json_schema": {"type": "object", "not": {}}}, "'not'"),
                       ({"regex": "a", "json_schema": {}}, "json_schema"),
                       ({"whitespace_pattern": "[ ]?"}, "whitespace_pattern"),
                       ({"json_schema": {}, "whitespace_pattern": r"\s*"}, "whitespace_pattern")]:
        with pytest.raises(RequestError, match=re.escape(field)) as info:
            SamplingParams.from_dict(bad).constraint()  # fields checked, then translated once
        assert info.value.param in ("regex", "json_schema", "whitespace_pattern")


def _duration_ok(s: str) -> bool:
    """RFC 3339 appendix A, parsed by hand (not by a regex)."""
    if not s.startswith("P") or len(s) < 3:
        return False
    body, _, time_part = s[1:].partition("T")
    if "T" in s and not time_part:
        return False

    def units(text: str, order: str) -> str | None:
        got, num = "", ""
        for ch in text:
            if ch.isdigit():
                num += ch
            elif ch in order and num and (not got or order.index(ch) > order.index(got[-1])):
                got, num = got + ch, ""
            else:
                return None
        return None if num else got

    date, time_units = units(body, "YMWD"), units(time_part, "HMS") if time_part else ""
    if date is None or time_units is None:
        return False
    if "W" in date:
        return date == "W" and not time_part
    contiguous = lambda u, order: u == "" or u in {order[i:j] for i in range(len(order)) for j in range(i + 1, len(order) + 1)}  # noqa: E731
    return (date or time_units) != "" and contiguous(date, "YMD") and contiguous(time_units, "HMS")


def _hostname_ok(s: str) -> bool:
    labels = s.split(".")
    return len(s) <= 253 and all(
        1 <= len(x) <= 63 and x[0] != "-" and x[-1] != "-" and all(c.isascii() and (c.isalnum() or c == "-") for c in x)
        for x in labels
    )


def _uri_chars_ok(s: str) -> bool:
    allowed = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~!$&'()*+,;=:@/?#%")
    return set(s) <= allowed and all(
        len(s) > i + 2 and all(c in "0123456789abcdefABCDEF" for c in s[i + 1 : i + 3])
        for i, c in enumerate(s) if c == "%"
    )


@pytest.mark.parametrize("fmt,ok", [
    ("ipv6", lambda s: bool(__import__("ipaddress").IPv6Address(s))),
    ("hostname", _hostname_ok),
    ("duration", _duration_ok),
    ("uri", lambda s: _uri_chars_ok(s) and __import__("urllib.parse").parse.urlsplit(s).scheme in ("http", "https")
     and bool(__import__("urllib.parse").parse.urlsplit(s).netloc)),
    ("uri-reference", lambda s: _uri_chars_ok(s) and s.count("#") <= 1),
])
def test_more_formats_admit_only_valid_values(fmt, ok):
    """Checked by independent code (ipaddress, a hand-written parser), since jsonschema's
    format checkers for these need optional packages."""
    schema = {"type": "string", "format": fmt}
    rx = schema_to_regex(schema)
    values = [json.loads(t) for t in sample_strings(rx, 300, seed=len(fmt))]
    assert len(set(values)) > 50, values[:10]
    for v in values:
        assert ok(v), (fmt, v)
        jsonschema.validate(v, schema, format_checker=jsonschema.FormatChecker())
    for bad in {"ipv6": ["1:2:3:4:5:6:7:8:9", ":::", "12345::", "g::"], "hostname": ["-a.com", "a..b", "a_b"],
                "duration": ["P", "PT", "P1S", "PT1D", "P1W1D", "P1M1Y"],
                "uri": ["ftp://x", "http://", "http://a/%zz"], "uri-reference": ["a b", "%g0", "a#b#c"]}[fmt]:
        assert not re.fullmatch(rx, json.dumps(bad)), (fmt, bad)


def test_number_ranges_with_open_integral_bounds_are_exact():
    """Every bound pair (open or closed) against exact rational arithmetic: no number
    outside is admitted, every canonical number inside is."""
    import itertools
    from fractions import Fraction

    values = {f"{sign}{ip}{fr}" for ip in [*range(13), 99, 100, 101, 999, 1000]
              for fr in ("", ".0", ".00", ".5", ".05", ".9", ".001", ".10", ".99") for sign in ("", "-")}
    for lo, hi in itertools.product([None, -10, -3, -1, 0, 1, 2, 7, 100], repeat=2):
        for lo_open, hi_open in itertools.product([False, True], repeat=2):
            if (lo is None and lo_open) or (hi is None and hi_open):
                continue
            empty = lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_open or hi_open)))
            if empty:
                with pytest.raises(SchemaError):
                    number_range_regex(lo, hi, lo_open, hi_open)
                continue
            rx = re.compile(number_range_regex(lo, hi, lo_open, hi_open))
            for text in values:
                v = Fraction(text)
                inside = (lo is None or (v > lo if lo_open else v >= lo)) and \
                    (hi is None or (v < hi if hi_open else v <= hi))
                canonical = not (text.startswith("-0") and v == 0) and not (
                    "." in text and text.endswith("0") and not text.endswith(".0"))
                assert not rx.fullmatch(text) or inside, (lo, hi, lo_open, hi_open, text)
                assert rx.fullmatch(text) or not inside or not canonical, (lo, hi, lo_open, hi_open, text)
    schema = {"type": "object", "properties": {"price": {"type": "number", "exclusiveMinimum": 0},
                                               "t": {"type": "number", "minimum": -1, "exclusiveMaximum": 1}},
              "required": ["price", "t"]}
    for text in sample_strings(schema_to_regex(schema), 200, seed=3):
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("schema", [
    {"type": "integer", "multipleOf": 2}, {"type": "integer", "multipleOf": 5}, {"type": "integer", "multipleOf": 100},
    {"type": "number", "multipleOf": 1, "minimum": -5, "exclusiveMaximum": 12.5},
    {"type": "integer", "multipleOf": 1, "minimum": 3, "maximum": 40},
])
def test_multiple_of_in_the_forms_a_regex_enforces(schema):
    rx = schema_to_regex(schema)
    values = [json.loads(t) for t in sample_strings(rx, 200, seed=7)]
    assert len(set(values)) > 10
    for v in values:
        jsonschema.validate(v, schema)
    for bad in (3, 7, 55, 1001, -9) if schema.get("multipleOf") != 1 else (1.5, -6, 13):
        if not jsonschema.Draft202012Validator(schema).is_valid(bad):
            assert not re.fullmatch(rx, json.dumps(bad)), (schema, bad)


@pytest.mark.parametrize("schema", [
    # (bounded integer steps, steps of 2 and 5 with a type list, binary fractions: test_schema_numbers)
    {"type": "number", "multipleOf": 0.01}, {"type": "integer", "multipleOf": 3},
    {"type": "integer", "multipleOf": 7, "minimum": 0},
])
def test_other_multiple_of_forms_are_refused_by_name(schema):
    with pytest.raises(SchemaError, match="multipleOf"):
        schema_to_regex(schema)


@pytest.mark.parametrize("schema", [
    {"not": {"type": "string"}},
    {"type": ["string", "integer", "null"], "not": {"type": "null"}},
    {"type": "number", "not": {"type": "integer"}},
    {"type": "object", "properties": {"v": {"not": {"type": ["object", "array", "null"]}}}, "required": ["v"]},
])
def test_not_type_is_folded_into_the_allowed_types(schema):
    rx = schema_to_regex(schema)
    for text in sample_strings(rx, 150, seed=11):
        jsonschema.validate(json.loads(text), schema)
    with pytest.raises(SchemaError, match="'not'"):
        schema_to_regex({**schema, "not": {"minimum": 3}})  # other forms of `not` are still refused


@pytest.mark.parametrize("lo,hi", [(1, None), (0, 1), (2, 3), (4, 4), (3, None)])
def test_min_and_max_properties_count_the_written_properties(lo, hi):
    schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in "abcde"},
              "required": ["b"], "minProperties": lo, **({} if hi is None else {"maxProperties": hi})}
    rx = schema_to_regex(schema)
    for text in sample_strings(rx, 200, seed=lo * 10 + (hi or 0)):
        jsonschema.validate(json.loads(text), schema)
    for n in range(1, 6):  # b and the first n - 1 optional ones, in the schema's order
        keys = ["a", "b", *"cde"][: n] if n > 1 else ["b"]
        obj = {k: 1 for k in "abcde" if k in keys}
        allowed = lo <= n and (hi is None or n <= hi)
        assert bool(re.fullmatch(rx, json.dumps(obj, separators=(",", ":")))) == allowed, (lo, hi, obj)
    for bad in ({"b": 1, "a": 2, "c": 3, "d": 4, "e": 5, "f": 6}, {}, {"a": 1}):
        if not jsonschema.Draft202012Validator(schema).is_valid(bad):
            assert not re.fullmatch(rx, json.dumps(bad, separators=(",", ":")))


def test_property_counts_need_listed_properties():
    with pytest.raises(SchemaError, match="minProperties"):  # free-form keys could repeat
        schema_to_regex({"type": "object", "minProperties": 2})
    with pytest.raises(SchemaError, match="at most 8 optional"):
        schema_to_regex({"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(9)},
                         "maxProperties": 2})
    with pytest.raises(SchemaError, match="no object"):
        schema_to_regex({"type": "object", "properties": {"a": {"type": "null"}}, "minProperties": 2})


def test_open_bounds_survive_float_parsing():
    """Validators parse JSON numbers as floats: nothing the regex admits may round onto
    an open bound (1.9999999999999999 is 2.0 as a float)."""
    for schema in ({"type": "number", "exclusiveMaximum": 2}, {"type": "number", "exclusiveMinimum": 2},
                   {"type": "number", "exclusiveMinimum": -2, "maximum": 0}, {"type": "number", "not": {"type": "integer"}}):
        rx = schema_to_regex(schema)
        for text in ("1.9999999999999999", "2.0000000000000001", "-1.9999999999999999", "3.0000000000000001"):
            if re.fullmatch(rx, text):
                assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(text)), (schema, text)
        for text in sample_strings(rx, 300, seed=5):
            jsonschema.validate(json.loads(text), schema)


def test_translation_has_a_time_limit(monkeypatch):
    """A schema that is slow to translate (simulated: a clock that jumps) is a clear
    SchemaError naming json_schema, never an unbounded stall."""
    from plait.runtime.constrained import json_schema as js

    ticks = iter(range(0, 10**6, 3))  # every look at the clock: 3 s later
    monkeypatch.setattr(js.time, "monotonic", lambda: float(next(ticks)))
    with pytest.raises(SchemaError, match="json_schema took longer than"):
        schema_to_regex({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})


@pytest.mark.parametrize("deps", [
    {"dependentRequired": {"card": ["billing"]}},
    {"dependencies": {"card": ["billing"], "billing": ["name"]}},  # draft 7's form
    {"dependentRequired": {"name": ["card"]}, "minProperties": 2},
])
def test_dependent_required_writes_a_property_only_with_its_dependencies(deps):
    schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9}
                                               for k in ("name", "card", "billing", "note")}, **deps}
    rx = schema_to_regex(schema)
    cls = jsonschema.Draft7Validator if "dependencies" in deps else jsonschema.Draft202012Validator
    for text in sample_strings(rx, 200, seed=13):
        cls(schema).validate(json.loads(text))
    import itertools

    for n in range(5):  # every subset, in the schema's order: admitted exactly when valid
        for keys in itertools.combinations(["name", "card", "billing", "note"], n):
            obj = {k: 1 for k in keys}
            validator = jsonschema.Draft7Validator if "dependencies" in deps else jsonschema.Draft202012Validator
            valid = validator(schema).is_valid(obj)
            assert bool(re.fullmatch(rx, json.dumps(obj, separators=(",", ":")))) == valid, (deps, obj)
    with pytest.raises(SchemaError, match="dependencies"):  # neither a name list nor a schema: refused
        schema_to_regex({**schema, "dependencies": {"card": "billing"}})


# -- patterns read for llguidance (value_pattern) and ECMA-262 spellings (issue 14) --------------
VALUE_PATTERNS = [
    r"^\d{2}-\w+$", r"^[^\s-]+$", r"\S+@\S+", r"^(?:[01]\d|2[0-3]):[0-5]\d$", r"[\w.-]+/[\w.-]+",
    r'^[^"\\]*$', r"^a.b$", r"^[^é]x", r"^\D\W\s$", r"(npm|yarn)@\d+\.\d+(-.+)?",
    # ECMA-262 spellings Python's re reads differently (a named group; '-' next to a class escape)
    r"^(?<major>0|[1-9]\d*)\.(?<minor>\d+)$", r"^[\w-_.]+/[\w-_.]+$",
]


@pytest.mark.parametrize("pattern", VALUE_PATTERNS)
def test_value_pattern_admits_only_strings_the_pattern_matches(pattern):
    """Each string of ``value_pattern(p)`` (a full match, read by Python here: its output
    is the syntax both Rust and Python read alike) contains a match of ``p`` as Python
    reads it (ECMA-262 spellings through ``ecma_to_python``), and a string with a
    non-ASCII digit or letter where ``\\d``/``\\w`` stand is left out (the narrowing)."""
    from plait.runtime.constrained.json_schema import ecma_to_python, value_pattern

    from regex_sampling import sample

    vp = value_pattern(pattern, "#")
    assert vp.startswith("^(?:") and vp.endswith(")$")
    python = re.compile(ecma_to_python(pattern))
    texts = sample(vp[1:-1], 200, seed=5)  # its pool has non-ASCII characters for negated classes
    assert len(texts) == 200
    for t in texts:
        assert re.fullmatch(vp, t) and python.search(t), (pattern, t)
    if pattern.startswith(r"^\d{2}"):
        assert not re.fullmatch(vp, "١٢-x") and python.search("١٢-x")  # narrowed: valid, but not written


def test_ecma_to_python_rewrites_only_what_python_reads_differently():
    from plait.runtime.constrained.json_schema import ecma_to_python

    assert ecma_to_python(r"(?<y>\d{4})-(?<m>\d\d)") == r"(?P<y>\d{4})-(?P<m>\d\d)"
    assert ecma_to_python(r"(?<=a)b(?<!c)") == r"(?<=a)b(?<!c)"  # look-behinds stay (and are refused later)
    assert ecma_to_python(r"[\w-_.][a-\d]") == r"[\w\-_.][a\-\d]"
    assert ecma_to_python(r"[a-z][\\-a]\[\w-x\]") == r"[a-z][\\-a]\[\w-x\]"  # ranges, escaped brackets untouched
    assert ecma_to_python(r"[]a-][^]b]") == r"[]a-][^]b]"
    assert re.fullmatch(ecma_to_python(r"[\w-_]+"), "a-_") and not re.fullmatch(ecma_to_python(r"[\w-_]+"), "+")


@pytest.mark.parametrize("deps", [
    {"dependentSchemas": {"card": {"required": ["billing"]}}},
    {"dependencies": {"card": {"required": ["billing"]}, "billing": ["name"]}},  # draft 7: a schema and a list
    {"dependentSchemas": {"name": {"not": {"required": ["note"]}}, "card": True, "note": False}},
])
def test_schema_dependencies_write_a_property_only_where_its_schema_holds(deps):
    """A schema dependency is ``anyOf`` [the name absent, the name present and the
    schema holding]: every subset of the properties is admitted exactly when valid."""
    import itertools

    schema = {"type": "object", "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9}
                                               for k in ("name", "card", "billing", "note")}, **deps}
    rx = schema_to_regex(schema)
    validator = (jsonschema.Draft7Validator if "dependencies" in deps else jsonschema.Draft202012Validator)(schema)
    for text in sample_strings(rx, 200, seed=13):
        validator.validate(json.loads(text))
    for n in range(5):  # every subset, in the schema's order
        for keys in itertools.combinations(["name", "card", "billing", "note"], n):
            obj = {k: 1 for k in keys}
            assert bool(re.fullmatch(rx, json.dumps(obj, separators=(",", ":")))) == validator.is_valid(obj), obj


def test_pattern_except_matches_every_string_but_the_words():
    """``not: {enum: [strings]}`` for llguidance: a ``pattern`` (full match) of the other strings."""
    from plait.runtime.constrained.json_schema import _pattern_except

    words = ["ab", "abc", "x:y", "", "a.b", "é"]
    rx = re.compile(_pattern_except(words))
    probes = ["a", "abd", "abcd", "x:", "x:yz", "b", "\n", "ab\n", "a-b", "axb", "ée", "e", "\u00e9\u00e9", "x:y "]
    for w in words:
        assert rx.fullmatch(w) is None, w
    for p in probes:
        assert rx.fullmatch(p), p


@pytest.mark.parametrize(
    "regex,text",
    [
        (r"[0-9]+(\.[0-9]+)?", "3.14"),  # a float's decimal point after digits that could end it
        (r"(ab)?", "ab"),  # the empty output is complete, "ab" too
        (r"[a-z]+( [a-z]+)*", "one two three"),
        (r"-?[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?", "-12.5e+3"),
    ],
)
def test_tokens_leaving_a_final_state_stay_allowed(compiler, vocab, regex, text):
    """outlines-core drops tokens that lead from a state where the pattern could end to
    one where it cannot yet (worker.py's end sentinel): each byte of ``text``, written
    one single-byte token at a time, must stay allowed, and EOS exactly where the
    prefix matches."""
    g = build(compiler, regex)
    assert g.error is None, g.error
    m = GrammarMatcher(g, jump_forward=False)
    m.start([5000])
    data = text.encode()
    for k, byte in enumerate(data):
        ids = set(allowed_ids(m).tolist())
        assert bool(set(EOS) & ids) == bool(re.fullmatch(regex, data[:k].decode())), (regex, data[:k])
        tok = vocab.byte_token(byte)
        assert tok in ids, (regex, data[:k], chr(byte))
        assert m.advance(tok)
    assert m.is_final and set(EOS) <= set(allowed_ids(m).tolist())


def test_the_end_sentinel_is_never_written(compiler, vocab):
    """Under the sentinel no token holding its first byte (plane 16, U+100000..U+10FFFF)
    is offered, even where the pattern allows any character; a pattern that names a
    plane-16 character is built without the sentinel and can write it."""
    g = build(compiler, r".{0,3}")
    m = GrammarMatcher(g, jump_forward=False)
    m.start([5000])
    ids = allowed_ids(m)
    assert len(ids) > 1000
    assert not any(vocab.token_bytes[i] and 0xF4 in vocab.token_bytes[i] for i in ids)
    assert g.grammar.sentinel is not None and g.grammar.sentinel not in ids.tolist()
    plane16 = build(compiler, "x\U0010fffdy")
    assert plane16.error is None and plane16.grammar.sentinel is None
    m = GrammarMatcher(plane16, jump_forward=False)
    m.start([5000])
    for byte in "x\U0010fffdy".encode():
        tok = vocab.byte_token(byte)
        assert tok in allowed_ids(m).tolist() and m.advance(tok)
    assert m.is_final
