"""KV store, RMSNorm (+ residual), rotary embedding and SiLU-and-mul kernels against
their torch references; the rotary frequencies also against transformers.

Runs on CPU under the Triton interpreter, on CUDA compiled. NOTE: ``TRITON_INTERPRET``
is set before ``plait.kernels`` (and so triton) is imported; see
tests/test_kernels_attention.py and ``plait.kernels._triton`` for why that order matters.

Tolerances: fp32, atol/rtol 1e-5 (also against transformers' own Llama RoPE); bf16,
atol/rtol 2e-2 (a couple of bf16 ulps: the kernels round once from fp32 where torch
rounds per op); the KV store and the residual sum are exact (one bf16 ulp under the
interpreter, which truncates on fp32 -> bf16 conversion).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: F401  (pinned in the test extra; a missing triton must fail, not skip)

from plait.kernels._triton import INTERPRET  # noqa: E402
from plait.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from plait.kernels.kv_store import store_kv, store_kv_ref  # noqa: E402
from plait.kernels.rmsnorm import fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_ref  # noqa: E402
from plait.kernels.rotary import apply_rotary, apply_rotary_ref, compute_inv_freq, rope_cos_sin_cache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
BF16_TOL = dict(atol=2e-2, rtol=2e-2)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def _rounding_tol(dtype: torch.dtype) -> dict[str, float]:
    """Exact, except that the interpreter converts fp32 -> bf16 by truncation where GPUs
    and torch round to nearest even: one bf16 ulp (2**-7 relative) apart."""
    return dict(atol=0.0, rtol=2.0**-7 if INTERPRET and dtype == torch.bfloat16 else 0.0)


# ----------------------------------------------------------------------------- KV store


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 64), (3, 128), (2, 80)])
def test_store_kv_matches_reference(kv_heads: int, head_dim: int, pool_dtype: torch.dtype) -> None:
    num_slots, num_tokens = 64, 11
    slots = torch.randperm(num_slots - 1, device=DEVICE)[:num_tokens] + 1  # distinct, never slot 0
    # k, v as strided views of one fused projection output [T, 2 * kv_heads, dim]
    kv = torch.randn(num_tokens, 2 * kv_heads, head_dim, device=DEVICE)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    bufs = [torch.randn(num_slots, kv_heads, head_dim, device=DEVICE).to(pool_dtype) for _ in range(2)]
    ref_bufs = [b.clone() for b in bufs]
    store_kv(bufs[0], bufs[1], slots, k, v)
    store_kv_ref(ref_bufs[0], ref_bufs[1], slots, k, v)
    for got, want in zip(bufs, ref_bufs):
        torch.testing.assert_close(got, want, **_rounding_tol(pool_dtype))


# ----------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 576), (3, 4, 64), (1, 1000)])
def test_rmsnorm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype)
    torch.testing.assert_close(rmsnorm(x, weight, 1e-6), rmsnorm_ref(x, weight, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rmsnorm_matches_reference(dtype: torch.dtype) -> None:
    x = torch.randn(7, 576, device=DEVICE).to(dtype)
    residual = torch.randn(7, 576, device=DEVICE).to(dtype)
    weight = (1 + 0.1 * torch.randn(576, device=DEVICE)).to(dtype)
    out, new_residual = fused_add_rmsnorm(x, residual, weight, 1e-5)
    ref_out, ref_residual = fused_add_rmsnorm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, **_rounding_tol(dtype))  # one rounded add
    torch.testing.assert_close(out, ref_out, **_tol(dtype))
    assert out.dtype == dtype and new_residual.dtype == dtype


def test_fused_add_rmsnorm_rejects_mismatched_residual() -> None:
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(x, torch.randn(2, 32, device=DEVICE), torch.ones(64, device=DEVICE), 1e-6)


# ----------------------------------------------------------------------------- rotary

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _hf_llama_rope(head_dim: int, theta: float, rope_scaling: dict | None):  # -> (module, apply fn)

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_type": "default", **(rope_scaling or {}), "rope_theta": theta}
    params["rope_type"] = params.pop("type", params["rope_type"])
    cfg = LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, rope_parameters=params,
        max_position_embeddings=131072,
    )
    return LlamaRotaryEmbedding(cfg), apply_rotary_pos_emb


@pytest.mark.parametrize(
    "rope_scaling", [None, {"rope_type": "linear", "factor": 4.0}, {"type": "linear", "factor": 2.0}, LLAMA3_SCALING]
)
@pytest.mark.parametrize("head_dim,theta", [(64, 100000.0), (128, 500000.0)])
def test_compute_inv_freq_matches_transformers(head_dim: int, theta: float, rope_scaling: dict | None) -> None:
    hf_rope, _ = _hf_llama_rope(head_dim, theta, rope_scaling)
    assert hf_rope.attention_scaling == 1.0
    torch.testing.assert_close(compute_inv_freq(head_dim, theta, rope_scaling), hf_rope.inv_freq, atol=0, rtol=0)


def test_compute_inv_freq_rejects_unknown_type() -> None:
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        compute_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        compute_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 2.0})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 128)])
def test_apply_rotary_matches_reference(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    num_tokens, max_pos = 13, 4096
    cache = rope_cos_sin_cache(head_dim, max_pos, 10000.0, LLAMA3_SCALING, device=DEVICE)
    positions = torch.randint(0, max_pos, (num_tokens,), device=DEVICE)
    # q and k as strided views of a fused QKV output
    qkv = torch.randn(num_tokens, heads + 2 * kv_heads, head_dim, device=DEVICE).to(dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    q_out, k_out = apply_rotary(q, k, positions, cache)
    q_ref, k_ref = apply_rotary_ref(q, k, positions, cache)
    torch.testing.assert_close(q_out, q_ref, **_tol(dtype))
    torch.testing.assert_close(k_out, k_ref, **_tol(dtype))


def test_apply_rotary_matches_transformers_llama() -> None:
    # HF: [B, heads, T, dim] layout, rotate_half, cos/sin from LlamaRotaryEmbedding (fp32)
    head_dim, theta, num_tokens = 64, 500000.0, 9
    hf_rope, hf_apply = _hf_llama_rope(head_dim, theta, LLAMA3_SCALING)
    positions = torch.tensor([0, 1, 2, 7, 100, 1000, 5000, 9000, 20000])
    q, k = torch.randn(num_tokens, 6, head_dim), torch.randn(num_tokens, 2, head_dim)
    cos, sin = hf_rope(q, positions[None])
    q_hf, k_hf = hf_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = rope_cos_sin_cache(head_dim, 20001, theta, LLAMA3_SCALING, device=DEVICE)
    q_out, k_out = apply_rotary(q.to(DEVICE), k.to(DEVICE), positions.to(DEVICE), cache)
    torch.testing.assert_close(q_out.cpu(), q_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out.cpu(), k_hf[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 2 * 1536), (2, 3, 2 * 64), (1, 2 * 5)])
def test_silu_and_mul_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (3 * torch.randn(shape, device=DEVICE)).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    torch.testing.assert_close(out, silu_and_mul_ref(x), **_tol(dtype))
