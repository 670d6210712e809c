"""Bounded soak test of ``plait serve`` on loopback.

Launches a server (``plait.runtime.server.launch`` on 127.0.0.1, a free port) and runs
``--clients`` concurrent clients for ``--duration`` seconds or ``--max-requests``
requests, whichever ends first; each request has a client timeout, so the run always
stops by itself. Each request's kind is drawn from a seeded RNG (``--seed``):

- ``native_stream`` / ``native``: ``/generate``, streamed or not (greedy, ``ignore_eos``);
- ``openai_stream`` / ``openai``: ``/v1/completions``, streamed or not;
- ``regex`` / ``json_schema``: constrained ``/generate``;
- ``cancel_stream``: a stream the client closes after its first event;
  ``cancel_timeout``: a non-streamed request with a short client timeout;
- ``bad_json``, ``bad_param``, ``bad_max_tokens``, ``bad_token_id``: malformed requests,
  which must get a 4xx with an OpenAI-shaped error body.

Greedy prompts come from a small fixed pool so that prompts repeat (and share cached
prefixes). At the end it checks, printing PASS/FAIL (exit code 1 on any FAIL):

1. tokens: each completed native stream's chunks extend one another and end at the
   final text and ``output_ids``, whose length is ``meta_info.completion_tokens``;
   greedy requests with the same prompt and ``max_new_tokens`` give the same output;
   constrained outputs match their constraint;
2. KV pages: once idle (``running == waiting == in_flight == 0``, bounded wait),
   ``pool.free + pool.evictable == pool.total``, ``pool.locked == 0``, ``invariant_ok``;
3. no 5xx responses except injected faults;
4. no request hung (a client timeout that was not a deliberate cancellation);
5. malformed requests got a 4xx with an OpenAI-shaped body.

``--kill-engine-every S`` SIGKILLs the engine process S seconds after the server was
last healthy (the server must restart it: ``launch(..., restart_engine=True)``). A 503
of a request that overlaps a kill (from the kill until the engine is back) is an
injected fault, not a failure; after the run ``/health`` must return 200 again and
check 2 must hold.

Reports requests by kind and outcome, throughput (over the load phase, until the last
client finished), p50/p99 end-to-end latency and TTFT (streams), and the machine. Timings are reported, never asserted. Examples::

    python benchmarks/soak.py --quick
    python benchmarks/soak.py --clients 200 --duration 60 --model /path/to/model
    python benchmarks/soak.py --quick --kill-engine-every 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench_serving import pct, sse_events
from machine import machine_line  # benchmarks/machine.py, the line every benchmark prints

HOST = "127.0.0.1"  # loopback only
CANCEL_TIMEOUT_RANGE_S = (0.05, 0.5)  # client timeout of cancel_timeout requests
HEALTH_WAIT_S = 180.0  # bounded wait for /health after a kill or after the run
IDLE_WAIT_S = 60.0  # bounded wait for running == waiting == in_flight == 0
MAX_NEW_TOKENS = (4, 8, 16, 32)
REGEX = "(yes|no)"
JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

# kind -> weight; the draw is per request, from the seeded RNG
KINDS: dict[str, float] = {
    "native_stream": 5, "native": 3, "openai_stream": 3, "openai": 2, "regex": 1, "json_schema": 1,
    "cancel_stream": 1, "cancel_timeout": 1, "bad_json": 0.5, "bad_param": 0.5, "bad_max_tokens": 0.5,
    "bad_token_id": 0.5,
}
GREEDY_KINDS = ("native_stream", "native", "openai_stream", "openai")
MALFORMED_KINDS = ("bad_json", "bad_param", "bad_max_tokens", "bad_token_id")
CANCEL_KINDS = ("cancel_stream", "cancel_timeout")

# Outcomes. completed / rejected (a malformed request's 4xx) / cancelled / fault are
# expected; the others fail a check.
OK_OUTCOMES = ("completed", "rejected", "cancelled", "fault")


# -- requests -----------------------------------------------------------------------------------
@dataclass
class Spec:
    """One request to send: what, where, and what its answer must satisfy."""

    kind: str
    path: str
    body: Any  # a dict (sent as JSON) or bytes (sent as is)
    stream: bool = False
    prompt: str = ""
    max_new_tokens: int = 0
    timeout: float = 120.0
    expect_param: str | None = None  # malformed: the field the error should name


@dataclass
class Record:
    """What happened to one request."""

    kind: str
    outcome: str = "failed"  # completed, rejected, cancelled, fault, hung, http_5xx, unexpected_4xx, failed, invalid
    status: int | None = None
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    output_tokens: int = 0
    text: str | None = None  # greedy kinds: the final text
    output_ids: list[int] | None = None  # native greedy kinds: the final ids
    key: tuple[str, int] | None = None  # greedy kinds: (prompt, max_new_tokens)
    finish: str | None = None  # finish_reason type of a completed native request
    retry_after: float | None = None  # seconds, from a 503's Retry-After header
    detail: str = ""

    @property
    def latency(self) -> float:
        return self.end - self.start


def prompt_pool(rng: random.Random, n: int = 12) -> list[str]:
    """``n`` short prompts; each of three shared prefixes starts a third of them."""
    words = ("river", "mountain", "engine", "garden", "signal", "market", "winter", "library", "circuit", "harbor",
             "orbit", "lantern", "forest", "protocol", "canvas", "meadow", "compiler", "glacier", "violin", "desert")
    prefixes = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(3)]
    return [f"{prefixes[i % 3]}. Tell me about the {rng.choice(words)} and the {rng.choice(words)}." for i in range(n)]


def make_spec(kind: str, rng: random.Random, prompts: list[str], vocab_size: int, model: str,
              timeout: float) -> Spec:
    prompt, k = rng.choice(prompts), rng.choice(MAX_NEW_TOKENS)
    greedy = {"max_new_tokens": k, "temperature": 0, "ignore_eos": True}
    if kind in ("native_stream", "native"):
        stream = kind == "native_stream"
        return Spec(kind, "/generate", {"text": prompt, "stream": stream, "sampling_params": greedy}, stream, prompt, k,
                    timeout)
    if kind in ("openai_stream", "openai"):
        stream = kind == "openai_stream"
        body = {"model": model, "prompt": prompt, "max_tokens": k, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return Spec(kind, "/v1/completions", body, stream, prompt, k, timeout)
    if kind == "regex":
        return Spec(kind, "/generate", {"text": prompt + " Answer yes or no:",
                                         "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": REGEX}},
                    timeout=timeout)
    if kind == "json_schema":
        sp = {"max_new_tokens": 32, "temperature": 0, "json_schema": JSON_SCHEMA}
        return Spec(kind, "/generate", {"text": prompt + " As JSON:", "sampling_params": sp}, timeout=timeout)
    if kind == "cancel_stream":
        sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
        return Spec(kind, "/generate", {"text": prompt, "stream": True, "sampling_params": sp}, True, timeout=timeout)
    if kind == "cancel_timeout":
        sp = {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}
        return Spec(kind, "/generate", {"text": prompt, "sampling_params": sp},
                    timeout=rng.uniform(*CANCEL_TIMEOUT_RANGE_S))
    if kind == "bad_json":
        path = rng.choice(("/generate", "/v1/completions"))
        return Spec(kind, path, b'{"text": "unterminated', timeout=timeout)
    if kind == "bad_param":
        sp = {"max_new_tokens": 4, "no_such_param": 1}
        return Spec(kind, "/generate", {"text": prompt, "sampling_params": sp}, timeout=timeout,
                    expect_param="sampling_params")
    if kind == "bad_max_tokens":
        if rng.random() < 0.5:
            return Spec(kind, "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": -3}},
                        timeout=timeout, expect_param="max_new_tokens")
        return Spec(kind, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": -3}, timeout=timeout,
                    expect_param="max_tokens")
    if kind == "bad_token_id":
        ids = [5, 17, vocab_size + rng.randrange(1, 1000)]
        return Spec(kind, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}},
                    timeout=timeout, expect_param="input_ids")
    raise ValueError(f"unknown request kind {kind!r}")


def openai_shaped(body: Any) -> bool:
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and {"message", "type", "param", "code"} <= err.keys() \
        and isinstance(err["message"], str) and bool(err["message"])


async def send(session: aiohttp.ClientSession, url: str, spec: Spec) -> Record:
    """Send one request and classify its answer (no exception escapes)."""
    rec = Record(spec.kind, start=time.perf_counter())
    if spec.kind in GREEDY_KINDS:
        rec.key = (spec.prompt, spec.max_new_tokens)
    try:
        await asyncio.wait_for(_exchange(session, url, spec, rec), spec.timeout)
    except asyncio.TimeoutError:
        if spec.kind == "cancel_timeout":
            rec.outcome, rec.detail = "cancelled", f"client timeout {spec.timeout:.2f} s"
        else:
            rec.outcome, rec.detail = "hung", f"no answer within {spec.timeout:.0f} s"
    except Exception as e:  # noqa: BLE001  (a transport error or a garbled answer: report, don't crash)
        rec.outcome, rec.detail = "failed", f"{type(e).__name__} on {spec.kind} ({spec.path}): {e}"
    rec.end = time.perf_counter()
    return rec


async def _exchange(session: aiohttp.ClientSession, url: str, spec: Spec, rec: Record) -> None:
    kwargs: dict[str, Any] = {"data": spec.body, "headers": {"Content-Type": "application/json"}} \
        if isinstance(spec.body, bytes) else {"json": spec.body}
    async with session.post(url + spec.path, **kwargs) as r:
        rec.status = r.status
        rec.retry_after = _seconds(r.headers.get("Retry-After"))
        if r.status != 200:
            raw = await r.read()
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
            _classify_error(spec, rec, r.status, body, raw)
            return
        if spec.kind in MALFORMED_KINDS:
            await r.read()
            rec.outcome, rec.detail = "failed", f"malformed request accepted with 200: {str(spec.body)[:120]}"
            return
        if not spec.stream:
            _check_result(spec, rec, await r.json())
            return
        events = []
        async for data, obj in sse_events(r.content):
            if rec.ttft is None and not _empty_event(obj):
                rec.ttft = time.perf_counter() - rec.start
            if isinstance(obj, dict) and "error" in obj:
                _classify_error(spec, rec, int(obj["error"].get("code") or 0), obj, data.encode(), in_stream=True)
                return
            events.append(obj)
            if spec.kind == "cancel_stream":
                r.close()  # hang up after the first event; the server must abort the request
                rec.outcome, rec.detail = "cancelled", "closed after the first event"
                return
        if spec.path == "/generate":
            _check_native_stream(rec, events)
        else:
            _check_openai_stream(rec, events)


def _seconds(header: str | None) -> float | None:
    try:
        return float(header) if header is not None else None
    except ValueError:
        return None


def _empty_event(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return True
    if "choices" in obj:
        return not any(c.get("text") for c in obj["choices"])
    return not obj.get("output_ids")


def _classify_error(spec: Spec, rec: Record, status: int, body: Any, raw: bytes, in_stream: bool = False) -> None:
    where = "stream error event" if in_stream else f"HTTP {status}"
    msg = body["error"].get("message", "") if openai_shaped(body) else raw[:200].decode("utf-8", "replace")
    rec.status = status
    if 400 <= status < 500:
        if spec.kind not in MALFORMED_KINDS:
            rec.outcome, rec.detail = "unexpected_4xx", f"{where}: {msg}"
        elif not openai_shaped(body):
            rec.outcome, rec.detail = "failed", f"{where} without an OpenAI-shaped body: {msg}"
        elif spec.expect_param is not None and body["error"].get("param") != spec.expect_param:
            rec.outcome = "failed"
            rec.detail = f"{where} names param={body['error'].get('param')!r}, expected {spec.expect_param!r}: {msg}"
        else:
            rec.outcome = "rejected"
        return
    rec.outcome = "http_5xx"  # reclassified as "fault" if it is a 503 that overlaps a kill
    rec.detail = f"{where} on {spec.kind} ({spec.path}): {msg}"


def _check_result(spec: Spec, rec: Record, out: Any) -> None:
    """A non-streamed 200 answer (native or OpenAI)."""
    if spec.path == "/generate":
        text, ids, n = out["text"], out["output_ids"], out["meta_info"]["completion_tokens"]
        if len(ids) != n:
            rec.outcome, rec.detail = "invalid", f"{len(ids)} output_ids but completion_tokens={n}"
            return
        rec.output_ids, rec.finish = ids, out["meta_info"]["finish_reason"]["type"]
        if spec.kind == "regex" and not re.fullmatch(REGEX, text):
            rec.outcome, rec.detail = "invalid", f"regex {REGEX} output {text!r}"
            return
        if spec.kind == "json_schema" and rec.finish != "length":  # a cut-off JSON text cannot parse
            try:
                obj = json.loads(text)
                valid = isinstance(obj, dict) and isinstance(obj.get("a"), int)
            except ValueError:
                valid = False
            if not valid:
                rec.outcome, rec.detail = "invalid", f"json_schema output {text!r}"
                return
    else:
        text, n = out["choices"][0]["text"], out["usage"]["completion_tokens"]
    if spec.kind in GREEDY_KINDS and n != spec.max_new_tokens:
        rec.outcome, rec.detail = "invalid", f"{n} tokens for max_new_tokens={spec.max_new_tokens} with ignore_eos"
        return
    rec.text, rec.output_tokens, rec.outcome = text, n, "completed"


def _check_native_stream(rec: Record, events: list[dict[str, Any]]) -> None:
    """Native stream events hold the text and ids so far; the last one is the result.
    Every event must extend the previous one (nothing lost, nothing repeated) and the
    chunks must end exactly at the result."""
    if not events:
        rec.outcome, rec.detail = "invalid", "stream ended without events"
        return
    *chunks, final = events
    meta = final.get("meta_info", {})
    if meta.get("finish_reason") is None or "completion_tokens" not in meta:
        rec.outcome, rec.detail = "invalid", f"last event is not a result: {str(final)[:200]}"
        return
    text, ids, streamed_ids = "", [], 0
    for c in chunks:
        if not c["text"].startswith(text) or c["output_ids"][:len(ids)] != ids:
            rec.outcome, rec.detail = "invalid", f"chunk does not extend the previous one: {str(c)[:200]}"
            return
        streamed_ids += len(c["output_ids"]) - len(ids)
        text, ids = c["text"], c["output_ids"]
    n = meta["completion_tokens"]
    if text != final["text"] or ids != final["output_ids"] or streamed_ids != n or len(final["output_ids"]) != n:
        rec.outcome = "invalid"
        rec.detail = (f"streamed {streamed_ids} ids / {len(text)} chars, result {len(final['output_ids'])} ids / "
                      f"{len(final['text'])} chars, completion_tokens={n}")
        return
    if n != rec.key[1]:
        rec.outcome, rec.detail = "invalid", f"{n} tokens for max_new_tokens={rec.key[1]} with ignore_eos"
        return
    rec.text, rec.output_ids, rec.output_tokens, rec.outcome = final["text"], final["output_ids"], n, "completed"


def _check_openai_stream(rec: Record, events: list[dict[str, Any]]) -> None:
    text = "".join(c.get("text") or "" for e in events for c in e.get("choices", []))
    finished = [c for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    usage = next((e["usage"] for e in events if e.get("usage")), None)
    if len(finished) != 1 or usage is None:
        rec.outcome, rec.detail = "invalid", f"{len(finished)} finish events, usage {usage}"
        return
    n = usage["completion_tokens"]
    if n != rec.key[1]:
        rec.outcome, rec.detail = "invalid", f"{n} tokens for max_tokens={rec.key[1]} with ignore_eos"
        return
    rec.text, rec.output_tokens, rec.outcome = text, n, "completed"


# -- the engine killer --------------------------------------------------------------------------
@dataclass
class Killer:
    """SIGKILLs the engine every ``every`` seconds of health; records each outage as
    ``(kill time, back time)`` (perf_counter seconds). It stays under the server's
    crash-loop rule (``crash_loop``: that many deaths within that many seconds stop the
    restarts), delaying a kill that would reach it: this tests restarts, not that rule."""

    url: str
    front_pid: int
    engine_pid: int
    every: float
    crash_loop: tuple[int, float] | None
    windows: list[tuple[float, float]] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)  # 5xx other than 503 seen while polling
    delayed: int = 0  # kills put off to stay under the crash-loop rule
    failure: str = ""

    async def run(self, session: aiohttp.ClientSession, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await _stopped(stop, self.every + self._crash_loop_delay()):
                return
            if not _is_child(self.engine_pid, self.front_pid):
                self.failure = f"pid {self.engine_pid} is not the server's engine process; not killing it"
                return
            os.kill(self.engine_pid, signal.SIGKILL)
            killed_at, old = time.perf_counter(), self.engine_pid
            pid = await wait_healthy(session, self.url, HEALTH_WAIT_S, not_pid=old, anomalies=self.anomalies)
            self.windows.append((killed_at, time.perf_counter()))
            if pid is None:
                self.failure = f"the server was not healthy with a new engine within {HEALTH_WAIT_S:.0f} s of a kill"
                return
            self.engine_pid = pid

    def _crash_loop_delay(self) -> float:
        """Seconds to wait beyond ``every`` so that the next kill is not the
        crash-loop's last death (1 s of margin)."""
        if self.crash_loop is None:
            return 0.0
        deaths, window = self.crash_loop
        at = time.perf_counter() + self.every
        recent = sorted(k for k, _ in self.windows if at - k < window + 1.0)
        if len(recent) < deaths - 1:
            return 0.0
        self.delayed += 1
        return recent[len(recent) - (deaths - 1)] + window + 1.0 - at


async def _stopped(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False


def crash_loop_rule() -> tuple[int, float] | None:
    """The server's crash-loop rule (deaths, window in seconds), if it has one."""
    from plait.runtime.server import front

    deaths, window = getattr(front, "CRASH_LOOP_DEATHS", None), getattr(front, "CRASH_LOOP_WINDOW_S", None)
    return (int(deaths), float(window)) if deaths and window else None


def _is_child(pid: int, parent: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1]) == parent
    except (OSError, ValueError, IndexError):
        return False


async def get_json(session: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
        return r.status, await r.json(content_type=None)


async def wait_healthy(session: aiohttp.ClientSession, url: str, limit: float, not_pid: int | None = None,
                       anomalies: list[str] | None = None) -> int | None:
    """Poll /health (and /server_info's engine_pid) until the server serves with an
    engine other than ``not_pid``; its engine pid, or None after ``limit`` seconds.
    Answers of 500 or more other than 503 go to ``anomalies``."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        try:
            status, _ = await get_json(session, url + "/health")
            if status == 200:
                status, info = await get_json(session, url + "/server_info")
                if status >= 500 and status != 503 and anomalies is not None:
                    anomalies.append(f"GET /server_info: HTTP {status}: {str(info)[:200]}")
                pid = info.get("engine_pid") if status == 200 else None
                if pid is not None and pid != not_pid:
                    return pid
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        await asyncio.sleep(0.2)
    return None


# -- the run ------------------------------------------------------------------------------------
@dataclass
class RunResult:
    records: list[Record]
    elapsed: float
    killer: Killer | None
    healthy: bool
    idle_info: dict[str, Any] | None
    idle_wait_s: float
    restarts: float | None  # the server's plait_engine_restarts_total, when it exports it

    @property
    def kills(self) -> list[tuple[float, float]]:
        return self.killer.windows if self.killer is not None else []


async def soak(url: str, engine_pid: int, front_pid: int, args: argparse.Namespace) -> RunResult:
    rng = random.Random(args.seed)
    prompts = prompt_pool(rng)
    kinds, weights = list(KINDS), list(KINDS.values())
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        _, info = await get_json(session, url + "/model_info")
        vocab_size, model = info["vocab_size"], info["served_model_name"]
        records: list[Record] = []
        issued = 0
        start = time.perf_counter()
        deadline = start + args.duration

        async def client(i: int) -> None:
            nonlocal issued
            crng = random.Random(f"{args.seed}-{i}")  # per client: the mix does not depend on timing
            while time.perf_counter() < deadline and issued < args.max_requests:
                issued += 1
                kind = crng.choices(kinds, weights)[0]
                rec = await send(session, url, make_spec(kind, crng, prompts, vocab_size, model, args.request_timeout))
                records.append(rec)
                if rec.status == 503:  # the engine is restarting: back off as told (bounded)
                    await asyncio.sleep(min(rec.retry_after if rec.retry_after is not None else 0.5, 2.0))

        stop = asyncio.Event()
        killer = None
        if args.kill_engine_every:
            killer = Killer(url, front_pid, engine_pid, args.kill_engine_every, crash_loop_rule())
            kill_task = asyncio.ensure_future(killer.run(session, stop))
        await asyncio.gather(*(client(i) for i in range(args.clients)))
        elapsed = time.perf_counter() - start
        stop.set()
        if killer is not None:
            await kill_task
        for rec in records:
            if rec.outcome == "http_5xx" and rec.status == 503 and killer is not None \
                    and any(rec.start <= b + 1.0 and rec.end >= a for a, b in killer.windows):
                rec.outcome = "fault"
        healthy = await wait_healthy(session, url, HEALTH_WAIT_S) is not None
        idle_info, t0 = None, time.perf_counter()
        while healthy and time.perf_counter() - t0 < IDLE_WAIT_S:
            status, info = await get_json(session, url + "/server_info")
            if status == 200 and info.get("running") == 0 and info.get("waiting") == 0 and info.get("in_flight") == 0:
                idle_info = info
                break
            await asyncio.sleep(0.2)
        idle_wait = time.perf_counter() - t0
        return RunResult(records, elapsed, killer, healthy, idle_info, idle_wait, await engine_restarts(session, url))


async def engine_restarts(session: aiohttp.ClientSession, url: str) -> float | None:
    """``plait_engine_restarts_total`` from /metrics (summed over labels), or None."""
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("plait_engine_restarts_total")]
    return sum(values) if values else None


# -- checks and report --------------------------------------------------------------------------
def greedy_mismatches(records: list[Record]) -> list[str]:
    """Keys whose completed greedy outputs differ (text across all greedy kinds, ids
    across native ones)."""
    texts: dict[tuple[str, int], set[str]] = defaultdict(set)
    ids: dict[tuple[str, int], set[tuple[int, ...]]] = defaultdict(set)
    for r in records:
        if r.outcome == "completed" and r.key is not None:
            texts[r.key].add(r.text or "")
            if r.output_ids is not None:
                ids[r.key].add(tuple(r.output_ids))
    bad = [k for k in texts if len(texts[k]) > 1 or len(ids.get(k, ())) > 1]
    return [f"max_new_tokens={k[1]}, prompt {k[0][-40:]!r}: {sorted(texts[k])[:3]}" for k in bad]


def checks(res: RunResult, args: argparse.Namespace) -> list[tuple[str, bool, str]]:
    recs = res.records
    by = Counter(r.outcome for r in recs)
    invalid = [r for r in recs if r.outcome == "invalid"]
    mismatch = greedy_mismatches(recs)
    repeated = sum(1 for n in Counter(r.key for r in recs if r.outcome == "completed" and r.key).values() if n > 1)
    constrained = [r for r in recs if r.kind in ("regex", "json_schema") and r.outcome == "completed"]
    cut = sum(1 for r in constrained if r.finish == "length")
    out = [("tokens: streams complete and consistent, greedy repeats identical, constraints hold",
            not invalid and not mismatch,
            f"{by['completed']} completed, {repeated} greedy keys repeated, {len(constrained) - cut} constrained "
            f"outputs checked ({cut} cut off by max_new_tokens); {len(invalid)} invalid, "
            f"{len(mismatch)} greedy keys differ" + _first([r.detail for r in invalid] + mismatch))]
    info = res.idle_info
    if info is None:
        out.append(("KV pages: no leak once idle", False,
                    "server not healthy" if not res.healthy else f"not idle within {IDLE_WAIT_S:.0f} s"))
    else:
        pool = info["pool"]
        ok = pool["free"] + pool["evictable"] == pool["total"] and pool["locked"] == 0 and info["invariant_ok"] is True
        out.append(("KV pages: no leak once idle", ok,
                    f"pool {pool}, invariant_ok={info['invariant_ok']}, idle after {res.idle_wait_s:.1f} s"
                    + ("" if info["invariant_ok"] else f": {info.get('invariant_error')}")))
    anomalies = res.killer.anomalies if res.killer is not None else []
    fives = [r.detail for r in recs if r.outcome == "http_5xx"] + anomalies
    out.append(("no 5xx except injected faults", not fives,
                f"{len(fives)} 5xx ({len(anomalies)} of them polling after kills), "
                f"{by['fault']} injected faults" + _first(fives)))
    hung = [r for r in recs if r.outcome == "hung"]
    out.append(("no request hung", not hung, f"{len(hung)} hung of {len(recs)}" + _first([r.detail for r in hung])))
    malformed = [r for r in recs if r.kind in MALFORMED_KINDS and r.outcome != "fault"]
    bad_reject = [r for r in malformed if r.outcome != "rejected"]
    out.append(("malformed requests get an OpenAI-shaped 4xx", not bad_reject,
                f"{len(malformed) - len(bad_reject)} of {len(malformed)} (not counting injected faults)"
                + _first([r.detail for r in bad_reject])))
    other = [r for r in recs if r.outcome in ("failed", "unexpected_4xx") and r.kind not in MALFORMED_KINDS]
    out.append(("no other errors", not other,
                f"{len(other)} transport errors or unexpected 4xx" + _first([r.detail for r in other])))
    if res.killer is not None:
        failure = res.killer.failure
        counted = res.restarts is None or res.restarts == len(res.kills)
        out.append(("engine restarts: healthy after every kill and after the run",
                    res.healthy and not failure and counted,
                    f"{len(res.kills)} kills, plait_engine_restarts_total "
                    f"{'not exported' if res.restarts is None else f'{res.restarts:g}'}, "
                    f"health {'ok' if res.healthy else 'not ok'}" + (f"; {failure}" if failure else "")))
    return out


def _first(details: list[str]) -> str:
    return f"; first: {details[0][:300]}" if details else ""


def _ms(xs: list[float], p: float) -> str:
    return f"{1000 * pct(xs, p):.0f}" if xs else "-"


def report(res: RunResult, args: argparse.Namespace) -> None:
    recs = res.records
    outcomes = [o for o in (*OK_OUTCOMES, "invalid", "http_5xx", "unexpected_4xx", "hung", "failed")
                if any(r.outcome == o for r in recs)]
    limit = "--max-requests" if len(recs) >= args.max_requests else "--duration"
    print(f"\n{len(recs)} requests from {args.clients} clients in {res.elapsed:.1f} s (until the last client finished; "
          f"new requests stopped by {limit}; seed {args.seed})")
    print("| kind | sent | " + " | ".join(outcomes) + " | p50 ms | p99 ms | TTFT p50/p99 ms |")
    print("|---|---|" + "---|" * len(outcomes) + "---|---|---|")
    for kind in KINDS:
        rows = [r for r in recs if r.kind == kind]
        if not rows:
            continue
        done = [r.latency for r in rows if r.outcome in ("completed", "rejected")]
        ttft = [r.ttft for r in rows if r.ttft is not None and r.outcome in ("completed", "cancelled")]
        cells = [str(sum(1 for r in rows if r.outcome == o)) for o in outcomes]
        print(f"| {kind} | {len(rows)} | " + " | ".join(cells)
              + f" | {_ms(done, 50)} | {_ms(done, 99)} | {_ms(ttft, 50)} / {_ms(ttft, 99)} |")
    completed = [r for r in recs if r.outcome == "completed"]
    tokens = sum(r.output_tokens for r in completed)
    lat = [r.latency for r in completed]
    ttft = [r.ttft for r in completed if r.ttft is not None]
    print(f"throughput: {len(completed) / res.elapsed:.2f} completed req/s, {len(recs) / res.elapsed:.2f} req/s sent, "
          f"{tokens / res.elapsed:.1f} output tok/s")
    print(f"latency (completed): e2e p50 {_ms(lat, 50)} ms, p99 {_ms(lat, 99)} ms; "
          f"TTFT (streams) p50 {_ms(ttft, 50)} ms, p99 {_ms(ttft, 99)} ms")
    print("load average at the end: " + " ".join(f"{x:.2f}" for x in os.getloadavg())
          + " (other work on this machine skews the timings above)")
    if args.kill_engine_every:
        faults = [r for r in recs if r.outcome == "fault"]
        downtime = sum(b - a for a, b in res.kills)
        print(f"engine kills: {len(res.kills)} (every {args.kill_engine_every:g} s of health; "
              f"{res.killer.delayed} put off by the crash-loop rule), "
              f"{downtime:.1f} s down in total; {len(faults)} requests failed because of them "
              f"({sum(r.retry_after is not None for r in faults)} with Retry-After)")


# -- main ---------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model to serve (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--num-threads", type=int, default=None, help="CPU threads of the engine")
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="KV pool size in tokens")
    p.add_argument("--max-running-requests", type=int, default=None, help="most requests decoding at once")
    p.add_argument("--clients", type=int, default=None, help="concurrent clients (default 200; --quick: 20)")
    p.add_argument("--duration", type=float, default=None, help="seconds of load (default 60; --quick: 15)")
    p.add_argument("--max-requests", type=int, default=None, help="requests in total (default 100000; --quick: 2000)")
    p.add_argument("--request-timeout", type=float, default=120.0, help="client timeout of each request (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-engine-every", type=float, default=None, metavar="S",
                   help="SIGKILL the engine S seconds after it was last healthy (needs restart_engine)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 20 clients, 15 s")
    p.add_argument("--echo-logs", action="store_true", help="show the server's log (by default only on failure)")
    args = p.parse_args(argv)
    for name, full, quick in (("clients", 200, 20), ("duration", 60.0, 15.0), ("max_requests", 100_000, 2000)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name in ("clients", "duration", "max_requests", "request_timeout", "kv_cache_tokens"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.kill_engine_every is not None and args.kill_engine_every <= 0:
        p.error(f"--kill-engine-every must be positive, got {args.kill_engine_every}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from plait.runtime.server import launch

    options: dict[str, Any] = {"kv_cache_tokens": args.kv_cache_tokens, "served_model_name": "soak",
                               "echo_logs": args.echo_logs}
    if args.num_threads is not None:
        options["num_threads"] = args.num_threads
    if args.max_running_requests is not None:
        options["max_running_requests"] = args.max_running_requests
    if args.kill_engine_every:
        options["restart_engine"] = True
    print("machine:", machine_line(args.num_threads), flush=True)
    print(f"model {args.model or 'SmolLM2-135M-Instruct (GGUF)'}; options {options}", flush=True)
    try:
        server = launch(args.model, host=HOST, port=0, **options)
    except ValueError as e:
        if "restart_engine" in str(e):
            print(f"--kill-engine-every needs a server that restarts its engine, but launch() rejects "
                  f"restart_engine=True: {e}", file=sys.stderr)
            return 2
        raise
    with server:
        print(f"server {server.url} (front pid {server.pid}, engine pid {server.engine_pid}); "
              f"{args.clients} clients, {args.duration:g} s, at most {args.max_requests} requests", flush=True)
        res = asyncio.run(soak(server.url, server.engine_pid, server.pid, args))
        results = checks(res, args)
        report(res, args)
        print()
        for name, ok, detail in results:
            print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
        failed = [name for name, ok, _ in results if not ok]
        print(f"\nsoak: {'FAIL' if failed else 'PASS'} ({len(results) - len(failed)}/{len(results)} checks passed)")
        if failed and not args.echo_logs:
            print("--- server log (tail) ---\n" + server.log_tail(), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
