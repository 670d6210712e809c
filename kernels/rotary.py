"""Rotary position embedding (RoPE), Hugging Face ``rotate_half`` layout.

Layout: a head vector ``x = [x1, x2]`` (two halves of ``head_dim / 2``) rotates as
``[x1 * cos - x2 * sin, x2 * cos + x1 * sin]`` with frequency ``i`` pairing ``x1[i]``
with ``x2[i]`` (non-interleaved; what HF checkpoints expect -- GGUF's interleaved
layout is undone by the loader).

The cos/sin cache is built once per model by :func:`rope_cos_sin_cache` from the
inverse frequencies of :func:`compute_inv_freq`, which implements the ``default``,
``linear``, ``llama3`` and ``yarn`` rope types exactly as transformers computes them
(YaRN also scales cos and sin by its attention factor: :func:`attention_factor`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from plait.runtime.models.config import ROPE_TYPES  # (the list lives with the configs)


def _rope_type(rope_scaling: Mapping[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def compute_inv_freq(head_dim: int, theta: float, rope_scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` fp32 for RoPE, as transformers computes them.

    ``rope_scaling`` is the HF config's dict (``rope_scaling`` / ``rope_parameters``):
    ``None`` or ``{"rope_type": "default"}``; ``{"rope_type": "linear", "factor": f}``
    (positions divided by f); ``{"rope_type": "llama3", "factor", "low_freq_factor",
    "high_freq_factor", "original_max_position_embeddings"}`` (Llama 3.1: long
    wavelengths slowed by ``factor``, short ones kept, a smooth blend between).
    The legacy key ``"type"`` is accepted for ``"rope_type"``.
    """
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = _rope_type(rope_scaling)
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor  # longer than this: fully scaled
        high_freq_wavelen = old_context / high_freq_factor  # shorter than this: untouched
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, factor, rope_scaling)
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


def _yarn_inv_freq(dim: int, theta: float, factor: float, rope_scaling: Mapping[str, Any]) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters`` inverse frequencies (same fp32 ops)."""
    if not rope_scaling.get("original_max_position_embeddings"):
        raise ValueError("rope_scaling type 'yarn' needs original_max_position_embeddings (the pretraining context)")
    original = float(rope_scaling["original_max_position_embeddings"])
    beta_fast = float(rope_scaling.get("beta_fast") or 32)
    beta_slow = float(rope_scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:  # the dimension that turns this often over the original context
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: the frequency extrapolates (kept), 0: interpolated
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(rope_scaling: Mapping[str, Any] | None) -> float:
    """The factor on cos and sin: YaRN's ``attention_factor`` (given, or from ``factor``
    and ``mscale`` / ``mscale_all_dim`` as transformers infers it); 1 otherwise."""
    if _rope_type(rope_scaling) != "yarn":
        return 1.0
    assert rope_scaling is not None
    given = rope_scaling.get("attention_factor")
    if given is not None:
        return float(given)
    factor = float(rope_scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, float(m)) / mscale(factor, float(m_all)))
    return mscale(factor)


def rope_cos_sin_cache(
    head_dim: int,
    max_positions: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The cos/sin cache ``[max_positions, head_dim]``: ``cos`` in the first half of the
    last dim, ``sin`` in the second, each ``[max_positions, head_dim // 2]``.
    Angles are computed in fp32 (as HF does) and then cast to ``dtype``; YaRN's
    attention factor multiplies both halves (as HF's ``attention_scaling``)."""
    inv_freq = compute_inv_freq(head_dim, theta, rope_scaling).to(device)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    scale = attention_factor(rope_scaling)  # 1 but for YaRN (x * 1.0 is x exactly)
    return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1).to(dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, heads, dim] by ``cos``, ``sin`` [T, 1, dim // 2] (fp32, HF
    ``rotate_half`` layout); computed in fp32, returned in ``x``'s dtype."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference RoPE: q [T, heads, dim], k [T, kv_heads, dim], positions [T] int,
    cos_sin_cache [max_positions, dim]. Returns rotated copies, computed in fp32."""
    half = q.shape[-1] // 2
    cs = cos_sin_cache[positions.long()].float()
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return rotate_ref(q, cos, sin), rotate_ref(k, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RoPE; same contract as :func:`apply_rotary_ref`. q and k may be strided
    views (e.g. of a fused QKV output) with a contiguous last dim."""
    from plait.kernels._rotary_triton import launch_rotary

    return launch_rotary(q, k, positions, cos_sin_cache)
