"""The front process: request table, tokenizer, engine link, language-client socket.

One asyncio loop runs everything here: the HTTP server (``http_api``), the ZMQ ROUTER
for language clients, the reader of the engine's outputs and a watchdog on the engine
process. Nothing in it waits on the model: requests go to the engine as messages and
their outputs come back as messages, routed to each request's ``sink``.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

import plait
from plait import protocol as P
from plait.errors import RequestError
from plait.runtime.logprob_text import add_token_text
from plait.runtime.prompt_tokens import encode_prompt
from plait.runtime.server.args import ServerArgs
from plait.runtime.server.metrics import COUNTER_FIELDS, Metrics
from plait.runtime.validation import GenerateInput, ModelLimits, check_text, prompt_name, validate_generate

logger = logging.getLogger("plait.front")

WATCHDOG_INTERVAL_S = 0.1
CONTROL_TIMEOUT_S = 60.0
CLIENT_SNDHWM = 100_000
CRASH_LOOP_DEATHS = 3  # this many engine deaths ...
CRASH_LOOP_WINDOW_S = 60.0  # ... within this many seconds stop the restarts
COSTLY_TEXT_CHARS = 16_384  # prompts longer than this are tokenized in a worker thread

Sink = Callable[[P.ServerResponse], None]  # where a request's outputs go (HTTP queue or a ZMQ client)


@dataclass
class ReqState:
    """One in-flight generate request (all ``n`` sequences of one prompt), on the
    engine replica ``replica``; ``cost`` is the tokens each sequence may take there
    (prompt + max_new_tokens), counted in that replica's load until it finishes."""

    rid: str
    n: int
    stream: bool
    sink: Sink
    owner: bytes | None  # ZMQ identity of a language client; None for HTTP
    prompt_tokens: int
    text_in_logprobs: bool = False
    replica: int = 0
    cost: int = 0
    created: float = field(default_factory=time.monotonic)
    done: set[int] = field(default_factory=set)
    last_token: dict[int, float] = field(default_factory=dict)
    cache_salt: str | None = None


@dataclass
class Replica:
    """One engine process of the server (``--dp-size`` of them) and what the front
    knows of it; the front is the one writer. ``push`` sends to it; ``restart`` starts
    a new process after a death (None: no restarts); ``load_tokens`` /
    ``load_requests``: what is in flight there (the dispatch policy's input)."""

    rank: int
    proc: subprocess.Popen
    push: zmq.asyncio.Socket
    restart: Callable[[], subprocess.Popen] | None = None
    alive: bool = True
    restarting: bool = False
    exit_code: int | None = None
    last_error: str = ""
    # why its engine process last exited: what the process said before it went (a crashed
    # step, a dead tensor-parallel rank) or the signal that killed it; kept after a restart
    # until the next exit. ``fatal``: said by the live process, not yet exited
    exit_reason: str = ""
    fatal: str = ""
    last_code: int | None = None  # that exit's code (exit_code goes back to None once a restart is ready)
    deaths: list[float] = field(default_factory=list)
    stats: P.EngineStats = field(default_factory=P.EngineStats)
    load_tokens: int = 0
    load_requests: int = 0
    # the counters of this replica's earlier (dead) engine processes: /metrics counters
    # carry on from them instead of going back to 0 after a restart
    carried: dict[str, float] = field(default_factory=dict)

    def last_exit(self) -> str:
        """How its last engine process ended ("" while none has): exit code and reason."""
        if self.last_code is None and not self.exit_reason:
            return ""
        return f"exit code {self.last_code}" + (f": {self.exit_reason}" if self.exit_reason else "")

    def reported_stats(self) -> P.EngineStats:
        """``stats`` with the counters of earlier processes added (for /metrics)."""
        if not self.carried:
            return self.stats
        return msgspec.structs.replace(self.stats, **{k: getattr(self.stats, k) + v for k, v in self.carried.items()})

    def carry_counters(self) -> None:
        """Keep the counters of the engine process that just died (before ``stats`` resets)."""
        for name in COUNTER_FIELDS:
            self.carried[name] = self.carried.get(name, 0) + getattr(self.stats, name)

    def state(self) -> str:
        """``ok``, ``restarting`` or ``down``."""
        return "ok" if self.alive else ("restarting" if self.restarting else "down")


class Front:
    """Validates and routes requests to the engine replicas (``replicas``, made by
    :mod:`plait.runtime.server.serve`); ``router`` is the language clients' socket,
    bound at ``zmq_address``.

    Dispatch (data parallel): a generate request goes to the live replica with the
    fewest tokens in flight (prompt + max_new_tokens of its unfinished sequences;
    fewest requests, then lowest rank, on a tie); the ``n`` sequences of one request
    stay together on one replica, so they share the prompt's KV. Cache flushes and
    weight updates go to every replica (they succeed where all succeed); a pin is taken
    on every live replica, so a batch's requests hit the pinned prefix wherever the
    dispatcher sends them (each replica spends its own pin budget on it)."""

    def __init__(self, args: ServerArgs, tokenizer: Any, model_info: dict[str, Any], *,
                 replicas: list[Replica], router: zmq.asyncio.Socket, zmq_address: str,
                 replica_infos: list[dict[str, Any]] | None = None) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model_info = model_info  # context_len, vocab_size, ... from the engine
        self.context_len: int = model_info["context_len"]
        self.vocab_size: int = model_info["vocab_size"]
        pools = [info.get("max_total_num_tokens") for info in replica_infos or [model_info]]
        self.limits = ModelLimits(self.vocab_size, self.context_len, args.engine.grammar_backend,
                                  min(pools) if pools and None not in pools else None)
        # no token is longer than this many characters: a longer text cannot fit
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1) if tokenizer else 1
        self.max_prompt_chars = self.context_len * max(self.max_token_chars, 1)
        # a chat template given to the server: its end-of-turn text ends chat replies
        # (the tokenizer carries it: serve loaded it with the resolved template)
        self.turn_end = given_turn_end(getattr(tokenizer, "chat_template", None), tokenizer) \
            if args.engine.chat_template is not None else None
        self.table: dict[str, ReqState] = {}
        # control id -> (future, client rid, replica rank)
        self.pending: dict[str, tuple[asyncio.Future, str, int]] = {}
        # a client's pin id -> (expiry, [(replica rank, that replica's pin id)])
        self.pins: dict[str, tuple[float, list[tuple[int, str]]]] = {}
        self.replicas = replicas
        self.metrics = Metrics(args.model_name, lambda: [r.reported_stats() for r in self.replicas], len(replicas))
        self.router = router
        self.zmq_address = zmq_address
        self._engine_decoder = msgspec.msgpack.Decoder(P.EngineMessage)
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}
        self._vocab_kind: str | None = None  # the tokenizer's spelling of bytes (constrained.vocab)
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task] = set()
        # language clients that ping are watched: silent for client_timeout_s = gone
        self._client_seen: dict[bytes, float] = {}
        self._watched: set[bytes] = set()

    # -- tokens ---------------------------------------------------------------------------
    def encode(self, text: str, param: str, *, bos: bool = True) -> list[int]:
        """Token ids of ``text`` (:func:`~plait.runtime.prompt_tokens.encode_prompt`; ``bos=False``
        for a rendered chat); a text too long to fit the context whatever its tokens is
        refused before the tokenizer runs."""
        if len(text) > self.max_prompt_chars:
            raise RequestError(
                f"{prompt_name(param)} has {len(text)} characters; this model's context length is "
                f"{self.context_len} tokens of at most {self.max_token_chars} characters, so at most {self.max_prompt_chars} characters fit",
                param,
            )
        check_text(text, param)
        return encode_prompt(self.tokenizer, text, bos=bos)

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            s = self._token_text[tid] = self.tokenizer.decode([tid])
        return s

    def token_bytes(self, tid: int) -> bytes:
        """The raw bytes token ``tid`` writes: OpenAI's ``bytes`` of a logprob. A piece
        of a multi-byte character has the text ``"\ufffd"`` alone, whose bytes are not
        the piece's (a client joining the bytes of an emoji's tokens got garbage)."""
        b = self._token_bytes.get(tid)
        if b is None:
            from plait.runtime.constrained.vocab import detect_kind, token_to_bytes

            if self._vocab_kind is None:
                self._vocab_kind = detect_kind(self.tokenizer)
            tok = self.tokenizer.convert_ids_to_tokens(tid)
            b = token_to_bytes(tok, self._vocab_kind) if isinstance(tok, str) else self.token_text(tid).encode()
            self._token_bytes[tid] = b
        return b

    # -- requests -------------------------------------------------------------------------
    def new_rid(self, prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def engine_state(self) -> str:
        """``ok`` while a replica serves, else ``restarting`` while one restarts, else
        ``down``; a dead process is noticed here at once."""
        states = [self._poll(r) for r in self.replicas]
        return next((st for st in ("ok", "restarting") if st in states), "down")

    def _poll(self, r: Replica) -> str:
        if r.alive and r.proc.poll() is not None:
            self.on_engine_death(r, r.proc.returncode)
        return r.state()

    def check_up(self) -> None:
        """Raise a 503 unless a replica serves."""
        state = self.engine_state()
        if state == "ok":
            return
        r = next((r for r in self.replicas if r.state() == state), self.replicas[0])
        which = "the engine process" if len(self.replicas) == 1 else f"every engine replica is down; replica {r.rank}"
        if state == "restarting":
            raise RequestError(f"{which} exited (code {r.exit_code}{self._reason(r)}) and is restarting; retry shortly",
                               None, 503, "server_error")
        raise RequestError(
            f"{which} is not running (exit code {r.exit_code}{self._reason(r)}); the server cannot serve requests"
            + (f" ({r.last_error})" if r.last_error else ""),
            None, 503, "server_error",
        )

    @staticmethod
    def _reason(r: Replica) -> str:
        return f": {r.exit_reason}" if r.exit_reason else ""

    def pick_replica(self) -> Replica:
        """The dispatch policy: the live replica with the fewest tokens in flight
        (then fewest requests, then lowest rank). Call after :meth:`check_up`."""
        live = [r for r in self.replicas if r.alive]
        return min(live, key=lambda r: (r.load_tokens, r.load_requests, r.rank))

    async def submit(self, req: P.GenerateRequest, sink: Sink, owner: bytes | None = None,
                     prompt_param: str | None = None) -> ReqState:
        """Validate, tokenize and send one generate request to the engine: the one
        place a served request is checked (:func:`validate_generate`; the engine trusts
        the result). A request that is costly to prepare (a long text, a constraint to
        translate) is prepared in a worker thread, off this event loop. Raises
        :class:`RequestError`; outputs go to ``sink``."""
        check_rid(req.rid, self.table)
        if self._is_costly(req):
            inp = await asyncio.to_thread(self.prepare, req, prompt_param)
            check_rid(req.rid, self.table)  # the table changed while it was prepared
        else:
            inp = self.prepare(req, prompt_param)
        self.check_up()  # after validation: a malformed request is a 400 even while the engine restarts
        return self._send(inp, req, sink, owner)

    @staticmethod
    def _is_costly(req: P.GenerateRequest) -> bool:
        sp = req.sampling_params
        return (
            (req.text is not None and len(req.text) > COSTLY_TEXT_CHARS)
            or (req.input_ids is not None and len(req.input_ids) > COSTLY_TEXT_CHARS)
            or (isinstance(sp, dict) and (sp.get("json_schema") is not None or sp.get("regex") is not None))
        )

    def prepare(self, req: P.GenerateRequest, prompt_param: str | None = None) -> GenerateInput:
        """Tokenize and validate (no state touched: safe in a worker thread)."""
        if (req.text is None) == (req.input_ids is None):
            raise RequestError("exactly one of text and input_ids must be given", prompt_param or "text")
        if req.text is not None:
            ids = self.encode(req.text, prompt_param or "text")
        else:
            ids = req.input_ids or []
        inp = validate_generate(
            req.rid, ids, req.sampling_params, self.limits,
            prompt_param=prompt_param or ("text" if req.text is not None else "input_ids"),
            cache_salt=req.cache_salt, return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num, stream=req.stream,
        )
        return inp

    def _send(self, inp: GenerateInput, req: P.GenerateRequest, sink: Sink, owner: bytes | None) -> ReqState:
        ids = inp.input_ids
        try:
            data = P.encode(inp.to_wire())
        except (OverflowError, TypeError, UnicodeEncodeError, msgspec.EncodeError) as e:  # (a lone surrogate)
            raise RequestError(f"the request holds a value that cannot be sent to the engine: {e}", "sampling_params") from None
        replica = self.pick_replica()
        if not _push(replica.push, data):
            raise RequestError(f"{self._which(replica)} is not reading its requests (its process has exited); "
                               "retry shortly", None, 503, "server_error")
        cost = len(ids) + inp.params.max_new_tokens
        st = ReqState(req.rid, inp.params.n, req.stream, sink, owner, len(ids), req.return_text_in_logprobs,
                      replica.rank, cost, cache_salt=req.cache_salt)
        self.table[req.rid] = st
        replica.load_tokens += cost * st.n
        replica.load_requests += 1
        return st

    def _which(self, r: Replica) -> str:
        return "the engine process" if len(self.replicas) == 1 else f"engine replica {r.rank}"

    def _settle(self, st: ReqState, sequences: int, ended: bool) -> None:
        """``sequences`` of ``st`` ended: their tokens leave the replica's load; when the
        request ``ended`` (all of them), it leaves the table."""
        r = self.replicas[st.replica]
        r.load_tokens -= st.cost * sequences
        if ended:
            r.load_requests -= 1
            self.table.pop(st.rid, None)

    def abort(self, rid: str, reason: str = "") -> bool:
        st = self.table.get(rid)
        if st is None or not self.replicas[st.replica].alive:
            return False
        return _push(self.replicas[st.replica].push, P.encode(P.AbortRequest(rid, reason=reason)))

    def abort_all(self, owner: bytes | None = None, everyone: bool = False, reason: str = "") -> list[str]:
        rids = [rid for rid, st in self.table.items() if everyone or st.owner == owner]
        for rid in rids:
            self.abort(rid, reason)
        return rids

    async def control(self, msg: P.FlushCacheRequest | P.ServerInfoRequest | P.PinRequest | P.UnpinRequest
                      | P.UpdateWeightsRequest, client_rid: str = "") -> P.ServerResponse | P.UpdateWeightsResult:
        """Send a flush/info/pin/unpin/update message to the engine replicas it concerns
        (the class docstring says which) and wait for their answer."""
        self.check_up()
        if isinstance(msg, P.PinRequest):
            return await self._pin(msg, client_rid)
        if isinstance(msg, P.UnpinRequest):
            return await self._unpin(msg, client_rid)
        live = [r for r in self.replicas if r.alive]
        if len(live) > 1 and isinstance(msg, (P.FlushCacheRequest, P.UpdateWeightsRequest)):
            refusal = self._refused_before(msg, client_rid)
            if refusal is not None:
                return refusal
        replies = await asyncio.gather(*(self._ask(r, msg, client_rid) for r in live))
        if isinstance(msg, P.ServerInfoRequest):
            return replies[0]
        return _all_ok(replies, [r.rank for r in live])

    def _refused_before(self, msg: P.FlushCacheRequest | P.UpdateWeightsRequest,
                        client_rid: str) -> P.FlushCacheResult | P.UpdateWeightsResult | None:
        """With several replicas, the refusal a flush or weight update gets while a
        request it would disturb is in flight on any of them, before any replica is
        asked: each replica refuses only for its own requests, so an idle one applied it
        while a busy one refused (the answer said so, but the cache or the weights
        differed between replicas). The engines still check (a request the front does
        not track, a pin's prefill, is theirs to see)."""
        if isinstance(msg, P.FlushCacheRequest) and msg.cache_salt is not None:
            busy = sorted({st.replica for st in self.table.values() if st.cache_salt == msg.cache_salt})
        else:
            busy = sorted({st.replica for st in self.table.values()})
        if not busy:
            return None
        which = "replica " + ", ".join(str(rank) for rank in busy)
        if isinstance(msg, P.UpdateWeightsRequest):
            return P.UpdateWeightsResult(client_rid, False, f"{which}: requests are running; update when idle "
                                                            "(no replica was updated)")
        return P.FlushCacheResult(client_rid, False, f"{which}: requests using it are running; flush when idle "
                                                     "(no replica was flushed)")

    async def _ask(self, replica: Replica, msg: Any, client_rid: str) -> Any:
        """One control message to one replica, and its answer (``rid``: ``client_rid``)."""
        cid = f"ctl-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        msg = msgspec.structs.replace(msg, rid=cid, api_key=None)
        if not _push(replica.push, P.encode(msg)):
            return P.ErrorResponse(client_rid, f"{self._which(replica)} is not reading its requests (its process "
                                               "has exited); retry shortly", 503, "server_error")
        fut = asyncio.get_running_loop().create_future()
        self.pending[cid] = (fut, client_rid, replica.rank)
        try:
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S)
        finally:
            self.pending.pop(cid, None)

    async def _pin(self, msg: P.PinRequest, client_rid: str) -> P.ServerResponse:
        now = time.monotonic()
        self.pins = {k: v for k, v in self.pins.items() if v[0] > now}  # expired in the engines too
        live = [r for r in self.replicas if r.alive]
        replies = await asyncio.gather(*(self._ask(r, msg, client_rid) for r in live))
        held = [(r.rank, rep.pin_id) for r, rep in zip(live, replies) if isinstance(rep, P.PinResult)]
        failed = next((rep for rep in replies if not isinstance(rep, P.PinResult)), None)
        if failed is not None:  # all or nothing: release what the others took
            await asyncio.gather(*(self._ask(self.replicas[rank], P.UnpinRequest("", pin_id), client_rid)
                                   for rank, pin_id in held))
            return failed
        if len(held) == 1 and len(self.replicas) == 1:
            return replies[0]  # one replica: its own pin id
        pin_id = f"pin-{uuid.uuid4().hex}"
        self.pins[pin_id] = (now + msg.ttl_s, held)
        return P.PinResult(client_rid, pin_id, replies[0].num_tokens)

    async def _unpin(self, msg: P.UnpinRequest, client_rid: str) -> P.ServerResponse:
        if len(self.replicas) == 1:
            return await self._ask(self.replicas[0], msg, client_rid)
        entry = self.pins.pop(msg.pin_id, None)
        if entry is None:
            return P.UnpinResult(client_rid, False)
        held = [(self.replicas[rank], pin_id) for rank, pin_id in entry[1] if self.replicas[rank].alive]
        replies = await asyncio.gather(*(self._ask(r, P.UnpinRequest("", pin_id), client_rid) for r, pin_id in held))
        return P.UnpinResult(client_rid, any(isinstance(rep, P.UnpinResult) and rep.ok for rep in replies))

    async def server_info(self) -> dict[str, Any]:
        """The engines' facts and state (SGLang's ``get_server_info``): the first live
        replica's at the top level with the counters summed over replicas, and each
        replica's own under ``replicas``."""
        live = [r for r in self.replicas if r.alive]
        replies = await asyncio.gather(*(self._ask(r, P.ServerInfoRequest(""), "") for r in live))
        by_rank = {r.rank: rep.info for r, rep in zip(live, replies) if isinstance(rep, P.ServerInfo)}
        replicas = []
        for r in self.replicas:
            entry = dict(by_rank.get(r.rank, {}))
            # the pid from the front's own handle: a replica that did not answer (just
            # restarted, or busy past the ask's deadline) still says which process it is
            entry.update(dp_rank=r.rank, engine_pid=r.proc.pid, engine_state=self._poll(r),
                         last_engine_error=r.last_error, last_engine_exit=r.last_exit(),
                         load_tokens=r.load_tokens, load_requests=r.load_requests)
            replicas.append(entry)
        info: dict[str, Any] = {}
        if by_rank:  # else every engine died while asked
            infos = list(by_rank.values())
            info.update(infos[0])
            for key in _SUMMED:
                if all(key in i for i in infos):
                    info[key] = sum(i[key] for i in infos)
            for key in ("max_total_num_tokens", "max_req_input_len"):  # what one request may use: the smallest
                if all(key in i for i in infos):  # replica's (as the front checks prompts), not replica 0's
                    info[key] = min(i[key] for i in infos)
            if all("pool" in i for i in infos):
                info["pool"] = {k: sum(i["pool"].get(k, 0) for i in infos) for k in infos[0]["pool"]}
            info["invariant_ok"] = all(i.get("invariant_ok", True) for i in infos)
            info["invariant_error"] = "; ".join(i["invariant_error"] for i in infos if i.get("invariant_error"))
        state = self.engine_state()
        info.update(
            version=plait.__version__,
            front_pid=os.getpid(),
            served_model_name=self.args.model_name,
            zmq_address=self.zmq_address,
            protocol_version=P.PROTOCOL_VERSION,
            in_flight=len(self.table),
            healthy=state == "ok",
            engine_state=state,
            last_engine_error="; ".join(r.last_error for r in self.replicas if r.last_error),
            last_engine_exit="; ".join((f"replica {r.rank}: " if len(self.replicas) > 1 else "") + r.last_exit()
                                       for r in self.replicas if r.last_exit()),
            dp_size=len(self.replicas),
            tp_size=self.args.engine.tp_size,
            engine_pids=[r.proc.pid for r in self.replicas],
            replicas=replicas,
            **chat_template_info(self.tokenizer),
        )
        return info

    def loads(self) -> dict[str, Any]:
        """Each replica's load in SGLang's ``/v1/loads`` shape (what SMG's load-aware
        policies read): ``num_total_tokens`` is the tokens in flight there (prompt +
        max_new_tokens of unfinished sequences, the dispatcher's own measure)."""
        entries = []
        for r in self.replicas:
            s = r.stats
            queried = s.cache_queried_tokens
            entries.append({
                "dp_rank": r.rank, "num_running_reqs": s.running, "num_waiting_reqs": s.waiting,
                "num_total_tokens": r.load_tokens, "num_used_tokens": s.pages_used * s.page_size,
                "max_total_num_tokens": s.pages_total * s.page_size,
                "token_usage": s.pages_used / s.pages_total if s.pages_total else 0.0,
                "cache_hit_rate": s.cache_hit_tokens / queried if queried else 0.0,
                "engine_state": self._poll(r),
            })
        return {
            "timestamp": time.time(), "dp_rank_count": len(entries), "loads": entries,
            "aggregate": {"total_running_reqs": sum(e["num_running_reqs"] for e in entries),
                          "total_waiting_reqs": sum(e["num_waiting_reqs"] for e in entries),
                          "total_tokens": sum(e["num_total_tokens"] for e in entries)},
        }

    # -- engine outputs -------------------------------------------------------------------
    async def engine_reader(self, replica: Replica, pull: zmq.asyncio.Socket) -> None:
        """Read what engine replica ``replica`` sends on ``pull`` (its own socket)."""
        while True:
            data = await pull.recv()
            try:
                msg = self._engine_decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("malformed message from engine replica %d: %s", replica.rank, e)
                continue
            if isinstance(msg, P.EngineOutputs):
                self.on_outputs(msg, replica)
                # other clients run between messages: a recv that finds one waiting does
                # not yield, and a huge step comes as many messages (engine_proc)
                await asyncio.sleep(0)
            elif isinstance(msg, P.EngineReady):
                self._on_engine_ready(replica, msg)
            elif isinstance(msg, P.EngineFatal):
                if replica.alive:
                    replica.fatal = msg.message
                else:  # (its death was seen first)
                    replica.exit_reason = msg.message
                logger.error("replica %d: the engine exits: %s", replica.rank, msg.message)
            elif isinstance(msg, P.EngineStartupError):
                replica.last_error = f"the restarted engine failed to start: {msg.message}"
                logger.error("replica %d: %s", replica.rank, replica.last_error)
            else:
                entry = self.pending.get(getattr(msg, "rid", ""))
                if entry is not None and not entry[0].done():
                    entry[0].set_result(msgspec.structs.replace(msg, rid=entry[1]))

    def on_outputs(self, out: P.EngineOutputs, replica: Replica) -> None:
        if out.stats is not None:
            replica.stats = out.stats
        now = time.monotonic()
        for c in out.chunks:
            st = self.table.get(c.rid)
            if st is None:
                continue
            if c.token_ids:
                last = st.last_token.get(c.index)
                if last is not None:
                    self.metrics.inter_token((now - last) / len(c.token_ids))
                st.last_token[c.index] = now
            if st.text_in_logprobs:
                add_token_text(c.meta, self.token_text)
            st.sink(c)
        for r in out.results:
            st = self.table.get(r.rid)
            if st is None or r.index in st.done:
                continue
            meta = r.meta_info
            first = meta.pop("first_token_time", None)
            e2e = now - st.created
            meta["e2e_latency"] = e2e
            reason = (meta.get("finish_reason") or {}).get("type", "unknown")
            self.metrics.finished(reason, meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0),
                                  e2e, None if first is None else max(first - st.created, 0.0))
            if st.text_in_logprobs:
                add_token_text(meta, self.token_text)
            st.done.add(r.index)
            self._settle(st, 1, len(st.done) == st.n)
            st.sink(r)
        for e in out.errors:
            st = self.table.get(e.rid)
            if st is None:
                continue
            self._settle(st, st.n - len(st.done), True)
            self.metrics.requests.labels(self.metrics.model, "error").inc()
            st.sink(e)

    # -- engine processes -----------------------------------------------------------------
    async def watchdog(self) -> None:
        """Notice each replica's death (and a restarted replica's death while starting)."""
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            for r in self.replicas:
                if r.proc.poll() is None:
                    continue
                if r.alive:
                    self.on_engine_death(r, r.proc.returncode)
                elif r.restarting:  # the new process died before it was ready
                    r.restarting = False
                    self._restart(r, r.proc.returncode)
            if all(r.state() == "down" for r in self.replicas):
                return

    def _restart(self, r: Replica, code: int | None) -> None:
        now = time.monotonic()
        r.deaths = [t for t in r.deaths if now - t < CRASH_LOOP_WINDOW_S] + [now]
        if r.restart is None:
            return
        if len(r.deaths) >= CRASH_LOOP_DEATHS:
            r.last_error = (f"the engine died {len(r.deaths)} times within {CRASH_LOOP_WINDOW_S:g} s "
                            f"(last exit code {code}{self._reason(r)}); not restarting it again"
                            + (f"; {r.last_error}" if r.last_error else ""))
            logger.error("replica %d: %s", r.rank, r.last_error)
            return
        logger.warning("restarting engine replica %d", r.rank)
        r.proc = r.restart()
        r.restarting = True
        self.metrics.engine_restarts.labels(self.metrics.model, str(r.rank)).inc()

    def _on_engine_ready(self, r: Replica, msg: P.EngineReady) -> None:
        if not r.restarting:
            return
        r.restarting = False
        r.alive = True
        r.exit_code = None
        r.last_error = ""
        logger.warning("the restarted engine process %s (replica %d) is ready", msg.info.get("engine_pid"), r.rank)

    def on_engine_death(self, r: Replica, code: int | None) -> None:
        """Replica ``r`` died: its in-flight requests and control messages fail (503),
        the other replicas serve on; a restart is started unless it is a crash loop."""
        if not r.alive:
            return
        r.alive = False
        r.exit_code = r.last_code = code
        r.exit_reason, r.fatal = r.fatal or _exit_signal(code), ""
        r.carry_counters()
        r.stats = P.EngineStats()
        lost = {rid: st for rid, st in self.table.items() if st.replica == r.rank}
        logger.error("engine replica %d exited with code %s; failing %d in-flight requests", r.rank, code, len(lost))
        message = f"the engine process exited (code {code}) before the request finished"
        for rid, st in lost.items():
            self._settle(st, st.n - len(st.done), True)
            self.metrics.requests.labels(self.metrics.model, "error").inc()
            st.sink(P.ErrorResponse(rid, message, 503, "server_error"))
        for fut, client_rid, rank in list(self.pending.values()):
            if rank == r.rank and not fut.done():
                fut.set_result(P.ErrorResponse(client_rid, message, 503, "server_error"))
        self._restart(r, code)

    # -- language clients (ZMQ ROUTER) ----------------------------------------------------
    async def client_watchdog(self) -> None:
        """Abort the requests of watched clients that went silent (killed programs)."""
        timeout = self.args.client_timeout_s
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            now = time.monotonic()
            for ident in list(self._watched):
                if now - self._client_seen.get(ident, now) <= timeout:
                    continue
                self._watched.discard(ident)
                self._client_seen.pop(ident, None)
                rids = self.abort_all(ident)
                if rids:
                    logger.warning("a language client went silent for %.0f s; aborted its %d requests",
                                   timeout, len(rids))
            for ident in [i for i, t in self._client_seen.items() if now - t > timeout and i not in self._watched]:
                del self._client_seen[ident]  # unwatched clients: forget them when idle


    def _send_client(self, ident: bytes, msg: P.ServerResponse) -> None:
        try:
            self.router.send_multipart([ident, P.encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("dropping a message to a language client that does not read")

    async def client_loop(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            ident, payload = frames[0], frames[-1]
            try:
                msg = P.decode_request(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._send_client(ident, P.ErrorResponse(_rid_of(payload), f"malformed request: {e}", 400))
                continue
            key = self.args.api_key
            if key is not None and not hmac.compare_digest((msg.api_key or "").encode(), key.encode()):
                self._send_client(ident, P.ErrorResponse(
                    getattr(msg, "rid", ""), "invalid or missing API key: send it in each message's api_key field",
                    401, "authentication_error", "api_key",
                ))
                continue
            self._client_seen[ident] = time.monotonic()
            if isinstance(msg, P.PingRequest):
                self._watched.add(ident)
                self._send_client(ident, P.Pong(msg.rid))
                continue
            task = asyncio.ensure_future(self._client_request(ident, msg))
            self._tasks.add(task)  # the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)

    async def _client_request(self, ident: bytes, msg: P.ClientRequest) -> None:
        reply: P.ServerResponse | None = None
        try:
            if isinstance(msg, P.GenerateRequest):
                await self.submit(msg, lambda m: self._send_client(ident, m), owner=ident)
            elif isinstance(msg, P.AbortRequest):
                if msg.abort_all:
                    self.abort_all(ident)
                elif msg.rid in self.table and self.table[msg.rid].owner == ident:
                    self.abort(msg.rid)
            elif isinstance(msg, P.PinRequest):
                self.check_up()
                if (msg.text is None) == (msg.input_ids is None):
                    raise RequestError("exactly one of text and input_ids must be given", "text")
                # the prefix, TTL and budget are checked where pins live (Engine.pin_prefix)
                ids = self.encode(msg.text, "text") if msg.text is not None else msg.input_ids
                reply = await self.control(msgspec.structs.replace(msg, text=None, input_ids=ids), msg.rid)
            elif isinstance(msg, P.ServerInfoRequest):
                reply = P.ServerInfo(msg.rid, await self.server_info())
            else:  # flush_cache, unpin
                reply = await self.control(msg, msg.rid)
        except RequestError as e:
            reply = P.error_response(getattr(msg, "rid", ""), e)
        except asyncio.TimeoutError:
            reply = P.ErrorResponse(msg.rid, "the engine did not answer in time", 504, "server_error")
        if reply is not None:
            self._send_client(ident, reply)


# server_info counters summed over the replicas (the rest is the first replica's)
_SUMMED = ("running", "waiting", "live_requests", "pages_total", "pages_used", "pages_evictable",
           "cache_queried_tokens", "cache_hit_tokens", "cache_evicted_tokens", "retractions", "kv_events_published")


def _all_ok(replies: list[Any], ranks: list[int]) -> Any:
    """One answer for a flush or weight update sent to several replicas: the first
    error, else a refusal naming the replicas that refused, else the first reply."""
    error = next((r for r in replies if isinstance(r, P.ErrorResponse)), None)
    if error is not None:
        return error
    refused = [(rank, r) for rank, r in zip(ranks, replies) if not r.ok]
    if not refused:
        return replies[0]
    first = refused[0][1]
    if len(replies) == 1:
        return first
    which = ", ".join(str(rank) for rank, _ in refused)
    return msgspec.structs.replace(first, message=f"replica {which}: {first.message}")


def check_rid(rid: Any, table: dict[str, ReqState]) -> None:
    if not isinstance(rid, str) or not rid or len(rid) > P.MAX_RID_LEN or "#" in rid:
        raise RequestError(
            f"rid={rid!r} is invalid; allowed: a non-empty string of at most {P.MAX_RID_LEN} characters without '#'",
            "rid",
        )
    check_text(rid, "rid")
    if rid in table:
        raise RequestError(f"rid={rid!r} is already in use by a running request", "rid")


def _rid_of(payload: bytes) -> str:
    try:
        obj = msgspec.msgpack.decode(payload)
        rid = obj.get("rid", "") if isinstance(obj, dict) else ""
        return rid if isinstance(rid, str) else ""
    except Exception:  # noqa: BLE001
        return ""


def _push(sock: Any, data: bytes) -> bool:
    """Send ``data`` to an engine without waiting; False when it cannot take it (no
    process connected: it exited). An asyncio socket answers with a future holding
    ``zmq.Again``, which nobody awaited (asyncio logged "Future exception was never
    retrieved" in crash loops, and the message was lost without a word)."""
    try:
        fut = sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        return False
    if isinstance(fut, asyncio.Future):
        if fut.done():
            return fut.cancelled() or fut.exception() is None
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())
    return True


def _exit_signal(code: int | None) -> str:
    """A process's exit code as the signal that ended it ("" for a plain exit)."""
    if code is None or code >= 0:
        return ""
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


# -- process entry ---------------------------------------------------------------------------
def start_engine(args: ServerArgs, model_path: str | None, in_addr: str, out_addr: str,
                 dp_rank: int = 0) -> subprocess.Popen:
    """Start engine replica ``dp_rank``, reading from ``in_addr`` and writing to
    ``out_addr`` (both bound by the front)."""
    import dataclasses

    spec = {
        "model": model_path,
        "engine": dataclasses.asdict(args.engine),
        "dp_rank": dp_rank,
        "dp_size": args.dp_size,
        "in_addr": in_addr,
        "out_addr": out_addr,
        "parent_pid": os.getpid(),
        "log_level": args.log_level,
    }
    return subprocess.Popen([sys.executable, "-m", "plait.runtime.server.engine_proc", json.dumps(spec)])


def given_turn_end(source: str | None, tokenizer: Any) -> str | None:
    """The end-of-turn text of a chat template given to the server (``--chat-template``),
    a stop string of its chat replies, or None: no template given, or its assistant turn
    ends with the model's EOS token (which ends generation already) or with nothing but
    whitespace. SGLang's built-in templates carry such a stop string (ChatML:
    ``<|im_end|>``); a model whose own EOS is another token (ChatML given to a base
    model) would otherwise write past its turn, into the next one."""
    if not source:
        return None
    from plait.chat_template import jinja_template

    eos = getattr(tokenizer, "eos_token", None) or ""
    special = {"bos_token": getattr(tokenizer, "bos_token", None) or "", "eos_token": eos}
    try:
        _, suffix = jinja_template(source, special).markers("assistant", ("user",))
    except Exception:  # noqa: BLE001 - a template that cannot write the turn: no stop string from it
        return None
    end = suffix.strip()
    if not end or (eos and end == eos) or len(end) > 256:
        return None
    return end


def chat_template_info(tokenizer: Any) -> dict[str, Any]:
    """The chat template as clients need it to render roles without the model files:
    ``chat_template`` (present or not), its Jinja text and the special tokens it uses."""
    text = getattr(tokenizer, "chat_template", None)
    if isinstance(text, dict):  # named templates: the default one renders chats
        text = text.get("default")
    special = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return {
        "chat_template": isinstance(text, str) and bool(text),
        "chat_template_text": text if isinstance(text, str) and text else None,
        "special_tokens": {k: v for k, v in special.items() if isinstance(v, str)},
    }
