"""The Triton weight-only GEMM (plait.kernels.quant_gemm, the CUDA side of
``quantization``) against x @ dequant(w)^T of plait.runtime.models.quant.

Runs on CPU under the Triton interpreter (small shapes), on CUDA compiled
(benchmarks/gpu_check.py runs every tests/test_kernels_*.py). ``TRITON_INTERPRET`` is
set before triton is imported (see tests/test_kernels_attention.py).

Tolerances: fp32 1e-5 (the same products, summed per block in another order); bf16 /
fp16: the kernel rounds each dequantized weight to the activations' dtype, as a model
whose dequantized weights were stored in that dtype would, so the reference is that
rounded product, within the accumulation's error.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: F401  (pinned in the test extra; a missing triton must fail, not skip)

from plait.kernels.quant_gemm import quant_linear  # noqa: E402
from plait.runtime.models.quant import BLOCK, quantize  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("M, N, K", [(1, 37, BLOCK), (3, 64, 3 * BLOCK), (17, 70, 2 * BLOCK)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_dequantized_reference(kind, M, N, K, dtype):
    """Tails in every direction: M past one 16-row tile, N past one 64-row tile, odd block
    counts; with and without a bias."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w = quantize(torch.randn(N, K, generator=g), kind)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    for b in (None, bias):
        out = quant_linear(dev(x).to(dtype), kind, dev(w.qs), dev(w.scales), dev(w.mins), dev(b))
        assert out.dtype == dtype and out.shape == (M, N)
        ref = x.to(dtype).double() @ w.dequantize().to(dtype).double().T + (0 if b is None else b.double())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double().cpu(), ref, rtol=tol, atol=tol * 10)


def test_the_nibble_order_and_the_minimum():
    """One block, one weight row, x a one-hot: each output picks exactly one weight, so a
    swapped nibble half or a dropped minimum shows as a wrong value, not a small error."""
    w = quantize(torch.linspace(-1.0, 2.0, BLOCK)[None, :], "q4")
    x = torch.eye(BLOCK)
    out = quant_linear(x.to(DEVICE), "q4", w.qs.to(DEVICE), w.scales.to(DEVICE), w.mins.to(DEVICE), None)
    torch.testing.assert_close(out[:, 0].cpu(), w.dequantize()[0], rtol=0, atol=1e-6)


def test_shapes_are_checked():
    w = quantize(torch.randn(8, 2 * BLOCK), "q4")
    with pytest.raises(ValueError, match="blocks"):
        quant_linear(torch.randn(2, BLOCK).to(DEVICE), "q4", w.qs.to(DEVICE), w.scales.to(DEVICE), w.mins.to(DEVICE), None)
    with pytest.raises(ValueError, match="minimums"):
        quant_linear(torch.randn(2, 2 * BLOCK).to(DEVICE), "q4", w.qs.to(DEVICE), w.scales.to(DEVICE), None, None)


def test_a_layer_cast_to_bfloat16_keeps_float32_blocks():
    """CausalLM.materialize casts the model to its dtype: a quantized layer's scales and
    minimums must come back float32 (bfloat16 scales would move every weight)."""
    from plait.runtime.models.quant import QuantLinear

    layer = QuantLinear(2 * BLOCK, 8, True, "q4", "portable").to(torch.bfloat16)
    assert layer.scales.dtype == torch.bfloat16  # what the cast does ...
    layer.keep_float32_blocks()
    assert layer.scales.dtype == torch.float32 and layer.mins.dtype == torch.float32  # ... and undoing it
    assert layer.qs.dtype == torch.uint8 and layer.bias.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="an engine on CUDA needs a GPU")
@pytest.mark.parametrize("mode", ["q4", "int8"])
def test_an_engine_on_cuda_gives_the_cpu_engines_greedy_tokens(tiny_model_factory, mode):
    """The same float checkpoint quantized the same way on both devices, float32: the
    Triton kernel's engine must give the CPU kernel's greedy tokens."""
    from plait.runtime import Engine

    path = str(tiny_model_factory("llama"))
    prompts = [list(range(10, 40)), list(range(50, 61))]
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for device in ("cpu", "cuda"):
        with Engine(path, device=device, dtype="float32", quantization=mode, kv_cache_tokens=2048) as e:
            outs[device] = [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=params)]
    assert outs["cuda"] == outs["cpu"]
