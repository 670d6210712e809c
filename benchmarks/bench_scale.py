"""Tensor parallel on this CPU: tokens/s of tp_size=1 vs tp_size=2 (1 thread per rank by
default) on one batch of greedy requests, and where rank 0's step time goes: the share
spent in collectives (all-reduce, broadcast, all-gather: waiting for the other rank
included) against the rest of the step.

    python benchmarks/bench_scale.py                     # the default model (SmolLM2-135M)
    python benchmarks/bench_scale.py --model ./folder --batch 8 --new-tokens 64

Reports, never asserts. Data-parallel routing (SMG cache_aware vs round_robin) is not
measured here yet.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from plait.runtime import Engine


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tp sizes to compare")
    ap.add_argument("--threads", type=int, default=1, help="threads per rank")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (a.prompt_len,), generator=g).tolist() for _ in range(a.batch)]
    print(f"batch {a.batch} x {a.prompt_len} prompt tokens, {a.new_tokens} new tokens, {a.threads} thread(s) per rank")
    print(f"{'tp':>3} {'tokens/s':>10} {'wall s':>8} {'collectives':>12} {'share of wall':>14}")
    for tp in a.tp:
        r = run(a.model, tp, a.threads, prompts, a.new_tokens)
        print(f"{tp:>3} {r['tokens_per_s']:>10.1f} {r['wall_s']:>8.2f} {r['collectives']:>12d} "
              f"{100 * r['collective_share']:>13.1f}%")


if __name__ == "__main__":
    main()
