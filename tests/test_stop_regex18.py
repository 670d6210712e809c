"""SGLang's ``stop_regex`` (sampling param and ``gen(stop_regex=...)``), ASCII ``\\d \\w
\\s`` in user regexes on both grammar backends, and ``spaces_between_special_tokens``.

Outputs are checked against a reference engine's greedy output without the setting:
a stop_regex output is that output cut where Python's ``re.search`` first finds a
match in a prefix of it (SGLang's check after each token)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

import plait as sgl
from plait.errors import RequestError
from plait.runtime import Engine
from plait.runtime.detokenizer import IncrementalDetokenizer, TextState
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.server import launch
from plait.runtime.stop_regex import MAX_STOP_REGEXES, compile_stop_regex

from lang_fixtures import ENGINE_OPTS, backend, folder, ref  # noqa: F401  (pytest fixtures)

PROMPT = "The weather today is"
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}


def first_match(patterns: list[str], text: str) -> tuple[str, int, int] | None:
    """SGLang's semantics by brute force: the first prefix of ``text`` that ``re.search``
    finds a pattern in (the first pattern listed when several do): (pattern, start, end)."""
    for end in range(1, len(text) + 1):
        for p in patterns:
            m = re.search(p, text[:end])
            if m:
                return p, m.start(), end
    return None


def tokens_through(tokenizer: Any, ids: list[int], chars: int) -> int:
    """How many of ``ids`` it takes for their text to reach ``chars`` characters."""
    return next(n for n in range(1, len(ids) + 1) if len(tokenizer.decode(ids[:n])) >= chars)


@pytest.fixture(scope="module")
def baseline(ref):
    out = ref.generate(PROMPT, GREEDY)
    assert len(out["text"]) > 40
    return out


def mid_pattern(text: str) -> str:
    """A regex (with a wildcard) that matches mid-way through ``text``."""
    mid = len(text) // 2
    return re.escape(text[mid]) + "." + re.escape(text[mid + 2])


# -- the scan itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", [r"\d+", r"a(b|c)+d", r"foo$", r"\bend\b", r"(?i)STOP", r"x{2,3}y", r"[^a-z ]",
                                     r"(ab)*c", r"^The", r"\n\n", r"(?m)^Q:", r"(?s)a.c", r"(?i)[a-c]z", r"\s\S"])
def test_scan_agrees_with_re_search_over_prefixes(pattern):
    import random

    rng = random.Random(pattern)
    alphabet = "abcdxyz !\n1234TheQ:STOPstopendfoo_é٣"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20)))
        scan, got, fed = compile_stop_regex((pattern,)).scanner(), None, 0
        while got is None and fed < len(text):  # pieces of 1-3 characters, as tokens
            n = rng.randint(1, 3)
            m = scan.feed(text[fed:fed + n])
            fed += n
            got = None if m is None else (m.pattern, m.start, m.end)
        want = first_match([pattern], text[:fed])
        if want is not None:  # SGLang checks after whole tokens: the end is the piece's
            want = (want[0], re.search(pattern, text[:want[2]]).start(), want[2])
        assert (got[:2] if got else None) == (want[:2] if want else None), (pattern, text)


def test_catastrophic_pattern_runs_in_linear_time():
    scan = compile_stop_regex((r"(a+)+b", r"(x|x)*y")).scanner()
    t = time.perf_counter()
    assert scan.feed("a" * 5000) is None
    assert scan.held_from == 0  # (a+)+b may still match: all of it is held back
    assert scan.feed("x" * 5000) is None
    assert scan.held_from == 5000  # the a's can no longer be part of a match; the x's can
    assert time.perf_counter() - t < 5  # re.search takes hours on 30 of them


@pytest.mark.parametrize("value,message", [
    ("(", "not a valid regular expression"),
    ("a*", "can match the empty string"),
    (r"\b", "can match the empty string"),
    (r"(?=a)b", "look-around"),
    (r"(a)\1", "backreference"),
    (r"(?>a)b", "atomic group"),
    ("x{5000}", "too large"),
    ("a" * 300, "at most 256 characters"),
    ([r"\d"] * (MAX_STOP_REGEXES + 1), f"at most {MAX_STOP_REGEXES}"),
    (5, "a regular expression or a list"),
    ([1], "a regular expression or a list"),
])
def test_bad_stop_regex_is_a_400_naming_it(value, message):
    with pytest.raises(RequestError, match=message) as e:
        SamplingParams.from_dict({"stop_regex": value})
    assert e.value.param == "stop_regex" and e.value.status == 400


# -- the engine -----------------------------------------------------------------------------------
def test_engine_cuts_at_the_first_match_and_reports_the_pattern(ref, baseline):
    text, ids = baseline["text"], baseline["output_ids"]
    pattern = mid_pattern(text)
    patterns = [r"zz\d{3}", pattern]
    _, start, end = first_match(patterns, text)
    out = ref.generate(PROMPT, {**GREEDY, "stop_regex": patterns})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert out["text"] == text[:start]
    assert out["output_ids"] == ids[:tokens_through(ref.tokenizer, ids, end)]
    # a single string is one pattern; no_stop_trim keeps the match (and cuts after it)
    kept = ref.generate(PROMPT, {**GREEDY, "stop_regex": pattern, "no_stop_trim": True})
    assert kept["text"] == text[:end]
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    # no match: the output is the reference's
    assert ref.generate(PROMPT, {**GREEDY, "stop_regex": [r"zz\d{3}"]})["text"] == text


def test_stop_string_in_the_same_token_wins_and_the_earlier_match_ends_first(ref, baseline):
    text = baseline["text"]
    pattern = mid_pattern(text)
    _, start, end = first_match([pattern], text)
    late = text[end + 4:end + 7]
    out = ref.generate(PROMPT, {**GREEDY, "stop": [late], "stop_regex": [pattern]})
    assert out["meta_info"]["finish_reason"]["matched"] == pattern and out["text"] == text[:start]
    early = text[start:end]
    out = ref.generate(PROMPT, {**GREEDY, "stop": [early], "stop_regex": [pattern]})
    assert out["meta_info"]["finish_reason"]["matched"] == early and out["text"] == text[:text.index(early)]


def test_stream_never_sends_text_a_match_trims(ref, baseline):
    text = baseline["text"]
    # a match that spans many tokens: from a character early on to one much later; the
    # text between is held back until the match completes (then it is trimmed)
    a, b = len(text) // 4, 3 * len(text) // 4
    pattern = re.escape(text[a:a + 2]) + "[^\\n]*" + re.escape(text[b:b + 2])
    _, start, end = first_match([pattern], text)
    (r,) = ref.add_request(ref.tokenizer.encode(PROMPT, add_special_tokens=False),
                           {**GREEDY, "stop_regex": [pattern]})
    sent = ""
    while ref.has_work():
        for o in ref.step():
            if o.rid == r.rid:
                sent += o.text
                assert text[:start].startswith(sent), "a piece of the trimmed match was streamed"
    assert sent == text[:start] == ref.result(r)["text"]


def test_ascii_digit_classes_on_both_backends(ref):
    # the byte token 0xD9 begins Arabic-Indic digits (U+0660..U+0669 are D9 A0..D9 A9):
    # pushed up, Unicode \p{Nd} writes them; \d is ASCII, as SGLang's backends read it
    d9 = ref.tokenizer.convert_tokens_to_ids("Ù")
    for backend_name in ("outlines", "llguidance"):
        params = {"temperature": 0.0, "max_new_tokens": 6, "logit_bias": {d9: 100}, "grammar_backend": backend_name}
        unicode_digits = ref.generate("Number:", {**params, "regex": r"\p{Nd}+"})["text"]
        assert unicode_digits and not unicode_digits.isascii(), backend_name
        for rx in (r"\d+", r"[\d]+", r"[^\D\s]+", r"(?i)\w{3}\W?\d+"):
            out = ref.generate("Number:", {**params, "regex": rx})["text"]
            assert re.fullmatch(rx, out, re.ASCII), (backend_name, rx, out)  # \W admits non-ASCII text
            assert "\\W" in rx or out.isascii(), (backend_name, rx, out)


def test_ascii_classes_translation():
    from plait.regex import ascii_classes

    assert ascii_classes(r"\d+\.\w\s\D\W\S") == r"[0-9]+\.[0-9A-Za-z_][\t-\r ][^0-9][^0-9A-Za-z_][^\t-\r ]"
    assert ascii_classes(r"[\d.][^\D]\\d") == r"[0-9.][^\x00-/:-\x{10FFFF}]\\d"
    assert ascii_classes(r"(?i)\w") == r"(?i)(?-i:[0-9A-Za-z_])"
    # every ASCII character and a few others: narrowed classes match as Python's re.ASCII
    probe = [chr(c) for c in range(128)] + ["٣", "𝟦", "é", "\u2003", "\u212a", "\u017f"]
    for rx in (r"\d", r"\w", r"\s", r"\D", r"\W", r"\S", r"[\d]", r"[^\D]", r"[\W]", r"[\S]", r"[^\s]"):
        py = ascii_classes(rx).replace(r"\x{10FFFF}", "\U0010ffff").replace(r"\x{17E}", "\u017e")
        for ch in probe:
            assert bool(re.fullmatch(py, ch)) == bool(re.fullmatch(rx, ch, re.ASCII)), (rx, ch)


def test_the_token_that_ends_the_output_stays_out_of_its_text(ref):
    """EOS or a stop id ends the output: the token is in output_ids, its text is not,
    even with skip_special_tokens=false (SGLang and vLLM trim it; a tool-call parser that
    keeps special tokens for its markers ended every reply with '<|im_end|>');
    no_stop_trim keeps it, streamed pieces add up to the same text."""
    tok = ref.tokenizer
    eos, dot = tok.eos_token_id, tok.convert_tokens_to_ids(".")
    cases = [({"logit_bias": {eos: 100}}, eos, "<|im_end|>"),
             ({"logit_bias": {dot: 100}, "stop_token_ids": [dot]}, dot, ".")]
    for extra, end, end_text in cases:
        for keep in (False, True):
            params = {**GREEDY, "ignore_eos": False, "max_new_tokens": 8, "min_new_tokens": 2,
                      "skip_special_tokens": False, "no_stop_trim": keep, **extra}
            out = ref.generate(PROMPT, params)
            ids = out["output_ids"]
            assert ids[-1] == end and len(ids) == 3 and out["meta_info"]["finish_reason"]["matched"] == end
            want = tok.decode(ids if keep else ids[:-1], skip_special_tokens=False)
            assert out["text"] == want and out["text"].endswith(end_text) == keep
            (r,) = ref.add_request(tok.encode(PROMPT, add_special_tokens=False), params)
            sent = ""
            while ref.has_work():
                sent += "".join(o.text for o in ref.step() if o.rid == r.rid)
            assert sent == want == ref.result(r)["text"]


# -- spaces_between_special_tokens ----------------------------------------------------------------
def test_spaces_between_special_tokens_decodes_as_hf(ref):
    tok = ref.tokenizer
    special = tok.convert_tokens_to_ids("<|im_start|>")
    params = {**GREEDY, "max_new_tokens": 8, "skip_special_tokens": False, "logit_bias": {special: 8}}
    for spaces in (True, False):
        out = ref.generate(PROMPT, {**params, "spaces_between_special_tokens": spaces})
        assert special in out["output_ids"]
        assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=False,
                                         spaces_between_special_tokens=spaces)
    with pytest.raises(RequestError, match="spaces_between_special_tokens") as e:
        SamplingParams.from_dict({"spaces_between_special_tokens": "no"})
    assert e.value.param == "spaces_between_special_tokens"


def test_spaces_between_special_tokens_reaches_the_tokenizer():
    """A slow tokenizer honours the flag: the detokenizer passes it (only when false, so a
    tokenizer without the keyword keeps working at the default)."""

    class Recorder:
        calls: list[dict[str, Any]] = []

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            self.calls.append(kwargs)
            return "".join(f"<{i}>" if kwargs.get("spaces_between_special_tokens", True) else str(i) for i in ids)

    class FakeReq:
        token_ids = [5, 6, 7]
        prompt_len = 2

        def __init__(self, spaces: bool) -> None:
            self.params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)

    det = IncrementalDetokenizer(Recorder())
    for spaces, piece in ((True, "<7>"), (False, "7")):
        r = FakeReq(spaces)
        assert det.step(r, TextState(prefix=0, read=2)) == piece  # type: ignore[arg-type]
    assert {"skip_special_tokens": False} in Recorder.calls
    assert {"skip_special_tokens": False, "spaces_between_special_tokens": False} in Recorder.calls


# -- HTTP /generate -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(folder):
    with launch(folder, num_threads=1, kv_cache_tokens=4096, max_running_requests=8) as rt:
        with httpx.Client(base_url=rt.url, timeout=60) as c:
            yield c


def test_http_generate_stop_regex_and_stream(http, baseline):
    text = baseline["text"]
    pattern = mid_pattern(text)
    _, start, end = first_match([pattern], text)
    req = {"text": PROMPT, "sampling_params": {**GREEDY, "stop_regex": pattern,
                                                "spaces_between_special_tokens": False}}
    out = http.post("/generate", json=req).json()
    assert out["text"] == text[:start]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    events = [json.loads(line[6:]) for line in http.post("/generate", json={**req, "stream": True}).text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["text"] == text[:start]
    assert all(text[:start].startswith(e["text"]) for e in events)  # cumulative, never past the cut
    for bad, message in (("(a+", "not a valid regular expression"), (r"(?<=a)b", "look-around")):
        r = http.post("/generate", json={"text": PROMPT, "sampling_params": {"stop_regex": [bad]}})
        assert r.status_code == 400 and "stop_regex" in r.text and message in r.text, r.text


# -- the language ---------------------------------------------------------------------------------
@sgl.function
def answer(s):
    s += PROMPT + sgl.gen("a", max_tokens=24, stop_regex=PATTERN[0])


PATTERN: list[str] = []


def test_gen_stop_regex(backend, baseline):
    text = baseline["text"]
    PATTERN[:] = [mid_pattern(text)]
    _, start, _ = first_match(PATTERN, text)
    state = answer.run(temperature=0, ignore_eos=True, backend=backend)
    assert state["a"] == text[:start]
    assert state.get_meta_info("a")["finish_reason"] == {"type": "stop", "matched": PATTERN[0]}

    @sgl.function
    def plain(s):
        s += PROMPT + sgl.gen("a", max_tokens=24)

    # run()'s stop_regex is a default for every gen; global_config's
    # spaces_between_special_tokens_in_out=False reaches the runtime as the sampling param
    sgl.global_config.spaces_between_special_tokens_in_out = False
    try:
        state = plain.run(temperature=0, ignore_eos=True, stop_regex=PATTERN, backend=backend)
    finally:
        sgl.global_config.spaces_between_special_tokens_in_out = True
    assert state["a"] == text[:start]
    with pytest.raises(ValueError, match="stop_regex"):
        sgl.gen("x", stop_regex="(")
    with pytest.raises(ValueError, match="look-around"):
        sgl.gen("x", stop_regex=r"a(?=b)")
