"""Offline throughput of the in-process Engine against Hugging Face transformers.

Workloads (token ids drawn at random from the vocabulary, as SGLang's `random` and
`generated-shared-prefix` datasets do; outputs use ignore_eos so lengths are exact):
  (a) random:  N requests, inputs U[in_min, in_max], outputs U[out_min, out_max]
  (b) shared:  G groups x P prompts: a long system prompt per group + a short question
  (c) the same as (b) with the radix cache disabled

The peer, in the same process with the same weights, dtype and threads: transformers
`generate` with static batching (requests taken in order, left-padded, each batch run
until its longest output). Prints a table; asserts nothing.

    python benchmarks/bench_offline.py [--threads 2] [--quick] [--breakdown]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import torch


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)

    def unique_prompt_tokens(self) -> int:
        """Tokens of the prompts' prefix tree (what a perfect cache computes)."""
        seen: set[tuple[int, ...]] = set()
        for p in self.prompts:
            for i in range(1, len(p) + 1):
                seen.add(tuple(p[:i]))
        return len(seen)


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def random_workload(n: int, in_rng: tuple[int, int], out_rng: tuple[int, int], seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prompts = [random_ids(rng, rng.randint(*in_rng)) for _ in range(n)]
    outputs = [rng.randint(*out_rng) for _ in range(n)]
    return Workload("(a) random", prompts, outputs)


def shared_prefix_workload(groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                           seed: int = 1) -> Workload:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = random_ids(rng, system_len)
        prompts += [system + random_ids(rng, question_len) for _ in range(per_group)]
    # arrival order interleaves the groups, as independent users would
    order = list(range(len(prompts)))
    rng.shuffle(order)
    return Workload("(b) shared prefix", [prompts[i] for i in order], [output_len] * len(prompts))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_plait(engine, wl: Workload) -> dict:
    sched, cache = engine.scheduler, engine.cache
    p0, q0, h0 = sched.prefill_tokens_computed, cache.queried_tokens, cache.hit_tokens
    params = [{"max_new_tokens": o, "temperature": 0.0, "ignore_eos": True} for o in wl.outputs]
    t = time.perf_counter()
    outs = engine.generate(input_ids=wl.prompts, sampling_params=params)
    dt = time.perf_counter() - t
    assert sum(len(o["output_ids"]) for o in outs) == wl.output_tokens
    log(f"plait {wl.name}: {dt:.1f} s")
    queried = cache.queried_tokens - q0
    return {
        "seconds": dt,
        "prefill_computed": sched.prefill_tokens_computed - p0,
        "hit_rate": (cache.hit_tokens - h0) / queried if queried else 0.0,
    }


def run_hf(model, wl: Workload, batch_size: int) -> dict:
    t = time.perf_counter()
    computed = 0
    for i in range(0, len(wl.prompts), batch_size):
        prompts, outs = wl.prompts[i : i + batch_size], wl.outputs[i : i + batch_size]
        width = max(map(len, prompts))
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(prompts):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        n = max(outs)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        computed += ids.numel()
    dt = time.perf_counter() - t
    log(f"HF {wl.name}: {dt:.1f} s")
    return {"seconds": dt, "prefill_computed": computed, "hit_rate": 0.0}


class Breakdown:
    """Wall time of plait's forward by part (GEMMs by row count, LM head, extend and
    decode attention), by wrapping the modules' methods; the rest of a step is what
    remains of the total. Costs a few timer calls per op: for explaining, not timing."""

    def __init__(self, attn_cls: type) -> None:
        self.attn_cls = attn_cls  # the engine's attention backend class
        self.parts: dict[str, float] = {}
        self.flops: dict[str, float] = {}
        self._undo: list = []

    def _wrap(self, owner, name: str, label, flops=None) -> None:
        orig = getattr(owner, name)

        def timed(obj, *args):
            t = time.perf_counter()
            out = orig(obj, *args)
            key = label(obj, *args)
            self.parts[key] = self.parts.get(key, 0.0) + time.perf_counter() - t
            if flops is not None:
                self.flops[key] = self.flops.get(key, 0.0) + flops(obj, *args)
            return out

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def __enter__(self) -> "Breakdown":
        from plait.runtime.models.linear import Linear
        from plait.runtime.models.llama import CausalLM

        def rows(x):
            m = x.shape[0]
            return "GEMM, decode-sized (<= 64 rows)" if m <= 64 else "GEMM, prefill-sized (> 64 rows)"

        self._wrap(Linear, "forward", lambda mod, x: rows(x),
                   lambda mod, x: 2 * x.shape[0] * mod.in_features * mod.out_features)
        self._wrap(CausalLM, "compute_logits", lambda m, h: "LM head",
                   lambda m, h: 2 * h.shape[0] * m.config.vocab_size * m.config.hidden_size)
        self._wrap(self.attn_cls, "forward_extend", lambda *a: "attention, extend")
        self._wrap(self.attn_cls, "forward_decode", lambda *a: "attention, decode")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)

    def report(self, total: float) -> str:
        lines = []
        for key in sorted(self.parts, key=self.parts.get, reverse=True):
            rate = f", {self.flops[key] / self.parts[key] / 1e9:.0f} GFLOP/s" if key in self.flops else ""
            lines.append(f"  {key}: {self.parts[key]:.1f} s{rate}")
        lines.append(f"  everything else: {total - sum(self.parts.values()):.1f} s")
        return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="plait model: a folder, a .gguf, a hub id or a named model such as gemma3-270m "
                                                "(default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quick", action="store_true", help="a small version of every workload")
    # 32 was transformers' fastest on workload (a) in a sweep of 8/16/32/64 (README)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--breakdown", action="store_true",
                    help="only run (a) on plait and print where its time goes")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"],
                    help="plait's attention backend; with auto, (a) also runs with the torch backend to show the "
                         "native decode kernel's share")
    ap.add_argument("--cpu-gemm", default="auto", choices=["auto", "native", "onednn", "torch"],
                    help="plait's EngineConfig.cpu_gemm; with auto, (a) also runs with oneDNN's (when auto is native) and torch's GEMMs to show their share")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.quick:
        wl_a = random_workload(16, (32, 128), (16, 64))
        wl_b = shared_prefix_workload(2, 8, 256, 16, 16)
    else:
        wl_a = random_workload(64, (32, 512), (32, 256))
        wl_b = shared_prefix_workload(4, 16, 512, 32, 32)

    from plait.runtime import Engine
    from plait.runtime.attention.cpu_backend import CpuAttentionBackend
    from plait.runtime.model_loader import resolve_model

    common = dict(num_threads=args.threads, kv_cache_tokens=65536, max_running_requests=128, cpu_gemm=args.cpu_gemm,
                  attention_backend=args.attention_backend)
    if args.breakdown:
        with Engine(args.model, **common) as engine:
            run_plait(engine, random_workload(4, (16, 32), (4, 8), seed=99))  # warm-up
            with Breakdown(type(engine.runner.attn)) as bd:
                res = run_plait(engine, wl_a)
        print(f"(a) plait: {res['seconds']:.1f} s\n{bd.report(res['seconds'])}")
        return
    rows = []
    with Engine(args.model, **common) as engine:
        run_plait(engine, random_workload(4, (16, 32), (4, 8), seed=99))  # warm-up
        res_a = run_plait(engine, wl_a)
        engine.flush_cache()
        res_b = run_plait(engine, wl_b)
        # plait's own parts switched off one at a time on (a), to show what each brings
        ablations = []
        if args.attention_backend == "auto" and isinstance(engine.runner.attn, CpuAttentionBackend):
            ablations.append(("attention_backend", "torch"))
        if args.cpu_gemm == "auto" and engine.config.resolved_cpu_gemm() in ("native", "onednn"):
            if engine.config.resolved_cpu_gemm() == "native":
                ablations.append(("cpu_gemm", "onednn"))
            ablations.append(("cpu_gemm", "torch"))
    with Engine(args.model, disable_radix_cache=True, **common) as engine:
        run_plait(engine, random_workload(4, (16, 32), (4, 8), seed=99))
        res_c = run_plait(engine, wl_b)
    res_ablations = []
    for field, value in ablations:
        with Engine(args.model, **{**common, field: value}) as engine:
            run_plait(engine, random_workload(4, (16, 32), (4, 8), seed=99))
            res_ablations.append((f"{field}={value}", run_plait(engine, wl_a)))

    res_hf_a = res_hf_b = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        src = resolve_model(args.model)
        if src.kind == "gguf":
            hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path),
                                                      dtype=torch.float32)
        else:
            hf = AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.float32)
        hf.eval()
        run_hf(hf, random_workload(4, (16, 32), (4, 8), seed=99), 4)  # warm-up
        res_hf_a = run_hf(hf, wl_a, args.hf_batch_size)
        res_hf_b = run_hf(hf, wl_b, args.hf_batch_size)

    def row(label: str, wl: Workload, res: dict, ref: dict | None) -> list[str]:
        out_tps = wl.output_tokens / res["seconds"]
        tot_tps = (wl.input_tokens + wl.output_tokens) / res["seconds"]
        ratio = f"{ref['seconds'] / res['seconds']:.2f}x" if ref else "-"
        return [label, f"{res['seconds']:.1f}", f"{out_tps:.1f}", f"{tot_tps:.1f}", ratio,
                f"{res['prefill_computed']}", f"{wl.unique_prompt_tokens()}", f"{res['hit_rate']:.2f}"]

    rows.append(row("(a) plait", wl_a, res_a, res_hf_a))
    for label, res in res_ablations:
        rows.append(row(f"(a) plait, {label}", wl_a, res, res_hf_a))
    if res_hf_a:
        rows.append(row(f"(a) HF static b={args.hf_batch_size}", wl_a, res_hf_a, None))
    rows.append(row("(b) plait, radix cache", wl_b, res_b, res_hf_b))
    rows.append(row("(c) plait, cache off", wl_b, res_c, res_hf_b))
    if res_hf_b:
        rows.append(row(f"(b) HF static b={args.hf_batch_size}", wl_b, res_hf_b, None))

    header = ["run", "seconds", "out tok/s", "total tok/s", "vs HF", "prefill computed", "unique prompt tok",
              "hit rate"]
    import transformers

    from machine import machine_line  # benchmarks/machine.py

    print(f"\nmachine: {machine_line(args.threads)}; transformers {transformers.__version__}; dtype float32, "
          f"model {args.model or 'SmolLM2-135M-Instruct (GGUF Q4_1, dequantized)'}")
    print(f"(a) {len(wl_a.prompts)} requests, {wl_a.input_tokens} input / {wl_a.output_tokens} output tokens")
    print(f"(b) {len(wl_b.prompts)} requests, {wl_b.input_tokens} input / {wl_b.output_tokens} output tokens")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print(f"\n(b) vs (c): plait with the radix cache is {res_c['seconds'] / res_b['seconds']:.2f}x faster end to end; "
          f"prefill computed / unique tokens = {res_b['prefill_computed'] / wl_b.unique_prompt_tokens():.3f}")


if __name__ == "__main__":
    main()
