"""``chunked_prefill_size="auto"``: the prefill budget of a step, from measured steps.

A step that carries a prefill chunk beside running decodes delays every one of them:
its time is the decodes' inter-token latency. A small chunk keeps that latency close
to a decode-only step but splits a long prompt into many steps (each paying the fixed
cost of a step, on CPU the weights' read); a large chunk does the opposite.

:class:`ChunkSizer` fits step time as ``a + d * decodes + p * prefill_tokens`` to the
last steps (least squares) and gives the largest chunk whose predicted step time stays
within the ITL target: ``itl_target_ms`` when set, else twice the predicted time of
the current decode-only step (so p99 ITL <= 2x the median even when every step is
mixed). With no decodes running there is no latency to protect: the whole budget
(``max_chunk``) goes to prefill. Nor when none of the running decodes streams: a
client that waits for the whole output (``Engine.generate``, a non-streaming HTTP
request, a program's ``gen``) sees its completion time, not the gaps between its
tokens, and small chunks only spread the same interference over more steps, each
paying the step's fixed cost again (bench_offline's prefill-bound (c) on the Zen 4:
175-187 s with the 2x bound for every decode against 100-121 s with 2048-token chunks).
Until prefill steps have been seen, ``initial``.
"""

from __future__ import annotations

from collections import deque

import numpy as np

AUTO = "auto"


class ChunkSizer:
    def __init__(self, itl_target_ms: float | None = None, *, min_chunk: int = 32, max_chunk: int = 4096,
                 initial: int = 512, window: int = 128) -> None:
        self.itl_target_s = None if itl_target_ms is None else itl_target_ms / 1000.0
        self.min_chunk, self.max_chunk, self.initial = min_chunk, max_chunk, initial
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)  # (decodes, prefill tokens, s)
        self._fit: tuple[float, float, float] | None = None  # (a, d, p)
        self._since_fit = 0

    def observe(self, decodes: int, prefill_tokens: int, seconds: float) -> None:
        self._steps.append((decodes, prefill_tokens, seconds))
        self._since_fit += 1
        if self._since_fit >= 8:
            self._refit()

    def budget(self, decodes: int, streaming: bool = True) -> int:
        """Prefill tokens for the next step with ``decodes`` decodes running;
        ``streaming``: whether any of them streams its tokens to a client."""
        if decodes == 0 or not streaming:
            return self.max_chunk
        if self._fit is None:
            return self.initial
        a, d, p = self._fit
        decode_step = a + d * decodes
        target = self.itl_target_s if self.itl_target_s is not None else 2.0 * decode_step
        chunk = int((target - decode_step) / p + 1e-6)  # + rounding slack of the fit
        return max(self.min_chunk, min(self.max_chunk, chunk))

    def _refit(self) -> None:
        self._since_fit = 0
        rows = np.array(self._steps, dtype=np.float64)
        if len(rows) < 8 or (rows[:, 1] > 0).sum() < 3 or np.ptp(rows[:, 1]) == 0:
            return  # not enough prefill steps of different sizes to tell p
        x = np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1]])
        coef, *_ = np.linalg.lstsq(x, rows[:, 2], rcond=None)
        a, d, p = (float(c) for c in coef)
        if p > 0:
            self._fit = (max(a, 0.0), max(d, 0.0), p)

    @property
    def fit(self) -> tuple[float, float, float] | None:
        """(fixed seconds per step, seconds per decode, seconds per prefill token)."""
        return self._fit
