"""A host-memory tier (L2) under the device prefix cache, after SGLang's HiCache.

Prefixes the device cache evicts are copied to a host pool instead of being dropped
(``write_back``), or copied there as they are cached (``write_through``); a request
whose prompt the host holds further than the device gets that part copied back at
admission instead of recomputed. On CUDA the host pool is pinned memory; on CPU it is a
second pool in RAM, so a small device pool (``kv_cache_tokens``) can keep a working set
several times its size without recomputation.

The host side is a radix tree of its own (:class:`~plait.runtime.radix_cache.RadixCache`
over a host :class:`~plait.runtime.memory.PageAllocator`), keyed like the device tree
(tokens from position 0, per ``cache_salt``), so it holds whole prefixes: saving a leaf
also saves the part of its path the host lacks. KV is copied bit for bit in the KV
dtype, so outputs are the same with the tier on or off.

Copy-back (:class:`HostLoader`): at admission, and with
``hicache_prefetch_policy="best_effort"`` (the default) already while a request waits:
each step the first waiting requests get what the host holds of their prompts copied
into device pages, a bounded number of pages per step, so that admission finds them
loaded.

Invariants: the host tree's pages and the host free list partition the host pool
(``free + cached == total``; the host tree is never locked except for the length of
one copy); the device tree's invariants are unchanged (prefetched pages are device
tree nodes, counted as locked while a prefetch holds them).

With KV events on, the host tree reports its pages like the device tree (``medium``
:func:`~plait.runtime.kv_events.tier_media`'s second name): stored when written to
the host, removed when the host evicts them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.runtime.memory import KVPool, PageAllocator
from plait.runtime.radix_cache import MatchResult, RadixCache, TreeNode

if TYPE_CHECKING:
    from plait.runtime.kv_events import KVEventSink
    from plait.runtime.request import Req

WRITE_POLICIES = ("write_back", "write_through")
# Tokens a prefetch copies per scheduler step, all waiting requests together. A copy
# costs far less than recomputing (memory traffic vs. the model's FLOPs) but is not
# free; the bound keeps a burst of arrivals from stretching one step's decodes.
PREFETCH_TOKENS_PER_STEP = 256
# Waiting requests (in arrival order) a prefetch looks at each step.
PREFETCH_WINDOW = 16


class HostTier:
    """Host KV buffers shaped like ``device_pool``'s, ``num_pages`` pages of them."""

    def __init__(self, device_pool: KVPool, num_pages: int, write_policy: str = "write_back",
                 events: KVEventSink | None = None) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy={write_policy!r} is invalid; allowed: {', '.join(WRITE_POLICIES)}")
        self.device_pool = device_pool
        self.page_size = ps = device_pool.page_size
        self.write_through = write_policy == "write_through"
        pin = device_pool.device.type == "cuda"
        shape = (num_pages * ps, device_pool.kv_heads, device_pool.head_dim)
        self.k = [torch.empty(shape, dtype=device_pool.dtype, pin_memory=pin) for _ in range(device_pool.num_layers)]
        self.v = [torch.empty(shape, dtype=device_pool.dtype, pin_memory=pin) for _ in range(device_pool.num_layers)]
        self.allocator = PageAllocator(num_pages, ps)
        self.events = events  # the host tree's KV events (plait.runtime.kv_events), or None
        self.tree = RadixCache(self.allocator, events=events)
        self.saved_tokens = 0  # copied device -> host
        self.loaded_tokens = 0  # copied host -> device instead of recomputed

    def save(self, tokens: Sequence[int], device_slots: torch.Tensor, salt: str | None) -> None:
        """Keep the KV of ``tokens`` (a prefix from position 0, whose KV is in
        ``device_slots``) on the host; only the whole pages the host lacks are copied.
        Older host prefixes make room (LRU); if the pool is too small, nothing is kept."""
        ps = self.page_size
        n = len(tokens) - len(tokens) % ps
        have = self.tree.match_prefix(tokens[:n], salt)
        need = (n - have.length) // ps
        if need <= 0:
            return
        self.tree.lock(have.node)
        try:
            if self.allocator.num_free < need:
                self.tree.evict(need - self.allocator.num_free)
            pages = self.allocator.alloc(need)
        finally:
            self.tree.unlock(have.node)
        if pages is None:
            return
        host_slots = self.allocator.pages_to_slots(pages)
        src = device_slots[have.length : n].to(self.device_pool.device)
        for layer in range(self.device_pool.num_layers):
            self.k[layer][host_slots] = self.device_pool.k_buffers[layer][src].to("cpu")
            self.v[layer][host_slots] = self.device_pool.v_buffers[layer][src].to("cpu")
        dup = self.tree.insert(list(tokens[:n]), torch.cat([have.slots, host_slots]), salt)
        self.allocator.free(self.allocator.slots_to_pages(dup))
        self.saved_tokens += n - have.length

    def match(self, tokens: Sequence[int], salt: str | None, max_len: int | None) -> MatchResult:
        return self.tree.match_prefix(tokens, salt, max_len=max_len)

    def load(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy host KV into device slots (one gather per layer, one copy each)."""
        dst = device_slots.to(self.device_pool.device)
        for layer in range(self.device_pool.num_layers):
            k, v = self.k[layer][host_slots], self.v[layer][host_slots]
            self.device_pool.k_buffers[layer][dst] = k.to(self.device_pool.device, non_blocking=True)
            self.device_pool.v_buffers[layer][dst] = v.to(self.device_pool.device, non_blocking=True)
        self.loaded_tokens += host_slots.numel()

    def check_invariants(self) -> None:
        held = self.tree.held_pages()
        if len(held) != len(set(held)) or self.allocator.num_free + len(held) != self.allocator.total_pages:
            raise AssertionError(f"host tier accounting broken: {self.allocator.num_free} free, {len(held)} held "
                                 f"({len(held) - len(set(held))} twice), {self.allocator.total_pages} total")
        if self.tree.locked_pages:
            raise AssertionError(f"host tier holds {self.tree.locked_pages} locked pages between steps")

    def usage(self) -> dict[str, int]:
        return {"total": self.allocator.total_pages, "free": self.allocator.num_free,
                "cached": self.tree.cached_pages}


@dataclass
class _Waiting:
    """What :class:`HostLoader` knows of one waiting request."""

    version: int  # the host tree's version when ``host`` was matched
    max_len: int  # the request's ``max_prefix_len()`` then
    host: MatchResult  # the host tier's match of its prompt
    node: TreeNode | None = None  # the device node its prefetch locks (None: none)


class HostLoader:
    """The scheduler's door to the host tier for waiting requests: copies the part of
    a prompt the host holds beyond the device cache into device pages, at admission
    (:meth:`load`) and, with prefetch on, while the request waits (:meth:`prefetch`).

    It probes the host tree once per waiting request and remembers the match until the
    host tree changes (its ``version``) or the request's cacheable length does.

    Ownership. A bounded number of pages per step, copied in the scheduler's thread,
    rather than a worker thread: the scheduler stays the only writer of both trees and
    both allocators, so no page changes hands behind its back and no copy is in flight
    between two calls (a worker would need pages owned by "a copy in progress", a state
    every eviction, abort and flush would have to wait for or cancel). Copied pages go into the device tree at once:
    they are cached pages like any other. A prefetch holds one lock per request, on the
    device node ending the host-held part of its prompt, so the pages wait there for
    admission. These locks give way to everything else: :meth:`release_all` drops them
    before a decode or a prefill chunk would go without memory (before any retraction)
    and at the start of each admission round, which so sees the device tree as it would
    without prefetch; each step's :meth:`prefetch` locks again what is still there.
    Admission takes a request's prefix over (locks its own match) before :meth:`forget`
    drops the request's entry and lock.

    Invariants (:meth:`check_invariants`): entries exist only for waiting requests;
    each holds at most one lock, on a node still in the device tree.
    """

    def __init__(self, tier: HostTier, cache: RadixCache, allocator: PageAllocator, prefetch: bool) -> None:
        self.tier = tier
        self.cache = cache
        self.allocator = allocator
        self.prefetch_on = prefetch
        self.page_size = ps = allocator.page_size
        self.pages_per_step = max(1, PREFETCH_TOKENS_PER_STEP // ps)
        self._waiting: dict[str, _Waiting] = {}  # by rid
        self.probes = 0  # host tree matches made
        self.prefetched_tokens = 0  # copied while their request waited

    def probe(self, r: Req) -> MatchResult:
        """The host tier's match of ``r``'s prompt (up to ``r.max_prefix_len()``),
        remembered while neither the host tree nor that length changes."""
        max_len = r.max_prefix_len()
        version = self.tier.tree.version
        w = self._waiting.get(r.rid)
        if w is not None and w.version == version and w.max_len == max_len:
            return w.host
        # NOTE: positions before max_prefix_len() never change while a request waits
        # (healing and jump-start touch only its last prompt token and after)
        host = self.tier.match(r.token_ids, r.kv_namespace, max_len)
        self.probes += 1
        if w is None:
            self._waiting[r.rid] = _Waiting(version, max_len, host)
        else:
            w.version, w.max_len, w.host = version, max_len, host
        return host

    def load(self, r: Req, match: MatchResult, max_pages: int | None = None) -> MatchResult:
        """Copy what the host holds of ``r``'s prompt beyond ``match`` (its device
        match; at most ``max_pages`` pages) into fresh device pages (evicting unlocked
        device prefixes if the free list is short) and cache it there. Returns the
        device match after it; ``match`` itself when nothing was copied (nothing to
        copy, or no page to be had)."""
        host = self.probe(r)
        ps = self.page_size
        k = (host.length - match.length) // ps
        if max_pages is not None:
            k = min(k, max_pages)
        if k <= 0:
            return match
        end = match.length + k * ps
        self.cache.lock(match.node)  # eviction below must not take the device part
        self.tier.tree.lock(host.node)  # ... nor saving evicted leaves the host part
        try:
            if self.allocator.num_free < k:
                self.cache.evict(k - self.allocator.num_free)
            pages = self.allocator.alloc(k)
            if pages is None:
                return match
            slots = self.allocator.pages_to_slots(pages)
            self.tier.load(host.slots[match.length : end], slots)
        finally:
            self.tier.tree.unlock(host.node)
            self.cache.unlock(match.node)
        dup = self.cache.insert(r.token_ids[:end], torch.cat([match.slots, slots]), r.kv_namespace)
        self.allocator.free(self.allocator.slots_to_pages(dup))
        return self.cache.match_prefix(r.token_ids, r.kv_namespace, max_len=r.max_prefix_len())

    def prefetch(self, waiting: Iterable[Req], reserved_pages: int) -> None:
        """With prefetch on: for the first :data:`PREFETCH_WINDOW` waiting requests,
        copy what the host holds of their prompts beyond the device cache, at most
        ``pages_per_step`` pages in all, and only while the device keeps more than
        ``reserved_pages`` (what running requests are expected to take) free or
        evictable; lock each one's host-held prefix on the device until admission."""
        if not self.prefetch_on:
            return
        copied = 0
        for r in itertools.islice(waiting, PREFETCH_WINDOW):
            spare = self.allocator.num_free + self.cache.evictable_pages - reserved_pages
            if spare <= 0:
                break
            host = self.probe(r)
            if host.length == 0:
                continue
            match = self.cache.match_prefix(r.token_ids, r.kv_namespace, max_len=host.length)
            room = min(self.pages_per_step - copied, spare)
            if match.length < host.length and room > 0:
                before = self.tier.loaded_tokens
                match = self.load(r, match, room)
                copied += (self.tier.loaded_tokens - before) // self.page_size
                self.prefetched_tokens += self.tier.loaded_tokens - before
            if match.length:
                self._lock(r.rid, match.node)

    def _lock(self, rid: str, node: TreeNode) -> None:
        w = self._waiting[rid]
        self.cache.lock(node)
        if w.node is not None:
            self.cache.unlock(w.node)
        w.node = node

    def release_all(self) -> bool:
        """Drop every prefetch lock (the pages stay cached, now evictable); True if
        one was held."""
        held = False
        for w in self._waiting.values():
            if w.node is not None:
                self.cache.unlock(w.node)
                w.node = None
                held = True
        return held

    def forget(self, r: Req) -> None:
        """``r`` left the waiting queue (admitted, aborted): drop its entry and lock."""
        w = self._waiting.pop(r.rid, None)
        if w is not None and w.node is not None:
            self.cache.unlock(w.node)

    @property
    def locks(self) -> int:
        """Prefetch locks held."""
        return sum(w.node is not None for w in self._waiting.values())

    def check_invariants(self, waiting: Iterable[Req]) -> None:
        stale = self._waiting.keys() - {r.rid for r in waiting}
        if stale:
            raise AssertionError(f"host loader keeps entries of requests that are not waiting: {sorted(stale)}")
        for rid, w in self._waiting.items():
            if w.node is not None and (w.node.lock_ref <= 0 or w.node.parent is None):
                raise AssertionError(f"prefetch of {rid!r} locks a node that is not locked in the tree: {w.node!r}")
