"""Triton paged attention: the kernels of :mod:`plait.kernels` behind the backend interface.

Imported lazily by :func:`plait.runtime.attention.base.create_attention_backend`, so only
a process that asks for ``"triton"`` imports Triton. On a machine without CUDA the
kernels run under the Triton interpreter (see :mod:`plait.kernels._triton`): correct and
slow, which is what the CPU tests want.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.kernels.decode_attention import MAX_KV_SPLITS, decode_attention, decode_num_splits
from plait.kernels.extend_attention import extend_attention
from plait.kernels.kv_store import store_kv
from plait.runtime.attention.base import AttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import KVPool
from plait.runtime.staging import Staging



def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 1 elsewhere (the interpreter runs
    one program at a time, so more splits are only overhead there)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


class TritonAttentionBackend(AttentionBackend):
    """Same results as :class:`~plait.runtime.attention.torch_backend.TorchAttentionBackend`
    (up to float rounding), computed by Triton kernels straight from the page table.

    :meth:`init_forward` uploads the per-step metadata once (int32 lengths, rows, token
    offsets) into a :class:`TritonMetadata`; every layer's :meth:`forward` then launches the KV store, the extend
    kernel and the decode kernel, writing both attention parts into one output tensor.

    The decode split-KV count is chosen per step by :meth:`num_kv_splits` from the
    batch size, the KV heads, ``sm_count`` (default: the pool device's SMs) and the
    longest context, and travels in the metadata.
    """

    def __init__(
        self, pool: KVPool, num_heads: int, scale: float, sm_count: int | None = None,
        max_kv_splits: int = MAX_KV_SPLITS,
        windows: tuple[int, ...] = (),
    ) -> None:
        super().__init__(pool, num_heads, scale, windows)
        self.sm_count = device_sm_count(pool.device) if sm_count is None else sm_count
        self.max_kv_splits = max_kv_splits
        decode_num_splits(1, pool.kv_heads, self.sm_count, 1, max_kv_splits)  # raises on a bad value
        self._staging = Staging(pool.device, torch.int32)  # a step's metadata lists, one transfer

    def num_kv_splits(self, batch: int, max_context_len: int) -> int:
        """Decode split count for ``batch`` requests with contexts up to
        ``max_context_len`` tokens (:func:`~plait.kernels.decode_attention.decode_num_splits`)."""
        return decode_num_splits(batch, self.pool.kv_heads, self.sm_count, max_context_len, self.max_kv_splits)

    def init_forward(self, fb: ForwardBatch) -> TritonMetadata:
        prefix_lens, seq_lens, start_loc, decode_lens = self._staging.to_device(
            fb.extend_prefix_lens, fb.extend_seq_lens, fb.extend_start_loc, fb.decode_seq_lens)
        return TritonMetadata(
            # extend part: [E] metadata; lengths also kept on the host for the grid size
            fb.req_rows[: fb.num_extends], prefix_lens, seq_lens, start_loc, max(fb.extend_seq_lens, default=0),
            # decode part: [D]
            fb.req_rows[fb.num_extends :], decode_lens,
            self.num_kv_splits(fb.num_decodes, max(fb.decode_seq_lens)) if fb.num_decodes else 1,
        )

    def decode_metadata(self, req_to_token: torch.Tensor, req_rows: torch.Tensor,
                        seq_lens: torch.Tensor, num_kv_splits: int | None = None) -> TritonMetadata:
        """Metadata of a decode-only step over device tensors that the caller refills
        in place before each step: what a CUDA graph records over this backend and
        replays (the capture hook of :mod:`plait.runtime.cuda_graph`). seq_lens: int32.

        The graph's launch grid includes the split count, so it must not depend on the
        lengths of the step being replayed: by default it is :meth:`num_kv_splits` of
        the rows' count (the bucket size) and the page table's width (the longest
        context any replay can have); a caller may pass its own."""
        if num_kv_splits is None:
            num_kv_splits = self.num_kv_splits(max(req_rows.numel(), 1), req_to_token.shape[1])
        elif num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        empty = torch.zeros(0, dtype=torch.int32, device=req_to_token.device)
        return TritonMetadata(req_rows[:0], empty, empty, empty, 0, req_rows, seq_lens, num_kv_splits)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, fb: ForwardBatch,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """As :meth:`AttentionBackend.forward`, with the Triton KV store and one output
        tensor that the extend and decode kernels fill in place (no concatenation)."""
        fb = fb.for_window(sliding_window)
        store_kv(self.pool.k_buffers[layer], self.pool.v_buffers[layer], fb.out_slots, k, v)
        out = torch.empty_like(q)
        n_ext = fb.num_extend_tokens
        w = sliding_window or 0
        if fb.num_extends:
            self._extend(q[:n_ext], layer, fb, out[:n_ext], w)
        if fb.num_decodes:
            self._decode(q[n_ext:], layer, fb, out[n_ext:], w)
        return out

    def forward_extend(
        self, q: torch.Tensor, layer: int, fb: ForwardBatch, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return self._extend(q, layer, fb.for_window(sliding_window), torch.empty_like(q), sliding_window or 0)

    def forward_decode(self, q: torch.Tensor, layer: int, fb: ForwardBatch, sliding_window: int | None = None) -> torch.Tensor:
        return self._decode(q, layer, fb.for_window(sliding_window), torch.empty_like(q), sliding_window or 0)

    def _extend(self, q: torch.Tensor, layer: int, fb: ForwardBatch, out: torch.Tensor, window: int) -> torch.Tensor:
        # q, out: [extend_tokens, heads, dim]; window 0: full attention. ``fb`` is the
        # layer's view (fb.for_window): its page table, the step's lengths
        m = fb.attn_metadata
        return extend_attention(
            q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], fb.req_to_token,
            m.ext_rows, m.ext_prefix, m.ext_lens, self.scale,
            max_extend_len=m.max_extend, extend_start_loc=m.ext_start, out=out, sliding_window=window,
        )

    def _decode(self, q: torch.Tensor, layer: int, fb: ForwardBatch, out: torch.Tensor, window: int) -> torch.Tensor:
        # q, out: [decodes, heads, dim]; window 0: full attention (fb: as in _extend)
        m = fb.attn_metadata
        return decode_attention(
            q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], fb.req_to_token,
            m.dec_rows, m.dec_lens, self.scale, num_kv_splits=m.num_kv_splits, out=out, sliding_window=window,
        )


@dataclass
class TritonMetadata:
    """One step's metadata for the kernels: [E] for the extend part, [D] for decodes
    (the page table is the batch's: ``ForwardBatch.for_window``)."""

    ext_rows: torch.Tensor
    ext_prefix: torch.Tensor  # int32
    ext_lens: torch.Tensor  # int32
    ext_start: torch.Tensor  # int32, first token of each extend in the flat tensors
    max_extend: int
    dec_rows: torch.Tensor
    dec_lens: torch.Tensor  # int32
    num_kv_splits: int  # decode split-KV count: part of the decode launch grid
