"""The attention backend interface shared by the torch, cpu and triton implementations."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import KVPool


class AttentionBackend(ABC):
    """Paged attention over a :class:`KVPool` through the page table.

    Per step the runner calls :meth:`init_forward` once and hands what it returns to
    every layer as ``fb.attn_metadata`` (nothing per step is kept on the backend); each
    layer calls :meth:`forward`, which stores the new K/V and attends for the extend
    part and the decode part of the batch.

    Sliding-window layers pass their ``sliding_window`` W: a query at position p then
    sees the keys at positions p - W + 1 .. p (transformers' rule). ``windows`` lists the
    windows the model's layers use, for backends that prepare per-window metadata.
    Where windowed layers keep their KV in a pool of their own (``pool.window``), they
    read and write through ``fb.for_window(w)``: the batch in that pool's slots.
    """

    def __init__(self, pool: KVPool, num_heads: int, scale: float, windows: tuple[int, ...] = ()) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.scale = scale
        self.windows = tuple(sorted(set(windows)))

    def init_forward(self, fb: ForwardBatch) -> object:
        """Per-step metadata shared by all layers (index tensors, masks), or None."""
        return None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, fb: ForwardBatch,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, dim]; k, v: [T, kv_heads, dim] for the new tokens.
        Returns the attention output [T, heads, dim]."""
        fb = fb.for_window(sliding_window)
        self.pool.set_kv(layer, fb.out_slots, k, v)
        n_ext = fb.num_extend_tokens
        w = sliding_window
        if fb.num_decodes == 0:
            return self.forward_extend(q, layer, fb, k, v, w)
        if fb.num_extends == 0:
            return self.forward_decode(q, layer, fb, w)
        return torch.cat(
            [self.forward_extend(q[:n_ext], layer, fb, k[:n_ext], v[:n_ext], w), self.forward_decode(q[n_ext:], layer, fb, w)]
        )

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, layer: int, fb: ForwardBatch, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Extend requests: each chunk attends to its cached prefix and causally to itself.
        q: [extend_tokens, heads, dim] -> [extend_tokens, heads, dim]. ``k``, ``v``: the
        chunks' own new K/V (already in the pool), when the caller has them at hand."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, layer: int, fb: ForwardBatch, sliding_window: int | None = None) -> torch.Tensor:
        """Decode requests: one query token each over its context (its window's part).
        q: [decodes, heads, dim] -> [decodes, heads, dim]."""


def create_attention_backend(
    name: str, pool: KVPool, num_heads: int, scale: float, windows: tuple[int, ...] = ()
) -> AttentionBackend:
    """Backend factory. GPU-only backends are imported lazily here. ``windows``: the
    sliding windows the model's layers use."""
    if name == "torch":
        from plait.runtime.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, num_heads, scale, windows=windows)
    if name == "cpu":
        from plait.runtime.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(pool, num_heads, scale, windows=windows)
    if name == "triton":
        from plait.runtime.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, num_heads, scale, windows=windows)
    raise ValueError(f"attention_backend must be one of 'torch', 'cpu', 'triton'; got {name!r}")
