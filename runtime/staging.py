"""Host-to-device copies of a step's small lists in one transfer.

A step sends the device a handful of index lists (token ids, positions, page-table
rows, sampling parameters). Each ``torch.tensor(list, device="cuda")`` is a pageable
copy of its own; :class:`Staging` packs the lists of one kind into one host buffer and
makes one copy. On CUDA the buffer is pinned and the copy ``non_blocking``: an event
recorded after the copy guards the buffer, so the next pack waits only if that copy is
still in flight. On CPU the packed tensor is used as it is (no copy at all).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class Staging:
    """One reusable host buffer of ``dtype`` for copies to ``device``."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        self._pinned = device.type == "cuda"
        self._host = torch.empty(0, dtype=dtype)
        self._done: torch.cuda.Event | None = None  # the last copy out of _host
        self.copies = 0  # transfers made, for tests and benchmarks

    def to_device(self, *lists: Sequence[int] | Sequence[float]) -> list[torch.Tensor]:
        """One device tensor per list (views of one transfer)."""
        sizes = [len(v) for v in lists]
        flat = torch.tensor([x for v in lists for x in v], dtype=self.dtype)
        if not self._pinned:
            return list(flat.split(sizes))
        total = flat.numel()
        if self._done is not None:
            self._done.synchronize()  # the buffer may still be read by the previous copy
        if self._host.numel() < total:
            self._host = torch.empty(max(total, 2 * self._host.numel(), 1024), dtype=self.dtype, pin_memory=True)
        self._host[:total].copy_(flat)
        out = self._host[:total].to(self.device, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()
        self.copies += 1
        return list(out.split(sizes))
