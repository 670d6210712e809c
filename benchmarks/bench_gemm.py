"""float32 CPU GEMMs over a model's stack of projections: plait's native kernel
(plait.kernels.gemm_cpu, with and without its software prefetch) against oneDNN's packed
GEMM (the engine's previous default) and F.linear (MKL), per row count.

The weights are those of SmolLM2-135M's shape (30 layers: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; 381 MB in float32) with random values, every layer's
four projections run in turn, so each call reads its weight from memory as a forward
step does (a single weight timed alone stays in cache and hides the read). Rows: a
decode batch (1-8), a decode batch plus a prefill chunk (16-128), prefill (512-2048).
Median of --repeats passes. ``--isa avx2`` runs the native AVX2 path on an AVX-512
CPU; set ``ONEDNN_MAX_CPU_ISA=AVX2`` for oneDNN's AVX2 path alike.

    python benchmarks/bench_gemm.py --num-threads 2
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_gemm.py --num-threads 2 --isa avx2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_line  # noqa: E402

from plait.kernels import gemm_cpu  # noqa: E402
from plait.runtime.models.linear import onednn_gemm_available, pack_weight, packed_linear  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's projections [out, in]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rows", default="1,8,16,40,64,128,512,2048")
    ap.add_argument("--isa", choices=["avx512", "avx2"], default=None, help="native path (default: this CPU's)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-mkl", action="store_true", help="skip F.linear")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    isa = args.isa or gemm_cpu.choose_isa()
    if isa is None or not gemm_cpu.available():
        sys.exit(f"no native GEMM here: {gemm_cpu.build_error() or 'no AVX2+FMA / AVX-512F'}")
    print(f"machine: {machine_line(args.num_threads)}")
    print(f"native path {isa}; oneDNN max ISA {os.environ.get('ONEDNN_MAX_CPU_ISA', 'default')}; "
          f"{args.layers} layers of {SHAPES} (float32, random)")
    torch.manual_seed(0)
    raw = [[torch.randn(*s) for s in SHAPES] for _ in range(args.layers)]
    systems = {"native": [[gemm_cpu.pack(w) for w in ws] for ws in raw]}
    if onednn_gemm_available():
        systems["oneDNN"] = [[pack_weight(w) for w in ws] for ws in raw]
    if args.no_mkl:
        del raw

    def run(name: str, rows: int) -> float:
        xs = {k: torch.randn(rows, k) for k in {s[1] for s in SHAPES}}
        t = time.perf_counter()
        if name.startswith("native"):
            pf = None if name == "native" else False  # None: the kernel's policy (PREFETCH_MIN_ROWS)
            for layer in systems["native"]:
                for p in layer:
                    gemm_cpu.linear(xs[p.in_features], p, None, isa=isa, prefetch=pf)
        elif name == "oneDNN":
            for layer in systems["oneDNN"]:
                for p, s in zip(layer, SHAPES):
                    packed_linear(xs[s[1]], p, None)
        else:
            for layer in raw:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)
        return (time.perf_counter() - t) * 1e3

    names = ["native", "native, no prefetch"] + [n for n in ("oneDNN",) if n in systems] + ([] if args.no_mkl else ["F.linear (MKL)"])
    print("| rows | " + " | ".join(f"{n} ms" for n in names) + " | oneDNN / native |")
    print("|---:|" + "---:|" * (len(names) + 1))
    for rows in [int(r) for r in args.rows.split(",")]:
        med = {}
        for n in names:
            run(n, rows)
            med[n] = statistics.median(run(n, rows) for _ in range(args.repeats))
        ratio = f"{med['oneDNN'] / med['native']:.2f}x" if "oneDNN" in med else "n/a"
        print(f"| {rows} | " + " | ".join(f"{med[n]:.1f}" for n in names) + f" | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
