"""Paged KV memory: the pool of KV slots, the page allocator and the page table.

A *slot* holds the K and V vectors of one token in every layer. Slots are grouped in
fixed-size *pages* (``page_size`` slots, 1 allowed); page ``p`` owns slots
``p * page_size .. p * page_size + page_size - 1``. Memory is taken a page at a time
and returned whole.

NOTE: page 0 is never handed out; its slots are the padding sink that batch tensors
point at for positions that do not exist.
"""

from __future__ import annotations

import torch


class KVPool:
    """Per-layer K and V buffers, each ``[num_slots, kv_heads, head_dim]``."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
    ) -> None:
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_slots, kv_heads, head_dim)
        # empty, so untouched memory is never committed; every slot is written before it
        # is read, except the padding sink, which must hold finite values (masked-out
        # attention weights are 0, and 0 * NaN would still poison the output).
        self.k_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._zeroed = bytearray(num_slots // page_size)  # pages zeroed since allocation
        self.zero_pages([0])

    def zero_pages(self, pages: list[int]) -> None:
        """Zero the pages among ``pages`` that were never zeroed, in every layer.

        Page-granular reads see (masked) the not-yet-written slots of a request's last
        page; those must be finite. A page is zeroed on its first use; afterwards it holds
        only zeros or K/V that a model wrote, so reuse needs no second pass.
        """
        fresh = [p for p in pages if not self._zeroed[p]]
        if not fresh:
            return
        for p in fresh:
            self._zeroed[p] = 1
        ps = self.page_size
        idx = torch.tensor(fresh, device=self.device)
        for buf in self.k_buffers + self.v_buffers:
            buf.view(-1, ps, *buf.shape[1:]).index_fill_(0, idx, 0)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def set_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[tokens, kv_heads, head_dim]`` into ``slots`` ``[tokens]``."""
        self.k_buffers[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v_buffers[layer].index_copy_(0, slots, v.to(self.dtype))


class PageAllocator:
    """Free list of pages; O(1) alloc and free per page.

    Invariant: every page except page 0 is either on the free list or owned by exactly
    one holder (a running request or a radix-tree node). ``free`` raises on a double
    free, so a slot can never be owned twice without the tests noticing.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first
        self._is_free = bytearray(num_pages)
        for p in self._free:
            self._is_free[p] = 1

    @property
    def total_pages(self) -> int:
        """Pages that can ever be handed out (page 0 excluded)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def free_pages(self) -> list[int]:
        """A copy of the free list (for invariant checks)."""
        return list(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` pages, or return None (taking nothing) if fewer are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._is_free[p] = 0
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p <= 0 or p >= self.num_pages:
                raise RuntimeError(f"free of invalid page {p}")
            if self._is_free[p]:
                raise RuntimeError(f"double free of page {p}")
            self._is_free[p] = 1
            self._free.append(p)

    def pages_to_slots(self, pages: list[int]) -> torch.Tensor:
        """All slots of ``pages``, in order, as an int64 tensor."""
        ps = self.page_size
        base = torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * ps
        return (base + torch.arange(ps, dtype=torch.int64)).reshape(-1)

    def slots_to_pages(self, slots: torch.Tensor) -> list[int]:
        """Pages of page-aligned ``slots`` (whole pages, in order)."""
        if slots.numel() == 0:
            return []
        return (slots[:: self.page_size] // self.page_size).tolist()


class ReqToToken:
    """The page table: ``[max_running, max_context]`` int32 rows mapping a running
    request's positions to slots. Attention backends read it; rows are handed out to
    requests when they start running and returned when they stop."""

    def __init__(self, max_running: int, max_context: int, device: torch.device | str) -> None:
        self.max_running = max_running
        self.max_context = max_context
        self.table = torch.zeros((max_running, max_context), dtype=torch.int32, device=device)
        self._free_rows = list(range(max_running - 1, -1, -1))

    @property
    def num_free_rows(self) -> int:
        return len(self._free_rows)

    def alloc_row(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free_row(self, row: int) -> None:
        if row in self._free_rows:
            raise RuntimeError(f"double free of page-table row {row}")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.table[row, start : start + slots.numel()] = slots.to(self.table.dtype)


def kv_pool_budget(mem_fraction_static: float, *, free: int, total: int) -> int:
    """Bytes the KV pool may take under SGLang's ``mem_fraction_static`` rule: all that
    is in use (weights, runtime context, other processes) plus the pool stay within
    ``mem_fraction_static * total``, i.e. ``free - (1 - fraction) * total`` is left for
    the pool, and ``(1 - fraction) * total`` for activations. May be <= 0."""
    return int(free - (1.0 - mem_fraction_static) * total)
