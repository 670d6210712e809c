"""Paged attention kernels against their torch references, and the triton attention
backend against the torch backend.

Runs on CPU under the Triton interpreter, on CUDA compiled (benchmarks/gpu_check.py).
NOTE: ``TRITON_INTERPRET`` must be set before anything imports triton (Triton decides
interpret-vs-compile when a function is decorated). This module sets it before importing
``plait.kernels``; ``plait.kernels._triton`` applies the same default for any other
importer, and raises with the fix if triton was imported earlier without it on a
machine with no CUDA.

Tolerances: fp32 inputs, atol 2e-5 / rtol 1e-4 (the kernels accumulate in fp32 in a
different order than the reference, and use exact ``ieee`` dots for fp32 on GPUs);
bf16 inputs, atol/rtol 2e-2 (P is rounded to bf16 before the P@V product).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: F401  (pinned in the test extra; a missing triton must fail, not skip)

from plait.kernels.decode_attention import (  # noqa: E402
    MAX_KV_SPLITS,
    MIN_KEYS_PER_SPLIT,
    decode_attention,
    decode_attention_ref,
    decode_num_splits,
)
from plait.kernels.extend_attention import (  # noqa: E402
    ExtendLaunch,
    extend_attention,
    extend_attention_ref,
    extend_launch_settings,
)
from plait.runtime.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from plait.runtime.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from plait.runtime.forward_batch import ForwardBatch  # noqa: E402
from plait.runtime.memory import KVPool, PageAllocator, ReqToToken  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = dict(atol=2e-5, rtol=1e-4)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)
KV_HEADS = {1: 4, 3: 2, 8: 1}  # GQA ratio -> KV heads: 4, 6 and 8 query heads


class PagedContexts:
    """Requests' contexts laid out in a real KVPool through a real page table.

    Pages are handed out in a shuffled order so consecutive positions of a request land
    in non-adjacent pages, and requests use scattered page-table rows.
    """

    def __init__(
        self, lens: list[int], page_size: int, kv_heads: int, head_dim: int,
        dtype: torch.dtype = torch.float32, num_layers: int = 1, seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        pages_per_req = [-(-n // page_size) for n in lens]
        num_pages = sum(pages_per_req) + 3  # + page 0 (padding sink) + slack
        self.pool = KVPool(num_pages * page_size, num_layers, kv_heads, head_dim, dtype, DEVICE)
        for buf in self.pool.k_buffers + self.pool.v_buffers:
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
        alloc = PageAllocator(num_pages, page_size)
        pages = alloc.alloc(sum(pages_per_req))
        assert pages is not None
        pages = [pages[i] for i in torch.randperm(len(pages), generator=gen).tolist()]
        max_context = max(lens) + 8
        self.table = ReqToToken(2 * len(lens) + 1, max_context, DEVICE)
        rows = list(range(2 * len(lens), 0, -2))[: len(lens)]  # scattered, descending
        self.rows = torch.tensor(rows, dtype=torch.int64, device=DEVICE)
        for row, n, n_pages in zip(rows, lens, pages_per_req):
            mine, pages = pages[:n_pages], pages[n_pages:]
            self.table.write(row, 0, alloc.pages_to_slots(mine)[:n].to(DEVICE))

    def k(self, layer: int = 0) -> torch.Tensor:
        return self.pool.k_buffers[layer]

    def v(self, layer: int = 0) -> torch.Tensor:
        return self.pool.v_buffers[layer]


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.float(), ref.float(), **tol)


# ----------------------------------------------------------------------------- decode


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_attention_matches_reference(page_size: int, gqa: int, head_dim: int) -> None:
    # ragged batch: a single-token context, short, page-boundary and long contexts
    lens = [1, 5, 16, 131, 300]
    kv_heads = KV_HEADS[gqa]
    ctx = PagedContexts(lens, page_size, kv_heads, head_dim, seed=page_size + gqa + head_dim)
    q = torch.randn(len(lens), kv_heads * gqa, head_dim, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    out = decode_attention(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, seq_lens, scale)
    ref = decode_attention_ref(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, seq_lens, scale)
    _close(out, ref, torch.float32)


@pytest.mark.parametrize("num_kv_splits", [1, 3, 16])
def test_decode_attention_split_counts(num_kv_splits: int) -> None:
    # more splits than keys (empty splits are skipped by the merge), uneven splits
    lens = [2, 7, 100]
    ctx = PagedContexts(lens, 16, 2, 64, seed=num_kv_splits)
    q = torch.randn(len(lens), 6, 64, device=DEVICE)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, seq_lens, 0.125, num_kv_splits=num_kv_splits)
    ref = decode_attention_ref(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, seq_lens, 0.125)
    _close(out, ref, torch.float32)


def test_decode_num_splits_fills_the_sms_at_small_batch() -> None:
    # an H100 (132 SMs) and Llama-3-8B's 8 KV heads over a 128k page table
    assert [decode_num_splits(b, 8, 132, 131072) for b in (1, 2, 4, 8, 16, 32, 64, 256)] == [
        32, 16, 8, 4, 2, 2, 1, 1]
    assert decode_num_splits(1, 8, 108, 131072) == 16  # A100: 27 wanted, rounded down
    assert decode_num_splits(1, 8, 132, 131072, max_splits=8) == 8
    assert decode_num_splits(1, 8, 132, 1) == 1  # one key: one split
    assert decode_num_splits(1, 8, 132, 3 * MIN_KEYS_PER_SPLIT) == 2  # 3 pieces -> 2
    for bad in ((0, 8, 132, 64), (1, 0, 132, 64), (1, 8, 0, 64), (1, 8, 132, 0)):
        with pytest.raises(ValueError):
            decode_num_splits(*bad)


@pytest.mark.parametrize("sm_count", [1, 7, 108, 132])
def test_decode_num_splits_bounds(sm_count: int) -> None:
    for batch in (1, 2, 3, 5, 16, 100, 512):
        for kv_heads in (1, 2, 8):
            for ctx in (1, 63, 64, 65, 1000, 8192, 131072):
                n = decode_num_splits(batch, kv_heads, sm_count, ctx)
                programs = batch * kv_heads
                assert n & (n - 1) == 0 and 1 <= n <= MAX_KV_SPLITS  # a power of two
                assert n <= -(-ctx // MIN_KEYS_PER_SPLIT)  # no split shorter than its share
                assert (n - 1) * programs < 2 * sm_count  # no more than ~2 programs per SM
                # at least one program per SM unless a cap binds
                capped = 2 * n > min(MAX_KV_SPLITS, -(-ctx // MIN_KEYS_PER_SPLIT))
                assert capped or n * programs >= sm_count
                assert decode_num_splits(batch + 1, kv_heads, sm_count, ctx) <= n  # more work, fewer splits


def test_decode_attention_bf16_and_strided_out() -> None:
    lens = [3, 90]
    ctx = PagedContexts(lens, 1, 1, 128, dtype=torch.bfloat16, seed=7)
    q = torch.randn(len(lens), 8, 128, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    big = torch.zeros(len(lens) + 2, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    out = decode_attention(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, seq_lens, 0.1, out=big[2:])
    assert out.data_ptr() == big[2:].data_ptr() and big[:2].abs().sum() == 0
    ref = decode_attention_ref(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, seq_lens, 0.1)
    _close(out, ref, torch.bfloat16)


# ----------------------------------------------------------------------------- extend


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("gqa", [1, 3, 8])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_attention_matches_reference(page_size: int, gqa: int, head_dim: int) -> None:
    # (prefix, new tokens): fresh prefills, one-token chunk, a chunk over a long prefix,
    # a chunk longer than one BLOCK_M tile on a page-aligned prefix
    reqs = [(0, 1), (0, 37), (45, 20), (260, 3), (16, 70)]
    kv_heads = KV_HEADS[gqa]
    ctx = PagedContexts([p + n for p, n in reqs], page_size, kv_heads, head_dim, seed=page_size * gqa + head_dim)
    prefix = torch.tensor([p for p, _ in reqs], device=DEVICE)
    lens = torch.tensor([n for _, n in reqs], device=DEVICE)
    q = torch.randn(int(lens.sum()), kv_heads * gqa, head_dim, device=DEVICE)
    scale = head_dim**-0.5
    out = extend_attention(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, prefix, lens, scale)
    ref = extend_attention_ref(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, prefix, lens, scale)
    _close(out, ref, torch.float32)


def test_extend_attention_bf16_odd_blocks() -> None:
    # block sizes that do not divide the lengths; bf16 pool and queries
    reqs = [(0, 9), (33, 18)]
    ctx = PagedContexts([p + n for p, n in reqs], 16, 2, 64, dtype=torch.bfloat16, seed=3)
    prefix = torch.tensor([p for p, _ in reqs], device=DEVICE)
    lens = torch.tensor([n for _, n in reqs], device=DEVICE)
    q = torch.randn(int(lens.sum()), 6, 64, device=DEVICE, dtype=torch.bfloat16)
    out = extend_attention(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, prefix, lens, 0.125, block_m=16, block_n=16)
    ref = extend_attention_ref(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, prefix, lens, 0.125)
    _close(out, ref, torch.bfloat16)


# The settings extend_attention ships, per (arch, dtype, head_dim): each distinct one is
# run under the interpreter at its dtype and head_dim (arch None: no GPU).
SHIPPED_EXTEND = sorted(
    {(extend_launch_settings(arch, dtype, hd), dtype, hd)
     for arch in (None, 80, 90) for dtype in (torch.bfloat16, torch.float32) for hd in (64, 128)},
    key=str,
)


def test_extend_launch_settings_use_wgmma_tiles_on_hopper() -> None:
    for hd in (64, 128):
        assert extend_launch_settings(90, torch.bfloat16, hd).block_m == 64  # wgmma's M
        assert extend_launch_settings(80, torch.bfloat16, hd).block_m == 32
        assert extend_launch_settings(90, torch.float32, hd) == extend_launch_settings(80, torch.float32, hd)
        assert extend_launch_settings(None, torch.bfloat16, hd) == extend_launch_settings(80, torch.bfloat16, hd)
    assert extend_launch_settings(90, torch.bfloat16, 128).num_warps == 8
    assert extend_launch_settings(80, torch.float32, 64).num_warps == 8
    assert {s.block_m for s, _, _ in SHIPPED_EXTEND} == {32, 64}


@pytest.mark.parametrize("settings,dtype,head_dim", SHIPPED_EXTEND, ids=str)
def test_extend_attention_at_shipped_settings(settings: ExtendLaunch, dtype: torch.dtype, head_dim: int) -> None:
    # chunks shorter and longer than both tiles, on unaligned and long prefixes; GQA 3
    reqs = [(0, 1), (5, 64), (70, 65), (0, 130)]
    ctx = PagedContexts([p + n for p, n in reqs], 16, 2, head_dim, dtype=dtype, seed=head_dim + settings.block_m)
    prefix = torch.tensor([p for p, _ in reqs], device=DEVICE)
    lens = torch.tensor([n for _, n in reqs], device=DEVICE)
    q = torch.randn(int(lens.sum()), 6, head_dim, device=DEVICE, dtype=dtype)
    scale = head_dim**-0.5
    out = extend_attention(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, prefix, lens, scale,
                           block_m=settings.block_m, block_n=settings.block_n, num_warps=settings.num_warps)
    ref = extend_attention_ref(q, ctx.k(), ctx.v(), ctx.table.table, ctx.rows, prefix, lens, scale)
    _close(out, ref, dtype)


# ----------------------------------------------------------------------------- backend


def _mixed_batch(
    ctx: PagedContexts, extends: list[tuple[int, int]], decode_lens: list[int]
) -> ForwardBatch:
    """A ForwardBatch over ``ctx``'s requests: the first ``len(extends)`` are extends
    (prefix, new), the rest decodes (context incl. the new token). The new tokens' slots
    are the last positions of each request's page-table row."""
    table = ctx.table.table
    rows = ctx.rows.tolist()
    positions: list[int] = []
    slots: list[int] = []
    for row, (prefix, n) in zip(rows, extends):
        positions += range(prefix, prefix + n)
        slots += table[row, prefix : prefix + n].tolist()
    for row, n in zip(rows[len(extends) :], decode_lens):
        positions.append(n - 1)
        slots.append(int(table[row, n - 1]))
    num_tokens = len(positions)
    return ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=DEVICE),
        positions=torch.tensor(positions, dtype=torch.int64, device=DEVICE),
        out_slots=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        req_rows=ctx.rows,
        req_to_token=table,
        num_extends=len(extends),
        extend_prefix_lens=[p for p, _ in extends],
        extend_seq_lens=[n for _, n in extends],
        decode_seq_lens=decode_lens,
    )


@pytest.mark.parametrize(
    "page_size,gqa,head_dim,extends,decode_lens,sm_count,splits",
    [
        (1, 3, 64, [(0, 7), (33, 12), (120, 1)], [1, 20, 77, 150], 16, 2),  # mixed, one-token decode
        (16, 1, 128, [(0, 16), (32, 21)], [17, 64], 1, 1),  # mixed, page-aligned prefix
        (16, 8, 64, [(0, 5), (48, 40)], [], 1, 1),  # extend only
        (1, 8, 128, [], [3, 200], 132, 4),  # decode only
    ],
)
def test_triton_backend_matches_torch_backend(
    page_size: int, gqa: int, head_dim: int, extends: list[tuple[int, int]], decode_lens: list[int],
    sm_count: int, splits: int,
) -> None:
    kv_heads, num_heads = KV_HEADS[gqa], KV_HEADS[gqa] * gqa
    num_layers = 2
    lens = [p + n for p, n in extends] + decode_lens
    ctx = PagedContexts(lens, page_size, kv_heads, head_dim, num_layers=num_layers, seed=11 + page_size)
    fb = _mixed_batch(ctx, extends, decode_lens)
    scale = head_dim**-0.5

    torch_pool = ctx.pool
    triton_pool = KVPool(torch_pool.num_slots, num_layers, kv_heads, head_dim, torch.float32, DEVICE)
    for layer in range(num_layers):
        triton_pool.k_buffers[layer].copy_(torch_pool.k_buffers[layer])
        triton_pool.v_buffers[layer].copy_(torch_pool.v_buffers[layer])
    reference = TorchAttentionBackend(torch_pool, num_heads, scale)
    backend = TritonAttentionBackend(triton_pool, num_heads, scale, sm_count=sm_count)
    fb_ref, fb = fb.with_attn_metadata(reference.init_forward(fb)), fb.with_attn_metadata(backend.init_forward(fb))
    # the split count comes from the decodes' count and longest context
    assert fb.attn_metadata.num_kv_splits == splits

    for layer in range(num_layers):  # per-step metadata is shared by all layers
        q = torch.randn(fb.num_tokens, num_heads, head_dim, device=DEVICE)
        # new K/V as a strided view of a fused projection output, like a real model's
        kv = torch.randn(fb.num_tokens, 2 * kv_heads, head_dim, device=DEVICE)
        k, v = kv[:, :kv_heads], kv[:, kv_heads:]
        expected = reference.forward(q, k, v, layer, fb_ref)
        got = backend.forward(q, k, v, layer, fb)
        _close(got, expected, torch.float32)
        torch.testing.assert_close(triton_pool.k_buffers[layer], torch_pool.k_buffers[layer], atol=0, rtol=0)
        torch.testing.assert_close(triton_pool.v_buffers[layer], torch_pool.v_buffers[layer], atol=0, rtol=0)
        if layer == 0 and fb.num_extends:  # the public per-part entry points agree too
            n_ext = fb.num_extend_tokens
            _close(backend.forward_extend(q[:n_ext], layer, fb), expected[:n_ext], torch.float32)
        if layer == 0 and fb.num_decodes:
            n_ext = fb.num_extend_tokens
            _close(backend.forward_decode(q[n_ext:], layer, fb), expected[n_ext:], torch.float32)


def test_decode_metadata_splits_depend_on_the_bucket_not_the_lengths() -> None:
    # what a CUDA graph records: the count of the bucket's size and the table's width
    pool = KVPool(64, 1, 2, 64, torch.float32, DEVICE)
    backend = TritonAttentionBackend(pool, 6, 0.125, sm_count=132)
    table = torch.zeros((16, 4096), dtype=torch.int32, device=DEVICE)
    for bs in (1, 4, 16):
        rows = torch.zeros(bs, dtype=torch.long, device=DEVICE)
        for fill in (1, 4000):  # the lengths the graph will replay with do not matter
            m = backend.decode_metadata(table, rows, torch.full((bs,), fill, dtype=torch.int32, device=DEVICE))
            assert m.num_kv_splits == decode_num_splits(bs, 2, 132, 4096) == backend.num_kv_splits(bs, 4096)
    rows = torch.zeros(4, dtype=torch.long, device=DEVICE)
    lens = torch.ones(4, dtype=torch.int32, device=DEVICE)
    assert backend.decode_metadata(table, rows, lens, num_kv_splits=3).num_kv_splits == 3
    with pytest.raises(ValueError, match="num_kv_splits"):
        backend.decode_metadata(table, rows, lens, num_kv_splits=0)
    with pytest.raises(ValueError, match="sm_count"):
        TritonAttentionBackend(pool, 6, 0.125, sm_count=0)
    assert TritonAttentionBackend(pool, 6, 0.125).sm_count == (
        torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 1)


def test_triton_backend_from_factory() -> None:
    from plait.runtime.attention.base import create_attention_backend

    pool = KVPool(32, 1, 2, 64, torch.float32, DEVICE)
    assert isinstance(create_attention_backend("triton", pool, 6, 0.125), TritonAttentionBackend)
