"""The engine process: one loop — receive, schedule, run a step, send what it produced.

Started by the front process as ``python -m plait.runtime.server.engine_proc SPEC``.
It owns the model and the KV memory; nothing else touches them. It connects a PULL
socket (requests from the front) and a PUSH socket (outputs to the front), both
bound by the front on private ``ipc://`` paths. Each step's output is one
:class:`~plait.protocol.EngineOutputs` message. It exits when the front asks, or when
the front process is gone (parent-death signal, and a parent-pid check as backup).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import os
import re
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from plait import protocol as P

logger = logging.getLogger("plait.engine")

STATS_INTERVAL_S = 0.5
PARENT_CHECK_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
_STAT_FIELDS = set(P.EngineStats.__struct_fields__)


@dataclass
class _Track:
    """Per-sequence streaming state: what has already been sent to the front."""

    req: Any  # plait.runtime.request.Req
    base: str
    index: int
    stream: bool
    sent_ids: int = 0
    sent_text: int = 0
    sent_logprobs: int = 0
    first_token_time: float | None = None


def safe_text_len(text: str, stops: list[str]) -> int:
    """Length of the prefix of ``text`` that can be streamed: it holds back the longest
    suffix that is a proper prefix of a stop string (it may still complete to one and
    then be trimmed)."""
    if not stops or not text:
        return len(text)
    longest = min(max(len(s) for s in stops) - 1, len(text))
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return len(text) - k
    return len(text)


class EngineLoop:
    def __init__(self, engine: Any, pull: zmq.Socket, push: zmq.Socket, parent_pid: int) -> None:
        self.engine = engine
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.live: dict[str, _Track] = {}  # engine rid -> track
        self.pins: dict[str, Any] = {}  # wire pin id -> the engine's pin id
        self.decoder = msgspec.msgpack.Decoder(P.EngineInput)
        self.stopping = False
        self._last_stats = 0.0
        self._last_parent_check = 0.0
        self._expire_pins = getattr(engine, "expire_pins", None)

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        while not self.stopping:
            busy = self.engine.scheduler.has_work()
            if self.pull.poll(0 if busy else IDLE_POLL_MS):
                self._drain()
            out = P.EngineOutputs()
            if self.engine.scheduler.has_work():
                self.engine.step()
            self._collect(out)
            now = time.monotonic()
            if out.chunks or out.results or out.errors or now - self._last_stats >= STATS_INTERVAL_S:
                if not busy and self._expire_pins is not None:
                    self._expire_pins()  # step() expires pins too; an idle loop does not step
                out.stats = P.EngineStats(**{k: v for k, v in self.engine.stats().items() if k in _STAT_FIELDS})
                self._last_stats = now
                self._send(out)
            if now - self._last_parent_check >= PARENT_CHECK_INTERVAL_S:
                self._last_parent_check = now
                if os.getppid() != self.parent_pid:
                    logger.warning("front process is gone; engine exits")
                    return

    def _send(self, msg: msgspec.Struct) -> None:
        self.push.send(P.encode(msg))

    def _drain(self) -> None:
        while True:
            try:
                data = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # the front validates first; if something slips through, fail that request
                rid = _raw_rid(data)
                logger.error("malformed message from the front (rid %r): %s", rid, e)
                if rid:
                    self._send(P.EngineOutputs(errors=[P.ErrorResponse(rid, f"malformed request: {e}", 400)]))
                continue
            self._handle(msg)

    # -- inputs -------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        if isinstance(msg, P.GenerateRequest):
            self._add(msg)
        elif isinstance(msg, P.AbortRequest):
            self.engine.abort(msg.rid)
        elif isinstance(msg, P.FlushCacheRequest):
            ok = self.engine.flush_cache()
            self._send(P.FlushCacheResult(msg.rid, ok, "" if ok else "requests are running; flush when idle"))
        elif isinstance(msg, P.ServerInfoRequest):
            self._send(P.ServerInfo(msg.rid, self.server_info()))
        elif isinstance(msg, P.PinRequest):
            self._pin(msg)
        elif isinstance(msg, P.UnpinRequest):
            self._unpin(msg)
        elif isinstance(msg, P.EngineShutdown):
            self.stopping = True

    def _add(self, msg: P.GenerateRequest) -> None:
        try:
            reqs = self.engine.add_request(
                msg.input_ids or [], msg.sampling_params, rid=msg.rid, cache_salt=msg.cache_salt,
                return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
                top_logprobs_num=msg.top_logprobs_num,
            )
        except (ValueError, TypeError) as e:
            self._send(P.EngineOutputs(errors=[error_from_exception(msg.rid, e)]))
            return
        except Exception as e:  # noqa: BLE001  (one bad request must not stop the engine)
            logger.exception("add_request failed for %s", msg.rid)
            self._send(P.EngineOutputs(errors=[
                P.ErrorResponse(msg.rid, f"internal error: {type(e).__name__}: {e}", 500, "server_error")
            ]))
            return
        for i, r in enumerate(reqs):
            self.live[r.rid] = _Track(r, msg.rid, i, msg.stream)

    def _pin(self, msg: P.PinRequest) -> None:
        pin = getattr(self.engine, "pin_prefix", None)
        if pin is None:
            self._send(P.ErrorResponse(msg.rid, "this engine does not support pinning prefixes", 501, "server_error"))
            return
        try:
            pin_id = pin(msg.input_ids or [], msg.ttl_s, cache_salt=msg.cache_salt)
        except (ValueError, TypeError, RuntimeError) as e:
            self._send(error_from_exception(msg.rid, e))
            return
        self.pins[str(pin_id)] = pin_id
        self._send(P.PinResult(msg.rid, str(pin_id), len(msg.input_ids or [])))

    def _unpin(self, msg: P.UnpinRequest) -> None:
        unpin = getattr(self.engine, "unpin", None)
        if unpin is None:
            self._send(P.ErrorResponse(msg.rid, "this engine does not support pinning prefixes", 501, "server_error"))
            return
        pin_id = self.pins.pop(msg.pin_id, None)
        ok = bool(unpin(pin_id)) if pin_id is not None else False
        self._send(P.UnpinResult(msg.rid, ok))

    # -- outputs ------------------------------------------------------------------------
    def _collect(self, out: P.EngineOutputs) -> None:
        now = time.monotonic()
        for rid, t in list(self.live.items()):
            r = t.req
            if t.first_token_time is None and r.output_len > 0:
                t.first_token_time = now
            if r.finished:
                del self.live[rid]
                res = self.engine.pop_result(r)
                reason = r.finish_reason or {}
                if reason.get("status_code") == 400:
                    # the request failed after admission (its constraint's index did not
                    # build within the limits): a client error, not a result
                    out.errors.append(P.ErrorResponse(
                        t.base, reason.get("message", "invalid request"), 400, "invalid_request_error",
                        "json_schema" if r.params.json_schema is not None else "regex",
                    ))
                    continue
                if t.stream:
                    chunk = self._chunk(t, res["text"], final=True)
                    if chunk is not None:
                        out.chunks.append(chunk)
                meta = res["meta_info"]
                meta["id"] = t.base
                meta["first_token_time"] = t.first_token_time
                out.results.append(P.GenerateResult(t.base, t.index, res["text"], res["output_ids"], meta))
            elif t.stream and r.output_len > t.sent_ids:
                chunk = self._chunk(t, r.text, final=False)
                if chunk is not None:
                    out.chunks.append(chunk)

    def _chunk(self, t: _Track, text: str, final: bool) -> P.StreamChunk | None:
        r = t.req
        end = len(text) if final else max(safe_text_len(text, r.params.stop), t.sent_text)
        piece = text[t.sent_text : end]
        ids = r.output_ids[t.sent_ids :]
        if not piece and not ids:
            return None
        t.sent_text, t.sent_ids = end, r.output_len
        meta: dict[str, Any] = {"completion_tokens": r.output_len}
        if r.return_logprob:
            meta["output_token_logprobs"] = r.output_token_logprobs[t.sent_logprobs :]
            if r.top_logprobs_num > 0:
                meta["output_top_logprobs"] = r.output_top_logprobs[t.sent_logprobs :]
            t.sent_logprobs = len(r.output_token_logprobs)
        return P.StreamChunk(t.base, t.index, piece, ids, meta)

    def server_info(self) -> dict[str, Any]:
        e = self.engine
        invariant_error = ""
        try:
            e.check_invariants()
        except AssertionError as err:
            invariant_error = str(err)
        mc = e.model_config
        info: dict[str, Any] = {
            "engine_pid": os.getpid(),
            "model_path": e.source.path,
            "architecture": mc.architecture,
            "context_len": e.context_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": sorted(e.eos_ids),
            "config": dataclasses.asdict(e.config),
            "device": str(e.device),
            "pool": e.pool_usage(),
            "invariant_ok": not invariant_error,
            "invariant_error": invariant_error,
            "live_requests": len(self.live),
            **e.stats(),
        }
        pin_stats = getattr(e, "pin_stats", None)
        if pin_stats is not None:
            info["pins"] = pin_stats()
        return info


_REQUEST_FIELDS = {"input_ids", "prompt", "return_logprob", "logprob_start_len", "top_logprobs_num", "cache_salt",
                   "rid", "sampling_params"}


def param_of(message: str) -> str | None:
    """The field a validation message starts with (``max_new_tokens=-1 is invalid``,
    ``stop is invalid: ...``), or None."""
    from plait.runtime.sampling_params import SamplingParams

    m = re.match(r"([A-Za-z_]\w*)", message)
    head = m.group(1) if m else ""
    if head in _REQUEST_FIELDS or head in {f.name for f in dataclasses.fields(SamplingParams)}:
        return "input_ids" if head == "prompt" else head
    if message.startswith("unknown sampling parameter"):
        return "sampling_params"
    return None


def error_from_exception(rid: str, e: BaseException) -> P.ErrorResponse:
    """A 400 naming the field the engine's validation message names."""
    text = str(e)
    return P.ErrorResponse(rid, text, 400, "invalid_request_error", param_of(text))


def _raw_rid(data: bytes) -> str:
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return ""
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else ""


def _set_parent_death_signal() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    parent_pid = spec["parent_pid"]
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front coordinates shutdown on Ctrl-C
    logging.basicConfig(
        level=getattr(logging, spec.get("log_level", "warning").upper()),
        format="%(asctime)s engine[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    if os.getppid() != parent_pid:
        return 1
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(spec["in_addr"])
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(spec["out_addr"])
    try:
        from plait.runtime.engine import Engine

        engine = Engine(spec["model"], **spec["engine"])
    except Exception as e:  # noqa: BLE001  (any load failure is reported to the front)
        logger.error("engine failed to start:\n%s", traceback.format_exc())
        push.send(P.encode(P.EngineStartupError(f"{type(e).__name__}: {e}")))
        push.close(linger=5000)
        ctx.term()
        return 1
    loop = EngineLoop(engine, pull, push, parent_pid)
    push.send(P.encode(P.EngineReady(loop.server_info())))
    code = 0
    try:
        loop.run()
    except Exception:  # noqa: BLE001
        # a bug in a step may have left the engine inconsistent: fail what is in flight, exit
        msg = traceback.format_exc()
        logger.error("engine loop crashed:\n%s", msg)
        errors = [
            P.ErrorResponse(t.base, f"engine error: {msg.strip().splitlines()[-1]}", 500, "server_error")
            for t in loop.live.values()
        ]
        push.send(P.encode(P.EngineOutputs(errors=errors)))
        code = 1
    engine.shutdown()
    pull.close(linger=0)
    push.close(linger=2000)
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
