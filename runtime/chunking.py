"""``chunked_prefill_size="auto"``: the prefill budget of a step, from measured steps.

A step that carries a prefill chunk beside running decodes delays every one of them:
its time is the decodes' inter-token latency. A small chunk keeps that latency close
to a decode-only step but splits a long prompt into many steps (each paying the fixed
cost of a step, on CPU the weights' read); a large chunk does the opposite.

:class:`ChunkSizer` fits step time as ``a + d * decodes + p * prefill_tokens + q *
attention`` to the last steps (least squares), where ``attention`` counts the
(query, key) pairs of the step's prefill chunks, ``n * (prefix + n / 2)`` for a chunk
of ``n`` tokens after ``prefix`` computed ones: a chunk late in a long prompt attends
to everything before it (on the Zen 4, a 56-token chunk of a 2048-token prompt beside
8 decodes took 139 ms at its start and 246 ms at its end). It gives the largest chunk
whose predicted step time, at the prefix the chunk continues from, stays within the
ITL target: ``itl_target_ms`` when set, else twice the predicted time of the current
decode-only step (so p99 ITL <= 2x the median even when every step is mixed). With
no decodes running there are no gaps between tokens to protect, nor when none of the
running decodes streams: a client that waits for the whole output (``Engine.generate``,
a non-streaming HTTP request, a program's ``gen``) sees its completion time, and small
chunks only spread the same interference over more steps, each paying the step's fixed
cost again (bench_offline's prefill-bound (c) on the Zen 4: 175-187 s with the 2x bound
for every decode against 100-121 s with 2048-token chunks). There the budget is steps of
about a second (:data:`MAX_STEP_S`, from the measured per-token cost of prefill steps),
``max_chunk`` at most: a request beside such a step, or arriving during it, waits for it
(4,096-token steps took 15-20 s on one thread).
Until the fit exists (8 steps, 3 of them with prefill chunks of different sizes), the
chunks beside streaming decodes are small and of three sizes in turn (``EXPLORE``), so
that the first measurements both stay near a decode step and tell the
per-token cost apart from the fixed one (a first guess of 512 tokens made the first
chunks of a long prompt 0.9-1.6 s steps beside 8 streams on the Zen 4). They stay at
or under the floor: with 32/64/128 the 128-token step (3-5 decode steps beside 8
streams on the Intel Xeon at 2.6 GHz) and one more set the p99 inter-token latency
alone (bench_serving chunked-prefill: p99/p50 2.25-3.21). The budget also allows for the
fit's high-side error (:meth:`ChunkSizer._high_error`): a least-squares fit is right on
average, so half the mixed steps run over it, and p99 sees the slow ones (with both,
p99/p50 1.54-1.92 in four runs; 1.63 and 2.24 without the margin; the long prompt's TTFT
1.83-2.08x unchunked throughout).

Where no chunk of at least ``min_chunk`` tokens keeps the target through a prompt's end
(on CPU a step beside decodes costs about a decode step before its chunk, so a chunk
step cannot stay within 2x a decode step and finish a long prompt within 1.5x its
unchunked time: README), the floor is not ``min_chunk`` itself but chunks of equal
predicted time, as many as ``min_chunk``-token chunks would take
(:meth:`ChunkSizer._even_chunk`): about the same TTFT, a lower slowest step
(bench_serving chunked-prefill on the Xeon: p99/p50 1.27-1.72 in thirteen runs against
1.58-1.99 with the fixed floor; the long prompt's TTFT about the same, 1.26-1.76x
unchunked as the baseline moved between 2.4 and 3.4 s: README).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

AUTO = "auto"
EXPLORE = (16, 24, 32)  # chunk sizes before the first fit
# Where no client watches the gaps between tokens (nothing decodes, or no decode streams),
# a step still holds up every request beside it and every one arriving during it: a
# step's predicted wall time stays under this. A forced tool call whose 600-value enum
# made a 7,000-token prompt (the tools are in it) was filled in 4,096-token steps of
# 15-20 s on one thread, and a 5-token request sent meanwhile took 37 s instead of
# 0.2 s. At a second a step, its fixed cost (the weights' read, ~20-60 ms on CPU) is a
# few per cent of throughput; on a GPU the cap is never reached (max_chunk is).
MAX_STEP_S = 1.0
FIRST_CHUNK = 512  # such a step's size before a prefill of at least RATE_TOKENS tokens was measured
RATE_TOKENS = 256  # prefill steps this large tell the per-token cost (the fixed part is small beside it)


class ChunkSizer:
    """Chunk budgets from measured steps (see the module docstring). ``min_chunk``: the
    floor when even a small chunk would pass the target (late in a long prompt on a slow
    machine). Measured (bench_serving chunked-prefill, Zen 4): with 8, p99/p50 ITL 1.49
    (AVX2 kernels 1.22) but the long prompt's TTFT 2.95x (3.50x) unchunked, the 16-token
    extreme of issue 19; with 32, 1.96 (2.79) and 1.90x (1.78x)."""

    def __init__(self, itl_target_ms: float | None = None, *, min_chunk: int = 32, max_chunk: int = 4096,
                 window: int = 128, max_step_s: float = MAX_STEP_S) -> None:
        if not 1 <= min_chunk <= max_chunk:
            raise ValueError(f"min_chunk={min_chunk} and max_chunk={max_chunk}: allowed 1 <= min_chunk <= max_chunk")
        self.itl_target_s = None if itl_target_ms is None else itl_target_ms / 1000.0
        self.min_chunk, self.max_chunk = min_chunk, max_chunk
        self.max_step_s = max_step_s
        # (decodes, prefill tokens, attention pairs, seconds)
        self._steps: deque[tuple[int, int, float, float]] = deque(maxlen=window)
        self._fit: tuple[float, float, float, float] | None = None  # (a, d, p, q)
        self._margin = 1.0  # the fit's high-side error on steps with a chunk beside decodes
        self._since_fit = 0

    def observe(self, decodes: int, prefill_tokens: int, seconds: float, attention: float = 0.0) -> None:
        """One step: its decodes, prefill tokens, wall time and the (query, key) pairs
        of its prefill chunks (:func:`attention_pairs`)."""
        self._steps.append((decodes, prefill_tokens, attention, seconds))
        self._since_fit += 1
        if self._since_fit >= 8:
            self._refit()

    def budget(self, decodes: int, streaming: bool = True, prefix: int = 0, prompt: tuple[int, int] | None = None) -> int:
        """Prefill tokens for the next step with ``decodes`` decodes running;
        ``streaming``: whether any of them streams its tokens to a client; ``prefix``:
        the tokens already computed of the prompt the chunk continues (0 for a new one);
        ``prompt``: that prompt's (first computed position, length), the tokens it was
        admitted with (its cache match) and all of its tokens, when known: where even a
        ``min_chunk``-token chunk passes the target, the floor is then the chunk that
        spreads the prompt's work evenly over the steps ``min_chunk``-token chunks would
        take (:meth:`_even_chunk`) instead of ``min_chunk`` itself."""
        if decodes == 0 or not streaming:
            return self._batch_budget()
        if self._fit is None:  # explore: small chunks of three sizes until the fit exists
            return min(self.max_chunk, EXPLORE[sum(1 for step in self._steps if step[1] > 0) % len(EXPLORE)])
        a, d, p, q = self._fit
        decode_step = a + d * decodes
        target = self.itl_target_s if self.itl_target_s is not None else 2.0 * decode_step
        slack = target / self._margin - decode_step  # the step's prediction, scaled by its error, within the target
        n = _largest_chunk(p, q, prefix, slack) if slack > 0 else 0
        floor = self.min_chunk
        # the target cannot be kept through the prompt's end (its last min_chunk tokens
        # attend to all before them): even steps instead of min_chunk-token ones
        if (prompt is not None and prompt[1] - prompt[0] > self.min_chunk
                and (slack <= 0 or _largest_chunk(p, q, prompt[1] - self.min_chunk, slack) < self.min_chunk)):
            floor = self._even_chunk(p, q, prefix, *prompt)
        return max(floor, min(self.max_chunk, n))

    def _batch_budget(self) -> int:
        """The budget where no decode streams: steps of at most :data:`MAX_STEP_S`
        (``max_step_s``) at the per-token cost of recent prefill steps of at least
        :data:`RATE_TOKENS` tokens (their median; decodes beside them only make it
        cautious), ``max_chunk`` at most; :data:`FIRST_CHUNK` tokens until such a step
        was measured."""
        rates = [seconds / tokens for _, tokens, _, seconds in self._steps if tokens >= RATE_TOKENS]
        if not rates:
            return min(self.max_chunk, FIRST_CHUNK)
        rate = float(np.median(rates[-5:]))
        return max(self.min_chunk, min(self.max_chunk, int(self.max_step_s / max(rate, 1e-12))))

    def _even_chunk(self, p: float, q: float, prefix: int, start: int, length: int) -> int:
        """The floor where the target cannot be kept: chunks equal in predicted time, as
        many as ``min_chunk``-token chunks of the prompt's tokens from ``start`` on would
        be. Each step beside the decodes costs their step plus its chunk's work (``p``
        per token, ``q`` per (query, key) pair); with ``min_chunk``-token chunks that
        work grows with the prefix (a late chunk attends to the whole prompt before it),
        so the last steps were the slowest, and p99 saw them (the Xeon, 8 streams, a
        2048-token prompt in 32-token chunks: ~55 ms early, 80-86 ms at the end). The
        same number of steps, each doing the average step's work, takes about as long in
        all (the prompt's TTFT) with the slowest step lower: larger chunks early, smaller
        late. Within ``[min_chunk / 2, 3 * min_chunk / 2]`` tokens: the fit's split
        between ``p`` and ``q`` is least sure early in a prompt (fitted from chunks near
        its start, ``q`` came out 25x too large and the first chunks 230 tokens, 285 ms
        steps; allowing 2x ``min_chunk`` made the first steps the slowest). (A budget
        past the prompt's end is the step's: the rest admits other prompts, as any.)"""
        tokens, m, rest = length - start, self.min_chunk, length - prefix
        # each step's share of the whole prompt's chunk work, over the floor's number of steps
        share = _chunk_work(p, q, start, tokens) / -(-tokens // m)
        # what is left, over the fewest steps that keep each within the share, evenly (a
        # step that took less, at the clamp, leaves more steps, not larger ones; no tail
        # of a few tokens left for a step of its own)
        work = _chunk_work(p, q, prefix, rest)
        steps = max(1, math.ceil(work / share - 1e-9))
        n = rest if steps == 1 else math.ceil(_chunk_root(p, q, prefix, work / steps) - 1e-6)
        return max(m // 2, min(self.max_chunk, m + m // 2, n))

    def _refit(self) -> None:
        self._since_fit = 0
        rows = np.array(self._steps, dtype=np.float64)
        # only steps with decodes: the budget matters only beside them, and a step without
        # any (the streams' own prompts, a server's first step) costs otherwise (the module
        # path, one-time set-up: a 0.5 s first step made the intercept 95 ms, the decode
        # step's prediction 3x its time and the next chunks 100-token, 150 ms steps)
        rows = rows[rows[:, 0] > 0]
        if len(rows) < 8 or (rows[:, 1] > 0).sum() < 3 or np.ptp(rows[:, 1]) == 0:
            return  # not enough prefill steps of different sizes to tell p
        fit = self._lstsq(rows)
        if fit is not None:  # once more without the steps far off the first fit (a stall, a swap)
            a, d, p, q = fit
            err = rows[:, 3] / np.maximum(a + d * rows[:, 0] + p * rows[:, 1] + q * rows[:, 2], 1e-9)
            kept = rows[(err < 2.0) & (err > 0.5)]
            if len(kept) < len(rows) and len(kept) >= 8 and (kept[:, 1] > 0).sum() >= 3 and np.ptp(kept[:, 1]) > 0:
                fit = self._lstsq(kept) or fit
        if fit is not None:
            self._fit = fit
            self._margin = self._high_error(rows, fit)

    @staticmethod
    def _lstsq(rows: np.ndarray) -> tuple[float, float, float, float] | None:
        """(a, d, p, q) fitted to ``rows`` (least squares), or None without a positive
        per-token cost. The intercept and per-decode cost are one number where every step
        had as many decodes: their sum at that count is what the budget uses."""
        ones = np.ones(len(rows))
        coef, *_ = np.linalg.lstsq(np.column_stack([ones, rows[:, 0], rows[:, 1], rows[:, 2]]), rows[:, 3], rcond=None)
        a, d, p, q = (float(c) for c in coef)
        if q < 0 or np.ptp(rows[:, 2]) == 0:  # no attention term to tell (or noise): fit without it
            coef, *_ = np.linalg.lstsq(np.column_stack([ones, rows[:, 0], rows[:, 1]]), rows[:, 3], rcond=None)
            (a, d, p), q = (float(c) for c in coef), 0.0
        if p <= 0:
            return None
        if d < 0:  # more decodes cannot cost less: the intercept keeps the step's time at the mean count
            a, d = a + d * float(rows[:, 0].mean()), 0.0
        elif a < 0:
            d, a = d + a / float(rows[:, 0].mean()), 0.0
        return (a, max(d, 0.0), p, q)

    @staticmethod
    def _high_error(rows: np.ndarray, fit: tuple[float, float, float, float]) -> float:
        """How far above its prediction a step with a chunk beside decodes runs: the 90th
        percentile of measured / predicted over the window's such steps (at least 1; 1
        with fewer than 5). A least-squares fit is right on average, so about half those
        steps ran over it; the ITL target is about the slow ones (p99)."""
        a, d, p, q = fit
        mixed = rows[(rows[:, 0] > 0) & (rows[:, 1] > 0)]
        if len(mixed) < 5:
            return 1.0
        predicted = a + d * mixed[:, 0] + p * mixed[:, 1] + q * mixed[:, 2]
        ok = predicted > 0
        if ok.sum() < 5:
            return 1.0
        return max(1.0, float(np.percentile(mixed[ok, 3] / predicted[ok], 90)))

    @property
    def margin(self) -> float:
        """The fit's high-side error the budget allows for (:meth:`_high_error`)."""
        return self._margin

    @property
    def fit(self) -> tuple[float, float, float, float] | None:
        """(fixed seconds per step, seconds per decode, seconds per prefill token,
        seconds per (query, key) pair of a prefill chunk)."""
        return self._fit


def _chunk_work(p: float, q: float, prefix: int, n: int) -> float:
    """The predicted cost of a chunk of ``n`` tokens after ``prefix`` computed ones
    beyond its step's fixed part: ``p`` per token, ``q`` per (query, key) pair."""
    return p * n + q * attention_pairs([(prefix, n)])


def _chunk_root(p: float, q: float, prefix: int, slack: float) -> float:
    """The n (real) with ``_chunk_work(p, q, prefix, n) == slack``: the quadratic's root,
    stable as q -> 0."""
    b = p + q * prefix
    return 2.0 * slack / (b + math.sqrt(b * b + 2.0 * q * slack))


def _largest_chunk(p: float, q: float, prefix: int, slack: float) -> int:
    """The largest n with ``_chunk_work(p, q, prefix, n) <= slack`` (plus the fit's
    rounding slack)."""
    return int(_chunk_root(p, q, prefix, slack) + 1e-6)


def attention_pairs(chunks: list[tuple[int, int]]) -> float:
    """The (query, key) pairs of prefill chunks given as (computed prefix, chunk tokens)."""
    return float(sum(n * (prefix + n / 2.0) for prefix, n in chunks))
