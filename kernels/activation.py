"""SiLU-and-mul, the gated activation of Llama/Qwen MLPs.

Input convention: one tensor ``x [..., 2 * I]`` holding the gate projection in the first
half of the last dim and the up projection in the second (the layout of a fused
``gate_up_proj`` whose weight is ``cat([gate_proj.weight, up_proj.weight])``). Output:
``silu(x[..., :I]) * x[..., I:]``, shape ``[..., I]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import jit, tl, triton

_BLOCK = 1024  # output columns per program


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: ``silu(gate) * up`` with ``gate, up = x.chunk(2, -1)``, computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


@jit
def _silu_and_mul_kernel(
    X, Out,
    stride_x, stride_o,
    n_cols,  # I
    BLOCK: tl.constexpr,
):
    # grid: (rows, cdiv(I, BLOCK))
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n_cols + offs, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Triton SiLU-and-mul; same contract as :func:`silu_and_mul_ref`."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim (gate | up), got {x.shape[-1]}")
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, _BLOCK))](
            x2, out, x2.stride(0), out.stride(0), n, BLOCK=_BLOCK
        )
    return out.view(*x.shape[:-1], n)
