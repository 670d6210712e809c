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

Invariants: the host tree's pages and the host free list partition the host pool
(``free + cached == total``; the host tree is never locked except for the length of
one copy-back); the device tree's invariants are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from plait.runtime.memory import KVPool, PageAllocator
from plait.runtime.radix_cache import MatchResult, RadixCache

WRITE_POLICIES = ("write_back", "write_through")


class HostTier:
    """Host KV buffers shaped like ``device_pool``'s, ``num_pages`` pages of them."""

    def __init__(self, device_pool: KVPool, num_pages: int, write_policy: str = "write_back") -> None:
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
        self.tree = RadixCache(self.allocator)
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
