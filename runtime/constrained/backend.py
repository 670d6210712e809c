"""Grammar backends: one interface over outlines-core and llguidance.

A request's constraint is translated once at the edge
(:meth:`plait.runtime.sampling_params.SamplingParams.constraint`) into a
:class:`~plait.runtime.sampling_params.Constraint` naming its backend and what that
backend compiles (a regex for ``outlines``, an llguidance grammar for ``llguidance``).
Behind the edge, every backend implements the same two objects:

- a **compiler** (``request(source) -> GrammarFuture``, ``poll()``, ``wait(timeout)``,
  ``busy``, ``close()``, ``build_times``): compiles off the engine loop under a time limit
  and caches by (tokenizer fingerprint, source); the backend is the third part of the
  cache key, since each backend has its own compiler;
- a per-request **matcher** (:class:`Matcher`): ``start``, ``jump_start``,
  ``allowed(eos_ok)`` (a packed ``int32 [vocab.mask_words]`` row), ``advance``,
  ``is_final``, ``terminated``, ``jump_forward``, and ``draft_masks`` (the rows after
  each speculative draft, the matcher left where it was).

:class:`Grammars` holds one compiler per backend (created on first use) and makes the
matcher a constraint needs. Torch-free; llguidance is imported only when used.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

OUTLINES = "outlines"
LLGUIDANCE = "llguidance"
AUTO = "auto"
BACKENDS = (OUTLINES, LLGUIDANCE)
GRAMMAR_BACKENDS = (AUTO, *BACKENDS)

# outlines-core builds one index at a time per worker process, and some regexes take
# until the time limit ("(a|b)*a(a|b){22}": 2**23 states): every new regex of every client
# waited behind such a build (30 s at the default limit). When each worker's build has
# run past SLOW_BUILD_S, a new constraint goes to another worker, up to OUTLINES_LANES
# (each within grammar_compile_memory_mb); a worker, once started, stays.
OUTLINES_LANES = 3
SLOW_BUILD_S = 2.0
TIMEOUT_RETRY_S = 60.0  # how long a build that ran past its time stays a cached refusal
# auto's regex build on outlines-core gets this long (at most grammar_compile_timeout) before
# llguidance, which follows the same regex lazily, takes it over: a forced strict tool call
# whose arguments outlines-core builds in minutes (ten format-typed fields, a GitHub Actions
# step) waited the whole 30 s limit first, and every outlines-core build queued behind it
AUTO_OUTLINES_BUDGET_S = 4.0


class GrammarFuture:
    """A compile in progress or done: ``grammar`` on success, ``error`` (a message) on
    failure. ``source`` is what the backend compiles; ``waiters``: the requests' matchers
    made on it while it was not done and not released (:meth:`Grammars.release`)."""

    __slots__ = ("key", "source", "grammar", "error", "started", "waiters", "retry_at", "budget_s")

    def __init__(self, key: tuple[str, str], source: str) -> None:
        self.key = key
        self.source = source
        self.grammar: Any = None
        self.error: str | None = None
        self.started: float | None = None
        self.waiters = 0
        self.retry_at: float | None = None  # a failure that may pass another time (a build past its time)
        self.budget_s: float | None = None  # a time limit shorter than the compiler's (auto's first try)

    @property
    def done(self) -> bool:
        return self.grammar is not None or self.error is not None

    def timed_out(self, message: str) -> None:
        """Fail it for running past its time: a cache keeps that answer only for
        TIMEOUT_RETRY_S (a build slow because the machine was busy is tried again later;
        the same pathological one sent again meanwhile is refused at once)."""
        self.error = message
        self.retry_at = time.monotonic() + TIMEOUT_RETRY_S

    @property
    def stale(self) -> bool:
        """A cached failure to drop: a timeout older than TIMEOUT_RETRY_S."""
        return self.retry_at is not None and time.monotonic() >= self.retry_at


class Matcher(Protocol):
    """One request's grammar state over a shared compiled grammar.

    Life: created with the request (its grammar may still be compiling: ``ready`` /
    ``error``); ``start(prompt_ids)`` once ready (returns how many prompt tokens to drop
    for token healing: 0 or 1), ``jump_start(budget)`` (forced opening tokens); then for
    every token the scheduler appends, ``advance(token)``, after which
    ``jump_forward(token, budget)`` may return tokens to put in place of it.
    """

    kind: str  # the request field the constraint came from: what a failure names
    started: bool
    rejected: int | None  # a token the grammar did not allow
    healed_text: str  # the backed-off prompt token's text ("" without healing)

    @property
    def ready(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    def start(self, prompt_ids: list[int]) -> int: ...

    def jump_start(self, budget: int) -> list[int]: ...

    @property
    def is_final(self) -> bool: ...

    @property
    def terminated(self) -> bool: ...

    def allowed(self, eos_ok: bool) -> np.ndarray: ...

    def draft_masks(self, drafts: list[int], eos_ok: bool) -> list[np.ndarray]:
        """``allowed`` now and after each draft, up to the first refused; state unchanged."""
        ...

    def advance(self, token: int) -> bool: ...

    def jump_forward(self, last: int, budget: int) -> list[int] | None: ...


class Grammars:
    """The engine's compilers, one per backend (made on first use), and the matcher for
    each constraint. ``vocab`` is called once, when the first compiler is made."""

    def __init__(self, vocab: Callable[[], Any], *, timeout_s: float, memory_mb: int, cache_size: int,
                 jump_forward: bool) -> None:
        self._vocab_factory = vocab
        self._vocab: Any = None
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.cache_size = cache_size
        self.jump_forward = jump_forward
        self.compilers: dict[str, Any] = {}

    @property
    def vocab(self) -> Any:
        if self._vocab is None:
            self._vocab = self._vocab_factory()
        return self._vocab

    def compiler(self, backend: str) -> Any:
        """``backend``'s compiler (for outlines, its first worker's; ``"outlines#2"``: its second)."""
        c = self.compilers.get(backend)
        if c is None:
            if backend.partition("#")[0] == OUTLINES:
                from plait.runtime.constrained.compiler import GrammarCompiler

                c = GrammarCompiler(self.vocab, timeout_s=self.timeout_s, memory_mb=self.memory_mb,
                                    cache_size=self.cache_size, jump_forward=self.jump_forward)
            else:
                from plait.runtime.constrained.llguidance_backend import LLGuidanceCompiler

                c = LLGuidanceCompiler(self.vocab, timeout_s=self.timeout_s, cache_size=self.cache_size)
            self.compilers[backend] = c
        return c

    def request(self, constraint: Any) -> GrammarFuture:
        """Start (or find in the cache) the compile of ``constraint``."""
        if constraint.backend != OUTLINES:
            return self.compiler(constraint.backend).request(constraint.grammar)
        lanes = [self.compiler(OUTLINES)]
        lanes += [self.compilers[k] for k in (f"{OUTLINES}#{i}" for i in range(2, OUTLINES_LANES + 1))
                  if k in self.compilers]
        lane = next((c for c in lanes if c.cached(constraint.grammar) is not None), None)
        if lane is None:
            lane = next((c for c in lanes if not c.busy), None)
        if lane is None and len(lanes) < OUTLINES_LANES and all(c.stalled(SLOW_BUILD_S) for c in lanes):
            lane = self.compiler(f"{OUTLINES}#{len(lanes) + 1}")
        if lane is None:  # every worker busy: behind the shortest queue of one not stalled
            lane = min(lanes, key=lambda c: (c.stalled(SLOW_BUILD_S), c.queued))
        # (the engine builds auto's regex on llguidance when this runs past its budget)
        fallback = getattr(constraint, "llguidance_fallback", False)
        return lane.request(constraint.grammar, min(self.timeout_s, AUTO_OUTLINES_BUDGET_S) if fallback else None)

    def matcher(self, future: GrammarFuture, constraint: Any, *, jump_forward: bool, heal: bool) -> Matcher:
        future.waiters += 1
        m: Any
        if constraint.backend == OUTLINES:
            from plait.runtime.constrained.matcher import GrammarMatcher

            m = GrammarMatcher(future, constraint.kind, jump_forward=jump_forward, heal=heal)
        else:
            from plait.runtime.constrained.llguidance_backend import LLGuidanceMatcher

            m = LLGuidanceMatcher(future, constraint.kind, jump_forward=jump_forward)
        if getattr(constraint, "unique", ""):  # uniqueItems kept beside the grammar
            import json

            from plait.runtime.constrained.unique_items import UniqueGuard

            m = UniqueGuard(m, json.loads(constraint.unique), self.vocab.token_bytes)
        return m

    def release(self, future: GrammarFuture) -> None:
        """A request waiting for ``future`` ended before it was done (aborted: its client
        left). Once none waits, a build that has not started is dropped: a client that
        sent many slow constraints and hung up kept the compile queue busy, and later
        requests' constraints waited behind builds nobody wanted. A build already
        running goes on (bounded by the time limit; its result is cached)."""
        future.waiters -= 1
        if future.waiters <= 0 and not future.done:
            for c in self.compilers.values():
                c.abandon(future)

    def poll(self) -> None:
        for c in self.compilers.values():
            c.poll()

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a compile in flight (when nothing else can run)."""
        busy = [c for c in self.compilers.values() if c.busy]
        for c in busy:
            c.wait(timeout / len(busy))

    @property
    def busy(self) -> bool:
        return any(c.busy for c in self.compilers.values())

    @property
    def build_times(self) -> dict[str, float]:
        """Source -> compile seconds, over every backend (for benchmarks)."""
        out: dict[str, float] = {}
        for c in self.compilers.values():
            out.update(c.build_times)
        return out

    def close(self) -> None:
        for c in self.compilers.values():
            c.close()
