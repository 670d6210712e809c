"""Weight-only quantized GEMM on CUDA (Triton): ``out = x @ dequant(w)^T (+ bias)``.

The GPU side of ``EngineConfig.quantization``: the weights stay in the blocks of
:mod:`plait.runtime.models.quant` in GPU memory (Q8: int8 ``qs [N, K]`` with a float32
scale per 32 weights, ``w = q * scale``; Q4: ``qs uint8 [N, K/2]``, byte j of a block
holding weight j in its low nibble and weight j + 16 in its high one, with a float32
scale and minimum, ``w = q * scale + min``), and each program dequantizes its tile of
weight rows block by block in registers, in float32 as the torch reference does, rounds
it to the activations' dtype and multiplies on ``tl.dot`` with a float32 accumulator.
So a decode step reads the 4- or 8-bit blocks instead of 16-bit weights. Per block of
32: one dot over its 32 inputs (Q8), or two over 16 (Q4: the low nibbles meet inputs
0-15, the high ones 16-31), so no unpacked tile is ever materialised.

Tested against the dequantized reference under the Triton interpreter
(``tests/test_kernels_quant_gemm.py``); ``benchmarks/gpu_check.py`` runs that file on a GPU.
"""

from __future__ import annotations

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import dot, dot_options, jit, tl, triton

BLOCK = 32  # weights per quantization block (quant.BLOCK)
_BLOCK_M = 16  # rows of x per program (the smallest tl.dot tile)
_BLOCK_N = 64  # weight rows per program


@jit
def _qgemm_kernel(
    X, QS, SC, MN, Bias, Out,
    M, N, nb,  # rows of x, weight rows, blocks per weight row (K / 32)
    stride_x, stride_o, row_bytes,
    Q4: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    rm64, rn64 = rm.to(tl.int64), rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, nb):
        s = tl.load(SC + rn64 * nb + b, mask=n_ok, other=0.0)  # [BLOCK_N] float32
        if Q4:
            j = tl.arange(0, 16)
            byte = tl.load(QS + rn64[None, :] * row_bytes + b * 16 + j[:, None], mask=n_ok[None, :], other=0)
            mn = tl.load(MN + rn64 * nb + b, mask=n_ok, other=0.0)
            w_lo = (byte & 0xF).to(tl.float32) * s[None, :] + mn[None, :]  # [16, BLOCK_N]: weights 0..15
            w_hi = (byte >> 4).to(tl.float32) * s[None, :] + mn[None, :]  # weights 16..31
            x_lo = tl.load(X + rm64[:, None] * stride_x + b * 32 + j[None, :], mask=m_ok[:, None], other=0.0)
            x_hi = tl.load(X + rm64[:, None] * stride_x + b * 32 + 16 + j[None, :], mask=m_ok[:, None], other=0.0)
            acc += dot(x_lo, w_lo.to(x_lo.dtype), DOT_PRECISION, DOT_UPCAST)
            acc += dot(x_hi, w_hi.to(x_hi.dtype), DOT_PRECISION, DOT_UPCAST)
        else:
            j = tl.arange(0, 32)
            q = tl.load(QS + rn64[None, :] * row_bytes + b * 32 + j[:, None], mask=n_ok[None, :], other=0)
            w = q.to(tl.float32) * s[None, :]  # [32, BLOCK_N]
            xv = tl.load(X + rm64[:, None] * stride_x + b * 32 + j[None, :], mask=m_ok[:, None], other=0.0)
            acc += dot(xv, w.to(xv.dtype), DOT_PRECISION, DOT_UPCAST)
    if HAS_BIAS:
        acc += tl.load(Bias + rn64, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Out + rm64[:, None] * stride_o + rn64[None, :], acc.to(Out.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def quant_linear(
    x: torch.Tensor,
    kind: str,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``x [M, K]`` (float32, bfloat16 or float16) times the blocked weight ``[N, K]``
    (``kind`` ``q8`` or ``q4``; the layouts above, on x's device). Returns ``[M, N]`` in
    x's dtype."""
    if kind not in ("q8", "q4") or (kind == "q4") != (mins is not None):
        raise ValueError(f"quant_linear: kind {kind!r} with{'' if mins is not None else 'out'} minimums")
    M, K = x.shape
    N, nb = scales.shape
    if K != nb * BLOCK or qs.shape != (N, K if kind == "q8" else K // 2):
        raise ValueError(f"quant_linear: x [{M}, {K}] against {kind} blocks qs {tuple(qs.shape)}, "
                         f"scales {tuple(scales.shape)}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M and N:
        grid = (triton.cdiv(M, _BLOCK_M), triton.cdiv(N, _BLOCK_N))
        _qgemm_kernel[grid](
            x, qs, scales, scales if mins is None else mins, scales if bias is None else bias, out,
            M, N, nb, x.stride(0), out.stride(0), qs.stride(0),
            Q4=kind == "q4", HAS_BIAS=bias is not None, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
            **dot_options(x.dtype),
        )
    return out
