"""The torch backend with decode attention in the native CPU kernel."""

from __future__ import annotations

import torch

from plait.kernels import cpu_attention
from plait.runtime.attention.torch_backend import TorchAttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import KVPool


class CpuAttentionBackend(TorchAttentionBackend):
    """Extend attention as in the torch backend (SDPA over the chunk and its prefix);
    decode attention in :mod:`plait.kernels.cpu_attention`, which reads each request's
    K/V in place from the pool once instead of gathering a copy for SDPA.

    Raises RuntimeError at construction when the kernel cannot be built, and ValueError
    for a shape or dtype it does not handle.
    """

    def __init__(self, pool: KVPool, num_heads: int, scale: float, windows: tuple[int, ...] = ()) -> None:
        super().__init__(pool, num_heads, scale, windows=windows)
        if not cpu_attention.supports(num_heads, pool.kv_heads, pool.head_dim, pool.dtype) or pool.device.type != "cpu":
            raise ValueError(
                f"attention_backend='cpu' handles float32 on CPU with up to {cpu_attention.MAX_GROUP} query heads "
                f"per KV head and head_dim <= {cpu_attention.MAX_DIM}; got {pool.dtype} on {pool.device}, "
                f"{num_heads} heads, {pool.kv_heads} KV heads, head_dim {pool.head_dim}"
            )
        cpu_attention.load()

    def _init_decodes(
        self, fb: ForwardBatch, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The decode part's metadata: page-table rows, context lengths and, with a
        window, the first position each request sees."""
        lens = torch.tensor(fb.decode_seq_lens, dtype=torch.int64)
        starts = (lens - window).clamp_(min=0) if window else None
        return fb.req_rows[fb.num_extends :].contiguous(), lens, starts

    def forward_decode(self, q: torch.Tensor, layer: int, fb: ForwardBatch, sliding_window: int | None = None) -> torch.Tensor:
        rows, lens, starts = self.metadata_for(fb, sliding_window).decodes
        return cpu_attention.paged_decode(
            q, self.pool.k_buffers[layer], self.pool.v_buffers[layer], fb.req_to_token, rows, lens, self.scale,
            starts=starts,
        )
