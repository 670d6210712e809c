"""Pinned prefixes: KV of a shared prompt prefix held in the radix cache on purpose.

A language client that is about to run a batch of programs sharing a prefix asks the
engine to *pin* it: the engine prefills the prefix (a request with
``max_new_tokens=0``), and when that prefill finishes, locks the radix node covering it,
exactly as a running request would. The node then survives eviction pressure until the
pin is released (``unpin``), its TTL passes, or the cache is flushed.

Pins are hints, never correctness: a pin that cannot be served (over budget, the
prefill aborted) fails loudly at ``add`` time or ends in state ``failed``; requests run
the same either way.

Budget: the tokens of all live pins (pending or active, counted per pin) may not
exceed ``budget_tokens``, so pins can never starve running requests of KV memory.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from plait.errors import RequestError
from plait.runtime.radix_cache import RadixCache, TreeNode
from plait.runtime.request import Req

MAX_PIN_TTL_S = 24 * 3600.0


@dataclass
class Pin:
    """One pinned prefix. ``state``: ``pending`` (prefill queued or running),
    ``active`` (``node`` locked), ``failed`` (the prefill was aborted)."""

    pin_id: str
    input_ids: list[int]
    cache_salt: str | None
    expires_at: float
    prefill: Req | None = None  # the internal prefill request while pending
    node: TreeNode | None = None
    num_tokens: int = 0  # tokens held locked once active (page aligned)
    state: str = "pending"
    error: str | None = None

    def info(self) -> dict[str, Any]:
        return {
            "pin_id": self.pin_id,
            "state": self.state,
            "prefix_tokens": len(self.input_ids),
            "num_tokens": self.num_tokens,
            "expires_at": self.expires_at,
            "error": self.error,
        }


class PinTable:
    """The engine's pins. Owns one radix lock per active pin.

    Invariant: every ``active`` pin holds exactly one ``cache.lock`` on ``pin.node``;
    ``pending`` and ``failed`` pins hold none. ``used_tokens`` (prompt tokens of live
    pins) never exceeds ``budget_tokens``.
    """

    def __init__(self, cache: RadixCache, budget_tokens: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.budget_tokens = budget_tokens
        self.clock = clock
        self._pins: dict[str, Pin] = {}
        self._ids = itertools.count()

    # -- queries ----------------------------------------------------------------------
    @property
    def used_tokens(self) -> int:
        return sum(len(p.input_ids) for p in self._pins.values() if p.state != "failed")

    def __len__(self) -> int:
        return len(self._pins)

    def get(self, pin_id: str) -> Pin | None:
        return self._pins.get(pin_id)

    def pending(self) -> list[Pin]:
        """Pins whose prefill has not finished yet."""
        return [p for p in self._pins.values() if p.prefill is not None]

    def stats(self) -> dict[str, int]:
        """Pins held, tokens they cover, and the budget."""
        states = [p.state for p in self._pins.values()]
        return {
            "active": states.count("active"),
            "pending": states.count("pending"),
            "pinned_tokens": self.used_tokens,
            "budget_tokens": self.budget_tokens,
        }

    # -- lifecycle --------------------------------------------------------------------
    def new(self, input_ids: list[int], ttl_s: float, cache_salt: str | None) -> Pin:
        """Register a pin (state ``pending``) for a validated prefix and TTL; raises
        :class:`RequestError` when the pin would exceed the budget."""
        used = self.used_tokens
        if used + len(input_ids) > self.budget_tokens:
            raise RequestError(
                f"pinning {len(input_ids)} tokens exceeds the pin budget: {used} of {self.budget_tokens} "
                f"tokens are pinned already; unpin something or pin a shorter prefix"
            )
        pin = Pin(f"pin-{next(self._ids)}", list(input_ids), cache_salt, self.clock() + float(ttl_s))
        self._pins[pin.pin_id] = pin
        return pin

    def attach_prefill(self, pin: Pin, req: Req) -> None:
        pin.prefill = req

    def activate(self, pin: Pin) -> None:
        """Lock the cached prefix of ``pin`` (its prefill has finished, or the prefix
        was cached already). Must run before the next eviction can happen."""
        pin.prefill = None
        match = self.cache.match_prefix(pin.input_ids, pin.cache_salt)
        self.cache.lock(match.node)
        pin.node, pin.num_tokens, pin.state = match.node, match.length, "active"

    def on_prefill_finished(self, pin: Pin) -> None:
        """``pin``'s prefill request finished: activate the pin, or mark it failed."""
        reason = pin.prefill.finish_reason if pin.prefill is not None else None
        if reason is not None and reason.type == "abort":
            pin.prefill, pin.state = None, "failed"
            pin.error = reason.message or "prefill aborted"
            return
        self.activate(pin)

    def release(self, pin_id: str) -> Pin | None:
        """Drop a pin; unlocks its node if active. Returns it (the caller aborts a
        pending prefill, ``pin.prefill``), or None if unknown."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return None
        if pin.state == "active" and pin.node is not None:
            self.cache.unlock(pin.node)
        pin.node, pin.state = None, "released"
        return pin

    def expired(self, now: float | None = None) -> list[str]:
        """Ids of pins whose TTL has passed (and failed pins, kept one TTL for
        inspection); the caller releases them."""
        now = self.clock() if now is None else now
        return [p.pin_id for p in self._pins.values() if p.expires_at <= now]

    def ids(self) -> list[str]:
        return list(self._pins)
