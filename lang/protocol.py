"""The wire protocol of the plait runtime: ``msgspec`` structs encoded as msgpack.

This module is torch-free and importable as ``plait.protocol``. It is the one place
where the messages between a language client, the runtime's front process and its
engine process are defined.

Wire contract for language clients (version :data:`PROTOCOL_VERSION`)
=====================================================================

Sockets and framing
-------------------
- The front process binds a ZMQ ``ROUTER`` socket at ``Runtime.zmq_address``
  (``launch(...).zmq_address``; by default ``ipc://`` inside a private 0700 temp
  folder, or ``tcp://HOST:PORT`` when the server was started with ``--zmq-address``).
- A client connects a ``DEALER`` socket to it. Each message is ONE frame: the bytes
  of :func:`encode` of a :data:`ClientRequest` struct. No empty delimiter frame (that
  is REQ's envelope, not DEALER's). The ROUTER answers on the same connection with
  one-frame messages, each :func:`encode` of a :data:`ServerResponse` struct; decode
  them with :func:`decode_response`.
- Messages are msgpack maps. The field ``"type"`` tags the struct (the ``type`` values
  are listed below). Unknown fields are ignored by both sides, so fields may be added
  in later versions without breaking older peers.
- Authentication: when the server was started with an API key (``--api-key``), every
  request must carry it in the ``api_key`` field (the same key as HTTP's Bearer token),
  on TCP and ipc sockets alike; a request without it is answered with an
  :class:`ErrorResponse` of code 401 and does nothing. A server refuses to bind a TCP
  socket on a non-loopback address without a key.
- Many requests may be in flight on one socket; every response carries the ``rid`` of
  the request it answers. ``rid`` is chosen by the client; it must be unique among the
  server's in-flight requests (a uuid4 hex is a good choice), non-empty, at most 256
  characters and without ``#``. A duplicate ``rid`` is answered with an
  :class:`ErrorResponse`.

Requests (client -> server)
---------------------------
``generate`` :class:`GenerateRequest`
    One prompt, as ``text`` or as ``input_ids`` (exactly one of them). The text is
    tokenized with the model's tokenizer, without adding special tokens (put BOS or a
    chat template in the text yourself, or send ``input_ids``). ``sampling_params``
    uses the runtime's names (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``min_p``, ``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``,
    ``stop``, ``stop_token_ids``, ``ignore_eos``, ``min_new_tokens``, ``seed``, ``n``,
    ``skip_special_tokens``). With ``n > 1`` the outputs carry ``index`` 0..n-1.
    ``stream=True`` sends :class:`StreamChunk` messages as tokens are produced, then
    one :class:`GenerateResult` per index; ``stream=False`` sends only the results.
    Logprobs: ``return_logprob``, ``logprob_start_len`` (-1: no prompt logprobs; k:
    logprobs of prompt tokens from position k on), ``top_logprobs_num`` (0..100),
    ``return_text_in_logprobs``. ``cache_salt`` namespaces the prefix cache: requests
    with different salts never share cached KV.
``abort`` :class:`AbortRequest`
    Abort the generate request ``rid`` (all ``n`` copies) of this client, or, with
    ``abort_all=True``, every in-flight request this client sent. An aborted request
    ends with a :class:`GenerateResult` whose ``meta_info["finish_reason"]`` is
    ``{"type": "abort", "message": ...}``. Nothing else is sent for the abort itself.
    A client should send ``abort_all`` before it closes its socket: the server cannot
    see a DEALER disappear.
``flush_cache`` :class:`FlushCacheRequest`
    Drop every cached prefix (or those of one ``cache_salt``). Answered by :class:`FlushCacheResult` (``ok=False``
    with a message while requests are running).
``get_server_info`` :class:`ServerInfoRequest`
    Answered by :class:`ServerInfo`: model facts (``context_len``, ``vocab_size``,
    ``model_path``, ``architecture``, ``eos_token_ids``, ``chat_template`` present),
    engine config, KV pool usage (pages ``total/free/evictable/locked`` with
    ``free + evictable + locked == total``), ``invariant_ok``, running/waiting
    counts, cache counters, ``engine_pid``, ``front_pid``, ``protocol_version``.
``pin`` :class:`PinRequest`
    Prefill the prefix (``text`` or ``input_ids``) and hold a radix-cache lock on it
    until ``unpin`` or until ``ttl_s`` seconds pass, bounded by the engine's pin
    budget. Answered by :class:`PinResult` (``pin_id`` to unpin with, ``num_tokens``
    pinned). Fails with :class:`ErrorResponse` when over budget or not supported.
``unpin`` :class:`UnpinRequest`
    Release a pin. Answered by :class:`UnpinResult` (``ok=False`` if the pin was
    unknown or had already expired).
``ping`` :class:`PingRequest`
    Answered by :class:`Pong` from the front (no engine round trip). A client that has
    sent a ping is *watched*: if it then sends nothing for the server's
    ``client_timeout_s`` (10 s by default) while it has requests in flight, the server
    takes it for dead and aborts them. :class:`~plait.runtime_endpoint.RuntimeEndpoint`
    pings every 2 s while it waits for answers. A client that never pings is not
    watched (it should send ``abort_all`` before it goes).

Responses (server -> client)
----------------------------
``chunk`` :class:`StreamChunk`
    New output of one sequence (``rid``, ``index``): ``text`` is the new text (never
    a broken UTF-8 character, never part of a stop string that may still match, so
    the chunks of a sequence concatenate exactly to its final text), ``token_ids`` are
    the new token ids. ``meta`` holds ``completion_tokens`` so far and, when logprobs
    were asked for, the new ``output_token_logprobs`` / ``output_top_logprobs``
    entries. A chunk may have empty ``text`` (held back) and still carry ids.
``result`` :class:`GenerateResult`
    The end of one sequence: full ``text``, ``output_ids`` and ``meta_info``
    (``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``finish_reason``
    (``{"type": "length", "length": n}``, ``{"type": "stop", "matched": str|int}``
    or ``{"type": "abort", "message": str}``), ``e2e_latency`` seconds, and logprob
    lists when asked: ``input_token_logprobs``, ``output_token_logprobs`` as
    ``[logprob, token_id]`` pairs (``[logprob, token_id, text]`` with
    ``return_text_in_logprobs``), ``input_top_logprobs`` / ``output_top_logprobs``
    as lists of such pairs per position (``None`` for a position without one). For a
    streamed sequence, ``text`` is the concatenation of its chunks' text. A request
    is complete when a result (or an error) has arrived for every index.
``error`` :class:`ErrorResponse`
    The request ``rid`` failed; this is terminal for every index of it. ``message``
    is for people; ``error_type`` and ``param`` are OpenAI's error ``type`` and
    ``param``; ``code`` follows HTTP (400: the request was invalid, ``param`` names
    the field; 404: unknown pin; 503: the engine is not running, for example
    because its process died; 500: an internal error). A bad request never affects
    other requests.
``flush_cache_result``, ``server_info``, ``pin_result``, ``unpin_result``
    The answers described above.

Everything below :data:`ServerResponse` is internal to the runtime (front <-> engine)
and not part of the client contract.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from plait.errors import BackendError, RequestError

PROTOCOL_VERSION = 1

# Limits the front enforces on every request (the engine checks the rest).
MAX_RID_LEN = 256


class _Msg(msgspec.Struct, tag_field="type", omit_defaults=True, forbid_unknown_fields=False):
    """Base of all messages; ``type`` on the wire is the struct's tag."""


# -- client -> server ------------------------------------------------------------------
class _ClientMsg(_Msg, kw_only=True):
    """Base of client requests: ``api_key`` authenticates each one (see above)."""

    api_key: str | None = None


class GenerateRequest(_ClientMsg, tag="generate"):
    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = msgspec.field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    cache_salt: str | None = None


class AbortRequest(_ClientMsg, tag="abort"):
    rid: str = ""
    abort_all: bool = False
    reason: str = ""  # the finish reason's message; empty: "aborted by request"


class FlushCacheRequest(_ClientMsg, tag="flush_cache"):
    rid: str
    cache_salt: str | None = None  # only this namespace; None: everything


class ServerInfoRequest(_ClientMsg, tag="get_server_info"):
    rid: str


class PinRequest(_ClientMsg, tag="pin"):
    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    ttl_s: float = 600.0
    cache_salt: str | None = None


class UnpinRequest(_ClientMsg, tag="unpin"):
    rid: str
    pin_id: str


class PingRequest(_ClientMsg, tag="ping"):
    rid: str


ClientRequest = Union[
    GenerateRequest, AbortRequest, FlushCacheRequest, ServerInfoRequest, PinRequest, UnpinRequest, PingRequest
]


# -- server -> client ------------------------------------------------------------------
class StreamChunk(_Msg, tag="chunk"):
    rid: str
    index: int = 0
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    meta: dict[str, Any] = msgspec.field(default_factory=dict)


class GenerateResult(_Msg, tag="result"):
    rid: str
    index: int = 0
    text: str = ""
    output_ids: list[int] = msgspec.field(default_factory=list)
    meta_info: dict[str, Any] = msgspec.field(default_factory=dict)


class ErrorResponse(_Msg, tag="error"):
    rid: str
    message: str
    code: int = 400
    error_type: str = "invalid_request_error"  # OpenAI's error "type"
    param: str | None = None


def error_response(rid: str, e: RequestError) -> ErrorResponse:
    """A typed request error as the wire's :class:`ErrorResponse` (ZMQ clients, and the
    engine's errors on their way to the front)."""
    return ErrorResponse(rid, e.message, e.status, e.error_type, e.param)


def request_error(e: ErrorResponse) -> RequestError:
    """The typed error an :class:`ErrorResponse` carries (its inverse)."""
    return RequestError(e.message, e.param, e.code, e.error_type)


def backend_error(e: ErrorResponse) -> BackendError:
    """What a language program raises for an :class:`ErrorResponse`."""
    return request_error(e).to_backend_error()


def error_body(e: RequestError) -> dict[str, Any]:
    """OpenAI's error body for an HTTP client."""
    return {"error": {"message": e.message, "type": e.error_type, "param": e.param,
                      "code": e.code if e.code is not None else e.status}}


class FlushCacheResult(_Msg, tag="flush_cache_result"):
    rid: str
    ok: bool
    message: str = ""


class ServerInfo(_Msg, tag="server_info"):
    rid: str
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class PinResult(_Msg, tag="pin_result"):
    rid: str
    pin_id: str
    num_tokens: int = 0


class UnpinResult(_Msg, tag="unpin_result"):
    rid: str
    ok: bool


class Pong(_Msg, tag="pong"):
    rid: str


ServerResponse = Union[
    StreamChunk, GenerateResult, ErrorResponse, FlushCacheResult, ServerInfo, PinResult, UnpinResult, Pong
]


# -- internal: front <-> engine -----------------------------------------------------
class EngineStats(_Msg, tag="stats"):
    """Gauges and counters the engine reports with its outputs (and when idle)."""

    running: int = 0
    waiting: int = 0
    pages_total: int = 0
    pages_used: int = 0
    pages_evictable: int = 0
    page_size: int = 1
    cache_queried_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_evicted_tokens: int = 0
    retractions: int = 0
    cache_early_divergences: int = 0
    hicache_saved_tokens: int = 0
    hicache_loaded_tokens: int = 0
    hicache_prefetched_tokens: int = 0
    window_pages_total: int = 0
    window_pages_attached: int = 0
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class EngineOutputs(_Msg, tag="outputs"):
    """Everything one engine step produced, sent as one message."""

    chunks: list[StreamChunk] = msgspec.field(default_factory=list)
    results: list[GenerateResult] = msgspec.field(default_factory=list)
    errors: list[ErrorResponse] = msgspec.field(default_factory=list)
    stats: EngineStats | None = None


class EngineGenerate(_Msg, tag="engine_generate"):
    """A generate request the front has validated (``plait.runtime.validation``):
    token ids checked against the model, sampling parameters complete and valid, the
    constraint translated once to ``constraint_regex``. The engine trusts it."""

    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]
    constraint_kind: str | None = None  # "regex" | "json_schema": the field a failure names
    constraint_regex: str | None = None
    constraint_backend: str | None = None  # "outlines" (constraint_regex is a regex) | "llguidance" (a grammar)
    constraint_unique: str | None = None  # uniqueItems the matcher keeps (Constraint.unique)
    constraint_auto: bool = False  # grammar_backend auto chose the backend (Constraint.auto)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None


class EngineReady(_Msg, tag="ready"):
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class EngineStartupError(_Msg, tag="startup_error"):
    message: str


class EngineFatal(_Msg, tag="fatal"):
    """Engine -> front, just before an engine process exits on an error of its own (a
    crashed step, a tensor-parallel rank that died): why, for /health and /server_info."""

    message: str


class EngineShutdown(_Msg, tag="shutdown"):
    pass


class UpdateWeightsRequest(_ClientMsg, tag="update_weights"):
    """Front -> engine (HTTP ``/update_weights_from_disk``): load new weights of the
    same model (:meth:`plait.runtime.Engine.update_weights_from_disk`)."""

    rid: str
    model_path: str


class UpdateWeightsResult(_Msg, tag="update_weights_result"):
    rid: str
    ok: bool
    message: str = ""


EngineInput = Union[
    EngineGenerate, AbortRequest, FlushCacheRequest, ServerInfoRequest, PinRequest, UnpinRequest, EngineShutdown,
    UpdateWeightsRequest,
]
EngineMessage = Union[
    EngineOutputs, EngineReady, EngineStartupError, EngineFatal, FlushCacheResult, ServerInfo, PinResult, UnpinResult,
    ErrorResponse, UpdateWeightsResult,
]

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(ClientRequest)
_response_decoder = msgspec.msgpack.Decoder(ServerResponse)


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of any message in this module."""
    return _encoder.encode(msg)


def decode_request(data: bytes) -> ClientRequest:
    """Decode a client request; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _request_decoder.decode(data)


def decode_response(data: bytes) -> ServerResponse:
    """Decode a server response (what a client receives)."""
    return _response_decoder.decode(data)


__all__ = [
    "PROTOCOL_VERSION", "MAX_RID_LEN",
    "GenerateRequest", "AbortRequest", "FlushCacheRequest", "ServerInfoRequest", "PinRequest", "UnpinRequest",
    "ClientRequest", "StreamChunk", "GenerateResult", "ErrorResponse", "FlushCacheResult", "ServerInfo",
    "PinResult", "UnpinResult", "PingRequest", "Pong", "ServerResponse", "encode", "decode_request", "decode_response",
    "error_response", "request_error", "backend_error", "error_body",
]
