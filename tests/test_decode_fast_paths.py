"""The decode step's cheaper formulations are the reference formulas bit for bit: the
one-op float32 RMSNorm and the four-op rotary (fewer ops per layer, same outputs)."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.rotary import rotate_ref
from plait.runtime.models.llama import RMSNorm, RotaryEmbedding


def reference_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 64), (130, 960)])
def test_rmsnorm_matches_reference_bitwise(rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim, generator=g))
    x, residual = torch.randn(rows, dim, generator=g) * 3, torch.randn(rows, dim, generator=g)
    with torch.no_grad():
        assert torch.equal(norm(x), reference_norm(x, norm.weight, 1e-5))
        out, res = norm(x, residual)
    assert torch.equal(res, x + residual)
    assert torch.equal(out, reference_norm(x + residual, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 256}])
def test_rotary_matches_rotate_ref_bitwise(dtype, tokens, scaling):
    g = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(64, 2048, 10000.0, scaling)
    positions = torch.randint(0, 2048, (tokens,), generator=g)
    x = (torch.randn(tokens, 12, 64, generator=g) * 4).to(dtype)
    cs = rope.cos_sin_cache[positions].float()
    want = rotate_ref(x, cs[:, None, :32], cs[:, None, 32:])
    assert torch.equal(rope.rotate(positions, x), want)
    # the per-step cache is keyed by the positions tensor: new positions, new tables
    other = positions + 1
    cs = rope.cos_sin_cache[other].float()
    assert torch.equal(rope.rotate(other, x), rotate_ref(x, cs[:, None, :32], cs[:, None, 32:]))
