"""Prefix-cache benchmarks on one engine (in process, the default model unless --model).

    python benchmarks/bench_cache.py [--part tier|modes|eviction|all] [--threads 2]

1. ``tier``: multi-turn conversations whose working set is 4x the device KV pool;
   time to first token and prefill tokens computed, host-memory tier off and on
   (``enable_hierarchical_cache``): one request at a time, then each turn's requests
   all at once (4 run, the rest wait), with the prefetch of waiting requests'
   host-held prefixes off and on (``hicache_prefetch_policy``).
2. ``modes``: token-level radix (page 1), radix at page 16 and vLLM-style block hashing
   (page 16) on partial-overlap workloads (few-shot with varying example counts,
   multi-turn chat, RAG with shared documents in different orders): reuse (tokens hit
   / tokens queried) and throughput.
3. ``eviction``: lru, lfu and cost on a multi-tenant workload with Zipf-skewed prefix
   popularity and a pool that holds a few of the prefixes: hit rate and throughput.

Timings are reported, never asserted. Run on a quiet machine: another busy process
collapses GEMM throughput.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_line  # noqa: E402  (benchmarks/machine.py)

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 1) for _ in range(n)]


def _engine(model: str | None, threads: int, **options: Any) -> Any:
    from plait.runtime import Engine

    return Engine(model, num_threads=threads, **options)


def _timed(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[dict[str, Any]]]:
    t = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": new_tokens})
    return time.perf_counter() - t, outs if isinstance(outs, list) else [outs]


# -- 1. the host tier -------------------------------------------------------------------------------
def bench_tier(args: argparse.Namespace) -> None:
    pool = args.pool_tokens
    convs, turn_tokens, turns = 8, pool // 8, 4  # after the first turns the working set is ~4x the pool
    print(f"\n## 1. host-memory tier: {convs} conversations x {turns} turns of {turn_tokens} new tokens, "
          f"device pool {pool} tokens")
    print("| tier | mean TTFT ms (turns 2+) | p90 TTFT ms | prefill tokens computed | loaded from host |")
    print("|---|---|---|---|---|")
    for tier in (False, True):
        rng = random.Random(0)
        with _engine(args.model, args.threads, kv_cache_tokens=pool, enable_hierarchical_cache=tier,
                     hicache_ratio=8.0, max_running_requests=4) as e:
            vocab = e.model_config.vocab_size
            history = [_ids(rng, turn_tokens, vocab) for _ in range(convs)]
            ttfts = []
            for turn in range(turns):
                for c in range(convs):
                    if turn:
                        history[c] = history[c] + _ids(rng, turn_tokens // 4, vocab)
                    dt, (out,) = _timed(e, [history[c]], 1)  # one token: the time to the first
                    if turn:
                        ttfts.append(dt)
                    history[c] = history[c] + out["output_ids"]
            st = e.stats()
            ttfts.sort()
            print(f"| {'on' if tier else 'off'} | {1e3 * sum(ttfts) / len(ttfts):.0f} | "
                  f"{1e3 * ttfts[int(0.9 * (len(ttfts) - 1))]:.0f} | {e.scheduler.prefill_tokens_computed} | "
                  f"{st['hicache_loaded_tokens']} |")
    print("\nEach turn's requests at once (4 running, the others waiting):\n")
    print("| tier | prefetch | mean TTFT ms (turns 2+) | p90 TTFT ms | turns 2+ s | prefill tokens computed | "
          "loaded from host | of which prefetched |")
    print("|---|---|---|---|---|---|---|---|")
    for tier, prefetch in ((False, "off"), (True, "off"), (True, "best_effort")):
        rng = random.Random(0)
        with _engine(args.model, args.threads, kv_cache_tokens=pool, enable_hierarchical_cache=tier,
                     hicache_ratio=8.0, max_running_requests=4, hicache_prefetch_policy=prefetch) as e:
            vocab = e.model_config.vocab_size
            history = [_ids(rng, turn_tokens, vocab) for _ in range(convs)]
            ttfts, wall = [], 0.0
            for turn in range(turns):
                if turn:
                    history = [h + _ids(rng, turn_tokens // 4, vocab) for h in history]
                t0 = time.perf_counter()
                reqs = [e.add_request(h, {**GREEDY, "max_new_tokens": 1})[0] for h in history]
                first: dict[str, float] = {}
                while e.has_work():
                    e.step()
                    now = time.perf_counter()
                    for r in reqs:
                        if r.output_len and r.rid not in first:
                            first[r.rid] = now - t0
                if turn:
                    ttfts += list(first.values())
                    wall += time.perf_counter() - t0
                history = [h + e.pop_result(r)["output_ids"] for h, r in zip(history, reqs)]
            st = e.stats()
            ttfts.sort()
            print(f"| {'on' if tier else 'off'} | {prefetch if tier else '-'} | {1e3 * sum(ttfts) / len(ttfts):.0f} | "
                  f"{1e3 * ttfts[int(0.9 * (len(ttfts) - 1))]:.0f} | {wall:.2f} | {e.scheduler.prefill_tokens_computed} | "
                  f"{st['hicache_loaded_tokens']} | {st['hicache_prefetched_tokens']} |")


# -- 2. radix vs block hash ------------------------------------------------------------------------
def _few_shot(rng: random.Random, vocab: int) -> list[list[int]]:
    header, shots = _ids(rng, 60, vocab), [_ids(rng, 45, vocab) for _ in range(8)]
    return [header + [t for s in shots[:k] for t in s] + _ids(rng, 20, vocab) for k in range(1, 9) for _ in range(2)]


def _chat(rng: random.Random, vocab: int) -> list[list[int]]:
    out = []
    for _ in range(4):
        conv = _ids(rng, 50, vocab)
        for _ in range(4):
            conv = conv + _ids(rng, 37, vocab)  # turns end anywhere in a page
            out.append(list(conv))
    return out


def _rag(rng: random.Random, vocab: int) -> list[list[int]]:
    system, docs = _ids(rng, 40, vocab), [_ids(rng, 90, vocab) for _ in range(5)]
    out = []
    for _ in range(16):
        picked = rng.sample(range(5), 3)
        out.append(system + [t for i in picked for t in docs[i]] + _ids(rng, 15, vocab))
    return out


def bench_modes(args: argparse.Namespace) -> None:
    print("\n## 2. radix vs block hash (reuse = tokens hit / tokens queried)")
    print("| workload | radix page 1 | radix page 16 | block_hash page 16 | tok/s radix p1 / p16 / block |")
    print("|---|---|---|---|---|")
    modes = [("radix", 1), ("radix", 16), ("block_hash", 16)]
    for name, make in (("few-shot (1-8 examples)", _few_shot), ("multi-turn chat", _chat),
                       ("RAG (docs in any order)", _rag)):
        reuse, speed = [], []
        for mode, ps in modes:
            with _engine(args.model, args.threads, kv_cache_tokens=65536, page_size=ps, prefix_cache_mode=mode) as e:
                prompts = make(random.Random(1), e.model_config.vocab_size)
                t = time.perf_counter()
                for p in prompts:  # one at a time: each sees everything cached before it
                    _timed(e, [p], 4)
                dt = time.perf_counter() - t
                reuse.append(e.cache.hit_tokens / max(e.cache.queried_tokens, 1))
                speed.append(sum(len(p) + 4 for p in prompts) / dt)
        print(f"| {name} | {reuse[0]:.3f} | {reuse[1]:.3f} | {reuse[2]:.3f} | "
              f"{speed[0]:.0f} / {speed[1]:.0f} / {speed[2]:.0f} |")


# -- 3. eviction policies --------------------------------------------------------------------------
def bench_eviction(args: argparse.Namespace) -> None:
    tenants, prefix_len, requests = 24, 240, args.eviction_requests
    pool = prefix_len * 6
    print(f"\n## 3. eviction: {tenants} tenant prompts of {prefix_len} tokens, Zipf(1.1) popularity, "
          f"{requests} requests, pool {pool} tokens (~6 prompts)")
    print("| policy | hit rate | tok/s |")
    print("|---|---|---|")
    weights = [1 / (k + 1) ** 1.1 for k in range(tenants)]
    for policy in ("lru", "lfu", "cost"):
        rng = random.Random(2)
        with _engine(args.model, args.threads, kv_cache_tokens=pool, eviction_policy=policy,
                     max_running_requests=2) as e:
            vocab = e.model_config.vocab_size
            prefixes = [_ids(rng, prefix_len - rng.randrange(0, 120), vocab) for _ in range(tenants)]
            t, tokens = time.perf_counter(), 0
            for _ in range(requests):
                p = prefixes[rng.choices(range(tenants), weights)[0]] + _ids(rng, 12, vocab)
                _timed(e, [p], 2)
                tokens += len(p) + 2
            dt = time.perf_counter() - t
            print(f"| {policy} | {e.cache.hit_tokens / max(e.cache.queried_tokens, 1):.3f} | {tokens / dt:.0f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--part", choices=("tier", "modes", "eviction", "all"), default="all")
    ap.add_argument("--pool-tokens", type=int, default=2048, help="part 1: the device KV pool")
    ap.add_argument("--eviction-requests", type=int, default=150)
    args = ap.parse_args(argv)
    print("machine:", machine_line(args.threads))
    if args.part in ("tier", "all"):
        bench_tier(args)
    if args.part in ("modes", "all"):
        bench_modes(args)
    if args.part in ("eviction", "all"):
        bench_eviction(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
