"""The batched allowed-token mask, applied to the sampling logits in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


def unpack_bits(words: torch.Tensor, width: int) -> torch.Tensor:
    """``int32 [B, W]`` packed rows -> ``bool [B, width]`` (bit ``i % 32`` of word
    ``i // 32`` is column ``i``), on the device of ``words``."""
    if words.device.type == "cpu":
        bits = np.unpackbits(words.numpy().view(np.uint8), axis=1, count=width, bitorder="little")
        return torch.from_numpy(bits).view(torch.bool)  # 0/1 bytes: a free reinterpretation
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :width].bool()


def apply_grammar_masks(logits: torch.Tensor, reqs: Sequence[Any]) -> None:
    """logits: ``[B, V]``, one row per request. Rows of requests with a grammar keep
    only their allowed tokens (others become -inf); free rows are untouched."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if not rows:
        return
    packed = np.stack([reqs[i].grammar.allowed(eos_ok=not reqs[i].params.ignore_eos) for i in rows])
    # packed rows are 32x less to copy to the device than a bool mask
    blocked = unpack_bits(torch.from_numpy(np.invert(packed)).to(logits.device), logits.shape[1])
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(blocked, float("-inf"))
    else:
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))
