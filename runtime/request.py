"""A request inside the engine: one plain class with counters."""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from plait.runtime.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Req:
    """State of one sequence. Scheduling is "computed tokens catch up to total tokens":
    ``num_computed`` tokens of ``all_ids`` have KV in the pool; each step feeds
    ``all_ids[num_computed:]`` (a prefill chunk, or the one last sampled token) and,
    once caught up, samples the next token.

    KV ownership: positions ``[0, cache_len)`` belong to radix-tree nodes locked through
    ``last_node``; positions from ``cache_len`` on live in ``private_pages`` (page
    aligned, since ``cache_len`` is). Both are mirrored in the page-table ``row``.
    """

    def __init__(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.params = params
        self.cache_salt = cache_salt
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.generator = generator
        self.status = ReqStatus.WAITING
        self.arrival = time.monotonic()

        # KV state
        self.num_computed = 0
        self.cache_len = 0
        self.last_node: Any = None
        self.private_pages: list[int] = []
        self.row: int | None = None
        self.cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.admitted_once = False
        self.num_retractions = 0

        # outputs
        self.finish_reason: dict[str, Any] | None = None
        self.output_token_logprobs: list[list[Any]] = []
        self.output_top_logprobs: list[list[list[Any]]] = []
        self.input_token_logprobs: list[list[Any]] = []
        self.input_top_logprobs: list[list[list[Any]] | None] = []
        self.input_logprobs_done = not (return_logprob and logprob_start_len >= 0)
        self.input_logprob_pos = max(logprob_start_len, 1)  # next prompt position to score
        self.text = ""  # detokenized output, maintained incrementally when stop strings are set
        # constrained decoding (plait.runtime.constrained.matcher.GrammarMatcher)
        self.grammar: Any = None
        self.text_skip = 0  # leading output characters not returned: a healed prompt token's text
        self.detok_prefix_offset = 0
        self.detok_read_offset = 0

    # -- derived counters -------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def num_pending(self) -> int:
        """Tokens still to feed before the next sample."""
        return self.seq_len - self.num_computed

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
        if not self.input_logprobs_done:
            limit = min(limit, max(self.logprob_start_len - 1, 0))
        return limit

    def __repr__(self) -> str:
        return (
            f"Req({self.rid!r}, prompt={self.prompt_len}, out={self.output_len}, "
            f"computed={self.num_computed}, status={self.status.value})"
        )
