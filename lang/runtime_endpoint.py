"""``RuntimeEndpoint`` and ``Runtime``: programs on a plait runtime over ZMQ.

The client follows the wire contract in :mod:`plait.protocol`: one ``DEALER`` socket
to the runtime front's ``ROUTER``, one msgpack frame per message, every response
tagged with the ``rid`` of its request. One I/O thread owns the socket; any number of
program threads submit through it (a lock-guarded ``inproc`` pipe wakes it) and get
their outputs back through :class:`~plait.backend.Pending` handles, so many programs
share one connection and streams interleave freely.

Liveness: ZMQ heartbeats (answered by libzmq itself, so a busy runtime still
answers) and a socket monitor notice a lost connection: every waiter then fails with
:class:`RuntimeUnavailableError`, as it does at once when a sidecar's process exits.
While requests are in flight the client sends a ping every ``PING_INTERVAL_S``: the
runtime answers (a runtime connected but hung fails the waiters after
``liveness_timeout_s`` of silence), and the runtime knows the client is alive (a
client that is killed stops pinging, and the runtime aborts its requests).
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from plait import protocol as P
from plait.backend import BaseBackend, OnChunk, Pending, Request, generate_outputs, stream_text, with_sglang_info
from plait.chat_template import ChatTemplate, ChatTemplateError, jinja_template
from plait.errors import BackendError, RuntimeUnavailableError

logger = logging.getLogger("plait")

PING_INTERVAL_S = 2.0
POLL_MS = 100
CONNECT_TIMEOUT_S = 10.0
LIVENESS_TIMEOUT_S = 300.0
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10000
RECONNECT_GRACE_S = 5.0  # waiters fail when the connection stays down this long
CONTROL_TIMEOUT_S = 120.0


class _ZmqClient:
    """The socket and its I/O thread. Handlers receive decoded responses by rid."""

    def __init__(self, address: str, liveness_timeout_s: float, alive: Callable[[], bool] | None,
                 api_key: str | None = None) -> None:
        self.address = address
        self.api_key = api_key  # sent in every message (the server's --api-key)
        self.liveness_timeout_s = liveness_timeout_s
        self.alive = alive
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        wake_addr = f"inproc://plait-client-{uuid.uuid4().hex}"
        self._wake_in = self.ctx.socket(zmq.PAIR)
        self._wake_in.bind(wake_addr)
        self._wake_out = self.ctx.socket(zmq.PAIR)
        self._wake_out.connect(wake_addr)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self.handlers: dict[str, Callable[[Any], None]] = {}
        self.dead: BaseException | None = None
        self._closing = False
        self._last_recv = time.monotonic()
        self._last_ping = 0.0
        self.connected = False
        self._down_since = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="plait-zmq-client", daemon=True)
        self._thread.start()

    # -- program threads -----------------------------------------------------------------------
    def request(self, msg: msgspec.Struct, handler: Callable[[Any], None] | None) -> None:
        """Send ``msg``; responses carrying its rid go to ``handler``."""
        rid = getattr(msg, "rid", "")
        with self._lock:
            if self.dead is not None:
                raise RuntimeUnavailableError(str(self.dead))
            if handler is not None:
                if not self.handlers:
                    self._last_recv = time.monotonic()  # the silence clock starts with the first waiter
                self.handlers[rid] = handler
        self.send(msg)

    def send(self, msg: msgspec.Struct) -> None:
        if self.api_key is not None:
            msg = msgspec.structs.replace(msg, api_key=self.api_key)
        data = P.encode(msg)
        with self._send_lock:
            if self._closing:
                raise RuntimeUnavailableError("the runtime client was shut down")
            self._wake_out.send(data)

    def forget(self, rid: str) -> None:
        with self._lock:
            self.handlers.pop(rid, None)

    def close(self) -> None:
        if self._closing:
            return
        try:
            self.send(P.AbortRequest(abort_all=True))  # the server cannot see a DEALER go away
        except RuntimeUnavailableError:
            pass
        with self._send_lock:
            self._closing = True
        self._thread.join(timeout=5)
        self._fail_all(RuntimeUnavailableError("the runtime client was shut down"), permanent=True)

    # -- I/O thread ---------------------------------------------------------------------------------
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(POLL_MS))
                if self._monitor in events:
                    self._on_monitor_event()
                if self._wake_in in events:
                    while True:
                        try:
                            self.sock.send(self._wake_in.recv(zmq.NOBLOCK), zmq.NOBLOCK)
                        except zmq.Again:
                            break
                if self.sock in events:
                    self._receive()
                if self._closing:
                    # flush what was queued (the final abort_all) before leaving
                    while True:
                        try:
                            self.sock.send(self._wake_in.recv(zmq.NOBLOCK), zmq.NOBLOCK)
                        except zmq.Again:
                            break
                    break
                self._check_liveness()
        except Exception as e:  # noqa: BLE001 - waiters must hear about it
            logger.exception("runtime client I/O failed")
            self._fail_all(RuntimeUnavailableError(f"the runtime client failed: {e}"), permanent=True)
        finally:
            self.sock.disable_monitor()
            for s in (self._monitor, self.sock, self._wake_in, self._wake_out):
                s.close(linger=200)
            self.ctx.term()

    def _on_monitor_event(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event["event"] == zmq.EVENT_DISCONNECTED and not self._closing:
                # the runtime's front went away (or stopped answering heartbeats): what
                # was in flight on that connection is lost
                self.connected, self._down_since = False, time.monotonic()
                self._fail_all(RuntimeUnavailableError(f"the connection to the runtime at {self.address} was lost"))

    def _receive(self) -> None:
        while True:
            try:
                data = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._last_recv = time.monotonic()
            try:
                msg = P.decode_response(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("undecodable message from the runtime: %s", e)
                continue
            if isinstance(msg, P.Pong):
                continue
            with self._lock:
                handler = self.handlers.get(msg.rid)
            if handler is not None:
                handler(msg)

    def _check_liveness(self) -> None:
        with self._lock:
            waiting = bool(self.handlers)
        if not waiting:
            return
        if self.alive is not None and not self.alive():
            self._fail_all(RuntimeUnavailableError(f"the runtime process at {self.address} has exited"), permanent=True)
            return
        now = time.monotonic()
        if not self.connected and now - self._down_since > RECONNECT_GRACE_S:
            self._fail_all(RuntimeUnavailableError(
                f"cannot reach the runtime at {self.address} (no connection for {now - self._down_since:.0f} s)"))
            return
        silent = now - self._last_recv
        if silent > self.liveness_timeout_s:
            self._fail_all(RuntimeUnavailableError(
                f"the runtime at {self.address} has not answered for {silent:.0f} s; is it running?"))
        elif now - self._last_ping >= PING_INTERVAL_S:
            # a heartbeat both ways: the Pong shows the runtime is there, the ping shows
            # the runtime this client is (it aborts a silent client's requests)
            self._last_ping = now
            self.sock.send(P.encode(P.PingRequest(f"ping-{uuid.uuid4().hex}", api_key=self.api_key)), zmq.NOBLOCK)

    def _fail_all(self, error: BaseException, permanent: bool = False) -> None:
        """Fail every waiter; ``permanent``: and every later request."""
        with self._lock:
            handlers, self.handlers = self.handlers, {}
            if permanent and self.dead is None:
                self.dead = error
        for rid, handler in handlers.items():
            handler(P.ErrorResponse(rid, str(error), 503, "server_error"))
        self._last_recv = time.monotonic()


class RuntimeEndpoint(BaseBackend):
    """A running plait runtime: ``RuntimeEndpoint(url)`` with its HTTP base URL
    (``http://host:port``; the ZMQ address is read from its server info) or its ZMQ
    address (``tcp://...`` / ``ipc://...``). Raises :class:`RuntimeUnavailableError`
    if nothing answers within ``connect_timeout_s``. ``verify`` is SGLang's (as in
    ``requests``): for an ``https://`` URL, False skips certificate checks and a path
    names a CA bundle (file) or folder of certificates. SGLang's ``chat_template_name``
    names a frontend template roles render with: a built-in one (``chatml``) is used;
    another name warns, and roles render with the runtime's chat template (the served
    model's own, or the server's ``--chat-template``), as without it."""

    def __init__(self, base_url: str, api_key: str | None = None, verify: bool | str | None = None,
                 chat_template_name: str | None = None, *, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 liveness_timeout_s: float = LIVENESS_TIMEOUT_S, alive: Callable[[], bool] | None = None) -> None:
        assigned = None
        if chat_template_name is not None:
            from plait.chat_template import BUILT_IN_TEMPLATES, get_chat_template

            if not isinstance(chat_template_name, str):
                raise ValueError(f"chat_template_name={chat_template_name!r} is invalid; allowed: a template name")
            if chat_template_name in BUILT_IN_TEMPLATES:
                assigned = get_chat_template(chat_template_name)
            else:  # SGLang's table names the model's own format ("qwen" for a Qwen model): the runtime has it
                warnings.warn(f"chat_template_name={chat_template_name!r} is not built into plait (built in: "
                              + ", ".join(BUILT_IN_TEMPLATES) + "): roles render with the runtime's chat template "
                              "(the served model's own, or the server's --chat-template)", stacklevel=2)
        if not isinstance(base_url, str) or not base_url:
            raise ValueError(f"base_url={base_url!r} is invalid; allowed: http(s)://host:port, tcp://host:port or ipc://path")
        self.base_url = base_url
        self.api_key = api_key
        if base_url.startswith(("tcp://", "ipc://")):
            address = base_url
        elif base_url.startswith(("http://", "https://")):
            address = _zmq_address_from_http(base_url, api_key, connect_timeout_s, _ssl_context(verify))
        else:
            raise ValueError(f"base_url={base_url!r} is invalid; allowed: http(s)://host:port, tcp://host:port or ipc://path")
        self.zmq_address = address
        self._client = _ZmqClient(address, liveness_timeout_s, alive, api_key)
        self._template: Any = None
        self._template_lock = threading.Lock()
        self._assigned_template = assigned
        try:
            self.server_info = self._control(P.ServerInfoRequest(self._rid("info")), connect_timeout_s).info
        except RuntimeUnavailableError as e:
            self._client.close()
            raise RuntimeUnavailableError(
                f"no plait runtime answered at {address} (waited up to {connect_timeout_s:g} s; {e}); is it running?"
            ) from None

    def _rid(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex}"

    # -- transport --------------------------------------------------------------------------------
    def submit(self, req: Request, on_chunk: OnChunk | None = None) -> Pending:
        pending = Pending(req, on_chunk)
        msg = P.GenerateRequest(
            rid=req.rid, text=req.text, input_ids=req.input_ids, sampling_params=req.sampling_params,
            stream=req.stream, return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num, return_text_in_logprobs=req.return_text_in_logprobs,
        )

        def handle(m: Any) -> None:
            if isinstance(m, P.StreamChunk):
                pending.chunk(m.index, m.text, m.meta)
            elif isinstance(m, P.GenerateResult):
                pending.result(m.index, {"text": m.text, "output_ids": m.output_ids, "meta_info": m.meta_info})
            elif isinstance(m, P.ErrorResponse):
                pending.fail(P.backend_error(m))
            if pending.done:
                self._client.forget(req.rid)

        self._client.request(msg, handle)
        return pending

    def abort(self, rid: str) -> None:
        try:
            self._client.send(P.AbortRequest(rid=rid))
        except RuntimeUnavailableError:
            pass

    def pin(self, text: str, ttl_s: float) -> str:
        return self._control(P.PinRequest(self._rid("pin"), text=text, ttl_s=ttl_s)).pin_id

    def unpin(self, pin_id: str) -> bool:
        return self._control(P.UnpinRequest(self._rid("unpin"), pin_id)).ok

    def flush_cache(self) -> bool:
        return self._control(P.FlushCacheRequest(self._rid("flush"))).ok

    def get_server_info(self) -> dict[str, Any]:
        return with_sglang_info(self._control(P.ServerInfoRequest(self._rid("info"))).info)

    def get_chat_template(self) -> ChatTemplate | None:
        with self._template_lock:
            if self._template is None:
                info = self.server_info
                if "model_path" not in info:  # connected while the engine was down: ask again
                    info = self.server_info = self.get_server_info()
                try:
                    self._template = _template_from_info(info) or False
                except ChatTemplateError as e:
                    self._template = e
            if isinstance(self._template, ChatTemplateError):
                raise self._template
            return self._template or None

    def shutdown(self) -> None:
        self._client.close()

    def _control(self, msg: Any, timeout: float = CONTROL_TIMEOUT_S) -> Any:
        fut: Future[Any] = Future()

        def handle(m: Any) -> None:
            self._client.forget(msg.rid)
            if not fut.done():
                fut.set_result(m)

        self._client.request(msg, handle)
        try:
            reply = fut.result(timeout)
        except TimeoutError:
            self._client.forget(msg.rid)
            raise RuntimeUnavailableError(f"the runtime at {self.zmq_address} did not answer within {timeout:g} s") from None
        if isinstance(reply, P.ErrorResponse):
            raise P.backend_error(reply)
        return reply


def _ssl_context(verify: bool | str | None) -> ssl.SSLContext | None:
    """The TLS settings of ``verify`` (``requests``' meaning): None or True the
    defaults, False no certificate checks, a path a CA bundle file or folder."""
    if verify is None or verify is True:
        return None
    if verify is False:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if isinstance(verify, (str, os.PathLike)):
        if os.path.isdir(verify):
            return ssl.create_default_context(capath=verify)
        if os.path.isfile(verify):
            return ssl.create_default_context(cafile=verify)
        raise ValueError(f"verify={verify!r} is invalid: no such file or folder; allowed: True, False, or the path "
                         "of a CA bundle file or of a folder of certificates")
    raise ValueError(f"verify={verify!r} is invalid; allowed: True, False, or the path of a CA bundle file or of a "
                     "folder of certificates")


def _zmq_address_from_http(url: str, api_key: str | None, timeout: float, context: ssl.SSLContext | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last: Exception | str | None = None
    for route in ("/server_info", "/get_server_info"):
        try:
            req = urllib.request.Request(url.rstrip("/") + route, headers=headers)
            with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
                info = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            if e.code == 401:
                raise BackendError(
                    f"the runtime at {url} needs an API key: RuntimeEndpoint(url, api_key=...) "
                    f"({'the key given was refused' if api_key else 'none was given'})",
                    code=401, param="api_key", error_type="authentication_error",
                ) from None
            last = e
            continue
        except (urllib.error.URLError, OSError, ValueError) as e:
            last = e
            continue
        address = info.get("zmq_address") if isinstance(info, dict) else None
        if isinstance(address, str) and address:
            return address
        last = f"its {route} names no ZMQ address (a server, but not a plait runtime?)"
    raise RuntimeUnavailableError(f"no plait runtime answered at {url}: {last}")


def _template_from_info(info: dict[str, Any]) -> ChatTemplate | None:
    """The runtime's chat template: its Jinja text from the server info when sent,
    otherwise read from the model files when they are on this machine."""
    for key in ("chat_template_text", "chat_template"):
        text = info.get(key)
        if isinstance(text, str) and text:
            return jinja_template(text, info.get("special_tokens") or {}, name=str(info.get("model_path")))
    if info.get("chat_template") is False:
        return None
    path = info.get("model_path")
    if isinstance(path, str) and os.path.exists(path):
        found = _template_from_files(path)
        if found is not None:
            return jinja_template(*found, name=path)
    raise ChatTemplateError(
        "the runtime has a chat template but does not send its text, and its model files are not on this machine; "
        "roles cannot be rendered"
    )


def _template_from_files(path: str) -> tuple[str, dict[str, str]] | None:
    """(template, special tokens) from a Hugging Face folder or a GGUF file."""
    if os.path.isdir(path):
        cfg_path = os.path.join(path, "tokenizer_config.json")
        if not os.path.exists(cfg_path):
            return None
        with open(cfg_path) as f:
            cfg = json.load(f)
        text = cfg.get("chat_template")
        if not isinstance(text, str):
            tpl_path = os.path.join(path, "chat_template.jinja")
            if not os.path.exists(tpl_path):
                return None
            with open(tpl_path) as f:
                text = f.read()
        special = {k: _token_str(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        return text, {k: v for k, v in special.items() if v is not None}
    if path.endswith(".gguf"):
        from plait.runtime.gguf_reader import FastGGUFReader  # light: gguf and numpy only

        reader = FastGGUFReader(path)

        def field(name: str) -> Any:
            f = reader.fields.get(name)
            return None if f is None or not f.data else f.parts[f.data[0]]

        raw = field("tokenizer.chat_template")
        if raw is None:
            return None
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        special = {}
        for key, name in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id")):
            tid = field(name)
            if tid is not None and tokens is not None:
                special[key] = bytes(tokens.parts[tokens.data[int(tid[0])]]).decode("utf-8", "replace")
        return bytes(raw).decode("utf-8"), special
    return None


def _token_str(tok: Any) -> str | None:
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    return None


class Runtime:
    """``Runtime(model_path=None, **config)``: launch a runtime sidecar
    (:func:`plait.runtime.launch`) and connect to it. ``.url`` is its HTTP base,
    ``.endpoint`` the connected :class:`RuntimeEndpoint`; ``shutdown()`` stops it.
    ``launch_timeout`` (SGLang's name) is launch's ``startup_timeout``."""

    def __init__(self, model_path: str | None = None, **config: Any) -> None:
        from plait.runtime.server import launch

        if "launch_timeout" in config:
            if "startup_timeout" in config:
                raise ValueError("launch_timeout and startup_timeout were both given; they are one option (seconds "
                                 "to wait for the runtime to start): give one")
            config["startup_timeout"] = config.pop("launch_timeout")
        self.handle = launch(model_path, **config)
        self.url: str = self.handle.url
        self.generate_url: str = self.url + "/generate"  # SGLang's Runtime attribute (scripts post to it)
        self.zmq_address: str = self.handle.zmq_address
        self.pid: int = self.handle.pid
        try:
            self.endpoint = RuntimeEndpoint(self.zmq_address, config.get("api_key"), alive=lambda: self.handle.alive)
        except BaseException:
            self.handle.shutdown()
            raise

    def shutdown(self) -> None:
        try:
            self.endpoint.shutdown()
        finally:
            self.handle.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def get_server_info(self) -> dict[str, Any]:
        return self.endpoint.get_server_info()

    def flush_cache(self) -> bool:
        return self.endpoint.flush_cache()

    def generate(self, prompt: str | list[str], sampling_params: dict[str, Any] | list[Any] | None = None,
                 return_logprob: bool = False, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None, lora_path: Any = None) -> str:
        """SGLang's ``Runtime.generate``: the runtime's answer as JSON text (an output
        dict, ``text``, ``output_ids``, ``meta_info``, or a list of them for a list of
        prompts), as SGLang's returns its HTTP response. plait serves no LoRA
        adapters: ``lora_path`` is refused."""
        if lora_path is not None:
            raise ValueError(f"lora_path={lora_path!r} is not supported: plait serves no LoRA adapters")
        return json.dumps(generate_outputs(self.endpoint, prompt, sampling_params, None, return_logprob,
                                           logprob_start_len, top_logprobs_num))

    async def async_generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> AsyncIterator[str]:
        """SGLang's ``Runtime.async_generate`` (also ``add_request``): ``async for``
        over the new text of one generation as the runtime streams it."""
        async for piece in stream_text(self.endpoint, prompt, sampling_params):
            yield piece

    add_request = async_generate

    def cache_prefix(self, prefix: str) -> None:
        """Prefill ``prefix`` into the runtime's prefix cache (SGLang's ``Runtime.cache_prefix``)."""
        self.endpoint.cache_prefix(prefix)

    def get_tokenizer(self) -> Any:
        """The served model's ``transformers`` tokenizer (SGLang's ``Runtime.get_tokenizer``),
        loaded in this process from the model's files: the sidecar runs on this machine."""
        from plait.runtime.model_loader import resolve_model

        return resolve_model(str(self.endpoint.server_info["model_path"])).load_tokenizer()
