"""The torch attention backend against naive per-request attention, with enough
decode requests of mixed lengths to be split into several length groups."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.attention.torch_backend import TorchAttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.memory import KVPool, PageAllocator, ReqToToken


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_from: int) -> torch.Tensor:
    # q: [n, H, D]; k, v: [L, KVH, D]; query i sits at position causal_from + i
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->hnl", q, k) * scale
    pos = torch.arange(k.shape[0])
    s = s.masked_fill(pos[None, None, :] > (causal_from + torch.arange(q.shape[0]))[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v)


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_with_many_decode_groups(page_size):
    g = torch.Generator().manual_seed(0)
    H, KVH, D, slots = 6, 2, 16, 16384
    pool = KVPool(slots, 1, KVH, D, torch.float32, "cpu", page_size=page_size)
    alloc = PageAllocator(slots // page_size, page_size)
    pool.k_buffers[0].normal_(generator=g)
    pool.v_buffers[0].normal_(generator=g)
    table = ReqToToken(40, 256, "cpu")
    every = alloc.alloc(alloc.total_pages)
    alloc.free([every[i] for i in torch.randperm(len(every), generator=g).tolist()])  # scattered pages
    ext = [(0, 9), (30, 5)]  # (prefix, new tokens)
    dec_lens = torch.randint(1, 200, (33,), generator=g).tolist()
    lens = [p + n for p, n in ext] + dec_lens
    for row, n in enumerate(lens):
        table.write(row, 0, alloc.pages_to_slots(alloc.alloc(-(-n // page_size)))[:n])
    T = sum(n for _, n in ext) + len(dec_lens)
    q = torch.randn(T, H, D, generator=g)
    fb = ForwardBatch(
        input_ids=torch.zeros(T, dtype=torch.long), positions=torch.zeros(T, dtype=torch.long),
        out_slots=torch.zeros(T, dtype=torch.long), req_rows=torch.arange(len(lens)),
        req_to_token=table.table, num_extends=len(ext),
        extend_prefix_lens=[p for p, _ in ext], extend_seq_lens=[n for _, n in ext], decode_seq_lens=dec_lens,
    )
    backend = TorchAttentionBackend(pool, H, D**-0.5, decode_group_bytes=64 << 10)  # groups of ~256 tokens
    fb = fb.with_attn_metadata(backend.init_forward(fb))
    assert len(fb.attn_metadata.decodes) > 3
    n_ext = sum(n for _, n in ext)
    out = torch.cat([backend.forward_extend(q[:n_ext], 0, fb), backend.forward_decode(q[n_ext:], 0, fb)])
    start = 0
    kb, vb = pool.k_buffers[0], pool.v_buffers[0]
    for row, L in enumerate(lens):
        n = ext[row][1] if row < len(ext) else 1
        idx = table.table[row, :L].long()
        ref = naive(q[start : start + n], kb[idx], vb[idx], D**-0.5, L - n)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        start += n
