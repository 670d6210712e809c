"""Compile every Triton kernel of ``plait.kernels`` for sm_80 and sm_90a, without a GPU.

    python benchmarks/gpu_compile_check.py [--targets sm_80,sm_90a] [--ptxas PATH]
                                           [--report-only] [--json out.json]

The kernels are compiled at their shipped launch settings by running the shipped
launchers themselves on small CPU tensors of real model shapes (SmolLM2-135M: 9/3
heads of dim 64; Llama-3-8B: 32/8 heads of dim 128; Qwen3-8B: Llama-3-8B's attention
plus its per-head q/k norm), in bfloat16 and float32: the attention backend's
``forward`` (KV store, extend, decode split + merge), RoPE, RMSNorm, fused add-RMSNorm
and SiLU-and-mul, the fused-MoE kernels, and the grammar bitmask kernel over each
model's vocabulary. The
attention case runs a mixed step and a decode-only step over a page table as wide as
the model's context, as a CUDA graph records it (the decode split count of graph
bucket 1). Triton's JIT specializes and compiles each launch exactly as on a GPU; a
compile-only driver (:class:`CompileOnlyDriver`) stands in for CUDA, names the target
(its SM count is an A100's / H100's), and turns each launch into a no-op. Nothing here
chooses a block size, warp count or stage count: the settings the launchers choose per
target (extend tiles and warps, decode splits per batch size) are printed first.

For each compiled kernel the PTX is assembled again with ``ptxas -v`` (Triton's own
flags) to read the registers per thread and the spill stores/loads, and the PTX tells
which MMA the dots use: ``wgmma`` (Hopper warpgroup MMA), ``mma.sync``, or ``fma`` (a
``tl.dot`` with no MMA: fp32 ``ieee`` precision).

Exit status: 1 on a compile failure (including a kernel of ``plait.kernels`` that no
case compiled, or one that needs more shared memory than the target has) or on a spill
at bfloat16; with ``--report-only`` spills are reported but only compile failures fail.
2 when the ptxas binary is missing.
"""

from __future__ import annotations

import os

# Before anything imports triton: compile (never interpret), for a GPU this machine may
# lack (see plait.kernels._triton).
os.environ["TRITON_INTERPRET"] = "0"
os.environ["PLAIT_TRITON_COMPILE_ONLY"] = "1"

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import pkgutil  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver as triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import plait.kernels  # noqa: E402
from plait.kernels import _triton  # noqa: E402



@dataclass(frozen=True)
class Target:
    """A CUDA target: Triton's arch number, the largest shared memory one block may use
    (CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, which Triton checks before a
    launch) and the SM count (the decode split count depends on it), of an A100 / H100."""

    arch: int
    max_shared_mem: int
    sm_count: int


# Triton compiles arch 90 for sm_90a (wgmma needs the "a").
TARGETS: dict[str, Target] = {
    "sm_80": Target(80, 166912, 108),
    "sm_90a": Target(90, 232448, 132),
}
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32}
# ptxas flags of Triton's own cubin step (triton/backends/nvidia/compiler.py make_cubin),
# so the registers read here are those of the binary Triton would load.
PTXAS_FLAGS = ["-lineinfo", "-v", "--regAllocOptLevel=2"]
MAX_ERROR_CHARS = 2000  # of one compile failure's message, printed and in the JSON


@dataclass(frozen=True)
class ModelShape:
    """The shapes one model's layer gives the kernels."""

    name: str
    num_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    context: int  # the page table's width: the longest context
    qk_norm: bool = False  # Qwen3's per-head RMSNorm on q and k


MODELS = [
    ModelShape("SmolLM2-135M", 9, 3, 64, 576, 1536, 49152, 8192),
    ModelShape("Llama-3-8B", 32, 8, 128, 4096, 14336, 128256, 8192),
    ModelShape("Qwen3-8B", 32, 8, 128, 4096, 12288, 151936, 40960, qk_norm=True),
]
# batch sizes whose decode split counts are printed (CUDA-graph buckets)
SPLIT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Case:
    """One shipped launcher call: ``launch(model, dtype, target)`` runs it on CPU tensors."""

    name: str
    launch: Callable[[ModelShape, torch.dtype, Target], object]
    has_head_dim: bool  # the kernels it launches take a head-dim constexpr


@dataclass
class Row:
    kernel: str
    case: str
    model: str
    target: str
    dtype: str
    head_dim: int | None
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int
    spill_stores: int
    spill_loads: int
    mma: str  # "wgmma" / "mma.sync" / "fma" (a tl.dot without MMA) / "-" (no dot)
    constexprs: str

    @property
    def spills(self) -> bool:
        return self.spill_stores + self.spill_loads > 0


@dataclass
class Failure:
    case: str
    model: str
    target: str
    dtype: str
    error: str


# ----------------------------------------------------------------------------- the driver


class _Utils:
    def __init__(self, max_shared_mem: int) -> None:
        self.max_shared_mem = max_shared_mem

    def get_device_properties(self, device: int) -> dict[str, int]:
        return {"max_shared_mem": self.max_shared_mem}

    def load_binary(self, name: str, kernel: bytes, shared: int, device: int) -> tuple[Any, ...]:
        # (module, function, n_regs, n_spills, max threads per block): nothing is loaded
        return None, None, 0, 0, 1024


class CompileOnlyDriver:
    """Triton's active driver for one CUDA target, with no device behind it: the JIT
    compiles for ``target`` as it would on such a GPU; a launch runs nothing and appends
    the compiled kernel to :attr:`launched`. ``device`` must be distinct per target
    (Triton keys its per-device caches by it)."""

    def __init__(self, device: int, target: GPUTarget, max_shared_mem: int) -> None:
        self.device, self.target = device, target
        self.utils = _Utils(max_shared_mem)
        self.launched: list[CompiledKernel] = []

    def get_current_device(self) -> int:
        return self.device

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def launcher_cls(self, src: Any, metadata: Any) -> Callable[..., None]:
        # Called when a just-compiled kernel is first launched; it is in the JIT's cache.
        kernel_cache = src.fn.device_caches[self.device][0]
        kernel = next(k for k in kernel_cache.values() if k.hash == metadata.hash)
        return lambda *args: self.launched.append(kernel)


# ----------------------------------------------------------------------------- the cases

TOKENS = 4  # tokens of the elementwise cases


def qkv_views(m: ModelShape, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """q [T, heads, dim], k, v [T, kv_heads, dim]: views of one fused QKV output, as the
    decoder layer makes them."""
    q_size, kv_size = m.num_heads * m.head_dim, m.kv_heads * m.head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (q.view(tokens, m.num_heads, m.head_dim), k.view(tokens, m.kv_heads, m.head_dim),
            v.view(tokens, m.kv_heads, m.head_dim))


def run_attention(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    """Two steps through the Triton attention backend: a mixed step, an extend request
    (16 new tokens on 16 cached) and a decode request (context 40); and that decode
    request alone over the metadata a CUDA graph of bucket 1 records (the split count
    of the page table's width, the model's context)."""
    from plait.runtime.attention.triton_backend import TritonAttentionBackend
    from plait.runtime.forward_batch import ForwardBatch
    from plait.runtime.memory import KVPool

    prefix, new, context = 16, 16, 40
    tokens = new + 1
    pool = KVPool(num_slots=128, num_layers=1, kv_heads=m.kv_heads, head_dim=m.head_dim, dtype=dtype, device="cpu")
    table = torch.zeros((2, m.context), dtype=torch.int32)
    table[0, : prefix + new] = torch.arange(1, 1 + prefix + new)
    table[1, :context] = torch.arange(64, 64 + context)
    fb = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.cat([torch.arange(prefix, prefix + new), torch.tensor([context - 1])]),
        out_slots=torch.cat([table[0, prefix : prefix + new], table[1, context - 1 : context]]).long(),
        req_rows=torch.tensor([0, 1]),
        req_to_token=table,
        num_extends=1, extend_prefix_lens=[prefix], extend_seq_lens=[new], decode_seq_lens=[context],
    )
    backend = TritonAttentionBackend(pool, m.num_heads, m.head_dim**-0.5, sm_count=target.sm_count)
    q, k, v = qkv_views(m, tokens, dtype)
    backend.forward(q, k, v, 0, fb.with_attn_metadata(backend.init_forward(fb)))
    decode = ForwardBatch(
        input_ids=fb.input_ids[-1:], positions=fb.positions[-1:], out_slots=fb.out_slots[-1:],
        req_rows=fb.req_rows[1:], req_to_token=table,
        num_extends=0, extend_prefix_lens=[], extend_seq_lens=[], decode_seq_lens=[context],
        attn_metadata=backend.decode_metadata(table, fb.req_rows[1:], torch.tensor([context], dtype=torch.int32)),
    )
    return backend.forward(q[-1:], k[-1:], v[-1:], 0, decode)


def run_rotary(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    from plait.kernels.rotary import apply_rotary, rope_cos_sin_cache

    q, k, _ = qkv_views(m, TOKENS, dtype)
    cos_sin = rope_cos_sin_cache(m.head_dim, 64, 10000.0)  # fp32, as the model keeps it
    return apply_rotary(q, k, torch.arange(TOKENS), cos_sin)


def run_rmsnorm(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    from plait.kernels.rmsnorm import rmsnorm

    return rmsnorm(torch.randn(TOKENS, m.hidden).to(dtype), torch.ones(m.hidden, dtype=dtype), 1e-6)


def run_fused_add_rmsnorm(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    from plait.kernels.rmsnorm import fused_add_rmsnorm

    x, residual = (torch.randn(TOKENS, m.hidden).to(dtype) for _ in range(2))
    return fused_add_rmsnorm(x, residual, torch.ones(m.hidden, dtype=dtype), 1e-6)


def run_qk_norm(m: ModelShape, dtype: torch.dtype, target: Target) -> object | None:
    """Qwen3's per-head norm: rmsnorm over the last dim of the strided q view."""
    if not m.qk_norm:
        return None
    from plait.kernels.rmsnorm import rmsnorm

    q, _, _ = qkv_views(m, TOKENS, dtype)
    return rmsnorm(q, torch.ones(m.head_dim, dtype=dtype), 1e-6)


def run_silu_and_mul(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    from plait.kernels.activation import silu_and_mul

    return silu_and_mul(torch.randn(TOKENS, 2 * m.intermediate).to(dtype))


def run_bitmask(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    """Grammar masks over the model's vocabulary: on every row, and on a subset of rows."""
    from plait.kernels.bitmask import apply_token_bitmask_inplace

    logits = torch.randn(TOKENS, m.vocab).to(dtype)
    bitmask = torch.zeros(TOKENS, -(-m.vocab // 32), dtype=torch.int32)
    apply_token_bitmask_inplace(logits, bitmask)
    return apply_token_bitmask_inplace(logits, bitmask[:2], torch.tensor([1, 3]))


def run_fused_moe(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    """The fused-MoE kernels at a decode step's tiles (one token) and a prefill's (64
    tokens): the model's hidden size, 8 experts of a quarter of its intermediate size,
    top-2 (weights left uninitialised: nothing runs)."""
    from plait.kernels.fused_moe import fused_experts

    experts, inter = 8, m.intermediate // 4
    w_gate_up = torch.empty(experts, 2 * inter, m.hidden, dtype=dtype)
    w_down = torch.empty(experts, m.hidden, inter, dtype=dtype)
    for tokens in (1, 64):
        ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)])
        out = fused_experts(torch.randn(tokens, m.hidden).to(dtype), w_gate_up, w_down,
                            torch.rand(tokens, 2).to(dtype), ids)
    return out


def run_quant_gemm(m: ModelShape, dtype: torch.dtype, target: Target) -> object:
    """The weight-only GEMM of ``quantization`` over q4 and q8 blocks of a hidden x
    hidden projection, at a decode step's rows (one) and a prefill's (64); blocks left
    uninitialised: nothing runs."""
    from plait.kernels.quant_gemm import quant_linear

    n = k = m.hidden
    scales, mins = torch.empty(n, k // 32), torch.empty(n, k // 32)
    q4, q8 = torch.empty(n, k // 2, dtype=torch.uint8), torch.empty(n, k, dtype=torch.int8)
    for tokens in (1, 64):
        x = torch.randn(tokens, k).to(dtype)
        out = quant_linear(x, "q4", q4, scales, mins, None)
        quant_linear(x, "q8", q8, scales, None, torch.zeros(n, dtype=dtype))
    return out


CASES = [
    Case("attention backend", run_attention, has_head_dim=True),
    Case("apply_rotary", run_rotary, has_head_dim=True),
    Case("rmsnorm", run_rmsnorm, has_head_dim=False),
    Case("fused_add_rmsnorm", run_fused_add_rmsnorm, has_head_dim=False),
    Case("rmsnorm (q/k norm)", run_qk_norm, has_head_dim=True),
    Case("silu_and_mul", run_silu_and_mul, has_head_dim=False),
    Case("token bitmask", run_bitmask, has_head_dim=False),
    Case("fused MoE", run_fused_moe, has_head_dim=False),
    Case("quantized GEMM", run_quant_gemm, has_head_dim=False),
]


def discover_kernels() -> list[str]:
    """Names of the Triton kernels defined in the modules of ``plait.kernels`` that
    build on ``_triton`` (its own ``dot`` is a device helper, not a kernel)."""
    names = []
    for info in pkgutil.iter_modules(plait.kernels.__path__):
        path = Path(plait.kernels.__path__[0]) / f"{info.name}.py"
        if info.name == "_triton" or "plait.kernels._triton import" not in path.read_text():
            continue
        module = importlib.import_module(f"plait.kernels.{info.name}")
        names += [name for name, obj in vars(module).items()
                  if isinstance(obj, JITFunction) and obj.module == module.__name__]
    return sorted(names)


# ----------------------------------------------------------------------------- ptxas


def default_ptxas() -> str | None:
    """The ptxas Triton compiles with: its bundled one unless ``TRITON_PTXAS_PATH``
    names another; None without Triton's NVIDIA backend."""
    try:
        return knobs.nvidia.ptxas.path
    except Exception:  # no NVIDIA backend or no runnable ptxas: main reports it
        return None


def ptxas_version(ptxas: str) -> str:
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout
    release = re.search(r"release \S+ V[\d.]+", out)
    return release.group(0) if release else out.strip().splitlines()[-1]


def ptxas_usage(ptxas: str, ptx: str, gpu_name: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of the one kernel in ``ptx``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [ptxas, *PTXAS_FLAGS, f"--gpu-name={gpu_name}", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
            capture_output=True, text=True,
        )
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"ptxas --gpu-name={gpu_name} failed ({proc.returncode}): {log.strip()}")
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spills is None:
        raise RuntimeError(f"cannot read the ptxas -v report: {log.strip()}")
    return int(regs.group(1)), int(spills.group(1)), int(spills.group(2))


def mma_kind(kernel: CompiledKernel) -> str:
    ptx = kernel.asm["ptx"]
    if "wgmma.mma_async" in ptx:
        return "wgmma"
    if "mma.sync" in ptx:
        return "mma.sync"
    return "fma" if "tt.dot" in kernel.asm["ttir"] else "-"


def constexpr_summary(kernel: CompiledKernel) -> str:
    """The block sizes and other integer constexprs the launcher passed, by name."""
    names = kernel.src.fn.arg_names
    parts = [f"{names[path[0]]}={value}" for path, value in sorted(kernel.src.constants.items())
             if len(path) == 1 and isinstance(value, (int, bool)) and not names[path[0]].startswith("DOT_")]
    return " ".join(parts)


# ----------------------------------------------------------------------------- the check


def error_text(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:MAX_ERROR_CHARS]}"


def compile_target(target_name: str, device: int, ptxas: str,
                   dtypes: Sequence[str]) -> tuple[list[Row], list[Failure]]:
    """Every case, model and dtype for one target; each distinct compiled kernel once."""
    target = TARGETS[target_name]
    drv = CompileOnlyDriver(device, GPUTarget("cuda", target.arch, 32), target.max_shared_mem)
    triton_driver.set_active(drv)
    rows: list[Row] = []
    failures: list[Failure] = []
    seen: set[str] = set()
    for dtype_name in dtypes:
        for model in MODELS:
            for case in CASES:
                start = len(drv.launched)
                try:
                    case.launch(model, DTYPES[dtype_name], target)
                except Exception as e:  # a compile failure is a result, reported with the others
                    failures.append(Failure(case.name, model.name, target_name, dtype_name, error_text(e)))
                # the kernels launched before any failure still count
                for kernel in drv.launched[start:]:
                    if kernel.hash in seen:
                        continue
                    seen.add(kernel.hash)
                    try:
                        regs, spill_st, spill_ld = ptxas_usage(ptxas, kernel.asm["ptx"], target_name)
                    except RuntimeError as e:
                        failures.append(Failure(case.name, model.name, target_name, dtype_name, error_text(e)))
                        continue
                    md = kernel.metadata
                    rows.append(Row(
                        kernel.name, case.name, model.name, target_name, dtype_name,
                        model.head_dim if case.has_head_dim else None,
                        md.num_warps, md.num_stages, md.shared, regs, spill_st, spill_ld,
                        mma_kind(kernel), constexpr_summary(kernel),
                    ))
    return rows, failures


def launch_settings(targets: Sequence[str], dtypes: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """What the launchers choose per target: extend attention's tiles and warps per
    dtype and head dim, and the decode split count per batch size for each model (the
    count a CUDA graph of that bucket records: page table as wide as the context)."""
    from plait.kernels.decode_attention import decode_num_splits
    from plait.kernels.extend_attention import extend_launch_settings

    head_dims = sorted({m.head_dim for m in MODELS})
    extend = [{"target": t, "dtype": d, "head_dim": hd, **extend_launch_settings(TARGETS[t].arch, DTYPES[d], hd)._asdict()}
              for t in targets for d in dtypes for hd in head_dims]
    decode = [{"target": t, "sm_count": TARGETS[t].sm_count, "model": m.name, "kv_heads": m.kv_heads,
               "context": m.context, "batches": list(SPLIT_BATCHES),
               "splits": [decode_num_splits(b, m.kv_heads, TARGETS[t].sm_count, m.context) for b in SPLIT_BATCHES]}
              for t in targets for m in MODELS]
    return {"extend": extend, "decode": decode}


def print_settings(settings: dict[str, list[dict[str, Any]]]) -> None:
    print("launch settings the launchers choose:")
    for e in settings["extend"]:
        print(f"  extend {e['target']} {e['dtype']} head_dim={e['head_dim']}: BLOCK_M={e['block_m']} "
              f"BLOCK_N={e['block_n']} num_warps={e['num_warps']}")
    for d in settings["decode"]:
        print(f"  decode splits {d['target']} ({d['sm_count']} SMs) {d['model']} ({d['kv_heads']} KV heads, "
              f"context {d['context']}), batch " + " ".join(f"{b}:{n}" for b, n in zip(d["batches"], d["splits"])))


def print_table(rows: list[Row]) -> None:
    cols = ["kernel", "case", "model", "target", "dtype", "head_dim", "warps", "stages",
            "regs", "spill st/ld B", "smem B", "MMA", "constexprs"]
    cells = [[r.kernel, r.case, r.model, r.target, r.dtype, "-" if r.head_dim is None else str(r.head_dim),
              str(r.num_warps), str(r.num_stages), str(r.registers), f"{r.spill_stores}/{r.spill_loads}",
              str(r.shared_bytes), r.mma, r.constexprs] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def parse_targets(text: str) -> list[str]:
    # each once: a target's driver and the JIT's caches for it are made once per process
    targets = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    unknown = [t for t in targets if t not in TARGETS]
    if not targets or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown target(s) {unknown or text!r}; allowed: {', '.join(TARGETS)} (comma-separated)")
    return targets


def parse_dtypes(text: str) -> list[str]:
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if not dtypes or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown dtype(s) {unknown or text!r}; allowed: {', '.join(DTYPES)} (comma-separated)")
    return dtypes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=parse_targets, default=list(TARGETS),
                        help=f"comma-separated CUDA targets (default: {','.join(TARGETS)})")
    parser.add_argument("--dtypes", type=parse_dtypes, default=list(DTYPES),
                        help=f"comma-separated tensor dtypes (default: {','.join(DTYPES)})")
    parser.add_argument("--ptxas", default=default_ptxas(),
                        help="ptxas binary for the register/spill report (default: the one Triton uses, "
                             "its bundled one unless TRITON_PTXAS_PATH says otherwise)")
    parser.add_argument("--report-only", action="store_true",
                        help="report spills without failing on them; fail only on compile failures")
    parser.add_argument("--json", help="also write the rows and failures to this file")
    args = parser.parse_args(argv)

    if _triton.INTERPRET:
        print("Triton was imported under its interpreter; nothing can be compiled", file=sys.stderr)
        return 1
    if not args.ptxas or not Path(args.ptxas).is_file():
        print(f"--ptxas: no ptxas binary at {args.ptxas!r}", file=sys.stderr)
        return 2
    ptxas_ver = ptxas_version(args.ptxas)
    print(f"machine: {platform.machine()} {platform.system()}, python {platform.python_version()}, "
          f"triton {triton.__version__}, torch {torch.__version__}, ptxas {ptxas_ver} ({args.ptxas}), "
          f"CUDA device: {'yes' if torch.cuda.is_available() else 'none (compile only)'}")

    settings = launch_settings(args.targets, args.dtypes)
    print_settings(settings)
    t0 = time.time()
    expected = discover_kernels()
    rows: list[Row] = []
    failures: list[Failure] = []
    # device ids: the index in TARGETS, so a target keeps its id whatever --targets says
    for target in args.targets:
        target_rows, target_failures = compile_target(target, list(TARGETS).index(target), args.ptxas, args.dtypes)
        rows += target_rows
        failures += target_failures
        compiled = {r.kernel for r in target_rows}
        failures += [Failure("-", "-", target, ",".join(args.dtypes), f"{name} was compiled by no case")
                     for name in expected if name not in compiled]
    print_table(rows)
    print(f"{len(rows)} kernels compiled in {time.time() - t0:.0f} s; kernels of plait.kernels: {', '.join(expected)}")

    spills = [r for r in rows if r.spills]
    for r in spills:
        print(f"SPILL: {r.kernel} ({r.case}, {r.model}) {r.target} {r.dtype} head_dim={r.head_dim or '-'} "
              f"num_warps={r.num_warps} num_stages={r.num_stages} {r.constexprs}: "
              f"{r.spill_stores} B stores / {r.spill_loads} B loads, {r.registers} registers")
    for r in rows:
        if r.target == "sm_90a" and r.mma in ("mma.sync", "fma"):
            why = "dots on mma.sync" if r.mma == "mma.sync" else "fp32 ieee dots on FMA, no MMA"
            print(f"NO WGMMA at sm_90a: {r.kernel} {r.dtype} head_dim={r.head_dim or '-'}: {why} "
                  f"(num_warps={r.num_warps}, {r.constexprs})")
    for f in failures:
        where = f"{f.target} {f.dtype}" + ("" if f.case == "-" else f" {f.case} ({f.model})")
        print(f"COMPILE FAILURE: {where}: " + f.error.replace("\n", "\n    "))

    if args.json:
        Path(args.json).write_text(json.dumps({
            "triton": triton.__version__, "torch": torch.__version__, "ptxas": ptxas_ver,
            "kernels": expected, "settings": settings,
            "rows": [asdict(r) for r in rows], "failures": [asdict(f) for f in failures],
        }, indent=1))

    bf16_spills = [r for r in spills if r.dtype == "bfloat16"]
    if failures:
        print(f"FAILED: {len(failures)} compile failure(s)")
        return 1
    if bf16_spills and not args.report_only:
        print(f"FAILED: {len(bf16_spills)} kernel(s) spill at bfloat16 (--report-only reports without failing)")
        return 1
    print("OK" + (f" (report only: {len(spills)} spilling kernel(s))" if spills else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
