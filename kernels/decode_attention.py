"""Paged decode attention: one query token per request over its whole cached context.

Split-KV ("flash-decoding"): a request's context is cut into ``num_kv_splits`` equal
ranges; stage 1 runs one program per (request, KV head, split) and writes each split's
normalized partial output and its log-sum-exp; stage 2 merges the splits per
(request, head) by log-sum-exp weights. Splitting keeps the GPU busy when the batch is
small and contexts are long; the grid depends only on the batch size and the split
count, never on the context lengths, so a decode step can be captured in a CUDA graph.

GQA: the query heads that share a KV head are processed together (a ``BLOCK_H`` tile of
them), so each K/V row is read once per split for the whole group, and the score
computation is a matrix product the tensor cores can run.

The context of request ``b`` is ``req_to_token[req_rows[b], :seq_lens[b]]``: the page
table maps every position to its slot, so the kernel is the same for every page size.
"""

from __future__ import annotations

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import dot, dot_options, jit, next_pow2, tl, triton

# Query heads per program. 16 is the smallest M of a tensor-core dot; groups smaller than
# 16 (GQA ratio 1..8) pad with masked heads, which costs FLOPs decode does not lack.
_BLOCK_H = 16
# Largest split count decode_num_splits picks, and the fewest keys it gives a split (one
# BLOCK_N tile: a shorter split pays a partial output and a merge for a part-empty tile).
MAX_KV_SPLITS = 32
MIN_KEYS_PER_SPLIT = 64


def decode_num_splits(
    batch: int, kv_heads: int, sm_count: int, max_context_len: int, max_splits: int = MAX_KV_SPLITS
) -> int:
    """Split-KV count for a decode launch of ``batch`` requests over ``kv_heads`` KV heads
    on a GPU with ``sm_count`` SMs, for contexts of at most ``max_context_len`` tokens.

    Stage 1 runs ``batch * kv_heads`` programs per split (for GQA groups up to
    ``_BLOCK_H`` query heads). The count is ``ceil(2 * sm_count / (batch * kv_heads))``
    (two programs per SM, so that a small batch does not leave most SMs idle), at most
    ``ceil(max_context_len / MIN_KEYS_PER_SPLIT)`` and ``max_splits``, rounded down to a
    power of two (at least one program per SM still), so that eager steps of varying
    sizes compile a handful of kernel variants (``NUM_SPLITS`` is a compile-time
    constant). Pure: a CUDA graph recorded for a batch-size bucket gets the count of
    that bucket's size and the page table's width, fixed for all its replays.
    """
    for name, value in (("batch", batch), ("kv_heads", kv_heads), ("sm_count", sm_count),
                        ("max_context_len", max_context_len), ("max_splits", max_splits)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    want = min(-(-2 * sm_count // (batch * kv_heads)), -(-max_context_len // MIN_KEYS_PER_SPLIT), max_splits)
    return 1 << (want.bit_length() - 1)  # the largest power of two <= want


def decode_attention_ref(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Pure-torch reference, one request at a time, softmax in fp32.

    q: [B, heads, dim]; k_buffer, v_buffer: [num_slots, kv_heads, dim];
    req_to_token: [rows, max_context] slot ids; req_rows, seq_lens: [B].
    ``sliding_window`` W > 0: only the last W positions are attended to.
    Returns [B, heads, dim] in q's dtype.
    """
    num_heads, kv_heads = q.shape[1], k_buffer.shape[1]
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        first = max(0, int(seq_lens[b]) - sliding_window) if sliding_window else 0
        slots = req_to_token[int(req_rows[b]), first : int(seq_lens[b])].long()
        k = k_buffer[slots].float().repeat_interleave(group, dim=1)  # [L, heads, dim]
        v = v_buffer[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * scale  # [heads, L]
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


@jit
def _decode_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_rows, Seq_lens,
    Mid_o, Mid_lse,
    scale,
    window,  # sliding window (0: none): attend to the last `window` positions only
    stride_qb, stride_qh,
    stride_ks, stride_kh,
    stride_vs, stride_vh,
    stride_table,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next_pow2(HEAD_DIM)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,  # cdiv(GROUP, BLOCK_H)
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    # grid: (B, kv_heads * HEAD_BLOCKS, NUM_SPLITS)
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head_block = tl.program_id(1) % HEAD_BLOCKS
    split = tl.program_id(2)

    seq_len = tl.load(Seq_lens + b)
    row = tl.load(Req_rows + b).to(tl.int64)
    # The visible range first..seq_len is split: every split but the last covers
    # split_len positions; trailing splits may be empty (short context), and stage 2
    # skips them by the same arithmetic.
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    split_len = tl.cdiv(seq_len - first, NUM_SPLITS)
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    if end > start:
        offs_g = head_block * BLOCK_H + tl.arange(0, BLOCK_H)  # index inside the group
        mask_h = offs_g < GROUP
        heads = kv_head * GROUP + offs_g  # [BLOCK_H] query heads
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM

        # q: [BLOCK_H, BLOCK_D]; padded heads/dims load as 0 and are never stored.
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=mask_h[:, None] & mask_d[None, :],
            other=0.0,
        )
        q = q.to(K_buf.dtype.element_ty)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end  # at least offs_n == n0 is valid, so m_i stays finite
            slots = tl.load(Req_to_token + row * stride_table + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            # k, v: [BLOCK_N, BLOCK_D]
            k = tl.load(K_buf + slots[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            qk = dot(q, tl.trans(k), DOT_PRECISION, DOT_UPCAST) * scale  # [BLOCK_H, BLOCK_N]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            v = tl.load(V_buf + slots[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, DOT_UPCAST)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        # Partial output of this split, normalized, and its log-sum-exp.
        tl.store(
            Mid_o + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
            acc / l_i[:, None],
            mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(Mid_lse + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log(l_i), mask=mask_h)


@jit
def _decode_merge_kernel(
    Mid_o, Mid_lse, Seq_lens, Out,
    window,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    # grid: (B, heads); merges the non-empty splits by log-sum-exp.
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(Seq_lens + b)
    span = seq_len - tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # visible positions
    split_len = tl.cdiv(span, NUM_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    m = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        if s * split_len < span:  # same emptiness test as stage 1
            o_s = tl.load(Mid_o + b * stride_mob + h * stride_moh + s * stride_mos + offs_d, mask=mask_d, other=0.0)
            lse_s = tl.load(Mid_lse + b * stride_mlb + h * stride_mlh + s)
            m_new = tl.maximum(m, lse_s)
            old = tl.exp(m - m_new)
            w = tl.exp(lse_s - m_new)
            acc = acc * old + w * o_s
            total = total * old + w
            m = m_new
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, (acc / total).to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int = 8,
    out: torch.Tensor | None = None,
    block_n: int = 64,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Triton paged decode attention; same contract as :func:`decode_attention_ref`.

    q: [B, heads, dim] (any strides with a contiguous last dim); k_buffer, v_buffer:
    [num_slots, kv_heads, dim]; req_to_token: [rows, max_context] int32;
    req_rows: [B] int; seq_lens: [B] int32, every entry >= 1.
    ``num_kv_splits`` is fixed per call (not derived from the lengths on the device) so
    the launch shape depends only on B (:func:`decode_num_splits` chooses it per batch
    size). ``out`` ([B, heads, dim], may be a view) receives the result.
    """
    batch, num_heads, head_dim = q.shape
    kv_heads = k_buffer.shape[1]
    if num_heads % kv_heads:
        raise ValueError(f"heads ({num_heads}) must be a multiple of kv_heads ({kv_heads})")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    for t in (q, k_buffer, v_buffer, out):
        if t.stride(-1) != 1:
            raise ValueError("decode_attention needs a contiguous last (head_dim) dimension")
    group = num_heads // kv_heads
    head_blocks = triton.cdiv(group, _BLOCK_H)
    block_d = next_pow2(head_dim)

    # fp32 partials: [B, heads, splits, dim] outputs and [B, heads, splits] log-sum-exps.
    mid_o = torch.empty((batch, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((batch, num_heads, num_kv_splits), dtype=torch.float32, device=q.device)
    seq_lens = seq_lens.to(torch.int32)

    _decode_split_kernel[(batch, kv_heads * head_blocks, num_kv_splits)](
        q, k_buffer, v_buffer, req_to_token, req_rows, seq_lens,
        mid_o, mid_lse,
        scale,
        sliding_window,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=_BLOCK_H, BLOCK_N=block_n,
        NUM_SPLITS=num_kv_splits, HEAD_BLOCKS=head_blocks, **dot_options(k_buffer.dtype),
        # 4 warps spill nowhere (ptxas, benchmarks/gpu_compile_check.py): at head_dim 128,
        # 111 (sm_80) / 96 (sm_90a) registers in bf16, 160 / 136 in fp32
        num_warps=4,
    )
    _decode_merge_kernel[(batch, num_heads)](
        mid_o, mid_lse, seq_lens, out,
        sliding_window,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits,
    )
    return out
