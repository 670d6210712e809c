"""Constrained-decoding benchmark on a JSON-generation workload.

Runs the same prompts (a chat request for a JSON record) through:

- ``free``: plait, unconstrained (and, for each constrained run, unconstrained requests
  of the same lengths: the "vs free" baseline, so batch occupancy is the same);
- ``json``: plait with the JSON Schema, jump-forward off;
- ``json+jf``: plait with the JSON Schema and jump-forward;
- ``outlines``: the ``outlines`` library on Hugging Face transformers with the same
  schema (and ``hf-free``, the same model unconstrained), when outlines is installed.

Reports output tokens per second, model steps per output (tokens the model sampled;
jump-forward writes the others), mask time per step, index build times, and how many
outputs validate against the schema. Ratios are against ``free`` measured in the same
run. Timings are reported, never asserted. Targets (issue 5): ``json`` >= 0.9x ``free``
tokens/s; ``json+jf`` >= 30% fewer model steps than ``json`` on key-heavy schemas.

    python benchmarks/bench_constrained.py --num-requests 16 --max-new-tokens 160
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    # many keys, short values: where jump-forward saves most
    "key_heavy": {
        "type": "object",
        "properties": {
            "first_name": {"type": "string", "maxLength": 16},
            "last_name": {"type": "string", "maxLength": 16},
            "date_of_birth": {"type": "string", "format": "date"},
            "nationality": {"type": "string", "maxLength": 16},
            "occupation": {"type": "string", "maxLength": 24},
            "employer_name": {"type": "string", "maxLength": 24},
            "years_of_experience": {"type": "integer", "minimum": 0, "maximum": 60},
            "is_currently_employed": {"type": "boolean"},
            "favourite_programming_language": {"enum": ["Python", "Rust", "C", "Go", "Java"]},
        },
        "required": ["first_name", "last_name", "date_of_birth", "nationality", "occupation", "employer_name",
                     "years_of_experience", "is_currently_employed", "favourite_programming_language"],
    },
    # nesting and arrays
    "nested": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "authors": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 24}, "affiliation": {"type": "string", "maxLength": 24}},
                "required": ["name"]}, "minItems": 1, "maxItems": 3},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        },
        "required": ["title", "year", "authors", "keywords"],
    },
}
SUBJECTS = ["a software engineer", "a nurse", "a chef", "a pilot", "a teacher", "a farmer", "an architect",
            "a journalist", "a plumber", "a violinist", "a geologist", "a librarian"]


def prompts(tokenizer: Any, schema_name: str, n: int) -> list[str]:
    what = "person" if schema_name == "key_heavy" else "research paper"
    out = []
    for i in range(n):
        msg = f"Write a JSON record describing a fictional {what} related to {SUBJECTS[i % len(SUBJECTS)]}."
        try:
            out.append(tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                                     add_generation_prompt=True))
        except Exception:
            out.append(msg + "\n")
    return out


def valid(schema: dict[str, Any], text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except Exception:
        return False


def run_plait(engine: Any, texts: list[str], params: dict[str, Any] | list[dict[str, Any]],
              schema: dict[str, Any] | None) -> dict[str, Any]:
    jf0, mask0, steps0 = engine.scheduler.jump_forward_tokens, engine.runner.mask_time_s, engine.runner.mask_steps
    forward, calls = engine.runner.forward, [0]

    def counted(batch: Any) -> Any:
        calls[0] += 1
        return forward(batch)

    engine.runner.forward = counted
    t0 = time.perf_counter()
    try:
        outs = engine.generate(texts, params)
    finally:
        del engine.runner.forward
    wall = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    jumped = engine.scheduler.jump_forward_tokens - jf0
    mask_steps = engine.runner.mask_steps - steps0
    return {
        "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
        "steps_per_output": (tokens - jumped) / len(outs), "tokens_per_output": tokens / len(outs),
        "mask_ms_per_step": 1e3 * (engine.runner.mask_time_s - mask0) / mask_steps if mask_steps else 0.0,
        "valid": sum(valid(schema, o["text"]) for o in outs) if schema else None, "n": len(outs),
        "engine_steps": calls[0], "ms_per_engine_step": 1e3 * wall / max(calls[0], 1),
        "lengths": [o["meta_info"]["completion_tokens"] for o in outs],
    }


def matched_free(engine: Any, texts: list[str], run: dict[str, Any], greedy: dict[str, Any]) -> dict[str, Any]:
    """Unconstrained, with each request as long as it was in ``run``: the same batch
    occupancy, so tokens/s compare the cost of constraining alone."""
    params = [{**greedy, "max_new_tokens": n, "ignore_eos": True} for n in run["lengths"]]
    return run_plait(engine, texts, params, None)


def run_outlines(args: argparse.Namespace, texts: list[str], schema: dict[str, Any]) -> dict[str, Any]:
    """outlines on transformers, one prompt at a time (its Generator takes one), plus the
    same model unconstrained; None entries when outlines is not installed."""
    try:
        import outlines
        from outlines.types import JsonSchema
    except ImportError as e:
        return {"error": f"outlines not installed ({e})"}
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.runtime.model_loader import resolve_model

    src = resolve_model(args.model)
    path = getattr(src, "path", None) or args.model
    if path and str(path).endswith(".gguf"):
        folder, name = os.path.dirname(path), os.path.basename(path)
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path)
    model = outlines.from_transformers(hf, tok)
    t0 = time.perf_counter()
    gen = outlines.Generator(model, JsonSchema(json.dumps(schema)))
    build_s = time.perf_counter() - t0
    res: dict[str, Any] = {"build_s": build_s}
    for mode in ("outlines", "hf-free"):
        tokens, ok = 0, 0
        t0 = time.perf_counter()
        for text in texts:
            if mode == "outlines":
                out = gen(text, max_new_tokens=args.max_new_tokens, do_sample=False)
                ok += valid(schema, out)
                tokens += len(tok.encode(out, add_special_tokens=False))
            else:
                ids = tok(text, return_tensors="pt", add_special_tokens=False)
                with torch.no_grad():
                    o = hf.generate(**ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                tokens += o.shape[1] - ids["input_ids"].shape[1]
        wall = time.perf_counter() - t0
        res[mode] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "n": len(texts),
                     "valid": ok if mode == "outlines" else None}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf or hub id (default: SmolLM2-135M GGUF)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--schemas", default="key_heavy,nested")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-outlines", action="store_true", help="skip the outlines/transformers comparison")
    args = ap.parse_args()

    from plait.runtime import Engine

    common = dict(device=args.device, num_threads=args.num_threads, max_running_requests=max(args.num_requests, 1))
    jf_engine = Engine(args.model, **common)
    plain_engine = Engine(args.model, disable_jump_forward=True, **common)
    greedy = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    rows: list[tuple[str, str, dict[str, Any]]] = []
    builds: dict[str, float] = {}
    outlines_res: dict[str, Any] = {}
    for name in args.schemas.split(","):
        schema = SCHEMAS[name]
        texts = prompts(jf_engine.tokenizer, name, args.num_requests)
        cons = {**greedy, "json_schema": schema}
        # warm-up: builds the indexes (timed separately) and the allocator's pages
        t0 = time.perf_counter()
        jf_engine.generate(texts[:1], cons)
        builds[name] = time.perf_counter() - t0
        plain_engine.generate(texts[:1], cons)
        jf_engine.generate(texts[:1], greedy)
        rows.append((name, "free", run_plait(jf_engine, texts, greedy, None)))
        for mode, engine in (("json", plain_engine), ("json+jf", jf_engine)):
            run = run_plait(engine, texts, cons, schema)
            run["matched_free"] = matched_free(jf_engine, texts, run, greedy)
            rows.append((name, mode, run))
        if not args.no_outlines:
            outlines_res[name] = run_outlines(args, texts, schema)

    print(f"\nconstrained decoding, {args.num_requests} requests x {args.max_new_tokens} max new tokens, greedy\n")
    print("vs free: tokens/s against unconstrained requests of the same lengths (same batch occupancy)")
    head = (f"{'schema':<10} {'mode':<9} {'tok/s':>8} {'vs free':>8} {'steps/out':>10} {'tok/out':>8} "
            f"{'ms/step':>8} {'mask ms/step':>13} {'valid':>7}")
    print(head)
    print("-" * len(head))
    for name, mode, r in rows:
        base = r.get("matched_free", r)
        v = "-" if r["valid"] is None else f"{r['valid']}/{r['n']}"
        print(f"{name:<10} {mode:<9} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>7.2f}x {r['steps_per_output']:>10.1f} "
              f"{r['tokens_per_output']:>8.1f} {r['ms_per_engine_step']:>8.1f} {r['mask_ms_per_step']:>13.3f} {v:>7}")
        if mode == "json+jf":
            plain = next(x for n, m, x in rows if n == name and m == "json")
            cut = 1 - r["steps_per_output"] / plain["steps_per_output"]
            print(f"{'':<10} jump-forward: {cut:.0%} fewer model steps per output than json")
    print("\nindex build (first request of a schema, incl. compile and worker start):")
    for name, secs in builds.items():
        print(f"  {name:<10} {secs:.2f} s")
    for regex, secs in jf_engine.grammar_compiler.build_times.items():
        print(f"  index build only: {secs:.3f} s  ({len(regex)} regex chars)")
    if outlines_res:
        print("\noutlines on transformers (one prompt at a time), same prompts and schemas:")
        for name, res in outlines_res.items():
            if "error" in res:
                print(f"  {name}: {res['error']}")
                continue
            o, f = res["outlines"], res["hf-free"]
            print(f"  {name:<10} outlines {o['tok_s']:.1f} tok/s ({o['valid']}/{o['n']} valid), "
                  f"hf-free {f['tok_s']:.1f} tok/s, ratio {o['tok_s'] / f['tok_s']:.2f}x, "
                  f"generator build {res['build_s']:.2f} s")
    jf_engine.shutdown()
    plain_engine.shutdown()


if __name__ == "__main__":
    main()
