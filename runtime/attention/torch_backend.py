"""Pure-PyTorch paged attention: runs everywhere and is the reference for the kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from plait.runtime.attention.base import AttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import KVPool

# Decode requests are sorted by context length and cut into groups whose gathered K/V
# (padded to the group's longest context) stays under this many bytes per layer. Groups
# that fit in the CPU caches are gathered and read back by SDPA from cache: on the 2-core
# development machine this is 1.2-1.6x faster than groups several times larger, and
# smaller groups cost more calls than they save.
DECODE_GROUP_BYTES = 6 << 20


class TorchAttentionBackend(AttentionBackend):
    """Gathers each request's K/V from the pool through the page table and runs SDPA.

    Extend requests run one at a time (their chunk against prefix + chunk, causal with
    an offset); decode requests run as a few padded batches grouped by context length,
    whose index and mask tensors are built once per step and shared by all layers.
    """

    def __init__(
        self, pool: KVPool, num_heads: int, scale: float, decode_group_bytes: int = DECODE_GROUP_BYTES,
        windows: tuple[int, ...] = (),
    ) -> None:
        super().__init__(pool, num_heads, scale, windows)
        self.decode_group_bytes = decode_group_bytes
        # Reused gather destinations for decode K/V (grown on demand, shared by all
        # layers and steps): writing into warm memory instead of a fresh allocation per
        # layer halves the gather's cost on CPU, where big allocations come back as
        # untouched pages that fault on first write.
        self._k_ws = torch.empty(0, dtype=pool.dtype, device=pool.device)
        self._v_ws = torch.empty(0, dtype=pool.dtype, device=pool.device)

    def _workspace(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k_ws.numel() < numel:
            self._k_ws = torch.empty(numel, dtype=self.pool.dtype, device=self.pool.device)
            self._v_ws = torch.empty(numel, dtype=self.pool.dtype, device=self.pool.device)
        return self._k_ws, self._v_ws

    def init_forward(self, fb: ForwardBatch) -> TorchMetadata:
        """Full-attention metadata, and the same for each of :attr:`windows`."""
        windowed = {w: TorchMetadata(*self._init_extends(fb.for_window(w), w), self._init_decodes(fb.for_window(w), w), {})
                    for w in self.windows}
        return TorchMetadata(*self._init_extends(fb, None), self._init_decodes(fb, None), windowed)

    def _init_extends(
        self, fb: ForwardBatch, window: int | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        table = fb.req_to_token
        rows = fb.req_rows[: fb.num_extends].tolist() if fb.num_extends else []
        ext_idx: list[torch.Tensor] = []
        ext_mask: list[torch.Tensor | None] = []
        for i in range(fb.num_extends):
            prefix, n = fb.extend_prefix_lens[i], fb.extend_seq_lens[i]
            # the first key any query of the chunk sees: query `prefix` sees prefix - W + 1..
            start = max(0, prefix - window + 1) if window else 0
            ext_idx.append(table[rows[i], start : prefix + n].long())
            if prefix == 0 and (not window or n <= window):
                ext_mask.append(None)  # plain causal
            else:
                # query i (absolute position prefix + i) sees keys j <= prefix + i, and
                # with a window only j > prefix + i - W
                q_pos = torch.arange(prefix, prefix + n, device=table.device).unsqueeze(1)
                k_pos = torch.arange(start, prefix + n, device=table.device).unsqueeze(0)
                visible = k_pos <= q_pos
                ext_mask.append(visible & (k_pos > q_pos - window) if window else visible)
        return ext_idx, ext_mask

    def _init_decodes(self, fb: ForwardBatch, window: int | None) -> Any:
        """The decode part's metadata: here, requests grouped by context length."""
        table = fb.req_to_token
        dec_groups: list[_DecodeGroup] = []
        if fb.num_decodes:
            dec_rows = fb.req_rows[fb.num_extends :]
            lens = fb.decode_seq_lens
            ps = self.pool.page_size
            # first visible position and its page; a request gathers from that page on
            starts = [max(0, n - window) for n in lens] if window else [0] * len(lens)
            first_pages = [s // ps for s in starts]
            spans = [n - p * ps for n, p in zip(lens, first_pages)]
            # Sort by length and split into a few groups, each padded only to its own
            # longest span: gather and attention cost follow the padded length, and
            # contexts of mixed lengths would otherwise all pay for the longest.
            order = sorted(range(len(lens)), key=spans.__getitem__)
            token_bytes = 2 * self.pool.kv_heads * self.pool.head_dim * self.pool.k_buffers[0].element_size()
            groups: list[list[int]] = [[]]
            for i in order:  # ascending: i is the longest in its group so far
                if groups[-1] and (len(groups[-1]) + 1) * spans[i] * token_bytes > self.decode_group_bytes:
                    groups.append([])
                groups[-1].append(i)
            for members in groups:
                pos = torch.tensor(members, device=table.device)
                glens = torch.tensor([lens[i] for i in members], device=table.device).unsqueeze(1)
                gstarts = torch.tensor([starts[i] for i in members], device=table.device).unsqueeze(1)
                gfirst = torch.tensor([first_pages[i] for i in members], device=table.device).unsqueeze(1)
                # Gather whole pages (contiguous blocks of page_size slots copy several
                # times faster than single slots); positions outside a request's window
                # or past its length, including the unwritten tail of its last page
                # (zeroed at allocation), are masked. Padded pages read page 0, the
                # zeroed padding sink.
                n_units = -(-spans[members[-1]] // ps)
                cols = (gfirst + torch.arange(n_units, device=table.device)) * ps  # [G, n_units] first positions
                unit_ok = cols < glens
                first = table[dec_rows[pos].unsqueeze(1), torch.where(unit_ok, cols, 0)].long() // ps
                units = torch.where(unit_ok, first, 0)
                abs_pos = gfirst * ps + torch.arange(n_units * ps, device=table.device)  # [G, L]
                valid = (abs_pos >= gstarts) & (abs_pos < glens)
                # an additive float mask is cheaper for SDPA than a boolean one
                bias = torch.zeros(valid.shape, dtype=self.pool.dtype, device=table.device)
                bias.masked_fill_(~valid, float("-inf"))
                dec_groups.append(
                    _DecodeGroup(pos, units.reshape(-1), (len(members), n_units * ps), bias[:, None, None, :])
                )
        return dec_groups

    def metadata_for(self, fb: ForwardBatch, sliding_window: int | None) -> TorchMetadata:
        """The step's metadata for a layer with this window (None: full attention)."""
        if sliding_window is None:
            return fb.attn_metadata
        if sliding_window not in fb.attn_metadata.windowed:
            raise ValueError(f"sliding_window={sliding_window} is not one of the backend's windows {self.windows}")
        return fb.attn_metadata.windowed[sliding_window]

    def forward_extend(
        self, q: torch.Tensor, layer: int, fb: ForwardBatch, k: torch.Tensor | None = None, v: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        meta = self.metadata_for(fb, sliding_window)
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(fb.extend_seq_lens):
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            mask = meta.ext_mask[i]
            if mask is None and k is not None:  # no prefix: K/V are the chunk's own
                ki = k[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, KVH, n, D]
                vi = v[start : start + n].transpose(0, 1).unsqueeze(0)
            else:
                idx = meta.ext_idx[i]
                ki = k_buf.index_select(0, idx).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
                vi = v_buf.index_select(0, idx).transpose(0, 1).unsqueeze(0)
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
            out[start : start + n] = oi[0].transpose(0, 1)
            start += n
        return out

    def forward_decode(self, q: torch.Tensor, layer: int, fb: ForwardBatch, sliding_window: int | None = None) -> torch.Tensor:
        k_buf, v_buf = self.pool.k_buffers[layer], self.pool.v_buffers[layer]
        heads = (self.pool.kv_heads, self.pool.head_dim)
        k_pages = k_buf.view(-1, self.pool.page_size, *heads)
        v_pages = v_buf.view(-1, self.pool.page_size, *heads)
        out = torch.empty_like(q)
        page_numel = k_pages[0].numel()
        groups: list[_DecodeGroup] = self.metadata_for(fb, sliding_window).decodes
        k_ws, v_ws = self._workspace(max(g.flat_idx.numel() for g in groups) * page_numel)
        for g in groups:
            # index_select on a flat index is several times faster than 2-D fancy indexing
            n = g.flat_idx.numel()
            k = k_ws[: n * page_numel].view(n, *k_pages.shape[1:])
            v = v_ws[: n * page_numel].view(n, *v_pages.shape[1:])
            torch.index_select(k_pages, 0, g.flat_idx, out=k)
            torch.index_select(v_pages, 0, g.flat_idx, out=v)
            k = k.view(*g.shape, *heads).transpose(1, 2)  # [G, KVH, L, dim]
            v = v.view(*g.shape, *heads).transpose(1, 2)
            # GQA without expanding K/V: the query heads that share a KV head become that
            # head's "query positions" (HF order: q head h uses kv head h // group)
            qg = q.index_select(0, g.positions).view(len(g.positions), heads[0], -1, heads[1])  # [G, KVH, group, dim]
            o = F.scaled_dot_product_attention(qg, k, v, attn_mask=g.mask, scale=self.scale)
            out.index_copy_(0, g.positions, o.reshape(len(g.positions), -1, heads[1]))
        return out


@dataclass
class TorchMetadata:
    """One step's attention metadata: per extend request its context's slots and mask;
    the decode part's metadata (decode groups here; the cpu backend's rows and lengths);
    the same for each sliding window of the model (empty in those)."""

    ext_idx: list[torch.Tensor]
    ext_mask: list[torch.Tensor | None]
    decodes: Any
    windowed: dict[int, TorchMetadata]


@dataclass
class _DecodeGroup:
    positions: torch.Tensor  # [G] indices of the group's requests among the decodes
    flat_idx: torch.Tensor  # [G * L / page_size] pages, padded with page 0
    shape: tuple[int, int]  # (G, L)
    mask: torch.Tensor  # [G, 1, 1, L] additive: 0 or -inf
