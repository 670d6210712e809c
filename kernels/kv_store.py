"""KV store: write the new tokens' K and V into their pool slots.

One program per new token copies its ``[kv_heads, head_dim]`` K and V rows to
``slot``; the inputs may be strided views (e.g. slices of a fused QKV projection) and
are cast to the pool's dtype on the way.
"""

from __future__ import annotations

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import jit, next_pow2, tl


def store_kv_ref(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Reference: ``k_buffer[slots] = k`` and ``v_buffer[slots] = v`` (cast to the pool dtype).

    k_buffer, v_buffer: [num_slots, kv_heads, dim]; slots: [T] int; k, v: [T, kv_heads, dim].
    """
    k_buffer[slots.long()] = k.to(k_buffer.dtype)
    v_buffer[slots.long()] = v.to(v_buffer.dtype)


@jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, Slots,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kbs, stride_kbh,
    stride_vbs, stride_vbh,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # grid: (T,)
    t = tl.program_id(0)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(K_buf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :],
             k.to(K_buf.dtype.element_ty), mask=mask)
    tl.store(V_buf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :],
             v.to(V_buf.dtype.element_ty), mask=mask)


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Triton KV store; same contract as :func:`store_kv_ref`. Slots must be distinct
    (two tokens writing one slot race); the padding slot 0 is the one exception the
    runner may use, since its contents are never read unmasked."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for t in (k, v, k_buffer, v_buffer):
        if t.stride(-1) != 1:
            raise ValueError("store_kv needs a contiguous last (head_dim) dimension")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_buffer, v_buffer, slots,
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_pow2(kv_heads), BLOCK_D=next_pow2(head_dim),
    )
