"""Where a decode step's sampling time goes, on any device: the sampler alone, on
random logits over SmolLM2's vocabulary (49152), at batch sizes 1/16/64/256.

Per batch size and setting (greedy; temperature only; temperature + top-k 50 + top-p
0.9; the same with a frequency penalty of 0.3), the mean milliseconds of one
``Sampler.sample`` call (each request's output grows by one token per call, as in
decoding, so the penalty counts update as they do in a run), and its parts, each timed
alone with the device synchronized around it: the penalties, the filters (temperature,
top-k, top-p: ``_probs``) and the draw (uniforms and ``inverse_cdf``). With
``--top-p-ways`` the top-p filter is timed both ways on the device: a sort of the whole
vocabulary, or a partial top-k of ``NUCLEUS_CANDIDATES`` first (the CPU's way; it adds
one host check per step). ``--profile SETTING:BATCH`` prints torch profiler's table
for five such calls (on CUDA the ``cudaLaunchKernel`` count and the GPU time against
the CPU time show whether the sampler is bound by kernel launches).

    python benchmarks/bench_sampler.py [--device cuda] [--batches 1,16,64,256] [--iters 50] [--top-p-ways]
                                       [--profile top-k+top-p+penalty:1]

Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_line  # noqa: E402

from plait.runtime import sampler as sampler_mod  # noqa: E402
from plait.runtime.request import Req  # noqa: E402
from plait.runtime.sampler import Sampler, inverse_cdf  # noqa: E402
from plait.runtime.sampling_params import SamplingParams  # noqa: E402

VOCAB = 49152
SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top-k+top-p": {"temperature": 0.8, "top_k": 50, "top_p": 0.9},
    "top-k+top-p+penalty": {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "frequency_penalty": 0.3},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_reqs(batch: int, params: dict[str, Any], g: torch.Generator) -> list[Req]:
    reqs = []
    for i in range(batch):
        r = Req(f"r{i}", torch.randint(3, VOCAB, (128,), generator=g).tolist(), SamplingParams(**params), seed=i)
        r.set_output(torch.randint(3, VOCAB, (32,), generator=g).tolist())
        r.row = i
        reqs.append(r)
    return reqs


def time_ms(fn: Callable[[], Any], device: torch.device, iters: int, before: Callable[[], Any] | None = None) -> float:
    total = 0.0
    for _ in range(iters):
        if before is not None:
            before()
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        total += time.perf_counter() - t
    return 1e3 * total / iters


def bench(device: torch.device, batch: int, name: str, iters: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(batch)
    reqs = make_reqs(batch, SETTINGS[name], g)
    sampler = Sampler(batch, device, eos_ids=[2])
    base = (torch.randn(batch, VOCAB, generator=g) * 4).to(device)
    logits = base.clone()

    def fresh() -> None:
        logits.copy_(base)
        for r in reqs:
            r.append_token(int(torch.randint(3, VOCAB, (1,), generator=g)))

    def whole() -> None:
        sampler.sample(logits, reqs)

    for _ in range(3):  # warm-up: allocations, penalty rows, kernels
        fresh()
        whole()
    row = {"sample": time_ms(whole, device, iters, fresh)}
    row["penalties"] = time_ms(lambda: sampler.penalties.apply(logits, reqs), device, iters, fresh)
    sampled = [i for i, r in enumerate(reqs) if not r.params.is_greedy]
    if sampled:
        row["filters"] = time_ms(lambda: sampler._probs(logits, reqs, sampled), device, iters, fresh)
        _, probs, _ = sampler._probs(logits, reqs, sampled)

        def draw() -> None:
            inverse_cdf(probs, sampler._uniform(reqs, sampled, [0] * len(sampled)))

        row["draw"] = time_ms(draw, device, iters)
    return row


def profile(device: torch.device, batch: int, name: str) -> None:
    """torch profiler's table (self CPU time first) for 5 ``Sampler.sample`` calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    g = torch.Generator().manual_seed(batch)
    reqs = make_reqs(batch, SETTINGS[name], g)
    sampler = Sampler(batch, device, eos_ids=[2])
    base = (torch.randn(batch, VOCAB, generator=g) * 4).to(device)
    for _ in range(3):
        sampler.sample(base.clone(), reqs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(5):
            for r in reqs:
                r.append_token(int(torch.randint(3, VOCAB, (1,), generator=g)))
            sampler.sample(base.clone(), reqs)
    print(f"profile of 5 calls, {name} at batch {batch}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--top-p-ways", action="store_true", help="time top-p by full sort and by partial top-k")
    ap.add_argument("--profile", metavar="SETTING:BATCH", help="print torch profiler's table for one call")
    args = ap.parse_args()
    device = torch.device(args.device)
    print(machine_line())
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    if args.profile:
        name, batch = args.profile.rsplit(":", 1)
        profile(device, int(batch), name)
        return
    ways = [("default", set(sampler_mod.PARTIAL_TOP_P_DEVICES))]
    if args.top_p_ways:
        ways = [("sort", set()), ("partial top-k", {device.type})]
    print(f"{'setting':<22} {'batch':>5} {'top-p way':<14} {'sample ms':>9} {'penalties':>9} {'filters':>8} {'draw':>7}")
    for name in SETTINGS:
        for batch in (int(b) for b in args.batches.split(",")):
            for way, devices in ways if "top-p" in name else ways[:1]:
                sampler_mod.PARTIAL_TOP_P_DEVICES = devices
                r = bench(device, batch, name, args.iters)
                print(f"{name:<22} {batch:>5} {way if 'top-p' in name else '-':<14} {r['sample']:>9.3f} "
                      f"{r['penalties']:>9.3f} {r.get('filters', 0.0):>8.3f} {r.get('draw', 0.0):>7.3f}", flush=True)


if __name__ == "__main__":
    main()
