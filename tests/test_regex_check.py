"""One regex check for the language and the runtime (``plait.regex.check_regex``):
``gen(regex=...)`` and the engine's sampling parameters accept and refuse the same
patterns with the same message, and what they accept outlines-core compiles."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import plait as sgl
from plait.ir import DTYPE_REGEX
from plait.regex import MAX_PATTERN_CHARS, check_regex
from plait.runtime.sampling_params import SamplingParams

from constrained_cases import REGEXES

# -- patterns: random strings over the regex alphabet, well-formed ones, and well-formed
# ones with one character inserted (mostly near misses)
ALPHABET = "ab()[]{}|*+?.^$\\-,0123456789"
_ATOMS = st.sampled_from([
    "a", "b", "0", "9", ",", ".", "é", " ", "}", r"\d", r"\w", r"\s", r"\D", r"\.", r"\-", r"\{", r"\\", r"\t",
    r"\x41", r"\x{42}", r"\u0043", r"\pL", r"\p{Greek}", "[ab]", "[^a]", "[a-z]", "[0-9-]", r"[\]a]", "[]b]",
    r"[\d,]", "()",
])
_QUANTS = st.sampled_from(["", "", "*", "+", "?", "{2}", "{1,3}", "{2,}", "*?", "{0,2}?"])
_OPENERS = st.sampled_from(["(", "(?:", "(?i:", "(?s-i:", "(?P<n>", "(?<m>"])
_NOISE = st.sampled_from(list(ALPHABET) + ["(?=", "(?i)", "(?x)", r"\b", r"\1", r"\0", r"\z", "[[", "&&", "\ud800"])


def _compose(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(inner, inner).map("".join),
        st.tuples(inner, inner).map("|".join),
        st.tuples(_OPENERS, inner, _QUANTS).map(lambda t: f"{t[0]}{t[1]}){t[2]}"),
    )


WELL_FORMED = st.recursive(st.tuples(_ATOMS, _QUANTS).map("".join), _compose, max_leaves=6)
NEAR_MISSES = st.tuples(WELL_FORMED, st.integers(0, 40), _NOISE).map(lambda t: t[0][:t[1]] + t[2] + t[0][t[1]:])
PATTERNS = st.one_of(st.text(ALPHABET, max_size=16), WELL_FORMED, NEAR_MISSES)

PROPERTY = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def lang_error(pattern: str) -> ValueError | None:
    """What ``gen(regex=...)`` raises for ``pattern`` (None: accepted)."""
    try:
        sgl.gen("x", regex=pattern)
    except ValueError as e:
        return e
    return None


def engine_error(pattern: str) -> ValueError | None:
    """What the engine's submit-time validation raises: the fields are checked, then
    the constraint translated once (``constraint()``)."""
    try:
        SamplingParams.from_dict({"regex": pattern}).constraint()
    except ValueError as e:
        return e
    return None


@PROPERTY
@given(PATTERNS)
def test_gen_and_the_engine_accept_the_same_patterns(pattern):
    lang, engine = lang_error(pattern), engine_error(pattern)
    assert (lang is None) == (engine is None), (pattern, lang, engine)
    if lang is not None:
        assert str(lang) in str(engine)  # one check, one message


def _small(pattern: str) -> bool:
    """Repetition counts that keep the automaton small (the soundness test compiles
    in process, without the engine's time and memory limits)."""
    product = 1
    for digits in re.findall(r"[0-9]+", pattern):
        product *= max(1, int(digits[:4]))
    return product <= 64


@PROPERTY
@given(PATTERNS)
def test_what_the_check_accepts_outlines_core_compiles(pattern):
    outlines_core = pytest.importorskip("outlines_core")
    assume(_small(pattern))
    # property names are left to the compiler; only known ones are generated intact
    assume(all(name in ("Greek", "L") for name in re.findall(r"\\[pP]\{([^}]*)\}?", pattern)))
    try:
        pattern = check_regex(pattern)  # what the engine compiles (end anchors dropped)
    except ValueError:
        return
    # every byte is a token: a failure can only come from the pattern
    vocab = outlines_core.Vocabulary(0, {bytes([b]): [b + 1] for b in range(256)})
    outlines_core.Index(pattern, vocab)


# -- examples --------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [
    *DTYPE_REGEX.values(), *REGEXES.values(), r"\p{L}+", r"(?i)yes|no", r"(?P<year>[0-9]{4})-(?<m>[0-9]{2})",
    r"[\]\-a]", r"\x{1F600}", "a{2}{3}", "(a*)+", "a**", "[]a]", "[^]a]", "a|", "()", "}", r"\U0010FFFF", r"a{0,2}?",
    re.escape("a\nb\tc\rd\x0be\x0cf g#~"),  # re.escape writes a backslash before whitespace (Rust takes it)
])
def test_accepted(pattern):
    assert check_regex(pattern) == pattern
    assert lang_error(pattern) is None and engine_error(pattern) is None


@pytest.mark.parametrize("pattern,stripped", [
    (r"^\d{3}-\d{4}$", r"\d{3}-\d{4}"), ("^a", "a"), ("a$", "a"), ("^(a|b)$", "(a|b)"), ("^a|b$", "a|b"),
    ("^a$|^b$", "a|b"), ("(?i)^yes$", "(?i)yes"), ("^(?i)yes$", "(?i)yes"), (r"a\$", r"a\$"), (r"\^a", r"\^a"),
    (r"[$^]a", r"[$^]a"),
])
def test_anchors_at_the_ends_are_dropped(pattern, stripped):
    """The whole output always matches: '^' at the start and '$' at the end (of the
    pattern or of a top-level alternative) say nothing, and SGLang's default backend
    (xgrammar) ignores them; an SGLang program's gen(regex="^...$") runs unchanged."""
    assert check_regex(pattern) == stripped
    assert lang_error(pattern) is None and engine_error(pattern) is None
    assert sgl.gen("x", regex=pattern).params["regex"] == stripped


@pytest.mark.parametrize("pattern,message", [
    ("(ab", "not a valid regular expression at position 0: a '(' that is never closed"),
    ("ab)", "unbalanced ')'"),
    ("a\\", "trailing"),
    ("a{", "literal '{'"),
    ("a{,5}", "literal '{'"),
    ("[0-9]{5,2}", "out of order"),
    ("[b-a]", "out of order"),
    (r"[\d-z]", "bound"),
    ("*a", "nothing to repeat"),
    ("(?i)*", "nothing to repeat"),
    ("a*+a", "uses a possessive quantifier ('+' right after a repetition) at position 2"),
    (r"\d++", "possessive"),
    ("a?+", "possessive"),
    ("a{2}+", "possessive"),
    ("a{1,3}?+", "possessive"),
    ("a^b", "an anchor ('^') inside the pattern at position 1"),
    ("a$b", "an anchor ('$') inside the pattern"),
    ("(^a)", "anchor"),
    ("(a$)", "anchor"),
    ("^$", "matches only the empty output"),
    (r"a\Z", "anchor"),
    (r"\bfoo", "word boundary"),
    ("a(?=b)", "uses a lookaround at position 1"),
    ("(?<!x)y", "negative lookaround"),
    (r"(a)\1", "backreference"),
    ("(?P<n>a)(?P=n)", "backreference"),
    ("(?(1)a|b)", "conditional"),
    ("(?>a)", "atomic"),
    ("(?#c)a", "comment"),
    ("(?x)a b", "flag 'x'"),
    ("(?P<a>x)(?P<a>y)", "used twice"),
    ("(?P<1a>x)", "group name"),
    ("[[:alpha:]]", "nested classes"),
    ("[a&&b]", "set operations"),
    ("[a-c--b]", "set operations"),
    (r"\0", "octal"),
    (r"\e", "unknown"),
    (r"\pX", "general category"),
    (r"\x{D800}", "scalar value"),
    ("a\ud800", "surrogate"),
    ("(" * 300 + ")" * 300, "nested deeper"),
    ("a" * (MAX_PATTERN_CHARS + 1), "at most"),
    ("", "non-empty"),
    (5, "non-empty"),
])
def test_refused_with_the_reason(pattern, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        sgl.gen("x", regex=pattern)
    assert str(info.value).startswith("regex")
    engine = engine_error(pattern)
    assert engine is not None
    if isinstance(pattern, str):  # a non-string is refused by the fields' type check first
        assert str(info.value) in str(engine)
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        check_regex(pattern, "whitespace_pattern")
    assert str(info.value).startswith("whitespace_pattern")
