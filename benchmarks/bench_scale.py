"""Scaling out on this CPU, in two parts (``--part tp|dp|all``):

1. ``tp``: tokens/s of tp_size=1 vs tp_size=2 (1 thread per rank by default; 3 on the
   default model, whose 9 heads 2 does not divide) on one batch
   of greedy requests, and where rank 0's step time goes: the share spent in collectives
   (all-reduce, broadcast, all-gather: waiting for the other rank included) against the
   rest of the step.
2. ``dp``: data-parallel routing. Two plait servers (one replica each, a KV pool that
   holds fewer of the workload's prefix groups than it has, all of them across both)
   behind SMG (``pip install smg``), with ``--policy cache_aware`` and then
   ``round_robin``, on a generated-shared-prefix workload sent with limited concurrency:
   prefix-cache hit rate (from the servers' /metrics counters) and throughput per policy,
   and the ratio of the hit rates (the target is cache_aware >= 1.5x round_robin).

    python benchmarks/bench_scale.py                     # both parts, the default model (SmolLM2-135M)
    python benchmarks/bench_scale.py --part tp --model ./folder --batch 8 --new-tokens 64
    python benchmarks/bench_scale.py --part dp --gsp-num-groups 8 --max-concurrency 4

Reports, never asserts. Run on a quiet machine: the numbers of a busy one say little.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import math
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import _tokenizer, extra_fields, plait_cache_counters, run_load, shared_prefix_dataset  # noqa: E402
from machine import machine_line  # noqa: E402  (benchmarks/machine.py)

from plait.runtime import Engine  # noqa: E402
from plait.runtime.server import launch  # noqa: E402

POLICIES = ("cache_aware", "round_robin")
SERVED_NAME = "scale"


class TimedPG:
    """A process group whose collectives are timed (start to completion, on rank 0)."""

    def __init__(self, pg: Any) -> None:
        self.pg, self.seconds, self.calls = pg, 0.0, 0

    def _timed(self, work: Any, t0: float) -> Any:
        work.wait()
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        return work

    def allreduce(self, tensors: list) -> Any:
        t0 = time.perf_counter()
        return self._timed(self.pg.allreduce(tensors), t0)

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        t0 = time.perf_counter()
        return self._timed(self.pg.broadcast(tensor, root), t0)

    def allgather(self, outs: list, ins: list) -> Any:
        t0 = time.perf_counter()
        return self._timed(self.pg.allgather(outs, ins), t0)


def run(model: str | None, tp: int, threads: int, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    with Engine(model, tp_size=tp, num_threads=threads, kv_cache_tokens=8192) as engine:
        timed = None
        if tp > 1:  # NOTE: benchmark-only instrumentation of the group every layer holds
            timed = TimedPG(engine._tp.group.pg)
            object.__setattr__(engine._tp.group, "pg", timed)
        sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
        engine.generate(input_ids=prompts[:1], sampling_params={**sp, "max_new_tokens": 2})  # warm-up
        if timed is not None:
            timed.seconds, timed.calls = 0.0, 0
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {"tokens_per_s": tokens / wall, "wall_s": wall,
            "collective_share": (timed.seconds / wall) if timed else 0.0, "collectives": timed.calls if timed else 0}


def default_tp_sizes(model: str | None) -> list[int]:
    """1 and the smallest size above 1 the model can be split into (3 for SmolLM2-135M's
    9 heads and 3 KV heads)."""
    from plait.runtime.model_loader import resolve_model
    from plait.runtime.models.parallel import check_tp

    mc = resolve_model(model).load_config()
    for size in range(2, 9):
        try:
            check_tp(mc, size)
        except ValueError:
            continue
        return [1, size]
    return [1]


def bench_tp(a: argparse.Namespace) -> None:
    a.tp = a.tp or default_tp_sizes(a.model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    print(f"\n== tensor parallel: batch {a.batch} x {a.prompt_len} prompt tokens, {a.new_tokens} new tokens, "
          f"{a.threads} thread(s) per rank")
    print(f"{'tp':>3} {'tokens/s':>10} {'wall s':>8} {'collectives':>12} {'share of wall':>14}")
    for tp in a.tp:
        r = run(a.model, tp, a.threads, prompts, a.new_tokens)
        print(f"{tp:>3} {r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} {r['collectives']:>12d} "
              f"{100 * r['collective_share']:>13.1f}%")


# -- data parallel: two servers behind SMG ------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    """``smg launch`` in front of ``workers`` with one routing ``policy``; ``close()``."""

    def __init__(self, smg: str, workers: list[str], policy: str) -> None:
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [smg, "launch", "--worker-urls", *workers, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(_free_port()), "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            self._wait_registered(len(workers))
        except BaseException:
            self.close()
            raise

    def _wait_registered(self, n: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"smg exited: {self.log.read().decode()[-2000:]}")
            try:
                r = httpx.get(self.url + "/workers", timeout=2)
                body = r.json() if r.status_code == 200 else {}
                workers = body.get("workers", body) if isinstance(body, dict) else body
                if sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True)) == n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"smg did not register {n} workers within {timeout_s:.0f} s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _counters(urls: list[str]) -> tuple[float, float]:
    """Prefix-cache hit and queried tokens summed over the servers."""
    got = [asyncio.run(plait_cache_counters(u, {})) for u in urls]
    if any(c is None for c in got):
        raise RuntimeError("a server's /metrics has no prefix-cache counters")
    return sum(c[0] for c in got), sum(c[1] for c in got)


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("plait_requests_total{"))


def bench_dp(a: argparse.Namespace) -> None:
    smg = shutil.which("smg")
    if smg is None:
        print("\n== data parallel: skipped (the smg gateway is not installed: pip install smg)")
        return
    tok = _tokenizer(a.model)
    reqs = shared_prefix_dataset(tok, a)
    groups = a.gsp_num_groups
    # a pool that holds a bit more than half the groups' system prompts: all of them fit in
    # two pools when each replica keeps its own half, not in one
    kv = a.dp_kv_tokens or (groups // 2 + 1) * a.gsp_system_prompt_len
    print(f"\n== data parallel: 2 servers x 1 replica behind smg {importlib.metadata.version('smg')}, "
          f"{a.threads} thread(s) each, KV pool {kv} tokens each (~{kv / a.gsp_system_prompt_len:.1f} of "
          f"{groups} prefix groups)")
    print(f"workload: {groups} groups x {a.gsp_prompts_per_group} prompts, {a.gsp_system_prompt_len}-token system "
          f"prompt + {a.gsp_question_len}-token question, {a.gsp_output_len} output tokens, shuffled; "
          f"{a.max_concurrency} in flight; {sum(r.prompt_len for r in reqs)} prompt tokens")
    opts = dict(num_threads=a.threads, kv_cache_tokens=kv, served_model_name=SERVED_NAME, echo_logs=False)
    extra = extra_fields("plait", tok)
    rows = []
    with launch(a.model, **opts) as s1, launch(a.model, **opts) as s2:
        urls = [s1.url, s2.url]
        for u in urls:  # one-time costs of each server, outside the measurements
            asyncio.run(run_load(u, SERVED_NAME, reqs[:1], math.inf, None, {}, extra, a.seed))
        for policy in a.policies:
            for u in urls:
                httpx.post(u + "/flush_cache", timeout=30).raise_for_status()
            before, served = _counters(urls), [_served(u) for u in urls]
            gw = Gateway(smg, urls, policy)
            try:
                results, wall = asyncio.run(run_load(gw.url, SERVED_NAME, reqs, math.inf, a.max_concurrency, {},
                                                     extra, a.seed))
            finally:
                gw.close()
            after = _counters(urls)
            ok = [r for r in results if r.ok]
            hit, queried = after[0] - before[0], after[1] - before[1]
            rows.append({"policy": policy, "hit_rate": hit / queried if queried else 0.0, "wall_s": wall,
                         "req_s": len(ok) / wall, "out_tok_s": sum(r.output_len for r in ok) / wall,
                         "failed": len(results) - len(ok),
                         "split": "/".join(f"{_served(u) - n:.0f}" for u, n in zip(urls, served))})
    print(f"{'policy':>12} {'cache hit':>10} {'req/s':>7} {'out tok/s':>10} {'wall s':>8} {'per server':>11} "
          f"{'failed':>7}")
    for r in rows:
        print(f"{r['policy']:>12} {100 * r['hit_rate']:>9.1f}% {r['req_s']:>7.2f} {r['out_tok_s']:>10.1f} "
              f"{r['wall_s']:>8.2f} {r['split']:>11} {r['failed']:>7}")
    by = {r["policy"]: r for r in rows}
    if "cache_aware" in by and "round_robin" in by:
        ca, rr = by["cache_aware"], by["round_robin"]
        ratio = ca["hit_rate"] / rr["hit_rate"] if rr["hit_rate"] else math.inf
        print(f"cache_aware / round_robin: hit rate {ratio:.2f}x (target >= 1.5x), throughput "
              f"{ca['req_s'] / rr['req_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--part", choices=("tp", "dp", "all"), default="all")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank (tp) / per server (dp)")
    ap.add_argument("--tp", type=int, nargs="+", default=None,
                    help="tp: tp sizes to compare (default: 1 and the smallest the model allows above 1)")
    ap.add_argument("--batch", type=int, default=8, help="tp: requests")
    ap.add_argument("--prompt-len", type=int, default=128, help="tp: prompt tokens per request")
    ap.add_argument("--new-tokens", type=int, default=32, help="tp: new tokens per request")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES), help="dp: SMG policies")
    ap.add_argument("--gsp-num-groups", type=int, default=8, help="dp: prefix groups")
    ap.add_argument("--gsp-prompts-per-group", type=int, default=8, help="dp: prompts sharing each prefix")
    ap.add_argument("--gsp-system-prompt-len", type=int, default=256, help="dp: tokens of each group's prefix")
    ap.add_argument("--gsp-question-len", type=int, default=16, help="dp: tokens after the prefix")
    ap.add_argument("--gsp-output-len", type=int, default=8, help="dp: output tokens per request")
    ap.add_argument("--dp-kv-tokens", type=int, default=None,
                    help="dp: KV pool of each server (default: room for half the groups' prefixes plus one)")
    ap.add_argument("--max-concurrency", type=int, default=4, help="dp: requests in flight")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args(argv)
    print("machine:", machine_line(a.threads))
    try:
        smg = importlib.metadata.version("smg")
    except importlib.metadata.PackageNotFoundError:
        smg = "not installed"
    print(f"smg {smg}, httpx {httpx.__version__}")
    if a.part in ("tp", "all"):
        bench_tp(a)
    if a.part in ("dp", "all"):
        bench_dp(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
