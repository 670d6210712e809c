"""Weight-only quantization (EngineConfig.quantization): the native q4/q8 kernel against
the torch dequantized reference on every path this machine runs (the portable one
everywhere), the kernel chooser, GGUF blocks kept bit for bit, and engines of each mode
loading and generating on a tiny model and the default model."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from plait.kernels import quant_cpu
from plait.runtime import Engine
from plait.runtime.config import EngineConfig
from plait.runtime.model_loader import _iter_gguf_weights
from plait.runtime.models.llama import weight_target
from plait.runtime.models.quant import BLOCK, QuantLinear, from_gguf, quantize

RUNNABLE = [isa for isa in quant_cpu.ISAS if quant_cpu.ISAS.index(isa) <= quant_cpu.ISAS.index(quant_cpu.choose_isa())]
X16_PATHS = ("avx2", "avx512vnni")  # one row of x on 16-bit activation blocks (the C file's X16_ONE_ROW)


@pytest.mark.parametrize(
    ("flags", "isa"),
    [
        ("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni", "avx512vnni"),
        ("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl", "avx512"),  # no VNNI
        ("fpu sse2 avx avx2 fma avx512f avx512_vnni", "avx512"),  # VNNI without BW/VL
        ("fpu sse2 avx avx2 fma f16c", "avx2"),
        ("fpu sse2 avx avx2", "portable"),  # AVX2 without FMA: the AVX2 path needs both
        ("fp asimd evtstrm aes", "portable"),  # an ARM Features line
        ("", "portable"),
    ],
)
def test_choose_isa_reads_the_cpu_flags(flags, isa):
    assert quant_cpu.choose_isa(flags) == isa


def test_chosen_path_exists_here():
    chosen = quant_cpu.choose_isa()
    assert chosen in quant_cpu.ISAS and "portable" in RUNNABLE and chosen in RUNNABLE
    x, w = torch.randn(2, 64), quantize(torch.randn(8, 64), "q4")
    out = quant_cpu.quant_linear(x, "q4", w.qs, w.scales, w.mins, None, chosen)
    torch.testing.assert_close(out, x @ w.dequantize().T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("rows, K", [(1, 4 * BLOCK), (3, 4 * BLOCK), (4, 4 * BLOCK), (9, 4 * BLOCK),
                                     (37, 4 * BLOCK), (20, 2048 + 2 * BLOCK), (300, 2 * BLOCK)])
def test_kernel_matches_dequantized_reference(isa, kind, rows, K):
    """Every path the kernel takes: one row, tiles of rows, and on AVX-512 the panels for
    16+ rows (K over two panels, M over two blocks), with a tail of weight rows (N = 37)."""
    g = torch.Generator().manual_seed(rows)
    N = 37
    w = quantize(torch.randn(N, K, generator=g), kind)
    x = torch.randn(rows, K, generator=g)
    bias = torch.randn(N, generator=g)
    ref = x.double() @ w.dequantize().double().T + bias.double()
    out = quant_cpu.quant_linear(x, kind, w.qs, w.scales, w.mins, bias, isa)
    if isa in X16_PATHS and rows == 1:  # 16-bit activations: their rounding's bound
        torch.testing.assert_close(out.double(), ref, rtol=0, atol=_x16_bound(x, w).max().item() + 1e-4)
    else:  # the kernel's math itself: float32 sums of exactly the reference's weights
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)
    deq = quant_cpu.dequantize(kind, w.qs, w.scales, w.mins, K, isa)
    torch.testing.assert_close(deq, w.dequantize(), rtol=1e-6, atol=1e-6)


def _x16_bound(x: torch.Tensor, w) -> torch.Tensor:
    """[N]: the most the one-row 16-bit paths' activation rounding can move each output:
    per block of 32, x is rounded to steps of s = max|x| / 32639, at most s / 2 each,
    times the weights without their minimum (the minimum meets x's exact float sum)."""
    K = x.shape[1]
    s = x.double().reshape(K // BLOCK, BLOCK).abs().amax(-1) / 32639
    wd = w.dequantize().double()
    if w.mins is not None:
        wd = wd - w.mins.double().repeat_interleave(BLOCK, dim=1)
    return wd.abs() @ (s / 2).repeat_interleave(BLOCK)


@pytest.mark.parametrize("isa", [isa for isa in X16_PATHS if isa in RUNNABLE])
@pytest.mark.parametrize("kind", ["q8", "q4"])
@pytest.mark.parametrize("K", [BLOCK, 3 * BLOCK, 4 * BLOCK, 5 * BLOCK, 19 * BLOCK])
def test_x16_one_row_is_exact_on_representable_activations(isa, kind, K):
    """x whose blocks are integers reaching +-32639 (so s = 1 and the 16-bit rounding is
    exact): the integer sums then give the reference product to float32 rounding, which
    checks the int16 packing, VNNI's pair layout and hi/lo split, the scales per lane
    and an odd last block (K = 1, 3, 5, 19 blocks)."""
    g = torch.Generator().manual_seed(K)
    w = quantize(torch.randn(21, K, generator=g), kind)
    x = torch.randint(-32639, 32640, (1, K), generator=g).double()
    x[0, ::BLOCK] = 32639.0 * torch.where(torch.rand(K // BLOCK, generator=g) < 0.5, -1.0, 1.0).double()
    ref = x @ w.dequantize().double().T
    out = quant_cpu.quant_linear(x.float(), kind, w.qs, w.scales, w.mins, None, isa)
    scale = x.abs() @ w.dequantize().double().abs().T
    assert ((out.double() - ref).abs() <= 1e-6 * scale).all()


@pytest.mark.parametrize("isa", [isa for isa in X16_PATHS if isa in RUNNABLE])
@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_x16_one_row_keeps_the_float_path_for_non_finite_or_tiny_rows(isa, kind):
    """A row with inf or NaN is not quantized (no scale exists): the call runs the
    float32 path, so the non-finite values reach the output."""
    w = quantize(torch.randn(9, 2 * BLOCK), kind)
    for bad in (float("inf"), float("nan")):
        x = torch.randn(1, 2 * BLOCK)
        x[0, 5] = bad
        got = quant_cpu.quant_linear(x, kind, w.qs, w.scales, w.mins, None, isa)
        # every output meets the bad value (inf or NaN by the path's order of sums); a
        # NaN rounded into 16 bits would have given finite outputs
        assert not torch.isfinite(got).any()
    # a block of values so small that 1/s overflows float32 (1e-36 / 32639 ... ): the
    # float32 path too, so the tiny block's zeros stay zeros (not -max|x| from inf * 0)
    x = torch.zeros(1, 2 * BLOCK)
    x[0, 3] = 1e-36
    x[0, BLOCK:] = torch.randn(BLOCK)
    got = quant_cpu.quant_linear(x, kind, w.qs, w.scales, w.mins, None, isa)
    ref = x.double() @ w.dequantize().double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 200, 1100])
def test_quant_linear_layer_at_every_row_count(rows):
    """The layer's three ways (kernel; dequantize + GEMM past KERNEL_MAX_ROWS on other
    paths; dequantize + oneDNN packing from PACK_MIN_ROWS) give the reference product."""
    from plait.runtime.models.quant import QuantLinear

    g = torch.Generator().manual_seed(rows)
    layer = QuantLinear(3 * BLOCK, 40, True, "q4", quant_cpu.choose_isa())
    layer.load_rows(torch.randn(40, 3 * BLOCK, generator=g), 0, 0)
    with torch.no_grad():
        layer.bias.copy_(torch.randn(40, generator=g))
        x = torch.randn(rows, 3 * BLOCK, generator=g)
        ref = x.double() @ layer.weight().dequantize().double().T + layer.bias.double()
        vnni_row = layer.isa in X16_PATHS and rows == 1  # 16-bit activations: their bound
        atol = _x16_bound(x, layer.weight()).max().item() + 1e-4 if vnni_row else 1e-4
        torch.testing.assert_close(layer(x).double(), ref, rtol=0 if vnni_row else 1e-5, atol=atol)


@pytest.mark.parametrize("kind", ["q8", "q4"])
def test_quantize_is_round_to_nearest(kind):
    w = torch.randn(16, 3 * BLOCK)
    q = quantize(w, kind)
    step = q.scales.repeat_interleave(BLOCK, dim=1)
    err = (q.dequantize() - w).abs()
    assert (err <= step / 2 + 1e-6).all()
    assert q.qs.dtype == (torch.int8 if kind == "q8" else torch.uint8)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_convert_exactly(type_name):
    qtype = getattr(gguf.GGMLQuantizationType, type_name)
    w = np.random.default_rng(0).standard_normal((6, 4 * BLOCK)).astype(np.float32)
    blocks = gguf.quants.quantize(w, qtype)
    ours = from_gguf(type_name, blocks, *w.shape).dequantize()
    assert torch.equal(ours, torch.from_numpy(gguf.quants.dequantize(blocks, qtype)))


def test_gguf_q4_k_blocks_convert_exactly():
    # random super-blocks are valid Q4_K data once d and dmin are finite float16 values
    rng = np.random.default_rng(1)
    rows, cols = 3, 2 * 256
    blocks = rng.integers(0, 256, size=(rows * cols // 256, 144), dtype=np.uint8)
    blocks[:, 0:4] = rng.uniform(0.001, 0.1, size=(len(blocks), 2)).astype(np.float16).view(np.uint8)
    blocks = blocks.reshape(rows, -1)
    ours = from_gguf("Q4_K", blocks, rows, cols).dequantize()
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_K).reshape(rows, cols)
    assert torch.equal(ours, torch.from_numpy(ref))


def test_config_takes_quantization_on_cpu_float32_and_on_cuda():
    with pytest.raises(ValueError, match="quantization='q8'"):
        EngineConfig(quantization="q8")
    with pytest.raises(ValueError, match="quantization='int8'.*device cpu and dtype float32"):
        EngineConfig(device="cpu", dtype="bfloat16", quantization="int8")
    # CUDA: the Triton kernel (plait.kernels.quant_gemm), in any dtype
    assert EngineConfig(device="cuda", dtype="bfloat16", quantization="q4").quantization == "q4"


def test_quantization_needs_block_aligned_projections():
    with pytest.raises(ValueError, match="multiple of 32.*quantization='none'"):
        QuantLinear(48, 16, False, "q4", "portable")


PROMPTS = ["The capital of France is", "def add(a, b):"]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_tiny_model_generates_in_each_mode(tiny_model_factory, mode):
    from transformers import AutoModelForCausalLM

    folder = tiny_model_factory("qwen2")  # q/k/v biases: the bias path of both modes
    with Engine(str(folder), kv_cache_tokens=1024, quantization=mode) as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        model = engine.model
        assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
        kinds = [m.kind for m in model.modules() if isinstance(m, QuantLinear)]
        # qkv, o, gate_up, down per layer in the mode's layout, the (untied) LM head in q8
        assert kinds == [{"int8": "q8", "q4": "q4"}[mode]] * 4 * model.config.num_layers + ["q8"]
        # fused q/k/v rows hold the checkpoint's weights to within half a step
        hf = AutoModelForCausalLM.from_pretrained(folder).state_dict()
        attn = model.model.layers[0].self_attn
        ref = torch.cat([hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        step = attn.qkv_proj.scales.repeat_interleave(BLOCK, dim=1)
        assert ((attn.qkv_proj.weight().dequantize() - ref).abs() <= step / 2 + 1e-6).all()


def test_default_model_q4_keeps_the_gguf_blocks_and_generates():
    """The default GGUF's Q4_1 projections are the file's values bit for bit (q/k rows
    un-permuted, q/k/v and gate/up fused as in float32 loading), and it generates."""
    with Engine(None, kv_cache_tokens=1024, quantization="q4") as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
        modules = dict(engine.model.named_modules())
        checked = 0
        for name, tensor in _iter_gguf_weights(engine.source._gguf()):  # float32, dequantized by gguf
            if name.startswith("model.layers.1."):
                break
            if not name.startswith("model.layers.0.") or "norm" in name:
                continue
            target, region = weight_target(name, engine.model.config)
            layer = modules[target.removesuffix(".weight")]
            _, off, n = region or (None, 0, 0)
            rows = layer.weight().dequantize()[off : off + (n or layer.out_features)]
            assert torch.equal(rows, tensor), name
            checked += 1
        assert checked == 7  # q, k, v, o, gate, up, down


def test_default_model_int8_generates():
    with Engine(None, kv_cache_tokens=1024, quantization="int8") as engine:
        outs = engine.generate(PROMPTS, GREEDY)
        assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs)
        head = engine.model.quant_lm_head  # SmolLM2 ties its embeddings
        assert head is not None and head.kind == "q8"
        assert {m.kind for m in engine.model.modules() if isinstance(m, QuantLinear)} == {"q8"}
