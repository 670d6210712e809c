"""Pure-PyTorch paged attention: runs everywhere and is the reference for the kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.runtime.attention.base import AttentionBackend
from plait.runtime.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's K/V from the pool through the page table and runs SDPA.

    Extend requests run one at a time (their chunk against prefix + chunk, causal with
    an offset); decode requests run as one padded batch whose index and mask tensors
    are built once per step and shared by all layers.
    """

    def init_forward(self, fb: ForwardBatch) -> None:
        table = fb.req_to_token
        rows = fb.req_rows.tolist()
        self._ext_idx: list[torch.Tensor] = []
        self._ext_mask: list[torch.Tensor | None] = []
        for i in range(fb.num_extends):
            prefix, n = fb.extend_prefix_lens[i], fb.extend_seq_lens[i]
            self._ext_idx.append(table[rows[i], : prefix + n].long())
            if prefix == 0:
                self._ext_mask.append(None)  # plain causal
            else:
                # query i (absolute position prefix + i) sees keys j <= prefix + i
                q_pos = torch.arange(prefix, prefix + n, device=table.device).unsqueeze(1)
                k_pos = torch.arange(prefix + n, device=table.device).unsqueeze(0)
                self._ext_mask.append(k_pos <= q_pos)
        if fb.num_decodes:
            dec_rows = fb.req_rows[fb.num_extends :]
            lens = torch.tensor(fb.decode_seq_lens, device=table.device)
            max_len = max(fb.decode_seq_lens)
            valid = torch.arange(max_len, device=table.device) < lens.unsqueeze(1)  # [D, L]
            # padded positions read slot 0 (the zeroed padding sink), never a slot that is
            # allocated but not yet written, whose garbage could be NaN
            self._dec_idx = torch.where(valid, table[dec_rows, :max_len].long(), 0)  # [D, L]
            self._dec_flat = self._dec_idx.reshape(-1)
            self._dec_mask = valid[:, None, None, :]

    def forward_extend(self, q: torch.Tensor, layer: int, fb: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(fb.extend_seq_lens):
            idx = self._ext_idx[i]
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            ki = k_buf.index_select(0, idx).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            vi = v_buf.index_select(0, idx).transpose(0, 1).unsqueeze(0)
            mask = self._ext_mask[i]
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start : start + n] = oi[0].transpose(0, 1)
            start += n
        return out

    def forward_decode(self, q: torch.Tensor, layer: int, fb: ForwardBatch) -> torch.Tensor:
        # index_select on a flat index is several times faster than 2-D fancy indexing
        shape = (*self._dec_idx.shape, self.pool.kv_heads, self.pool.head_dim)  # [D, L, KVH, dim]
        k = self.pool.k_buffers[layer].index_select(0, self._dec_flat).view(shape).transpose(1, 2)  # [D, KVH, L, dim]
        v = self.pool.v_buffers[layer].index_select(0, self._dec_flat).view(shape).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=self._dec_mask, scale=self.scale, enable_gqa=True
        )  # [D, H, 1, dim]
        return o.squeeze(2)
