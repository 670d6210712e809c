"""The Triton half of :mod:`plait.kernels.rotary`, kept apart so the model can import
:func:`plait.kernels.rotary.compute_inv_freq` without importing Triton."""

from __future__ import annotations

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import jit, next_pow2, tl


@jit
def _rotary_kernel(
    Q, K, Q_out, K_out, Positions, Cos_sin,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,  # next_pow2(max(heads, kv_heads))
    BLOCK_HALF: tl.constexpr,  # next_pow2(HALF)
):
    # grid: (T,); one program rotates every q and k head of one token.
    t = tl.program_id(0)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    cos = tl.load(Cos_sin + pos * stride_cs + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Cos_sin + pos * stride_cs + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]

    # q: two halves [BLOCK_H, BLOCK_HALF]
    mask = (offs_h < NUM_HEADS)[:, None] & mask_d[None, :]
    base = Q + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = Q_out + t * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(Q_out.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(Q_out.dtype.element_ty), mask=mask)

    # k: same rotation over the KV heads
    mask = (offs_h < KV_HEADS)[:, None] & mask_d[None, :]
    base = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = K_out + t * stride_kot + offs_h[:, None] * stride_koh + offs_d[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(K_out.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(K_out.dtype.element_ty), mask=mask)


def launch_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """See :func:`plait.kernels.rotary.apply_rotary`."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if head_dim % 2 or k.shape[-1] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"rotary needs an even head_dim shared by q {tuple(q.shape)}, k {tuple(k.shape)} "
            f"and the cos/sin cache {tuple(cos_sin_cache.shape)}"
        )
    for t in (q, k, cos_sin_cache):
        if t.stride(-1) != 1:
            raise ValueError("apply_rotary needs a contiguous last (head_dim) dimension")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_HEADS=num_heads, KV_HEADS=kv_heads, HALF=half,
        BLOCK_H=next_pow2(max(num_heads, kv_heads)), BLOCK_HALF=next_pow2(half),
    )
    return q_out, k_out
