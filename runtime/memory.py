"""Paged KV memory: the pool of KV slots, the page allocator and the page table.

A *slot* holds the K and V vectors of one token in every layer. Slots are grouped in
fixed-size *pages* (``page_size`` slots, 1 allowed); page ``p`` owns slots
``p * page_size .. p * page_size + page_size - 1``. Memory is taken a page at a time
and returned whole.

NOTE: page 0 is never handed out; its slots are the padding sink that batch tensors
point at for positions that do not exist.

Sliding-window layers may keep their KV in a smaller pool of their own
(:class:`WindowPages`): a full page is *attached* to a window page while some reader
still needs its windowed KV, and detached (the window page freed) once none does.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor from calloc'ed memory (numpy's zeros): large blocks are fresh
    mappings the kernel zero-fills page by page on first touch, so nothing is written
    or committed up front (``torch.zeros`` writes every byte)."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
    start = -raw.data_ptr() % 64  # 64-byte aligned, as torch's own allocations are
    return raw[start:start + nbytes].view(dtype).view(shape)


class KVPool:
    """Per-layer K and V buffers, each ``[num_slots, kv_heads, head_dim]``; with
    ``window`` the layers in ``windowed_layers`` have ``[window.num_slots, ...]``
    buffers instead, addressed through ``window.slot_map``."""

    def __init__(
        self,
        num_slots: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 1,
        *,
        window: WindowPages | None = None,
        windowed_layers: frozenset[int] = frozenset(),
    ) -> None:
        if window is not None and (window.page_size != page_size or window.num_full_pages * page_size != num_slots):
            raise ValueError("the window pool must map exactly this pool's pages")
        self.window = window
        self.windowed_layers = windowed_layers if window is not None else frozenset()
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # empty, so untouched memory is never committed; every slot is written before it
        # is read, except the padding sink, which must hold finite values (masked-out
        # attention weights are 0, and 0 * NaN would still poison the output).
        def rows(layer: int) -> int:
            return window.num_slots if layer in self.windowed_layers else num_slots  # type: ignore[union-attr]

        # On CPU the buffers come zeroed from the OS (calloc: pages mapped on first touch,
        # never memset), so no page needs a zeroing pass and untouched memory is still never
        # committed; a tensor-parallel worker rank, which does not see which pages rank 0
        # hands out, zeroed its whole pool at start-up (each rank then held the whole
        # machine's KV budget at once).
        cpu = self.device.type == "cpu"

        def new(layer: int) -> torch.Tensor:
            shape = (rows(layer), kv_heads, head_dim)
            return _zeroed_cpu(shape, dtype) if cpu else torch.empty(shape, dtype=dtype, device=device)

        self.k_buffers = [new(i) for i in range(num_layers)]
        self.v_buffers = [new(i) for i in range(num_layers)]
        done = 1 if cpu else 0
        self._zeroed = bytearray([done]) * (num_slots // page_size)  # pages zeroed since allocation
        self._zeroed_window = bytearray([done]) * (window.num_pages if window is not None else 0)
        self._full_layers = [i for i in range(num_layers) if i not in self.windowed_layers]
        self._window_layers = sorted(self.windowed_layers)
        self._zero([0], self._zeroed, self._full_layers)
        if window is not None:
            self._zero([0], self._zeroed_window, self._window_layers)

    def zero_pages(self, pages: list[int]) -> None:
        """Zero the pages among ``pages`` that were never zeroed, in every layer (for
        windowed layers: the window pages they are attached to).

        Page-granular reads see (masked) the not-yet-written slots of a request's last
        page; those must be finite. A page is zeroed on its first use; afterwards it holds
        only zeros or K/V that a model wrote, so reuse needs no second pass.
        """
        self._zero(pages, self._zeroed, self._full_layers)
        if self.window is not None:
            attached = [w for w in map(self.window.page_of, pages) if w]
            self._zero(attached, self._zeroed_window, self._window_layers)

    def _zero(self, pages: list[int], zeroed: bytearray, layers: list[int]) -> None:
        fresh = sorted({p for p in pages if not zeroed[p]})
        if not fresh or not layers:
            return
        for p in fresh:
            zeroed[p] = 1
        ps = self.page_size
        idx = torch.tensor(fresh, device=self.device)
        for i in layers:
            for buf in (self.k_buffers[i], self.v_buffers[i]):
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
        self.window: WindowPages | None = None  # the windowed layers' pages, set by the engine
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
        if self.window is not None:
            self.window.detach(pages)  # a freed page keeps no windowed KV
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


class WindowPages:
    """The pool of the sliding-window layers' KV: ``num_pages`` window pages (page 0 the
    zeroed sink) for the ``num_full_pages`` pages of the main pool.

    A full page is *attached* to one window page while its windowed KV is kept, and
    *detached* when no one will read it: a running request reads the windowed KV of
    its last ``window`` positions only, so the scheduler detaches a request's own pages
    as it moves past them, and detaches cached (tree) pages that no running request's
    window covers when window pages run short. A detached page maps to the sink;
    attention never reads it (it lies outside every window that reaches it).

    Invariant: every window page except 0 is free or attached to exactly one full page,
    and only allocated full pages are attached (:meth:`check`).
    """

    def __init__(self, num_pages: int, num_full_pages: int, page_size: int, window: int,
                 device: torch.device | str) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.allocator = PageAllocator(num_pages, page_size)
        self.num_pages = num_pages
        self.num_full_pages = num_full_pages
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.window = window  # the widest window of the model's windowed layers
        self._page = [0] * num_full_pages  # full page -> window page (0: detached)
        # the same per slot, for the attention backends (int64: an index tensor)
        self.slot_map = torch.zeros(num_full_pages * page_size, dtype=torch.int64, device=device)
        self._offsets = torch.arange(page_size, dtype=torch.int64)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def total_pages(self) -> int:
        return self.allocator.total_pages

    def usage(self) -> dict[str, int]:
        """Window pages: ``total``, ``free``, ``attached``, and the ``window`` (tokens)."""
        return {"total": self.total_pages, "free": self.num_free, "attached": self.total_pages - self.num_free,
                "window": self.window}

    def page_of(self, page: int) -> int:
        """The window page attached to full ``page`` (0: none)."""
        return self._page[page]

    def attached(self, pages: list[int]) -> list[bool]:
        return [self._page[p] != 0 for p in pages]

    def attach(self, pages: list[int]) -> None:
        """Give each of ``pages`` (new full pages) a window page. The caller makes room
        first; raises RuntimeError if there is none."""
        got = self.allocator.alloc(len(pages))
        if got is None:
            raise RuntimeError(f"window KV pool exhausted: needed {len(pages)} pages, {self.num_free} free")
        for p, w in zip(pages, got):
            if self._page[p]:
                raise RuntimeError(f"page {p} is already attached to window page {self._page[p]}")
            self._page[p] = w
        self._write(pages, got)

    def detach(self, pages: list[int]) -> int:
        """Free the window pages of those of ``pages`` that have one; returns how many."""
        held = [p for p in pages if self._page[p]]
        if not held:
            return 0
        self.allocator.free([self._page[p] for p in held])
        for p in held:
            self._page[p] = 0
        self._write(held, [0] * len(held))
        return len(held)

    def adopt(self, old: list[int], new: list[int]) -> None:
        """Full pages ``new`` computed again what ``old`` hold (the cache keeps ``old``
        and frees ``new``): where ``old`` lost its windowed KV and ``new`` has it, it
        moves over instead of being freed with ``new``."""
        moved_old, moved_new = [], []
        for o, n in zip(old, new):
            if not self._page[o] and self._page[n]:
                self._page[o], self._page[n] = self._page[n], 0
                moved_old.append(o)
                moved_new.append(n)
        if moved_old:
            self._write(moved_old, [self._page[o] for o in moved_old])
            self._write(moved_new, [0] * len(moved_new))

    def _write(self, pages: list[int], window_pages: list[int]) -> None:
        ps = self.page_size
        full = (torch.tensor(pages, dtype=torch.int64).unsqueeze(1) * ps + self._offsets).reshape(-1)
        win = torch.tensor(window_pages, dtype=torch.int64).unsqueeze(1) * ps
        win = torch.where(win > 0, win + self._offsets, 0).reshape(-1)
        self.slot_map[full.to(self.slot_map.device)] = win.to(self.slot_map.device)

    def check(self, allocated: set[int]) -> None:
        """The invariant above, given the allocated full pages."""
        held = [w for w in self._page if w]
        if len(held) != len(set(held)) or len(held) + self.num_free != self.total_pages:
            raise AssertionError(f"window KV pool accounting broken: {len(held)} attached "
                                 f"({len(held) - len(set(held))} twice), {self.num_free} free, {self.total_pages} total")
        stray = [p for p, w in enumerate(self._page) if w and p not in allocated]
        if stray:
            raise AssertionError(f"free pages still attached to window pages: {stray[:8]}")


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
