"""Per-step forward state, passed explicitly to the model and the attention backend."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """One model step over a mixed batch.

    The batch holds ``num_extends`` *extend* requests first (prefill or a prefill chunk:
    ``extend_seq_lens[i]`` new tokens on top of ``extend_prefix_lens[i]`` tokens whose
    KV is already in the pool), then the *decode* requests (one new token each).
    Token tensors are flat: the extend tokens come first, request by request, then one
    token per decode request.

    Every new token's K/V is written to ``out_slots`` before attention runs, so a
    request's full context is always ``req_to_token[row, :seq_len]``.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, rotary rows (+ the long-rope offset: models.llama.cos_sin_cache)
    out_slots: torch.Tensor  # [T] int64, slot for each new token's KV
    req_rows: torch.Tensor  # [B] int64, page-table row of each request (extends first)
    req_to_token: torch.Tensor  # [max_running, max_context] int32, the page table
    num_extends: int
    extend_prefix_lens: list[int]  # [E] cached tokens before the chunk
    extend_seq_lens: list[int]  # [E] new tokens in the chunk
    decode_seq_lens: list[int]  # [D] context length including the new token
    # what the attention backend's init_forward (or a CUDA graph's decode_metadata)
    # built for this step; read by every layer
    attn_metadata: Any = None
    # with windowed KV in a pool of its own (plait.runtime.memory.WindowPages): this
    # batch with ``out_slots`` and ``req_to_token`` in that pool's slots, for the
    # windowed layers; None otherwise
    windowed: ForwardBatch | None = None

    def with_attn_metadata(self, metadata: Any) -> ForwardBatch:
        w = self.windowed
        return dataclasses.replace(self, attn_metadata=metadata,
                                   windowed=None if w is None else dataclasses.replace(w, attn_metadata=metadata))

    def for_window(self, sliding_window: int | None) -> ForwardBatch:
        """The batch a layer with this window (None: full attention) reads and writes."""
        return self.windowed if sliding_window is not None and self.windowed is not None else self

    def split(self) -> tuple[ForwardBatch, ForwardBatch]:
        """(the extend part, the decode part) as two batches over views of the same
        tensors; neither has attention metadata yet. The parts never read each other's
        KV (they are different requests), so they can run as two forwards."""
        t = self.num_extend_tokens
        e = self.num_extends
        ext = ForwardBatch(self.input_ids[:t], self.positions[:t], self.out_slots[:t], self.req_rows[:e],
                           self.req_to_token, e, self.extend_prefix_lens, self.extend_seq_lens, [])
        dec = ForwardBatch(self.input_ids[t:], self.positions[t:], self.out_slots[t:], self.req_rows[e:],
                           self.req_to_token, 0, [], [], self.decode_seq_lens)
        if self.windowed is not None:
            ext.windowed, dec.windowed = self.windowed.split()
        return ext, dec

    # cached: every layer reads these (the lists are never changed after construction)
    @functools.cached_property
    def num_decodes(self) -> int:
        return len(self.decode_seq_lens)

    @functools.cached_property
    def num_extend_tokens(self) -> int:
        return sum(self.extend_seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def extend_start_loc(self) -> list[int]:
        """Offset of each extend request's first token in the flat token tensors."""
        out, acc = [], 0
        for n in self.extend_seq_lens:
            out.append(acc)
            acc += n
        return out
