"""Compiling constraints to indexes without stalling the engine loop.

``GrammarCompiler.request(regex)`` returns a ``GrammarFuture`` at once: from the cache
(keyed by (tokenizer fingerprint, regex), shared by every request), or queued for the
worker process (``worker.py``), which builds the outlines-core ``Index`` and the
jump-forward automaton. ``poll()`` (called by the engine each step) collects results
and enforces the limits: a build running past ``timeout_s`` is killed; one that needs
more than ``memory_mb`` dies in the worker. Either way the future fails with a message
naming the limit, and the worker is restarted for the next build.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from typing import Any

import numpy as np

from plait.runtime.constrained.backend import GrammarFuture
from plait.runtime.constrained.jump_forward import CharAutomaton
from plait.runtime.constrained.vocab import TokenVocab
from plait.runtime.constrained.worker import read_frame, write_frame


NEST_HINT = 120  # group depth past which a failed outlines build is put down to nesting


def group_depth(regex: str) -> int:
    """How deeply ``regex``'s groups nest (escapes and character classes skipped)."""
    depth = top = 0
    i, n = 0, len(regex)
    while i < n:
        c = regex[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            j += regex[j:j + 1] == "]"
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i = j + 1
            continue
        if c == "(":
            depth += 1
            top = max(top, depth)
        elif c == ")":
            depth = max(depth - 1, 0)
        i += 1
    return top


class CompiledGrammar:
    """An index over one vocabulary, its jump-forward automaton, and per-state caches.

    Masks are packed bit rows (``int32 [words]``, bit ``i % 32`` of word ``i // 32``
    is token ``i``) of the allowed non-EOS tokens; EOS is the matcher's business.

    ``sentinel``: the pseudo-token id of an index built with the worker's end sentinel
    (``worker.py``: outlines-core drops tokens that leave a state where the pattern could
    end); a state is then final when the pseudo-token may follow and leads to a final
    state; it is never offered, and neither is a token holding the sentinel's first byte. None: the index
    is the pattern's own.
    """

    def __init__(self, index: Any, vocab: TokenVocab, chars: CharAutomaton | None, sentinel: int | None = None) -> None:
        self.index = index
        self.vocab = vocab
        self.chars = chars
        self.sentinel = sentinel
        self.initial: int = index.get_initial_state()
        self.words = vocab.mask_words
        self._masks: dict[int, np.ndarray] = {}
        self._final: dict[int, bool] = {}
        self._extend: dict[tuple[int, int], bool] = {}
        self._heal: dict[bytes, dict[int, tuple[int | None, bytes]]] = {}
        self._first_bytes: set[int] | None = None

    def pack(self, ids: Any) -> np.ndarray:
        bits = np.zeros(self.words * 32, dtype=np.bool_)
        if len(ids):
            bits[np.asarray(ids, dtype=np.int64)] = True
        bits[self.vocab.outlines_eos_id] = False
        return np.packbits(bits, bitorder="little").view(np.int32)

    def mask(self, state: int) -> np.ndarray:
        """Allowed non-EOS tokens in ``state`` (cached; do not modify)."""
        m = self._masks.get(state)
        if m is None:
            ids = self.index.get_allowed_tokens(state) or []
            if self.sentinel is not None:
                arr = np.asarray(ids, dtype=np.int64)
                is_pseudo = arr == self.sentinel
                # final when the pattern may end here: the sentinel may follow *and* ends the
                # match (a pattern that allows the character U+10FFFF itself, inside a JSON
                # string say, takes the pseudo-token there too, into a state that is not final)
                self._final[state] = bool(is_pseudo.any()) and bool(
                    self.index.is_final_state(self.index.get_next_state(state, self.sentinel)))
                m = self.pack(arr[~is_pseudo]) & ~self.vocab.sentinel_byte_mask
            else:
                m = self.pack(ids)
            self._masks[state] = m
            m.setflags(write=False)
        return m

    def is_final(self, state: int) -> bool:
        if self.sentinel is None:
            return bool(self.index.is_final_state(state))
        if state not in self._final:
            self.mask(state)
        return self._final[state]

    def has_continuation(self, state: int) -> bool:
        return bool(self.mask(state).any())

    def next_state(self, state: int, token: int) -> int | None:
        if self.sentinel is not None and (token == self.sentinel or self.vocab.holds_sentinel_byte(token)):
            return None
        return self.index.get_next_state(state, token)

    def walk(self, state: int | None, tokens: list[int]) -> list[int] | None:
        """States after each token (None if one is not allowed)."""
        out = []
        for t in tokens:
            state = None if state is None else self.next_state(state, t)
            if state is None:
                return None
            out.append(state)
        return out

    def walk_bytes(self, state: int, data: bytes) -> int | None:
        """The state after ``data`` read one single-byte token at a time."""
        for b in data:
            tok = self.vocab.byte_token(b)
            nxt = None if tok is None else self.next_state(state, tok)
            if nxt is None:
                return None
            state = nxt
        return state

    def can_extend(self, state: int, token: int) -> bool:
        """Could a longer token, starting with ``token``'s bytes, be taken in ``state``?
        (Then ``token`` is not a safe place to stop a jump: the model may want to
        write across it.)"""
        key = (state, token)
        if key not in self._extend:
            b = self.vocab.token_bytes[token] or b""
            self._extend[key] = any(
                self.next_state(state, t) is not None for t in self.vocab.tokens_with_prefix(b)
            )
        return self._extend[key]

    def first_bytes(self) -> set[int]:
        if self._first_bytes is None:
            ids = np.flatnonzero(np.unpackbits(self.mask(self.initial).view(np.uint8), bitorder="little"))
            self._first_bytes = {self.vocab.token_bytes[i][0] for i in ids if self.vocab.token_bytes[i]}
        return self._first_bytes

    def heal_table(self, heal: bytes) -> dict[int, tuple[int | None, bytes]]:
        """Tokens allowed while the bytes ``heal`` (a backed-off prompt token, or what is
        left of it) must be written first: token -> (index state after it, or None while
        ``heal`` is not used up; the heal bytes still to write)."""
        table = self._heal.get(heal)
        if table is not None:
            return table
        table = {}
        for k in range(1, len(heal)):
            for t in self.vocab.ids_of(heal[:k]):
                table[t] = (None, heal[k:])
        for t in self.vocab.ids_of(heal):
            table[t] = (self.initial, b"")
        firsts = self.first_bytes()
        for t in self.vocab.tokens_with_prefix(heal):
            rest = self.vocab.token_bytes[t][len(heal) :]
            if rest[0] in firsts:
                st = self.walk_bytes(self.initial, rest)
                if st is not None:
                    table[t] = (st, b"")
        if len(self._heal) < 1024:
            self._heal[heal] = table
        return table


class GrammarCompiler:
    """The outlines-core backend's compiler (see ``backend.py``): builds indexes in one
    worker process, one at a time, with limits; caches them."""

    def __init__(
        self,
        vocab: TokenVocab,
        *,
        timeout_s: float = 30.0,
        memory_mb: int = 4096,
        cache_size: int = 64,
        jump_forward: bool = True,
    ) -> None:
        self.vocab = vocab
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.cache_size = cache_size
        self.jump_forward = jump_forward
        self._cache: OrderedDict[tuple[str, str], GrammarFuture] = OrderedDict()
        self._queue: deque[GrammarFuture] = deque()
        self._inflight: GrammarFuture | None = None
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._jobs = 0
        self.build_times: dict[str, float] = {}  # regex -> seconds, for benchmarks
        self.cache_hits = 0

    # -- public ---------------------------------------------------------------------------
    def request(self, regex: str, budget_s: float | None = None) -> GrammarFuture:
        """The build of ``regex`` (cached); ``budget_s``: a shorter time limit for a new
        build than ``timeout_s`` (auto's first try, which llguidance takes over)."""
        key = (self.vocab.fingerprint, regex)
        fut = self._cache.get(key)
        if fut is not None and not fut.stale:
            self._cache.move_to_end(key)
            self.cache_hits += 1
            return fut
        fut = GrammarFuture(key, regex)
        fut.budget_s = budget_s
        self._cache[key] = fut
        self._queue.append(fut)
        self._evict()
        self.poll()
        return fut

    def cached(self, regex: str) -> GrammarFuture | None:
        """The compile of ``regex`` this compiler has (done or not), or None."""
        fut = self._cache.get((self.vocab.fingerprint, regex))
        return None if fut is None or fut.stale else fut

    def stalled(self, seconds: float) -> bool:
        """Whether the build in flight has run longer than ``seconds``."""
        fut = self._inflight
        return fut is not None and fut.started is not None and time.monotonic() - fut.started > seconds

    @property
    def queued(self) -> int:
        return len(self._queue)

    def poll(self) -> None:
        """Collect finished builds, enforce the time limit, start the next build."""
        self._collect(0.0)

    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the build in flight (the engine does this
        when nothing else can run)."""
        self._collect(timeout)

    def _collect(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while self._inflight is not None:
            limit = self._limit(self._inflight)
            left = min(end, self._inflight.started + limit) - time.monotonic()
            try:
                reply = self._replies.get(timeout=left) if left > 0 else self._replies.get_nowait()
            except queue.Empty:
                reply = None
            if reply is not None and reply[0] == "ready":
                self._inflight.started = time.monotonic()  # the limit covers the build, not the start-up
                continue
            if reply is not None:
                self._finish(reply)
            elif time.monotonic() - self._inflight.started > limit:
                self._kill()
                what = "limit" if limit >= self.timeout_s else "budget of grammar_backend auto's outlines-core try"
                self._fail(f"compiling it took longer than the {limit:g} s {what} (grammar_compile_timeout)",
                           timed_out=True)
            if self._inflight is None and self._queue:
                self._start(self._queue.popleft())
            if time.monotonic() >= end:
                break
        if self._inflight is None and self._queue:
            self._start(self._queue.popleft())

    def abandon(self, fut: GrammarFuture) -> None:
        """Drop ``fut`` if its build is queued, not started (no request waits for it):
        out of the queue and the cache (a later request for it queues it again)."""
        if fut.done or not any(f is fut for f in self._queue):
            return
        self._queue = deque(f for f in self._queue if f is not fut)
        if self._cache.get(fut.key) is fut:
            del self._cache[fut.key]
        fut.error = "no request waits for it"

    @property
    def busy(self) -> bool:
        return self._inflight is not None or bool(self._queue)

    def close(self) -> None:
        self._kill()
        for fut in [*self._queue, *([self._inflight] if self._inflight else [])]:
            fut.error = "the engine shut down"
        self._queue.clear()
        self._inflight = None

    # -- worker ---------------------------------------------------------------------------
    def _spawn(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "plait.runtime.constrained.worker", str(self.memory_mb), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        self._replies = queue.Queue()
        threading.Thread(target=self._read_replies, args=(self._proc, self._replies), daemon=True).start()
        write_frame(self._proc.stdin, ("vocab", self.vocab.fingerprint, self.vocab.outlines_eos_id, self.vocab.outlines_map()))

    @staticmethod
    def _read_replies(proc: subprocess.Popen, out: queue.Queue) -> None:
        while True:
            try:
                msg = read_frame(proc.stdout)
            except Exception:
                msg = None
            if msg is None:
                out.put(("dead", None, proc.wait()))
                return
            out.put(msg)

    def _start(self, fut: GrammarFuture) -> None:
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        self._jobs += 1
        fut.started = time.monotonic()
        self._inflight = fut
        try:
            limit = self._limit(fut)
            jf_seconds = 0.8 * limit if self.jump_forward else 0.0
            write_frame(self._proc.stdin, ("build", self._jobs, self.vocab.fingerprint, fut.source, jf_seconds,
                                           limit))
        except (BrokenPipeError, OSError):
            self._kill()
            self._fail("the compile worker could not be reached")

    def _limit(self, fut: GrammarFuture) -> float:
        return self.timeout_s if fut.budget_s is None else min(fut.budget_s, self.timeout_s)

    def _finish(self, reply: tuple) -> None:
        fut = self._inflight
        assert fut is not None
        if reply[0] == "ok":
            _, _, index, chars, sentinel = reply
            fut.grammar = CompiledGrammar(index, self.vocab, chars, sentinel)
            self.build_times[fut.source] = time.monotonic() - fut.started
            self._inflight = None
        elif reply[0] == "error":
            msg = reply[2]
            if msg == "memory" or "memory allocation" in msg or "capacity overflow" in msg:
                msg = f"compiling it needs more than the {self.memory_mb} MiB limit (grammar_compile_memory_mb)"
            elif "Failed to build DFA" in msg and (depth := group_depth(fut.source)) > NEST_HINT:
                # outlines-core's parser nests at most ~250 levels (groups and what they hold):
                # an integer bound of 300 digits is written as 300 nested groups
                msg = (f"it cannot be compiled ({msg}): its regex nests groups {depth} levels "
                       f"deep, past what outlines-core's parser takes (about 250; a JSON Schema bound of that "
                       f"many digits is written that deep)")
            elif "Failed to build DFA" in msg:
                msg = (f"it cannot be compiled ({msg}); the regex dialect has no look-around or back-references, "
                       "and repetition bounds must be ordered ({2,5}, not {5,2})")
            else:
                msg = f"it cannot be compiled: {msg}"
            self._fail(msg)
        else:  # the worker died: almost always the memory limit (allocation failure aborts)
            self._proc = None
            self._fail(
                f"compiling it needs more than the {self.memory_mb} MiB limit (grammar_compile_memory_mb); "
                f"the compile worker exited with code {reply[2]}"
            )

    def _fail(self, message: str, timed_out: bool = False) -> None:
        if self._inflight is not None:
            if timed_out:  # cached for a while only (GrammarFuture.timed_out)
                self._inflight.timed_out(message)
            else:
                self._inflight.error = message
            self._inflight = None

    def _kill(self) -> None:
        if self._proc is not None:
            try:
                self._proc.kill()
                self._proc.wait(timeout=5)
            except Exception:
                pass
            for f in (self._proc.stdin, self._proc.stdout):
                try:
                    f.close()
                except Exception:
                    pass
            self._proc = None

    def _evict(self) -> None:
        while len(self._cache) > self.cache_size:
            for key, fut in self._cache.items():
                if fut.done:
                    del self._cache[key]
                    break
            else:
                return
