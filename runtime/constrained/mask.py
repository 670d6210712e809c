"""The batched allowed-token mask, applied to the sampling logits in place.

Masks are packed rows (``int32 [W]``, bit ``i % 32`` of word ``i // 32`` = token ``i``
allowed), one per constrained request. Tokens past ``32 * W`` are blocked (a grammar
allows only tokens it knows); mask bits past the logits' width are ignored.

On CPU the rows are unpacked with numpy (one byte per token, a free view as bool) and
filled with ``masked_fill_``. On a GPU the packed rows go to the device as they are
(32x less than a bool mask) and a Triton kernel
(:func:`plait.kernels.bitmask.apply_token_bitmask_inplace`) writes the blocked logits:
no ``[B, V]`` temporary on either side.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def unpack_bits(words: torch.Tensor, width: int) -> torch.Tensor:
    """``int32 [B, W]`` packed rows on the CPU -> ``bool [B, width]`` (bit ``i % 32`` of
    word ``i // 32`` is column ``i``; columns past ``32 * W`` are False)."""
    bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, count=width, bitorder="little")
    return torch.from_numpy(bits).view(torch.bool)  # 0/1 bytes: a free reinterpretation


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Any]) -> None:
    """logits: ``[B, V]``, one row per request. Rows of requests with a grammar keep
    only their allowed tokens (others become -inf); free rows are untouched."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if not rows:
        return
    apply_packed_masks(logits, [reqs[i].grammar.allowed(eos_ok=not reqs[i].params.ignore_eos) for i in rows], rows)


def apply_packed_masks(logits: torch.Tensor, masks: list[np.ndarray], rows: list[int]) -> None:
    """logits: ``[B, V]``; row ``rows[i]`` keeps only the tokens packed row ``masks[i]``
    allows (speculative drafts bring one mask per verified position)."""
    if not rows:
        return
    if logits.device.type == "cpu":
        _apply_on_host(logits, masks, rows)
    else:
        _apply_with_kernel(logits, masks, rows)


def _apply_on_host(logits: torch.Tensor, masks: list[np.ndarray], rows: list[int]) -> None:
    vocab = logits.shape[1]
    packed = np.stack(masks)  # [R, W]
    known = min(vocab, 32 * packed.shape[1])
    blocked = unpack_bits(torch.from_numpy(np.invert(packed)), known)  # [R, known]
    if len(rows) == logits.shape[0]:
        logits[:, :known].masked_fill_(blocked, float("-inf"))
        logits[:, known:] = float("-inf")
    else:
        idx = torch.tensor(rows, dtype=torch.long)
        masked = logits[idx]
        masked[:, :known].masked_fill_(blocked, float("-inf"))
        masked[:, known:] = float("-inf")
        logits[idx] = masked


def _apply_with_kernel(logits: torch.Tensor, masks: list[np.ndarray], rows: list[int]) -> None:
    """The device path: one host->device copy of the packed rows and their row indices,
    then the Triton kernel. The staging block is page-locked on CUDA, so the copy is
    asynchronous; it comes from PyTorch's caching host allocator, which keeps freed
    pinned blocks for reuse and does not hand one out again before the copies that
    read it have finished (no per-step ``cudaHostAlloc``, no stale-buffer race).
    On CPU tensors (the interpreter tests) the block is plain memory."""
    from plait.kernels.bitmask import apply_token_bitmask_inplace  # Triton: device path only

    n, words = len(rows), masks[0].shape[0]
    # staging: [n * words] mask words, then the n logits-row indices
    host = torch.empty(n * (words + 1), dtype=torch.int32, pin_memory=logits.device.type == "cuda")
    flat = host.numpy()
    np.stack(masks, out=flat[: n * words].reshape(n, words))
    flat[n * words :] = rows
    staged = host.to(logits.device, non_blocking=True)
    bitmask = staged[: n * words].view(n, words)
    apply_token_bitmask_inplace(logits, bitmask, None if n == logits.shape[0] else staged[n * words :])
