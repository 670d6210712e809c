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

``--corpus`` instead measures coverage over the real-world schemas of
``benchmarks/schema_corpus/`` (see its README): each schema is compiled by the
``--grammar-backend`` and classified as compiled, rejected by name (the keyword and its
location), over a limit, or crashed; for compiled ones random instances of the
constraint are validated with ``jsonschema`` (an admitted invalid instance is an
*unsound admit*; there must be none). Reports compile time p50/p99 and the top refusal
reasons. No model is loaded.

    python benchmarks/bench_constrained.py --corpus --grammar-backend outlines --jobs 2
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import time
from typing import Any, Callable

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


def _quantile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_plait(engine: Any, texts: list[str], params: dict[str, Any] | list[dict[str, Any]],
              schema: dict[str, Any] | None) -> dict[str, Any]:
    jf0, mask0, steps0 = engine.scheduler.jump_forward_tokens, engine.runner.mask_time_s, engine.runner.mask_steps
    forward, calls = engine.runner.forward, [0]

    def counted(batch: Any) -> Any:
        calls[0] += 1
        return forward(batch)

    engine.runner.forward = counted
    # NOTE: benchmark-only instrumentation: each request's mask timed on its own (its
    # grammar's allowed() plus its share of applying the step's masks to the logits)
    import plait.runtime.model_runner as runner_mod
    from plait.runtime.constrained.mask import apply_packed_masks

    per_row: list[float] = []

    def timed_masks(logits: Any, reqs: Any) -> None:
        rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
        if not rows:
            return
        masks, own = [], []
        for i in rows:
            t = time.perf_counter()
            masks.append(reqs[i].grammar.allowed(eos_ok=not reqs[i].params.ignore_eos))
            own.append(time.perf_counter() - t)
        t = time.perf_counter()
        apply_packed_masks(logits, masks, rows)
        share = (time.perf_counter() - t) / len(rows)
        per_row.extend(x + share for x in own)

    original = runner_mod.apply_grammar_masks
    runner_mod.apply_grammar_masks = timed_masks
    t0 = time.perf_counter()
    try:
        outs = engine.generate(texts, params)
    finally:
        del engine.runner.forward
        runner_mod.apply_grammar_masks = original
    wall = time.perf_counter() - t0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    jumped = engine.scheduler.jump_forward_tokens - jf0
    mask_steps = engine.runner.mask_steps - steps0
    return {
        "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
        "steps_per_output": (tokens - jumped) / len(outs), "tokens_per_output": tokens / len(outs),
        "mask_ms_per_step": 1e3 * (engine.runner.mask_time_s - mask0) / mask_steps if mask_steps else 0.0,
        "mask_ms_p50": 1e3 * _quantile(per_row, 0.5), "mask_ms_p99": 1e3 * _quantile(per_row, 0.99),
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


# -- corpus coverage (--corpus) --------------------------------------------------------------
CORPUS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema_corpus")
CORPUS_SETS = {"ShishirPatil": "bfcl (function calls)", "github": "github (REST API)",
               "willthames": "kubernetes", "SchemaStore": "schemastore"}


def load_corpus(folder: str, limit: int | None = None) -> list[tuple[str, Any]]:
    """(source, schema) of every line of the corpus' ``*.jsonl.gz`` files."""
    rows: list[tuple[str, Any]] = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl.gz"))):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            file_rows = [json.loads(line) for line in f if line.strip()]
        rows.extend((r["source"], r["schema"]) for r in file_rows[:limit])
    return rows


class Compiled:
    """One compiled constraint, as the corpus section needs it: its compile time and a
    way to draw random instances of what it admits (texts)."""

    def __init__(self, compile_s: float, sample: Callable[[int, int], list[str]], check: Callable[[str], bool]):
        self.compile_s = compile_s
        self.sample = sample  # (n, seed) -> texts the constraint admits
        self.check = check  # text -> does the compiled constraint itself accept it (sampler sanity)


def compile_outlines(schema: Any) -> Compiled:
    """plait's JSON Schema -> regex translation (what the outlines-core backend compiles;
    the index over a tokenizer is a function of the regex alone and is not built here)."""
    import re

    from plait.runtime.constrained.json_schema import schema_to_regex
    from regex_sampling import sample

    t0 = time.perf_counter()
    regex = schema_to_regex(schema)
    dt = time.perf_counter() - t0
    pattern = re.compile(regex)
    return Compiled(dt, lambda n, seed: sample(regex, n, seed), lambda text: pattern.fullmatch(text) is not None)


_BYTE_TOKENIZER: Any = None


def byte_tokenizer() -> Any:
    """An llguidance tokenizer with one token per byte (id 256: EOS), so that random
    walks of a grammar's matcher draw any text the grammar admits."""
    global _BYTE_TOKENIZER
    if _BYTE_TOKENIZER is None:
        import llguidance

        class _Bytes:
            tokens = [bytes([i]) for i in range(256)] + [b"\xff[eos]"]
            eos_token_id = 256
            bos_token_id = None
            special_token_ids = [256]

            def __call__(self, text: str | bytes) -> list[int]:
                return list(text.encode() if isinstance(text, str) else text)

        _BYTE_TOKENIZER = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()), n_vocab=257, eos_token=[256])
    return _BYTE_TOKENIZER


def compile_llguidance(schema: Any, sites: list[list[Any]] | None = None) -> Compiled:
    """The llguidance backend's translation (plait.runtime.constrained.llguidance_backend:
    its checks and llguidance's JSON compiler) and the matcher over a byte tokenizer;
    instances are random walks of that matcher. ``sites``: arrays whose items the walk
    keeps distinct, byte by byte, as the engine's ``UniqueGuard`` does (a byte that would
    complete a repeated item is not drawn)."""
    import random

    import llguidance
    import llguidance.numpy as lln
    import numpy as np

    from plait.runtime.constrained.llguidance_backend import parser_limits, schema_grammar
    from plait.runtime.constrained.unique_items import Duplicate, JsonTracker

    def repeats(tracker: Any, byte: int) -> bool:
        try:
            tracker.copy().feed(bytes((byte,)))
        except Duplicate:
            return True
        return False

    t0 = time.perf_counter()
    grammar = schema_grammar(schema, None)
    tok = byte_tokenizer()
    root = llguidance.LLMatcher(tok, grammar, limits=parser_limits())
    if root.is_error():
        raise ValueError(root.get_error())
    dt = time.perf_counter() - t0

    def walk(n: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        out = []
        mask = lln.allocate_token_bitmask(1, 257)
        for _ in range(n):
            m, text = root.deep_copy(), bytearray()
            tracker = None if sites is None else JsonTracker(sites)
            while not m.is_stopped() and len(text) < 4000:
                lln.fill_next_token_bitmask(m, mask)
                bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:257]
                allowed = [int(i) for i in np.flatnonzero(bits)]
                if tracker is not None:
                    allowed = [t for t in allowed if t == 256 or not repeats(tracker, t)]
                if m.is_accepting() and (256 in allowed) and (len(text) > 200 or rng.random() < 0.2):
                    break
                choices = [t for t in allowed if t != 256]
                if not choices:
                    break
                # prefer structure over long strings: printable ASCII most of the time
                ascii_ = [t for t in choices if 0x20 <= t < 0x7F]
                t = rng.choice(ascii_ if ascii_ and rng.random() < 0.9 else choices)
                m.consume_token(t)
                text.append(t)
                if tracker is not None:
                    tracker.feed(bytes((t,)))
            out.append(text.decode("utf-8", errors="replace"))
        return out

    def accepts(text: str) -> bool:
        m = root.deep_copy()
        for b in text.encode():
            if not m.consume_token(b):
                return False
        return m.is_accepting()

    return Compiled(dt, walk, accepts)


def compile_auto(schema: Any) -> Compiled:
    """``auto``: the backends in the order plait.runtime.sampling_params.choose_backend
    gives for json_schema; the first that compiles the schema enforces it."""
    from plait.runtime.sampling_params import choose_backend

    errors = []
    for b in choose_backend("json_schema"):
        try:
            return compile_backend(b)(schema)
        except ValueError as e:
            errors.append(e)
    if any("uniqueItems" in str(e) for e in errors):  # the engine's next try: the guard beside the grammar
        from plait.runtime.constrained.unique_items import has_unique, plan

        if has_unique(schema):
            try:
                stripped, sites = plan(schema)
            except ValueError as e:
                raise ValueError(str(e)) from None
            try:  # the walk keeps the items distinct on the llguidance matcher only: a schema
                # the engine would send to the regex path with the guard counts as refused here
                return compile_llguidance(stripped, sites)
            except ValueError:
                pass
    raise errors[-1]


def compile_backend(name: str) -> Callable[[Any], Compiled]:
    """The compile function of ``--grammar-backend``: ``outlines`` is plait's JSON
    Schema -> regex translation, ``llguidance`` the llguidance backend's translation,
    ``auto`` the engine's rule between them."""
    return {"outlines": compile_outlines, "llguidance": compile_llguidance, "auto": compile_auto}[name]


def classify_error(e: BaseException) -> tuple[str, str]:
    """(status, reason) of a compile error: ``rejected`` (a keyword or value named),
    ``limit`` (size, expansion or time limits) or ``crashed`` (anything else)."""
    import re

    from plait.runtime.constrained.json_schema import SchemaError

    msg = str(e)
    if not isinstance(e, (SchemaError, ValueError)):
        return "crashed", f"{type(e).__name__}: {msg[:80]}"
    if re.search(r"took longer|too large|translates to a regex|characters; allowed|expands to more|nested (too|more)|"
                 r"values; it is too", msg):
        return "limit", re.sub(r"\d[\d.,]*", "N", re.sub(r" at #\S*", "", msg).split(";")[0])[:90]
    msg = re.sub(r" at #\S*", "", msg)  # the location: one reason across schemas
    m = re.search(r"keywords? ('[^']+'(?: and '[^']+')*)", msg) or re.search(r"json_schema ('[^']+')", msg)
    head = m.group(1) if m else msg[:60]
    tail = msg.split(":", 1)[1].strip() if ":" in msg else ""
    if "'format'" in head or "'$ref'" in head:
        head = msg.split(" is not supported")[0].split(" points")[0].replace("json_schema ", "")
        head = re.sub(r"'\$ref' (.*\(('[^']*')\).*|.*)", lambda mm: "'$ref' " + ("recursive" if "recursive" in msg else
                      "non-local" if "not supported" in msg else "unresolved"), head)
    return "rejected", (head + (": " + tail[:70] if tail and len(head) < 40 else ""))[:110]


def corpus_one(job: tuple[str, Any, str, int, int]) -> dict[str, Any]:
    """Compile one schema and check the instances it admits (runs in a worker)."""
    import signal

    import jsonschema

    source, schema, backend, samples, timeout_s = job
    out: dict[str, Any] = {"source": source}

    def alarm(signum: int, frame: Any) -> None:
        raise TimeoutError(f"over {timeout_s} s")

    signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout_s)
    try:
        try:
            compiled = compile_backend(backend)(schema)
        except TimeoutError as e:
            out.update(status="limit", reason=f"compile {e} (harness timeout)")
            return out
        except (RecursionError, MemoryError) as e:
            out.update(status="crashed", reason=type(e).__name__)
            return out
        except Exception as e:
            out["status"], out["reason"] = classify_error(e)
            return out
        out.update(status="compiled", compile_s=compiled.compile_s, unsound=[], checked=0)
        try:
            cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
            validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
            for text in compiled.sample(samples, hash(source) & 0xFFFF):
                if not compiled.check(text):
                    out["sampler_error"] = text[:200]  # the sampler drew a text the constraint refuses
                    continue
                try:
                    errors = list(validator.iter_errors(json.loads(text)))
                except (ValueError, RecursionError) as e:
                    errors = [e]
                except jsonschema.exceptions._WrappedReferencingError as e:
                    out["unverifiable"] = str(e)[:120]
                    break
                out["checked"] += 1
                if errors:
                    out["unsound"].append({"text": text[:300], "error": str(errors[0])[:300]})
        except TimeoutError:
            out["check_timeout"] = True
        except Exception as e:  # a sampler or validator limitation, not the constraint's
            out["unverifiable"] = f"{type(e).__name__}: {str(e)[:120]}"
        return out
    finally:
        signal.alarm(0)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_corpus(args: argparse.Namespace) -> None:
    import collections
    import multiprocessing
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(CORPUS_DIR), "..", "tests"))
    sys.setrecursionlimit(20_000)
    rows = load_corpus(args.corpus_dir, args.corpus_limit)
    compile_backend(args.grammar_backend)  # refuse an unknown backend before starting workers
    jobs = [(src, schema, args.grammar_backend, args.corpus_samples, args.corpus_timeout) for src, schema in rows]
    with multiprocessing.get_context("fork").Pool(args.jobs, maxtasksperchild=50) as pool:
        results = list(pool.imap(corpus_one, jobs, chunksize=4))
    if args.corpus_out:
        with open(args.corpus_out, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")

    by_set: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in results:
        name = CORPUS_SETS.get(r["source"].split("/")[0], r["source"].split("/")[0])
        by_set[name][r["status"]] += 1
        by_set["all"][r["status"]] += 1
    statuses = ("compiled", "rejected", "limit", "crashed")
    print(f"\nJSON Schema corpus coverage, backend {args.grammar_backend}, {len(results)} schemas "
          f"({args.corpus_samples} random instances each validated with jsonschema)\n")
    print(f"{'set':<22} {'schemas':>8} " + " ".join(f"{s:>9}" for s in statuses) + f" {'compiled %':>11}")
    for name, c in sorted(by_set.items(), key=lambda kv: kv[0] == "all"):
        n = sum(c.values())
        print(f"{name:<22} {n:>8} " + " ".join(f"{c[s]:>9}" for s in statuses) + f" {100 * c['compiled'] / n:>10.1f}%")
    compiled = [r for r in results if r["status"] == "compiled"]
    times = [r["compile_s"] * 1e3 for r in compiled]
    unsound = [r for r in compiled if r["unsound"]]
    print(f"\ncompile ms: p50 {_pct(times, 0.5):.2f}  p99 {_pct(times, 0.99):.2f}  max {max(times, default=0):.1f}")
    print(f"instances validated: {sum(r['checked'] for r in compiled)}; unsound admits: "
          f"{sum(len(r['unsound']) for r in compiled)} in {len(unsound)} schemas; "
          f"unverifiable: {sum('unverifiable' in r for r in compiled)}; "
          f"check timeouts: {sum('check_timeout' in r for r in compiled)}; "
          f"sampler errors: {sum('sampler_error' in r for r in compiled)}")
    for r in unsound[:10]:
        print(f"  UNSOUND {r['source']}\n    {r['unsound'][0]['text'][:160]}\n    {r['unsound'][0]['error'][:160]}")
    reasons = collections.Counter(r["reason"] for r in results if r["status"] != "compiled")
    print(f"\ntop refusal reasons ({sum(reasons.values())} schemas not compiled):")
    for reason, n in reasons.most_common(args.corpus_top):
        print(f"  {n:>5}  {reason}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder, .gguf or hub id (default: SmolLM2-135M GGUF)")
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--schemas", default="key_heavy,nested")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-outlines", action="store_true", help="skip the outlines/transformers comparison")
    ap.add_argument("--corpus", action="store_true", help="coverage over the real-world schema corpus (no model)")
    ap.add_argument("--corpus-dir", default=CORPUS_DIR)
    ap.add_argument("--corpus-limit", type=int, default=None, help="at most this many schemas of each file")
    ap.add_argument("--corpus-samples", type=int, default=5, help="random instances validated per schema")
    ap.add_argument("--corpus-timeout", type=int, default=60, help="seconds per schema (compile and checks)")
    ap.add_argument("--corpus-top", type=int, default=25, help="refusal reasons listed")
    ap.add_argument("--corpus-out", default=None, help="write one JSON result per schema here")
    ap.add_argument("--grammar-backend", default="outlines", choices=("outlines", "llguidance", "auto"))
    ap.add_argument("--jobs", type=int, default=1, help="worker processes for --corpus")
    args = ap.parse_args()
    from machine import machine_line  # benchmarks/machine.py

    print(f"machine: {machine_line(args.num_threads)}", flush=True)
    if args.corpus:
        run_corpus(args)
        return

    from plait.runtime import Engine

    common = dict(device=args.device, num_threads=args.num_threads, max_running_requests=max(args.num_requests, 1))
    jf_engine = Engine(args.model, **common)
    plain_engine = Engine(args.model, disable_jump_forward=True, **common)
    greedy = {"temperature": 0.0, "max_new_tokens": args.max_new_tokens}
    rows: list[tuple[str, str, dict[str, Any]]] = []
    builds: dict[str, float] = {}
    first_tokens: dict[str, tuple[float, float]] = {}
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
        # first token of a never-seen schema (a title no request used: a new constraint
        # to compile) against an unconstrained request's, both on the warm engine
        one = {**greedy, "max_new_tokens": 1}
        t0 = time.perf_counter()
        jf_engine.generate(texts[:1], one)
        free_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        jf_engine.generate(texts[:1], {**one, "json_schema": {**schema, "title": f"unseen {time.time_ns()}"}})
        first_tokens[name] = (free_s, time.perf_counter() - t0)
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
            f"{'ms/step':>8} {'mask ms/step':>13} {'req mask p50/p99 ms':>20} {'valid':>7}")
    print(head)
    print("-" * len(head))
    for name, mode, r in rows:
        base = r.get("matched_free", r)
        v = "-" if r["valid"] is None else f"{r['valid']}/{r['n']}"
        print(f"{name:<10} {mode:<9} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>7.2f}x {r['steps_per_output']:>10.1f} "
              f"{r['tokens_per_output']:>8.1f} {r['ms_per_engine_step']:>8.1f} {r['mask_ms_per_step']:>13.3f} "
              f"{r['mask_ms_p50']:>9.3f} / {r['mask_ms_p99']:<8.3f} {v:>7}")
        if mode == "json+jf":
            plain = next(x for n, m, x in rows if n == name and m == "json")
            cut = 1 - r["steps_per_output"] / plain["steps_per_output"]
            print(f"{'':<10} jump-forward: {cut:.0%} fewer model steps per output than json")
    print("\nfirst token, one request, warm engine: unconstrained vs a never-seen schema (compiled on arrival):")
    for name, (free_s, new_s) in first_tokens.items():
        print(f"  {name:<10} {1e3 * free_s:.1f} ms vs {1e3 * new_s:.1f} ms (+{1e3 * (new_s - free_s):.1f} ms)")
    print("\nfirst whole request of a schema (its generation included, and the compile and worker start):")
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
