"""Validation at the edge: a raw generate request becomes one typed, checked value.

The front process (for HTTP and ZMQ clients) and :meth:`Engine.add_request` (for
in-process callers) both call :func:`validate_generate`; nothing behind them checks a
request again. Every problem is a :class:`~plait.errors.RequestError` naming the field.
This module is torch-free (the front does not load the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from plait import protocol as P
from plait.errors import RequestError, is_int
from plait.runtime.sampling_params import Constraint, SamplingParams

MAX_TOP_LOGPROBS = 100


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against."""

    vocab_size: int
    context_len: int
    grammar_backend: str = "auto"  # the engine's option: a request's constraint goes to it unless it names one
    pool_tokens: int | None = None  # the KV pool's size: a prompt needs its tokens + 1 there (None: not checked)


@dataclass
class GenerateInput:
    """A validated generate request: what the engine runs, unchecked."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    constraint: Constraint | None = None
    cache_salt: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False

    def to_wire(self) -> P.EngineGenerate:
        c = self.constraint
        return P.EngineGenerate(
            self.rid, self.input_ids, self.params.to_dict(),
            constraint_kind=None if c is None else c.kind, constraint_regex=None if c is None else c.grammar,
            constraint_backend=None if c is None else c.backend, constraint_unique=None if c is None else c.unique,
            constraint_auto=c is not None and c.auto,
            stream=self.stream, return_logprob=self.return_logprob, logprob_start_len=self.logprob_start_len,
            top_logprobs_num=self.top_logprobs_num, cache_salt=self.cache_salt,
        )

    @classmethod
    def from_wire(cls, m: P.EngineGenerate) -> GenerateInput:
        """Rebuild what the front validated (trusted: nothing is checked again)."""
        constraint = None if m.constraint_regex is None else Constraint(
            m.constraint_kind or "regex", m.constraint_regex, m.constraint_backend or "outlines",
            m.constraint_unique or "", m.constraint_auto)
        return cls(
            m.rid, m.input_ids, SamplingParams(**m.sampling_params), constraint, m.cache_salt,
            m.return_logprob, m.logprob_start_len, m.top_logprobs_num, m.stream,
        )


def prompt_name(param: str) -> str:
    """How a length error names the prompt of ``param``: a chat's is its messages rendered
    with the template, tool definitions included (a long tool description, not the
    messages, may be what does not fit)."""
    return "the prompt rendered from messages (with tools, if given)" if param == "messages" else param


def check_prompt(ids: Any, limits: ModelLimits, param: str) -> list[int]:
    """A prompt's token ids: a non-empty list of ids inside the vocabulary, shorter
    than the context. Returns it."""
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise RequestError(f"{param} must be a list of integer token ids", param)
    if not ids:
        raise RequestError(f"{param}: prompt is empty; allowed: at least one token", param)
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"{param} contains token id {bad}, outside the vocabulary [0, {limits.vocab_size})", param)
    if len(ids) >= limits.context_len:
        raise RequestError(
            f"{prompt_name(param)} has {len(ids)} tokens; this model's context length is {limits.context_len}, "
            f"so a prompt may have at most {limits.context_len - 1} tokens", param,
        )
    if limits.pool_tokens is not None and len(ids) >= limits.pool_tokens:
        # it could never be admitted: it was a 200 with finish_reason abort and no text
        raise RequestError(
            f"{prompt_name(param)} has {len(ids)} tokens; the server's KV cache holds {limits.pool_tokens} tokens "
            f"(kv_cache_tokens / mem_fraction_static), so a prompt may have at most {limits.pool_tokens - 1} tokens",
            param,
        )
    return ids


def check_text(text: str, param: str) -> str:
    """Reject strings that are not valid Unicode (lone surrogates from JSON escapes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param} is not valid UTF-8 (it contains a lone surrogate)", param) from None
    return text


def check_cache_salt(salt: Any) -> str | None:
    if salt is not None and not isinstance(salt, str):
        raise RequestError(f"cache_salt={salt!r} is invalid; allowed: a string or None", "cache_salt")
    if salt is not None and "\x00" in salt:
        raise RequestError("cache_salt must not contain NUL characters", "cache_salt")
    return None if salt is None else check_text(salt, "cache_salt")


def check_ttl(ttl_s: Any, max_ttl_s: float) -> float:
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not math.isfinite(ttl_s) \
            or not 0 < ttl_s <= max_ttl_s:
        raise RequestError(f"ttl_s={ttl_s!r} is invalid; allowed: a number of seconds in (0, {max_ttl_s:g}]", "ttl_s")
    return float(ttl_s)


def check_int64(params: dict[str, Any]) -> None:
    """Integers travel as msgpack int64: reject larger ones naming their field."""
    for key, v in params.items():
        for x in v if isinstance(v, list) else [v]:
            if isinstance(x, int) and not -(2**63) <= x < 2**63:
                raise RequestError(f"{key}={x} is out of range; allowed: at most {2**63 - 1}", key)


def validate_generate(
    rid: str,
    input_ids: Any,
    sampling_params: SamplingParams | dict[str, Any] | None,
    limits: ModelLimits,
    *,
    prompt_param: str = "input_ids",
    cache_salt: Any = None,
    return_logprob: Any = False,
    logprob_start_len: Any = -1,
    top_logprobs_num: Any = 0,
    stream: bool = False,
) -> GenerateInput:
    """Check every field of one generate request and translate its constraint, once.
    ``max_new_tokens`` is capped by the room the context leaves (the engine stops there
    anyway; a smaller reservation keeps admission from holding back others)."""
    ids = check_prompt(input_ids, limits, prompt_param)
    if isinstance(sampling_params, dict):
        check_int64(sampling_params)
    params = SamplingParams.from_dict(sampling_params)
    bad = next((t for t in params.stop_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestError(
            f"stop_token_ids contains token id {bad}, outside the vocabulary [0, {limits.vocab_size})", "stop_token_ids"
        )
    bad = next((t for t in params.logit_bias or () if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestError(f"logit_bias holds token id {bad}, outside the vocabulary [0, {limits.vocab_size})",
                           "logit_bias")
    if not isinstance(return_logprob, bool):
        raise RequestError(f"return_logprob={return_logprob!r} is invalid; allowed: true or false", "return_logprob")
    if not is_int(logprob_start_len) or not -1 <= logprob_start_len < len(ids):
        raise RequestError(
            f"logprob_start_len={logprob_start_len!r} is invalid; allowed: -1 or an integer in [0, {len(ids) - 1}]",
            "logprob_start_len",
        )
    if not is_int(top_logprobs_num) or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"top_logprobs_num={top_logprobs_num!r} is invalid; allowed: an integer in [0, {MAX_TOP_LOGPROBS}]",
            "top_logprobs_num",
        )
    salt = check_cache_salt(cache_salt)
    room = limits.context_len - len(ids)
    if params.max_new_tokens > room:
        params.max_new_tokens = room
        params.min_new_tokens = min(params.min_new_tokens, room)
    return GenerateInput(
        rid, ids, params, params.constraint(limits.grammar_backend), salt, return_logprob, logprob_start_len, top_logprobs_num, stream
    )
