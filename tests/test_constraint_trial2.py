"""Constraints as users send them, second trial: GBNF grammars as written for llama.cpp /
SGLang and regexes past what an automaton builds quickly. Each either compiles and is
enforced soundly (random outputs of the matcher checked against a reference written
here: a Python regex of the same language) or is refused with a 400 naming the field."""

from __future__ import annotations

import re

import pytest

from plait.errors import RequestError
from plait.runtime.constrained.llguidance_backend import gbnf_for_llguidance
from plait.runtime.sampling_params import SamplingParams
from test_llguidance import admits, compiled, grammars, random_output, tokenizer, vocab  # noqa: F401 (fixtures)


def matcher(grammars, params: dict):
    c, fut = compiled(grammars, params)
    m = grammars.matcher(fut, c, jump_forward=False, heal=False)
    m.start([1])
    return m


# GBNF -> the same language as a Python regex (llama.cpp's reading), texts in it, texts outside it
GBNF_CHARACTERS = {
    # \u / \U escapes lost their leading zeros in llguidance's conversion to Lark: refused
    # as invalid escapes, or read as another character
    "u_escape_in_a_class": (r"root ::= [a-z\u00e0-\u00ff]+", r"[a-z\u00e0-\u00ff]+", ["caf\u00e9"], ["E", "\u0100"]),
    "u_escape_then_hex_digits": (r'root ::= "\u00410000"', "A0000", ["A0000"], ["\u410000"]),
    "u_escape_below_0x20": (r'root ::= "\"" [^\u0000-\u001F\u0022]+ "\""', r'"[^\x00-\x1f"]+"', ['"a b"'], ['"\n"']),
    "big_u_escape": (r"root ::= [\U0001F600-\U0001F64F]+", "[\U0001F600-\U0001F64F]+", ["\U0001F600"],
                    ["\U0001F680"]),
    "u_escape_of_a_quote": (r'root ::= "\u0022" [a-z]+ "\u0022"', r'"[a-z]+"', ['"a"'], ["'a'"]),
    # '.' is any character in llama.cpp, newlines too (the conversion's /./ left them out)
    "dot_is_any_character": (r'root ::= . . "\""', r'(?s:..)"', ['a\n"', '\n\n"'], ["ab"]),
    # doubled &, ~, - in a class are plain characters in GBNF, set operations in Rust's regex
    "and_and_in_a_class": (r"root ::= [a&&b]+", r"[a&b]+", ["a&b"], ["c"]),
    "range_to_a_hyphen": (r"root ::= [+--]+", r"[+,\-]+", ["+,-"], ["."]),
    "tilde_tilde_in_a_class": (r"root ::= [~~x]+", r"[~x]+", ["~x"], ["y"]),
}


@pytest.mark.parametrize("name", sorted(GBNF_CHARACTERS))
def test_gbnf_characters_mean_what_llama_cpp_reads(grammars, vocab, name):
    text, reference, inside, outside = GBNF_CHARACTERS[name]
    for seed in range(4):
        out = random_output(matcher(grammars, {"ebnf": text}), vocab, seed, cap=12)
        assert out is not None and re.fullmatch(reference, out.decode()), out
    for good in inside:
        assert re.fullmatch(reference, good) and admits(matcher(grammars, {"ebnf": text}), vocab, good), good
    for bad in outside:
        assert not admits(matcher(grammars, {"ebnf": text}), vocab, bad), bad


@pytest.mark.parametrize("text, good, bad", [
    ('root ::= "x" start\nstart ::= "a"', "xa", "a"),  # taken for Lark (its start rule: "a")
    ('root ::= start start-rule\nstart ::= "a"\nstart-rule ::= "b" # start\n', "ab", "b"),
])
def test_a_gbnf_rule_named_start_is_a_gbnf_rule(grammars, vocab, text, good, bad):
    assert admits(matcher(grammars, {"ebnf": text}), vocab, good)
    assert not admits(matcher(grammars, {"ebnf": text}), vocab, bad)


def test_gbnf_rewrite_leaves_comments_lark_and_other_escapes_alone(grammars, vocab):
    text = 'root ::= "a" [\\]\\\\-] # not a class: [&& \\u0041 "\nb ::= "\\x41"'
    assert gbnf_for_llguidance(text) == text
    assert gbnf_for_llguidance(r'root ::= "\u00e9\u4E00\U0001F600"') == 'root ::= "\\xE9\u4e00\U0001F600"'
    assert gbnf_for_llguidance(r"root ::= [\uD800]") == r"root ::= [\uD800]"  # a surrogate: refused by the conversion
    lark = 'start: "\\u00e9" /[a-c&&b]/'  # Lark reads its own escapes and Rust's class syntax: not rewritten
    assert admits(matcher(grammars, {"ebnf": lark}), vocab, "\u00e9b")


# -- counted repetitions on the outlines backend ----------------------------------------------------
def test_counted_repetitions_past_the_limit_are_found_in_one_pass():
    from plait.runtime.constrained.worker import MAX_REPEAT_EXPANSION, counted_repetition_too_large as too_large

    assert MAX_REPEAT_EXPANSION == 10_000
    for ok in ["a{10001}", "(ab){5001}", "(?:ab){5001}", "(?P<x>ab){5001}", "(?i)(ab){5001}", "x{2}{3}",
               "-?(?:0|[1-9][0-9]{0,15})", r"[\]a]{10001}", "a{5000}b{5000}c{5000}"]:
        assert too_large(ok) is None, ok
    for bad, where in [("a{100000}", "{100000} at position 1"), ("(a{1000}){1000}", "{1000} at position 9"),
                       ("[a-z]{1,100000}", "{1,100000} at position 5"), ("(?:ab){5002}", "{5002}"),
                       (r"\x{41}{20000}", "{20000}"), ("[]a]{20000}", "{20000}"), ("a{10002,}", "{10002,}")]:
        why = too_large(bad)
        assert why is not None and where in why and "llguidance" in why, (bad, why)


def test_a_huge_counted_repetition_is_refused_before_the_build(vocab):
    # outlines-core wrote every copy out and ran into the time limit, holding the one
    # compile worker (every other outlines compile waited) all that time
    # (the message is the pre-build check's: a build past the limit says it took too long)
    from plait.runtime.constrained.compiler import GrammarCompiler

    c = GrammarCompiler(vocab, timeout_s=15)
    try:
        fut = c.request("a{100000}")
        while not fut.done:
            c.wait(0.2)
        assert "the counted repetition {100000} at position 1" in fut.error and "at most 10000" in fut.error, fut.error
        quick = c.request("(yes|no){2}")
        while not quick.done:
            c.wait(0.2)
        assert quick.grammar is not None
    finally:
        c.close()


# -- llguidance computations that never end -------------------------------------------------------
HANGING = r'''
import json, sys
from transformers import AutoTokenizer
from plait.runtime.constrained import llguidance_backend as llg
from plait.runtime.constrained.backend import Grammars
from plait.runtime.constrained.vocab import TokenVocab
from plait.runtime.sampling_params import SamplingParams

llg.MASK_TIMEOUT_S = 0.5
vocab = TokenVocab.from_tokenizer(AutoTokenizer.from_pretrained(sys.argv[1]), (0, 2), 49152)
grammars = Grammars(lambda: vocab, timeout_s=2, memory_mb=2048, cache_size=8, jump_forward=True)
out = {}

def compile(text):
    c = SamplingParams.from_dict({"ebnf": text}).constraint()
    fut = grammars.request(c)
    while not fut.done:
        grammars.wait(0.1)
    return c, fut

# the first mask never ends: two of them (as many as the compile threads), then a plain grammar
out["first_mask"] = [compile(t)[1].error for t in ['start: A A\nA: /a+/', 'root ::= b b\nb ::= "x"+']]
out["after"] = compile('root ::= "yes" | "no"')[1].grammar is not None
# a later mask never ends: the request's next token is refused; then another request of
# the same grammar (its copies share the lexer's state) ends at once, and others run
c, fut = compile('start: ("c" | "d") x\nx: A A\nA: /a+/')
(tok,) = vocab.encode("c")
m = grammars.matcher(fut, c, jump_forward=True, heal=False)
m.start([1])
out["later"] = [m.advance(tok), m.jump_forward(tok, 8), m.stuck, int(m.allowed(eos_ok=True).any()), m.is_final,
                m.advance(tok), m.rejected == tok]
m = grammars.matcher(fut, c, jump_forward=False, heal=False)
m.start([1])
out["again"] = [m.stuck, int(m.allowed(eos_ok=True).any()), m.advance(tok), m.rejected == tok]
c, fut = compile('root ::= "yes" | "no"')
m = grammars.matcher(fut, c, jump_forward=False, heal=False)
m.start([1])
out["other"] = [m.advance(vocab.encode("yes")[0]), m.is_final]
print(json.dumps(out), flush=True)
'''


def test_llguidance_computations_that_never_end_are_given_up(tokenizer_dir):
    # llguidance 1.9.1 never finishes these masks: the first one held a compile thread
    # for good (two such grammars and no llguidance compile ran again, JSON Schemas
    # included); a later one held the engine loop. In a child process: the threads it
    # leaves spinning end with it. A computation that is not given up hangs the child, which
    # the deadline below ends (a failure, not a timing measurement).
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", HANGING, str(tokenizer_dir)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert all("longer than the 2 s limit" in e for e in out["first_mask"]), out
    assert out["after"], out  # a later compile ran: the hung first masks hold no compile thread
    assert out["later"] == [True, None, True, 0, False, False, True], out
    assert out["again"] == [True, 0, False, True] and out["other"] == [True, True], out


def test_auto_takes_a_huge_counted_repetition_to_llguidance(grammars, vocab):
    """outlines-core writes out every copy of a counted repetition, so the worker refuses
    one past MAX_REPEAT_EXPANSION positions; under ``auto`` such a regex now goes to
    llguidance (which does not expand it) instead of a 400, and is enforced there.
    Named outlines, it is refused at the edge, naming the repetition."""
    c = SamplingParams(regex="[ab]{12000}").constraint()
    assert c is not None and c.backend == "llguidance"
    m = matcher(grammars, {"regex": "[ab]{12000}"})
    assert admits(m, vocab, "ab" * 6000)
    m = matcher(grammars, {"regex": "[ab]{12000}"})
    assert not admits(m, vocab, "ab" * 5999)  # one copy short: not final
    assert SamplingParams(regex="[ab]{3}").constraint().backend == "outlines"  # the usual path
    with pytest.raises(RequestError, match=r"counted repetition \{12000\} at position 4") as e:
        SamplingParams(regex="[ab]{12000}", grammar_backend="outlines").constraint()
    assert e.value.param == "regex"


def test_a_regex_outside_the_dialect_is_reported_once():
    with pytest.raises(RequestError) as e:
        SamplingParams(regex="(?=a)b").constraint()
    assert str(e.value).count("lookaround") == 1 and e.value.param == "regex"
