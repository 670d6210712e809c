"""Incremental detokenization that never emits broken UTF-8, and stop-string matching."""

from __future__ import annotations

from typing import Any

from plait.runtime.request import Req

# Prompt tokens decoded in front of the output so that the first output token gets
# its leading space right (sentencepiece drops it at the start of a string).
CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    """Appends each request's new text to ``req.text``; streamed pieces concatenate to
    the final text. A piece ending in an incomplete UTF-8 sequence (U+FFFD) is held
    back until the next token completes it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _ids(self, r: Req) -> list[int]:
        return r.prompt_ids[-CONTEXT_TOKENS:] + r.output_ids

    def start(self, r: Req) -> None:
        n = min(CONTEXT_TOKENS, r.prompt_len)
        r.detok_prefix_offset = 0
        r.detok_read_offset = n

    def step(self, r: Req) -> str:
        """Decode what the newest tokens add; returns the new piece ('' if held back)."""
        ids = self._ids(r)
        skip = r.params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[r.detok_prefix_offset : r.detok_read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[r.detok_prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        piece = _skip(r, full[len(prefix) :])
        r.detok_prefix_offset, r.detok_read_offset = r.detok_read_offset, len(ids)
        r.text += piece
        return piece

    def flush(self, r: Req) -> str:
        """At the end: emit whatever is held back, replacement characters included."""
        ids = self._ids(r)
        if r.detok_read_offset >= len(ids):
            return ""
        skip = r.params.skip_special_tokens
        prefix = self.tokenizer.decode(ids[r.detok_prefix_offset : r.detok_read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(ids[r.detok_prefix_offset :], skip_special_tokens=skip)
        piece = _skip(r, full[len(prefix) :])
        r.detok_prefix_offset = r.detok_read_offset = len(ids)
        r.text += piece
        return piece


def _skip(r: Req, piece: str) -> str:
    """Drop what remains of ``r.text_skip`` (text that belongs to the prompt) from the
    front of a new piece."""
    if r.text_skip and piece:
        cut = min(r.text_skip, len(piece))
        r.text_skip -= cut
        piece = piece[cut:]
    return piece


def match_stop(r: Req, piece: str) -> str | None:
    """If a stop string completed within the newest ``piece``, trim ``r.text`` to
    before it and return the string."""
    if not r.params.stop or not piece:
        return None
    longest = max(len(s) for s in r.params.stop)
    window_start = max(len(r.text) - len(piece) - longest + 1, 0)
    best: tuple[int, str] | None = None
    for s in r.params.stop:
        i = r.text.find(s, window_start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    r.text = r.text[: best[0]]
    return best[1]
