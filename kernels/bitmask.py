"""Packed allowed-token bitmasks applied to logits in place (grammar-constrained decoding).

A bitmask row is ``int32 [W]``: bit ``i % 32`` of word ``i // 32`` set means token ``i``
is allowed. Applying it sets every disallowed logit to -inf and leaves the others
untouched. Tokens past the mask (``i >= 32 * W``, when the logits are wider than the
grammar's vocabulary) are disallowed: a grammar allows only tokens it knows. Mask bits
past the logits' width are ignored.

The kernel reads the packed words (32x less than a bool mask) and writes only the
blocked logits, so a step costs one pass over ``[rows, V]`` and no ``[B, V]``
temporary. One program per (mask row, ``BLOCK_W`` words).
"""

from __future__ import annotations

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import jit, tl, triton

_BLOCK_W = 64  # words per program: 2048 logits


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Pure-torch reference of :func:`apply_token_bitmask_inplace` (same contract)."""
    _check(logits, bitmask, rows)
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1).bool()  # [R, 32 W]
    allowed = torch.nn.functional.pad(allowed, (0, max(0, vocab - allowed.shape[1])))[:, :vocab]
    idx = torch.arange(logits.shape[0], device=logits.device) if rows is None else rows.long()
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))


@jit
def _bitmask_kernel(
    Logits, Bitmask, Rows,
    vocab, words,
    stride_l, stride_b,
    HAS_ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    # grid: (mask rows, cdiv(cdiv(vocab, 32), BLOCK_W)); mask row r applies to logits row
    # Rows[r] (or r)
    r = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(Rows + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W] word indices
    # words past the mask load as 0: their tokens are blocked
    w = tl.load(Bitmask + r.to(tl.int64) * stride_b + offs_w, mask=offs_w < words, other=0)
    bits = tl.arange(0, 32)
    blocked = ((w[:, None] >> bits[None, :]) & 1) == 0  # [BLOCK_W, 32]
    tokens = offs_w[:, None] * 32 + bits[None, :]
    ptrs = Logits + row * stride_l + tokens
    # built in fp32 and cast (the interpreter cannot make a bf16 constant)
    neg_inf = tl.full([BLOCK_W, 32], float("-inf"), tl.float32).to(Logits.dtype.element_ty)
    tl.store(ptrs, neg_inf, mask=blocked & (tokens < vocab))


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None
) -> None:
    """Set ``logits[rows[r], i]`` to -inf where token ``i`` is not allowed by mask row
    ``r``, in place.

    logits: ``[B, V]`` floating, contiguous last dim; bitmask: ``int32 [R, W]``,
    contiguous last dim; rows: ``[R]`` integer indices into logits' rows (distinct),
    on logits' device, or None for ``R == B`` (mask row ``r`` is logits row ``r``).
    """
    _check(logits, bitmask, rows)
    num_masks, words = bitmask.shape
    if num_masks == 0 or logits.shape[1] == 0:
        return
    grid = (num_masks, triton.cdiv(triton.cdiv(logits.shape[1], 32), _BLOCK_W))
    _bitmask_kernel[grid](
        logits, bitmask, bitmask if rows is None else rows,  # Rows unread without HAS_ROWS
        logits.shape[1], words,
        logits.stride(0), bitmask.stride(0),
        HAS_ROWS=rows is not None, BLOCK_W=_BLOCK_W,
    )


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    if logits.dim() != 2 or not logits.is_floating_point() or logits.stride(-1) != 1:
        raise ValueError(f"logits must be a [B, V] float tensor with a contiguous last dim, got "
                         f"{tuple(logits.shape)} {logits.dtype} strides {logits.stride()}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32 or bitmask.stride(-1) != 1:
        raise ValueError(f"bitmask must be an int32 [R, W] tensor with a contiguous last dim, got "
                         f"{tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.device != logits.device or (rows is not None and rows.device != logits.device):
        raise ValueError("logits, bitmask and rows must be on one device")
    if rows is None:
        if bitmask.shape[0] != logits.shape[0]:
            raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {logits.shape[0]} logits rows; pass rows")
    elif rows.dim() != 1 or rows.dtype.is_floating_point or rows.numel() != bitmask.shape[0]:
        raise ValueError(f"rows must be an integer [R] tensor with R = {bitmask.shape[0]} (bitmask rows), got "
                         f"{tuple(rows.shape)} {rows.dtype}")
