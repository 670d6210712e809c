"""outlines-core vs llguidance on the same JSON Schemas, without a model: compile time
(outlines: schema -> regex + index build in the worker; llguidance: its JSON compiler
+ matcher build) and mask time per step along a random valid output (each step takes
a random allowed token, preferring ones that close the value after 60 tokens).

    python benchmarks/bench_grammar_backends.py [--walks 4]

Reports, never asserts. What ``grammar_backend=auto`` picks for JSON Schemas is
decided from these numbers (docs/constrained.md).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from constrained_cases import SCHEMAS  # noqa: E402

from plait.runtime.constrained.backend import Grammars  # noqa: E402
from plait.runtime.sampling_params import SamplingParams  # noqa: E402

KEY_HEAVY = {
    "type": "object",
    "properties": {k: {"type": "string", "maxLength": 20} for k in (
        "first_name", "last_name", "occupation", "city", "country", "employer", "title", "email", "phone")},
    "required": ["first_name", "last_name", "occupation", "city", "country", "employer", "title", "email", "phone"],
}
CLOSERS = [ord(c) for c in '"}]0']


def walk(matcher, vocab, rng: random.Random, cap: int = 60, limit: int = 400) -> tuple[list[float], bool]:
    """One random valid output; the seconds of each mask."""
    times = []
    for step in range(limit):
        t0 = time.perf_counter()
        mask = matcher.allowed(eos_ok=True)
        times.append(time.perf_counter() - t0)
        if matcher.is_final and (matcher.terminated or rng.random() < 0.3):
            return times, True
        ids = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
        ids = [int(i) for i in ids if vocab.token_bytes[i] is not None]
        if step > cap:
            for b in CLOSERS:
                close = [i for i in ids if vocab.token_bytes[i] == bytes([b])]
                if close:
                    ids = close
                    break
        if not ids:
            return times, False
        tok = rng.choice(ids)
        assert matcher.advance(tok)
    return times, False


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--walks", type=int, default=4)
    args = ap.parse_args()
    from machine import machine_line  # benchmarks/machine.py

    print(f"machine: {machine_line()}", flush=True)
    from transformers import AutoTokenizer

    from conftest import smollm2_gguf_path
    from plait.runtime.constrained.vocab import TokenVocab

    path = smollm2_gguf_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    vocab = TokenVocab.from_tokenizer(tok, (0, 2), 49152)
    grammars = Grammars(lambda: vocab, timeout_s=120, memory_mb=4096, cache_size=64, jump_forward=False)
    schemas = {**SCHEMAS, "key_heavy": KEY_HEAVY}
    print(f"{'schema':22} {'backend':10} {'compile ms':>10} {'mask p50 us':>12} {'mask p99 us':>12} {'steps':>6}")
    for name, schema in schemas.items():
        for backend in ("outlines", "llguidance"):
            t0 = time.perf_counter()
            try:
                c = SamplingParams.from_dict({"json_schema": schema, "grammar_backend": backend}).constraint()
            except ValueError as e:
                print(f"{name:22} {backend:10} refused: {str(e)[:60]}")
                continue
            fut = grammars.request(c)
            while not fut.done:
                grammars.wait(0.05)
            compile_ms = (time.perf_counter() - t0) * 1e3
            if fut.error:
                print(f"{name:22} {backend:10} failed: {fut.error[:60]}")
                continue
            times: list[float] = []
            for w in range(args.walks):
                m = grammars.matcher(fut, c, jump_forward=False, heal=False)
                m.start([1])
                ts, _ = walk(m, vocab, random.Random(w))
                times += ts
            print(f"{name:22} {backend:10} {compile_ms:10.1f} {pct(times, 0.5) * 1e6:12.0f} "
                  f"{pct(times, 0.99) * 1e6:12.0f} {len(times):6d}")
    grammars.close()
    _ = statistics


if __name__ == "__main__":
    main()
