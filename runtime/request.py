"""A request inside the engine: one plain class with counters, split by owner.

- :class:`Req` — tokens and scheduling/KV state, written by the scheduler (and the
  engine when a constraint heals the prompt's last token).
- :class:`LogprobState` — requested logprobs and the lists being filled, written by
  the model runner.
- Text, stop strings and stream cursors live in the output processor
  (:mod:`plait.runtime.output_processor`), not here.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plait.errors import RequestError
from plait.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from plait.runtime.constrained.matcher import GrammarMatcher
    from plait.runtime.radix_cache import TreeNode


NO_SLOTS = torch.empty(0, dtype=torch.int64)  # the prefix slots of a request holding none


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class ReqKind(enum.Enum):
    GENERATE = "generate"  # a client's request: its outputs are reported
    PIN_PREFILL = "pin_prefill"  # internal prefill of a pinned prefix: never reported


@dataclass(frozen=True)
class FinishReason:
    """Why a sequence ended. ``stop``: EOS, a stop token id or a stop string
    (``matched``; None when a constraint completed); ``length``: ``max_new_tokens`` or
    the context; ``abort``: aborted, did not fit, or failed — ``error`` is set when the
    request failed as a client error after admission (its constraint did not compile),
    which is reported as an error, not a result."""

    type: str  # "stop" | "length" | "abort"
    matched: str | int | None = None
    length: int = 0
    message: str = ""
    error: RequestError | None = None

    @classmethod
    def stop(cls, matched: str | int | None) -> FinishReason:
        return cls("stop", matched=matched)

    @classmethod
    def of_length(cls, n: int) -> FinishReason:
        return cls("length", length=n)

    @classmethod
    def abort(cls, message: str, error: RequestError | None = None) -> FinishReason:
        return cls("abort", message=message, error=error)

    @property
    def by_token(self) -> bool:
        """Ended by EOS or a stop token id (the token stays in the output)."""
        return self.type == "stop" and isinstance(self.matched, int)

    def to_dict(self) -> dict[str, Any]:
        """The wire form (``meta_info["finish_reason"]``)."""
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        if self.type == "length":
            return {"type": "length", "length": self.length}
        return {"type": "abort", "message": self.message}


@dataclass
class LogprobState:
    """Logprobs asked for by one request and the entries recorded so far (model runner)."""

    start_len: int = -1  # -1: no prompt logprobs; k: prompt tokens from position k on
    top_n: int = 0
    output_token: list[list[Any]] = field(default_factory=list)  # [logprob, token id]
    output_top: list[list[list[Any]]] = field(default_factory=list)
    input_token: list[list[Any]] = field(default_factory=list)
    input_top: list[list[list[Any]] | None] = field(default_factory=list)
    input_done: bool = True
    input_pos: int = 1  # next prompt position to score

    def __post_init__(self) -> None:
        self.input_done = self.start_len < 0
        self.input_pos = max(self.start_len, 1)

    def drop_output(self, n: int) -> None:
        """Forget the entries of the last ``n`` output tokens: tokens the scheduler did
        not keep (verified drafts after a finish, an output cut at a stop string)."""
        if n > 0:
            del self.output_token[max(len(self.output_token) - n, 0) :]
            del self.output_top[max(len(self.output_top) - n, 0) :]


def long_rope_namespace(salt: str | None) -> str:
    """The cache namespace of long-rope requests of ``salt`` (user salts never hold a
    NUL character: :func:`plait.runtime.validation.check_cache_salt`)."""
    return "\x00long-rope" if salt is None else "\x00long-rope\x00" + salt  # "" is a salt of its own, as elsewhere


class Req:
    """State of one sequence. Scheduling is "computed tokens catch up to total tokens":
    ``num_computed`` tokens of ``token_ids`` (prompt then output, one list) have KV in
    the pool; each step feeds ``token_ids[num_computed:]`` (a prefill chunk, or the one
    last sampled token) and, once caught up, samples the next token.

    KV ownership: positions ``[0, cache_len)`` belong to radix-tree nodes locked through
    ``last_node`` (their slots, on the host, in ``prefix_slots``); positions from
    ``cache_len`` on live in ``private_pages`` (page aligned, since ``cache_len`` is).
    Both are mirrored in the page-table ``row`` (on the device).
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        group: str | None = None,
        index: int = 0,
        kind: ReqKind = ReqKind.GENERATE,
        cache_salt: str | None = None,
        logprobs: LogprobState | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
        stream: bool = False,
    ) -> None:
        self.rid = rid
        self.group = rid if group is None else group  # the client's rid (shared by n > 1 copies)
        self.index = index  # which of the n copies
        self.kind = kind
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(self.token_ids)
        self.params = params
        self.cache_salt = cache_salt
        self.logprobs = logprobs  # None: no logprobs asked for
        self.generator = generator  # sampling on CPU draws from it
        self.seed = seed  # ... and on CUDA from a hash of (seed, output position)
        self.stream = stream  # its tokens go to a client as they come (chunk sizes protect its ITL)
        self.status = ReqStatus.WAITING
        self.arrival = time.monotonic()
        self.finish_reason: FinishReason | None = None

        # KV state (scheduler)
        self.num_computed = 0
        self.cache_len = 0
        self.last_node: TreeNode | None = None
        self.prefix_slots = NO_SLOTS  # host: slots of [0, cache_len)
        self.private_pages: list[int] = []
        # with windowed KV in a pool of its own: own pages before this page index have
        # given their windowed KV back (they lie before the window)
        self.window_floor = 0
        # longrope: computed with the long factors throughout (the scheduler sets it once
        # the sequence is longer than the model's original context; its KV lives apart)
        self.long_rope = False
        self.row: int | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted_at = 0  # tokens computed when last admitted (its cache match): where its prefill starts
        self.healed = 0  # 1 when token healing backed off the prompt's last token (written again as output)
        self.admitted_once = False
        self.num_retractions = 0
        self.grammar: GrammarMatcher | None = None  # constrained decoding
        # (constraint, matcher options) of an auto-chosen regex on outlines-core, built on
        # llguidance instead if its build fails for its time or memory (Engine)
        self.grammar_fallback: tuple[Any, dict[str, bool]] | None = None

    @property
    def kv_namespace(self) -> str | None:
        """The prefix-cache namespace of this request's KV: its ``cache_salt``, or
        for long-rope requests (whose KV is rotated differently) that salt's own."""
        return long_rope_namespace(self.cache_salt) if self.long_rope else self.cache_salt

    # -- tokens -----------------------------------------------------------------------
    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def append_token(self, tid: int) -> None:
        self.token_ids.append(tid)

    def replace_last_token(self, ids: list[int]) -> None:
        """Jump-forward: the newest output token becomes ``ids`` (re-tokenized with it)."""
        self.token_ids[-1:] = ids

    def set_output(self, ids: list[int]) -> None:
        del self.token_ids[self.prompt_len :]
        self.token_ids.extend(ids)

    def drop_last_prompt_token(self) -> None:
        """Token healing backs off the prompt's last token (before any output)."""
        assert self.output_len == 0, "the prompt can only change before the output starts"
        self.token_ids.pop()
        self.prompt_len -= 1
        self.healed = 1

    # -- derived counters -------------------------------------------------------------
    @property
    def return_logprob(self) -> bool:
        return self.logprobs is not None

    @property
    def output_len(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def completion_len(self) -> int:
        """Output tokens the client counts: a healed token re-writes prompt text, so it
        counts with the prompt (``completion_tokens`` stays within ``max_new_tokens``)."""
        return self.output_len - self.healed

    @property
    def seq_len(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.output_len > 0 and self.num_pending == 1

    @property
    def remaining_new_tokens(self) -> int:
        return max(self.params.max_new_tokens - self.output_len, 0)

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def capacity(self, page_size: int) -> int:
        """Positions that have a slot (cached prefix plus private pages)."""
        return self.cache_len + len(self.private_pages) * page_size

    def max_prefix_len(self) -> int:
        """Longest prefix that may come from the cache: at least one token must be fed
        to get logits, and input logprobs need the hidden states before their tokens."""
        limit = self.seq_len - 1
        lp = self.logprobs
        if lp is not None and not lp.input_done:
            limit = min(limit, max(lp.start_len - 1, 0))
        return limit

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, prompt={self.prompt_len}, out={self.output_len}, "
            f"computed={self.num_computed}, status={self.status.value})"
        )
