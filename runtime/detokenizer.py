"""Incremental detokenization that never emits broken UTF-8, and stop-string and
stop_regex matching.

Both work on a sequence's :class:`TextState` (owned by the output processor) and read
the request's tokens; neither writes the request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plait.runtime.request import Req
from plait.runtime.stop_regex import StopRegexScan

# Prompt tokens decoded in front of the output so that the first output token gets
# its leading space right (sentencepiece drops it at the start of a string).
CONTEXT_TOKENS = 4


@dataclass
class TextState:
    """The detokenized output of one sequence. ``prefix``/``read`` are positions in
    ``req.token_ids``: text up to ``read`` is in ``text``, decoded in context from
    ``prefix``. ``skip`` leading characters are not output (a healed prompt token's
    text)."""

    text: str = ""
    prefix: int = 0
    read: int = 0
    skip: int = 0


class IncrementalDetokenizer:
    """Appends each sequence's new text to its :class:`TextState`; streamed pieces
    concatenate to the final text. A piece ending in an incomplete UTF-8 sequence
    (U+FFFD) is held back until the next token completes it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def start(self, r: Req, skip: int = 0) -> TextState:
        """A fresh state for ``r``'s output (again after token healing changed the prompt)."""
        read = r.prompt_len
        return TextState(prefix=max(read - CONTEXT_TOKENS, 0), read=read, skip=skip)

    def step(self, r: Req, st: TextState, end: int | None = None) -> str:
        """Decode what the newest tokens (up to position ``end``, default all) add;
        returns the new piece ('' if held back)."""
        ids = r.token_ids if end is None else r.token_ids[:end]
        prefix, full = self._decode(r, ids[st.prefix : st.read]), self._decode(r, ids[st.prefix :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        piece = _skip(st, full[len(prefix) :])
        st.prefix, st.read = st.read, len(ids)
        st.text += piece
        return piece

    def flush(self, r: Req, st: TextState, end: int | None = None) -> str:
        """At the end: emit whatever is held back (up to position ``end``, default all),
        replacement characters included."""
        ids = r.token_ids if end is None else r.token_ids[:end]
        if st.read >= len(ids):
            return ""
        prefix, full = self._decode(r, ids[st.prefix : st.read]), self._decode(r, ids[st.prefix :])
        piece = _skip(st, full[len(prefix) :])
        st.prefix = st.read = len(ids)
        st.text += piece
        return piece

    def _decode(self, r: Req, ids: list[int]) -> str:
        """``ids`` as text, with the request's ``skip_special_tokens`` and (when false, the
        tokenizer's default being true) ``spaces_between_special_tokens``: a slow HF
        tokenizer honours it, a fast one ignores it, as HF's own decode does."""
        params = r.params
        if params.spaces_between_special_tokens:
            return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                                     spaces_between_special_tokens=False)


def _skip(st: TextState, piece: str) -> str:
    """Drop what remains of ``st.skip`` (text that belongs to the prompt) from the
    front of a new piece."""
    if st.skip and piece:
        cut = min(st.skip, len(piece))
        st.skip -= cut
        piece = piece[cut:]
    return piece


def match_stop(st: TextState, stops: list[str], piece: str, keep: bool = False) -> str | None:
    """If a stop string completed within the newest ``piece``, trim ``st.text`` to
    before it (``keep``: to after it, SGLang's ``no_stop_trim``) and return the string."""
    if not stops or not piece:
        return None
    longest = max(len(s) for s in stops)
    window_start = max(len(st.text) - len(piece) - longest + 1, 0)
    best: tuple[int, str] | None = None
    for s in stops:
        i = st.text.find(s, window_start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    st.text = st.text[: best[0] + (len(best[1]) if keep else 0)]
    return best[1]


def safe_text_len(text: str, stops: list[str]) -> int:
    """Length of the prefix of ``text`` that can be streamed: it holds back the longest
    suffix that is a proper prefix of a stop string (it may still complete to one and
    then be trimmed)."""
    if not stops or not text:
        return len(text)
    longest = min(max(len(s) for s in stops) - 1, len(text))
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return len(text) - k
    return len(text)


def match_stop_regex(st: TextState, scan: StopRegexScan, piece: str, keep: bool = False) -> str | None:
    """Search the newest ``piece`` of ``st.text`` (its continuation) for a stop_regex
    match; if one ends in it, trim ``st.text`` to before the match (``keep``: to after
    it, SGLang's ``no_stop_trim``) and return the pattern (SGLang's ``matched``)."""
    m = scan.feed(piece)
    if m is None:
        return None
    st.text = st.text[: m.end if keep else m.start]
    return m.pattern
