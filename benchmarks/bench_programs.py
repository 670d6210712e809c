"""Programs per second for three workloads, against peers measured in the same run.

Workloads (generated locally, deterministic):
- ``qa``: 5-shot QA, one gen per instance;
- ``agent``: an agent-like chat program (long tool-describing system prompt, then
  thought / tool select / tool input / answer: three gens and a select per instance);
- ``mc``: select-heavy multiple choice in the shape of HellaSwag (5-shot, 4 endings).

Systems:
- ``plait``: ``run_batch`` with tracing and pinning, over ZMQ to a runtime sidecar;
- ``plait-nopin``: the same without pinning (prefix cache still on);
- ``http-nocache``: the very prompts plait sent, replayed as independent concurrent
  HTTP ``/generate`` requests to a runtime with the radix cache off;
- ``hf``: the same prompts through Hugging Face transformers, one at a time
  (``generate`` for gens, one forward pass for scoring and prefill-only requests).

Reported: programs per second, its ratio to ``plait``, and the prefix-cache hit rate
(runtime counters). Timings are reported, never asserted.

``--churn N --kv-cache-tokens T`` adds N streams of other traffic (unique prompts) to
the runtime during the plait runs, in a pool small enough that the churn evicts what is
not held: the situation pinning is for.

    python benchmarks/bench_programs.py --instances 64
    python benchmarks/bench_programs.py --instances 16 --workloads qa,mc --skip-hf --num-threads 2
    python benchmarks/bench_programs.py --workloads agent --churn 2 --kv-cache-tokens 4096 --skip-http --skip-hf
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import plait as sgl
from plait.backend import Request

# -- workloads ------------------------------------------------------------------------------------------
QA_SHOTS = [
    ("What is the capital of France?", "Paris"),
    ("How many legs does a spider have?", "Eight"),
    ("What is 12 times 3?", "36"),
    ("Which planet is known as the red planet?", "Mars"),
    ("What gas do plants absorb from the air?", "Carbon dioxide"),
]
QA_HEAD = "Answer each question in a few words.\n\n" + "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in QA_SHOTS)


@sgl.function
def qa(s, question):
    s += QA_HEAD + "Question: " + question + "\nAnswer:"
    s += sgl.gen("answer", max_tokens=16, stop="\n")


def qa_instances(n: int, rng: random.Random) -> list[dict[str, Any]]:
    things = ["a cat", "the moon", "a bicycle", "the ocean", "a violin", "a volcano", "a library", "a glacier"]
    forms = ["What is {} made of?", "Why is {} important?", "Where would you find {}?", "How old can {} get?"]
    return [{"question": rng.choice(forms).format(rng.choice(things))} for _ in range(n)]


AGENT_SYSTEM = (
    "You are a careful assistant that solves tasks with tools. Available tools:\n"
    "- search: looks up facts on the web. Input: a short query.\n"
    "- calculator: evaluates arithmetic. Input: an expression such as 12 * (3 + 4).\n"
    "- calendar: answers questions about dates and weekdays. Input: a date question.\n"
    "- none: answer directly without a tool.\n"
    "Always think first, pick exactly one tool, give its input on one line, then answer in one sentence. "
    "Be concise and never invent tool outputs; if a tool fails, say so plainly."
)


@sgl.function
def agent(s, task):
    s += sgl.system(AGENT_SYSTEM)
    s += sgl.user(task)
    with s.assistant():
        s += "Thought: " + sgl.gen("thought", max_tokens=24, stop="\n") + "\n"
        s += "Tool: " + sgl.select("tool", ["search", "calculator", "calendar", "none"]) + "\n"
        s += "Input: " + sgl.gen("tool_input", max_tokens=16, stop="\n") + "\n"
        s += "Observation: (tool output omitted)\n"
        s += "Answer: " + sgl.gen("answer", max_tokens=24, stop="\n")


def agent_instances(n: int, rng: random.Random) -> list[dict[str, Any]]:
    tasks = ["What day of the week is {d} March 2031?", "What is {a} times {b}?",
             "Who wrote the novel about a whale, and when?", "Convert {a} miles to kilometres.",
             "Find the population of the largest city in Canada.", "Is {a} a prime number?"]
    return [{"task": rng.choice(tasks).format(d=rng.randint(1, 28), a=rng.randint(10, 999), b=rng.randint(2, 99))}
            for _ in range(n)]


ACTIVITIES = ["Making a sandwich", "Washing a car", "Playing the guitar", "Planting a tree", "Ironing a shirt",
              "Baking bread", "Painting a fence", "Tying a tie"]
MC_VERBS = ["takes", "picks up", "holds", "puts down", "looks at", "cleans"]
MC_OBJECTS = ["a knife", "a sponge", "the strings", "a shovel", "the iron", "the dough", "a brush", "the fabric"]


def _mc_item(rng: random.Random) -> tuple[str, list[str], int]:
    act = rng.choice(ACTIVITIES)
    ctx = f"{act}: A person {rng.choice(MC_VERBS)} {rng.choice(MC_OBJECTS)} and"
    endings = [f" {rng.choice(MC_VERBS)} {rng.choice(MC_OBJECTS)} carefully." for _ in range(4)]
    return ctx, endings, rng.randrange(4)


def mc_instances(n: int, rng: random.Random) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        ctx, endings, _ = _mc_item(rng)
        out.append({"context": ctx, "endings": endings})
    return out


MC_SHOTS_RNG = random.Random(1234)
MC_HEAD = "Pick the most plausible continuation.\n\n" + "".join(
    f"{c}{e[k]}\n\n" for c, e, k in (_mc_item(MC_SHOTS_RNG) for _ in range(5)))


@sgl.function
def mc(s, context, endings):
    s += MC_HEAD + context
    s += sgl.select("ending", endings)


WORKLOADS = {"qa": (qa, qa_instances), "agent": (agent, agent_instances), "mc": (mc, mc_instances)}


# -- measurement --------------------------------------------------------------------------------------------
class Recorder:
    """Wraps an endpoint's submit to record every request a batch sends."""

    def __init__(self, endpoint: Any) -> None:
        self.endpoint = endpoint
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._submit = endpoint.submit

    def __enter__(self) -> Recorder:
        def submit(req: Request, on_chunk: Any = None) -> Any:
            with self._lock:
                self.requests.append(req)
            return self._submit(req, on_chunk)

        self.endpoint.submit = submit
        return self

    def __exit__(self, *exc: Any) -> None:
        del self.endpoint.submit


def hit_rate(before: dict[str, Any], after: dict[str, Any], churn: Churn | None = None) -> float:
    """Share of the batch's prompt tokens served from the prefix cache (runtime
    counters; the churn's own tokens are taken out)."""
    q = after["cache_queried_tokens"] - before["cache_queried_tokens"]
    h = after["cache_hit_tokens"] - before["cache_hit_tokens"]
    if churn is not None:
        q, h = q - churn.prompt_tokens, h - churn.cached_tokens
    return h / q if q > 0 else 0.0


class Churn:
    """Other traffic on the same runtime while a batch runs: ``streams`` clients, each
    sending unique random-word prompts of about ``words`` words (one output token) one
    after another. Their prompts fill the prefix cache and evict what nobody holds."""

    def __init__(self, url: str, streams: int, words: int = 300) -> None:
        self.url, self.streams, self.words = url, streams, words
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self.sent = self.prompt_tokens = self.cached_tokens = 0  # since the last __enter__

    def _loop(self, seed: int) -> None:
        rng = random.Random(seed)
        vocab = ["river", "stone", "amber", "cloud", "gear", "violet", "pine", "harbor", "signal", "maple",
                 "copper", "lantern", "meadow", "orbit", "quartz", "willow", "canyon", "ember", "falcon", "glacier"]
        while not self._stop.is_set():
            text = " ".join(rng.choice(vocab) + str(rng.randrange(1000)) for _ in range(self.words))
            body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 1}}).encode()
            req = urllib.request.Request(self.url + "/generate", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as resp:
                meta = json.loads(resp.read())["meta_info"]
            with self._lock:
                self.sent += 1
                self.prompt_tokens += meta["prompt_tokens"]
                self.cached_tokens += meta["cached_tokens"]

    def __enter__(self) -> Churn:
        self.sent = self.prompt_tokens = self.cached_tokens = 0
        self._stop.clear()
        for i in range(self.streams):
            t = threading.Thread(target=self._loop, args=(1000 + i + 100 * len(self._threads),), daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._threads.clear()


def run_plait(fn: Any, batch: list[dict[str, Any]], endpoint: Any, pin: bool,
              churn: Churn | None = None) -> tuple[float, float, list[Request]]:
    endpoint.flush_cache()
    before = endpoint.get_server_info()
    with Recorder(endpoint) as rec, churn or _nothing():
        t = time.perf_counter()
        states = fn.run_batch(batch, temperature=0, backend=endpoint, pin_prefixes=pin, num_threads=64)
        elapsed = time.perf_counter() - t
    errors = [s.error() for s in states if s.error() is not None]
    if errors:
        raise RuntimeError(f"{len(errors)} programs failed, first: {errors[0]}")
    return elapsed, hit_rate(before, endpoint.get_server_info(), churn), rec.requests


@contextlib.contextmanager
def _nothing() -> Any:
    yield


def http_payload(r: Request) -> dict[str, Any]:
    body: dict[str, Any] = {"sampling_params": r.sampling_params, "return_logprob": r.return_logprob,
                            "logprob_start_len": r.logprob_start_len}
    if r.text is not None:
        body["text"] = r.text
    else:
        body["input_ids"] = r.input_ids
    return body


def run_http(requests: list[Request], url: str, concurrency: int = 64) -> float:
    def post(r: Request) -> None:
        data = json.dumps(http_payload(r)).encode()
        req = urllib.request.Request(url + "/generate", data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()

    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(post, requests))
    return time.perf_counter() - t


class HFRunner:
    def __init__(self, model: str | None, num_threads: int | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from plait.runtime.model_loader import resolve_model

        if num_threads:
            torch.set_num_threads(num_threads)
        self.torch = torch
        source = resolve_model(model)
        path = str(source.path)
        if path.endswith(".gguf"):
            import os

            folder, name = os.path.dirname(path), os.path.basename(path)
            self.tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        else:
            self.tok = AutoTokenizer.from_pretrained(path)
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()

    def run(self, requests: list[Request]) -> float:
        torch = self.torch
        t = time.perf_counter()
        with torch.no_grad():
            for r in requests:
                ids = r.input_ids if r.input_ids is not None else self.tok.encode(r.text, add_special_tokens=False)
                x = torch.tensor([ids])
                n = r.sampling_params.get("max_new_tokens", 128)
                if n == 0:
                    logits = self.model(x).logits
                    if r.return_logprob:
                        logits.log_softmax(-1)
                    continue
                stop = r.sampling_params.get("stop") or None
                self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                    stop_strings=stop, tokenizer=self.tok if stop else None,
                                    pad_token_id=self.tok.eos_token_id)
        return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="plait program benchmarks")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct GGUF")
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--workloads", default="qa,agent,mc")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (engine and HF)")
    p.add_argument("--kv-cache-tokens", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1, help="plait runs per system (the best is reported)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--churn", type=int, default=0,
                   help="streams of other traffic (unique ~300-word prompts) on the runtime during the plait runs; "
                        "with a small --kv-cache-tokens they evict what is not pinned")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    from machine import machine_line  # benchmarks/machine.py

    print(f"machine: {machine_line(args.num_threads)}", flush=True)

    config: dict[str, Any] = {"echo_logs": False}
    if args.num_threads:
        config["num_threads"] = args.num_threads
    if args.kv_cache_tokens:
        config["kv_cache_tokens"] = args.kv_cache_tokens
    names = [w for w in args.workloads.split(",") if w]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workload(s) {bad}; allowed: {', '.join(WORKLOADS)}")

    results: list[dict[str, Any]] = []
    recorded: dict[str, list[Request]] = {}
    rt = sgl.Runtime(args.model, **config)
    try:
        for w in names:
            fn, make = WORKLOADS[w]
            batch = make(args.instances, random.Random(0))
            fn.run_batch(batch[:2], temperature=0, backend=rt)  # warm-up
            t_pin = t_nopin = float("inf")
            churn = Churn(rt.url, args.churn) if args.churn else None
            for _ in range(args.repeats):  # alternate, keep the best of each
                t, hr_pin, reqs = run_plait(fn, batch, rt.endpoint, pin=True, churn=churn)
                t_pin = min(t_pin, t)
                t, hr_nopin, _ = run_plait(fn, batch, rt.endpoint, pin=False, churn=churn)
                t_nopin = min(t_nopin, t)
            recorded[w] = reqs
            results.append({"workload": w, "system": "plait", "seconds": t_pin, "hit_rate": hr_pin,
                            "requests": len(reqs)})
            results.append({"workload": w, "system": "plait-nopin", "seconds": t_nopin, "hit_rate": hr_nopin})
            print(f"[{w}] plait {t_pin:.2f}s (hit {hr_pin:.0%}), no pin {t_nopin:.2f}s (hit {hr_nopin:.0%}), "
                  f"{len(reqs)} requests", file=sys.stderr)
    finally:
        rt.shutdown()

    if not args.skip_http:
        nocache = sgl.Runtime(args.model, disable_radix_cache=True, **config)
        try:
            for w in names:
                run_http(recorded[w][:4], nocache.url)  # warm-up
                t = run_http(recorded[w], nocache.url)
                results.append({"workload": w, "system": "http-nocache", "seconds": t, "hit_rate": 0.0})
                print(f"[{w}] http, no cache {t:.2f}s", file=sys.stderr)
        finally:
            nocache.shutdown()

    if not args.skip_hf:
        hf = HFRunner(args.model, args.num_threads)
        for w in names:
            t = hf.run(recorded[w])
            results.append({"workload": w, "system": "hf", "seconds": t, "hit_rate": None})
            print(f"[{w}] hf {t:.2f}s", file=sys.stderr)

    base = {r["workload"]: r["seconds"] for r in results if r["system"] == "plait"}
    print(f"\n{args.instances} instances per workload, model {args.model or 'SmolLM2-135M-Instruct (GGUF)'}\n")
    print("| workload | system | programs/s | vs plait | cache hit rate |")
    print("|---|---|---:|---:|---:|")
    for r in results:
        r["programs_per_s"] = args.instances / r["seconds"]
        r["vs_plait"] = base[r["workload"]] / r["seconds"]
        hr = "n/a" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
        print(f"| {r['workload']} | {r['system']} | {r['programs_per_s']:.2f} | {r['vs_plait']:.2f}x | {hr} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"instances": args.instances, "model": args.model, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
