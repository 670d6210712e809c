"""Sliding-window attention (Gemma 3's local layers, Mistral): every backend and kernel
against a dense softmax written out here from the rule (a query at position p sees the
keys at positions p - W + 1 .. p), on mixed batches whose prefixes, chunks and decode
contexts are shorter and longer than the window. Triton runs under the interpreter on
CPU (see test_kernels_attention.py); fp32, atol 2e-5 / rtol 1e-4."""

from __future__ import annotations

import pytest
import torch
from test_kernels_attention import DEVICE, PagedContexts, _mixed_batch  # sets TRITON_INTERPRET first

from plait.kernels import cpu_attention
from plait.kernels.decode_attention import decode_attention, decode_attention_ref
from plait.kernels.extend_attention import extend_attention, extend_attention_ref
from plait.runtime.attention.base import create_attention_backend
from plait.runtime.forward_batch import ForwardBatch

TOL = dict(atol=2e-5, rtol=1e-4)
HEADS, KV_HEADS, DIM = 6, 2, 64
SCALE = DIM**-0.5


def dense_windowed(q: torch.Tensor, ctx: PagedContexts, fb: ForwardBatch, window: int | None, layer: int = 0):
    """Per token of ``fb``: softmax over the keys of its request at positions
    max(0, p - W + 1) .. p, K/V read from the pool through the page table."""
    table, rows = fb.req_to_token, fb.req_rows.tolist()
    owners = [(rows[i], fb.extend_prefix_lens[i] + j) for i, n in enumerate(fb.extend_seq_lens) for j in range(n)]
    owners += [(rows[fb.num_extends + i], n - 1) for i, n in enumerate(fb.decode_seq_lens)]
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for t, (row, p) in enumerate(owners):
        first = max(0, p - window + 1) if window else 0
        slots = table[row, first : p + 1].long()
        k = ctx.k(layer)[slots].repeat_interleave(group, dim=1)  # [L, heads, dim]
        v = ctx.v(layer)[slots].repeat_interleave(group, dim=1)
        w = (torch.einsum("hd,lhd->hl", q[t], k) * SCALE).softmax(-1)
        out[t] = torch.einsum("hl,lhd->hd", w, v)
    return out


# (prefix, new) extends and decode context lengths around windows of 5, 16 and 40:
# chunks longer than the window, prefixes longer than it, decodes shorter and longer
EXTENDS = [(0, 9), (0, 50), (37, 12), (3, 1), (70, 25)]
DECODES = [1, 4, 17, 41, 100]


def _batch(page_size: int, extends, decodes, layers: int = 1):
    ctx = PagedContexts([p + n for p, n in extends] + decodes, page_size, KV_HEADS, DIM, num_layers=layers,
                        seed=page_size)
    return ctx, _mixed_batch(ctx, extends, decodes)


@pytest.mark.parametrize("page_size,window", [(1, 5), (16, 40)])
def test_kernels_and_references_keep_to_the_window(page_size: int, window: int) -> None:
    ctx, fb = _batch(page_size, EXTENDS, DECODES)
    q = torch.randn(fb.num_tokens, HEADS, DIM, device=DEVICE)
    expected = dense_windowed(q, ctx, fb, window)
    n_ext = fb.num_extend_tokens
    prefix = torch.tensor(fb.extend_prefix_lens, device=DEVICE)
    lens = torch.tensor(fb.extend_seq_lens, device=DEVICE)
    ext_rows, dec_rows = fb.req_rows[: fb.num_extends], fb.req_rows[fb.num_extends :]
    dec_lens = torch.tensor(fb.decode_seq_lens, dtype=torch.int32, device=DEVICE)
    args = (ctx.k(), ctx.v(), fb.req_to_token)
    ext_ref = extend_attention_ref(q[:n_ext], *args, ext_rows, prefix, lens, SCALE, sliding_window=window)
    dec_ref = decode_attention_ref(q[n_ext:], *args, dec_rows, dec_lens, SCALE, sliding_window=window)
    torch.testing.assert_close(torch.cat([ext_ref, dec_ref]), expected, **TOL)
    # small tiles: rows of one tile whose windows start blocks apart
    ext = extend_attention(q[:n_ext], *args, ext_rows, prefix, lens, SCALE, block_m=16, block_n=16,
                           sliding_window=window)
    torch.testing.assert_close(ext, expected[:n_ext], **TOL)
    for splits in (1, 8):  # splits of the window, some empty
        dec = decode_attention(q[n_ext:], *args, dec_rows, dec_lens, SCALE, num_kv_splits=splits, sliding_window=window)
        torch.testing.assert_close(dec, expected[n_ext:], **TOL)
    if cpu_attention.supports(HEADS, KV_HEADS, DIM, torch.float32) and DEVICE == "cpu":
        starts = (dec_lens.long() - window).clamp(min=0)
        cpu = cpu_attention.paged_decode(q[n_ext:], *args, dec_rows, dec_lens, SCALE, starts=starts)
        torch.testing.assert_close(cpu, expected[n_ext:], **TOL)


BACKENDS = ["torch", "triton"] + (["cpu"] if DEVICE == "cpu" else [])


@pytest.mark.parametrize("backend_name,page_size", [(name, 16) for name in BACKENDS] + [("torch", 1)])
def test_backends_mix_windowed_and_full_layers(backend_name: str, page_size: int) -> None:
    """Layers 0 and 2 windowed (W = 16), layer 1 full, over one step's shared metadata;
    the new K/V are stored by the backend (all positions, windowed layers too)."""
    layers = [16, None, 16]
    ctx, fb = _batch(page_size, EXTENDS[:3], DECODES, layers=len(layers))
    backend = create_attention_backend(backend_name, ctx.pool, HEADS, SCALE, windows=(16,))
    fb = fb.with_attn_metadata(backend.init_forward(fb))
    for layer, window in enumerate(layers):
        q = torch.randn(fb.num_tokens, HEADS, DIM, device=DEVICE)
        kv = torch.randn(fb.num_tokens, 2 * KV_HEADS, DIM, device=DEVICE)
        got = backend.forward(q, kv[:, :KV_HEADS], kv[:, KV_HEADS:], layer, fb, window)
        # the pool now holds the new K/V: the dense reference reads them from there
        torch.testing.assert_close(got, dense_windowed(q, ctx, fb, window, layer), **TOL)


def test_a_window_the_backend_was_not_given_is_refused() -> None:
    ctx, fb = _batch(1, [(0, 3)], [5])
    backend = create_attention_backend("torch", ctx.pool, HEADS, SCALE, windows=(16,))
    fb = fb.with_attn_metadata(backend.init_forward(fb))
    q = torch.randn(fb.num_tokens, HEADS, DIM)
    kv = torch.randn(fb.num_tokens, 2 * KV_HEADS, DIM)
    with pytest.raises(ValueError, match="sliding_window=8 is not one of the backend's windows"):
        backend.forward(q, kv[:, :KV_HEADS], kv[:, KV_HEADS:], 0, fb, 8)
