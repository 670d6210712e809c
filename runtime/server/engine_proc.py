"""The engine process: one loop — receive, schedule, run a step, send what it produced.

Started by the front process as ``python -m plait.runtime.server.engine_proc SPEC``, once
per data-parallel replica (``dp_rank`` in the spec).
It owns the model and the KV memory; nothing else touches them. It connects a PULL
socket (requests from the front) and a PUSH socket (outputs to the front), both
bound by the front on private ``ipc://`` paths. Each step's output is one
:class:`~plait.protocol.EngineOutputs` message. It exits when the front asks, or when
the front process is gone (parent-death signal, and a parent-pid check as backup).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.config import EngineConfig, build_trusted
from plait.runtime.engine import Engine
from plait.runtime.output_processor import RequestOutput
from plait.runtime.process import freeze_startup_objects, set_parent_death_signal
from plait.runtime.validation import GenerateInput

logger = logging.getLogger("plait.engine")

STATS_INTERVAL_S = 0.5
PARENT_CHECK_INTERVAL_S = 0.5
IDLE_POLL_MS = 100
# a step's outputs go to the front in messages of at most this many items: a step that
# ends 600k sequences (a huge n x prompts request aborted) was one message the front's
# event loop decoded and dispatched in one go, stalling every client for 10 s
OUTPUTS_PER_MESSAGE = 2048
_STAT_FIELDS = set(P.EngineStats.__struct_fields__)


class EngineLoop:
    """Receive validated messages from the front, step the engine, send each step's
    outputs (:class:`~plait.runtime.output_processor.RequestOutput`) as one
    :class:`~plait.protocol.EngineOutputs` message."""

    def __init__(self, engine: Engine, pull: zmq.Socket, push: zmq.Socket, parent_pid: int) -> None:
        self.engine = engine
        self.pull = pull
        self.push = push
        self.parent_pid = parent_pid
        self.streams: dict[str, int] = {}  # client rid that streams -> its sequences not finished
        self.decoder = msgspec.msgpack.Decoder(P.EngineInput)
        self.stopping = False
        self._last_stats = 0.0
        self._last_parent_check = 0.0

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        while not self.stopping:
            busy = engine.has_work()
            if self.pull.poll(0 if busy else IDLE_POLL_MS):
                self._drain()
            out = P.EngineOutputs()
            if engine.has_work():
                self._collect(engine.step(), out)
            else:
                engine.expire_pins()  # step() expires pins too; an idle loop does not step
            now = time.monotonic()
            if out.chunks or out.results or out.errors or now - self._last_stats >= STATS_INTERVAL_S:
                out.stats = P.EngineStats(**{k: v for k, v in engine.stats().items() if k in _STAT_FIELDS})
                self._last_stats = now
                self._send_outputs(out)
            if now - self._last_parent_check >= PARENT_CHECK_INTERVAL_S:
                self._last_parent_check = now
                if os.getppid() != self.parent_pid:
                    logger.warning("front process is gone; engine exits")
                    return
                # a rank that died while the engine idled: exit now (the front restarts the
                # engine) rather than fail the next request with a 500 and report health meanwhile
                engine.check_workers()

    def _send_outputs(self, out: P.EngineOutputs) -> None:
        """Send a step's outputs in messages of at most :data:`OUTPUTS_PER_MESSAGE`
        items, in their order (chunks, results, errors; the stats with the first)."""
        k = OUTPUTS_PER_MESSAGE
        if len(out.chunks) + len(out.results) + len(out.errors) <= k:
            self._send(out)
            return
        stats = out.stats
        for name in ("chunks", "results", "errors"):
            items = getattr(out, name)
            for i in range(0, len(items), k):
                self._send(P.EngineOutputs(**{name: items[i:i + k]}, stats=stats))
                stats = None

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
    def _handle(self, msg: P.EngineInput) -> None:
        try:
            if isinstance(msg, P.EngineGenerate):
                inp = GenerateInput.from_wire(msg)
                self.engine.submit(inp)
                if msg.stream:
                    self.streams[msg.rid] = inp.params.n
            elif isinstance(msg, P.AbortRequest):
                self.engine.abort(msg.rid, msg.reason or "aborted by request")
            elif isinstance(msg, P.FlushCacheRequest):
                ok = self.engine.flush_cache(msg.cache_salt)
                self._send(P.FlushCacheResult(msg.rid, ok, "" if ok else "requests using it are running; flush when idle"))
            elif isinstance(msg, P.ServerInfoRequest):
                self._send(P.ServerInfo(msg.rid, self.engine.server_info()))
            elif isinstance(msg, P.PinRequest):
                pin_id = self.engine.pin_prefix(msg.input_ids or [], msg.ttl_s, cache_salt=msg.cache_salt)
                self._send(P.PinResult(msg.rid, pin_id, len(msg.input_ids or [])))
            elif isinstance(msg, P.UnpinRequest):
                self._send(P.UnpinResult(msg.rid, self.engine.unpin(msg.pin_id)))
            elif isinstance(msg, P.UpdateWeightsRequest):
                ok = self.engine.update_weights_from_disk(msg.model_path)
                self._send(P.UpdateWeightsResult(msg.rid, ok, "" if ok else "requests are running; update when idle"))
            elif isinstance(msg, P.EngineShutdown):
                self.stopping = True
        except RequestError as e:
            error = P.error_response(msg.rid, e)
            self._send(P.EngineOutputs(errors=[error]) if isinstance(msg, P.EngineGenerate) else error)
        except Exception as e:  # noqa: BLE001  (one bad request must not stop the engine)
            logger.exception("handling %s failed", type(msg).__name__)
            error = P.ErrorResponse(msg.rid, f"internal error: {type(e).__name__}: {e}", 500, "server_error")
            self._send(P.EngineOutputs(errors=[error]) if isinstance(msg, P.EngineGenerate) else error)

    # -- outputs ------------------------------------------------------------------------
    def _collect(self, outputs: list[RequestOutput], out: P.EngineOutputs) -> None:
        for o in outputs:
            if o.error is not None:
                out.errors.append(P.error_response(o.group, o.error))
                self.streams.pop(o.group, None)
                continue
            left = self.streams.get(o.group)
            if left is not None:
                chunk = o.chunk()
                if chunk is not None:
                    out.chunks.append(chunk)
            if o.result is not None:
                out.results.append(P.GenerateResult(o.group, o.index, o.result["text"], o.result["output_ids"],
                                                    {**o.result["meta_info"], "id": o.group}))
                if left is not None:
                    if left > 1:
                        self.streams[o.group] = left - 1
                    else:
                        del self.streams[o.group]


def _raw_rid(data: bytes) -> str:
    try:
        obj = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return ""
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else ""


def main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    parent_pid = spec["parent_pid"]
    set_parent_death_signal()
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
        # validated by the front's settings, once: rebuilt here without checking again
        engine = Engine(spec["model"], config=build_trusted(EngineConfig, spec["engine"]), dp_rank=spec["dp_rank"],
                        dp_size=spec.get("dp_size", 1))
    except Exception as e:  # noqa: BLE001  (any load failure is reported to the front)
        if isinstance(e, ValueError):  # a refusal that names its option: its message is the news
            logger.error("engine failed to start: %s", e)
            logger.debug("engine start-up refusal:\n%s", traceback.format_exc())
        else:
            logger.error("engine failed to start:\n%s", traceback.format_exc())
        push.send(P.encode(P.EngineStartupError(f"{type(e).__name__}: {e}")))
        pull.close(linger=0)  # (left open, ctx.term() blocked until the front killed the process 5 s later)
        push.close(linger=5000)
        ctx.term()
        return 1
    loop = EngineLoop(engine, pull, push, parent_pid)
    freeze_startup_objects()
    push.send(P.encode(P.EngineReady(engine.server_info())))
    code = 0
    try:
        loop.run()
    except Exception as e:  # noqa: BLE001
        # a bug in a step may have left the engine inconsistent: fail what is in flight, exit
        msg = traceback.format_exc()
        logger.error("engine loop crashed:\n%s", msg)
        errors = [
            P.ErrorResponse(rid, f"engine error: {msg.strip().splitlines()[-1]}", 500, "server_error")
            for rid in engine.live_rids()
        ]
        push.send(P.encode(P.EngineOutputs(errors=errors)))
        push.send(P.encode(P.EngineFatal(f"{type(e).__name__}: {e}")))
        code = 1
    engine.shutdown()
    pull.close(linger=0)
    push.close(linger=2000)
    ctx.term()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
