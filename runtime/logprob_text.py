"""Logprob entries with their tokens' text: what the front adds to the engine's
``[logprob, id]`` entries. Torch-free, so that the front's process (which imports this,
not the engine's modules) starts without importing torch (~3 s on a 2-core Zen 3, paid
again by the engine's process)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_LOGPROB_KEYS = ("output_token_logprobs", "input_token_logprobs")
_TOP_LOGPROB_KEYS = ("output_top_logprobs", "input_top_logprobs")


def map_logprob_entries(meta: dict[str, Any], fn: Callable[[list[Any]], list[Any]]) -> dict[str, Any]:
    """In place: every logprob entry (and every entry of the top-logprob rows) through ``fn``."""
    for key in _LOGPROB_KEYS:
        if key in meta:
            meta[key] = [fn(e) for e in meta[key]]
    for key in _TOP_LOGPROB_KEYS:
        if key in meta:
            meta[key] = [None if row is None else [fn(e) for e in row] for row in meta[key]]
    return meta


def add_token_text(meta: dict[str, Any], token_text: Callable[[int], str]) -> None:
    """In place: ``[logprob, id]`` entries (and top-logprob rows) become
    ``[logprob, id, text]`` (``return_text_in_logprobs``)."""
    map_logprob_entries(meta, lambda e: [e[0], e[1], token_text(e[1])])


def pad_logprob_text(meta: dict[str, Any]) -> dict[str, Any]:
    """In place: ``[logprob, id]`` entries (and top-logprob rows) become
    ``[logprob, id, None]``, entries with their text stay: the native HTTP API's shape,
    as SGLang's ``/generate`` returns them (``None`` text without
    ``return_text_in_logprobs``). Returns ``meta``."""
    return map_logprob_entries(meta, lambda e: e if len(e) > 2 else [*e, None])
