"""RMSNorm, optionally fused with the residual add that precedes it.

Hugging Face semantics (``LlamaRMSNorm`` and the decoder layer's residual stream):
``residual = x + residual`` (in the input dtype), then
``out = weight * (residual_f32 * rsqrt(mean(residual_f32**2) + eps)).to(dtype)``.
The fused form saves one read and one write of the hidden states per norm.
"""

from __future__ import annotations

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import jit, next_pow2, tl


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dim. x: [..., N]; weight: [N]."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: returns ``(rmsnorm(x + residual), x + residual)``."""
    new_residual = x + residual
    return rmsnorm_ref(new_residual, weight, eps), new_residual


@jit
def _rmsnorm_kernel(
    X, Residual, W, Out, Res_out,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next_pow2(n_cols): one program holds a whole row
):
    # grid: (rows,)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    # All arithmetic in fp32 with explicit rounding to the input dtype where HF rounds
    # (the residual sum; the normed value before the weight), which is what half-precision
    # arithmetic does on a GPU and also what the interpreter computes correctly.
    dtype = X.dtype.element_ty
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(Residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        x = x.to(dtype)
        tl.store(Res_out + row * stride_ro + offs, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # [rows, N]; a view when x's leading dims are contiguous
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    # output dtype follows torch promotion of ``weight * x`` (as in the reference)
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r2 = res_out = None
    if residual is not None:
        r2 = residual.reshape(-1, n).contiguous()
        res_out = torch.empty_like(x2)
    if x2.shape[0] == 0:
        return out.view(x.shape), None if res_out is None else res_out.view(x.shape)
    _rmsnorm_kernel[(x2.shape[0],)](
        x2, r2 if r2 is not None else x2, weight, out, res_out if res_out is not None else out,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, out.stride(0),
        res_out.stride(0) if res_out is not None else 0,
        n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=next_pow2(n),
    )
    return out.view(x.shape), None if res_out is None else res_out.view(x.shape)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm over the last dim; same contract as :func:`rmsnorm_ref`.
    Also serves Qwen3's per-head q/k norm: pass ``[tokens, heads, head_dim]``."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm; returns ``(normed, new_residual)`` like
    :func:`fused_add_rmsnorm_ref`. x, residual: [..., N] of one dtype; weight: [N]."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x in shape and dtype; got {tuple(residual.shape)}/{residual.dtype} "
            f"for x {tuple(x.shape)}/{x.dtype}"
        )
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
