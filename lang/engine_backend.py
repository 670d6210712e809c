"""``EngineBackend``: programs on an in-process :class:`plait.runtime.Engine`.

No sockets: one driver thread owns the engine (it is not thread-safe), takes
requests from program threads through a queue, steps the engine while it has work,
and hands outputs back through :class:`~plait.backend.Pending` handles. For offline
batch work, benchmarks and tests. :class:`OfflineEngine` (``plait.Engine``) is SGLang's
``sgl.Engine`` on top of it. Importing this module imports torch (the runtime);
``import plait`` does not import it until ``EngineBackend`` or ``Engine`` is used.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from plait.backend import (
    BaseBackend, OnChunk, Pending, Request, generate_outputs, logprob_tuples, offline_requests, stream_outputs,
    with_sglang_info,
)
from plait.chat_template import ChatTemplate
from plait.errors import RequestError, RuntimeUnavailableError

if TYPE_CHECKING:
    from plait.runtime.engine import Engine
    from plait.runtime.output_processor import RequestOutput
    from plait.runtime.validation import GenerateInput

IDLE_WAIT_S = 0.1

_UNSET: Any = object()


@dataclass
class _Live:
    """One submitted request (all its ``n`` sequences) and where its outputs go."""

    pending: Pending
    stream: bool
    text_in_logprobs: bool
    left: int  # sequences not finished yet


class EngineBackend(BaseBackend):
    """``EngineBackend(model=None, **engine_config)`` or ``EngineBackend(engine)``."""

    def __init__(self, model: str | Engine | None = None, **config: Any) -> None:
        from plait.runtime.engine import Engine

        if isinstance(model, Engine):
            if config:
                raise ValueError("engine options cannot be given together with an Engine instance")
            self.engine, self._owns_engine = model, False
        else:
            self.engine, self._owns_engine = Engine(model, **config), True
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._dead: BaseException | None = None
        self._closed = False
        self._template: Any = _UNSET
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="plait-engine-driver", daemon=True)
        self._thread.start()

    # -- transport ----------------------------------------------------------------------------
    def submit(self, req: Request, on_chunk: OnChunk | None = None) -> Pending:
        pending = Pending(req, on_chunk)
        self._post(("submit", req, pending))
        return pending

    def abort(self, rid: str) -> None:
        if self._dead is None and not self._closed:
            self._inbox.put(("abort", rid))

    def pin(self, text: str, ttl_s: float) -> str:
        return self._call(lambda e: e.pin_prefix(self._encode(text), ttl_s))

    def unpin(self, pin_id: str) -> bool:
        return self._call(lambda e: e.unpin(pin_id))

    def flush_cache(self) -> bool:
        return self._call(lambda e: e.flush_cache())

    def get_server_info(self) -> dict[str, Any]:
        return with_sglang_info(self._call(lambda e: e.server_info()))

    def get_chat_template(self) -> ChatTemplate | None:
        with self._lock:
            if self._template is _UNSET:
                tok = self.engine.tokenizer  # its template is the engine's chat_template when one was given
                if getattr(tok, "chat_template", None):
                    self._template = ChatTemplate(
                        lambda msgs: tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False),
                        name=str(self.engine.source.path),
                        render_generation=lambda msgs: tok.apply_chat_template(msgs, tokenize=False,
                                                                               add_generation_prompt=True),
                    )
                else:
                    self._template = None
            return self._template

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._thread.join(timeout=30)
        self._fail_all(RuntimeUnavailableError("the backend was shut down"))
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> EngineBackend:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- program threads -> driver ---------------------------------------------------------------
    def _post(self, cmd: tuple[Any, ...]) -> None:
        if self._dead is not None:
            raise RuntimeUnavailableError(f"the in-process engine failed earlier: {self._dead}")
        if self._closed:
            raise RuntimeUnavailableError("the backend was shut down")
        self._inbox.put(cmd)

    def _call(self, fn: Callable[[Engine], Any]) -> Any:
        fut: Future[Any] = Future()
        self._post(("call", fn, fut))
        try:
            return fut.result()
        except RequestError as e:
            raise e.to_backend_error() from None

    # -- driver ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._closed:
                busy = engine.has_work()
                if not self._drain(block=not busy) and not busy:
                    engine.expire_pins()
                if engine.has_work():
                    self._collect(engine.step())
        except BaseException as e:  # noqa: BLE001 - every waiter must hear about it
            self._dead = e
            self._fail_all(RuntimeUnavailableError(f"the in-process engine failed: {type(e).__name__}: {e}"))

    def _drain(self, block: bool) -> bool:
        """Handle queued commands; returns whether there were any."""
        got = False
        while True:
            try:
                cmd = self._inbox.get(timeout=IDLE_WAIT_S) if block and not got else self._inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            self._handle(cmd)

    def _handle(self, cmd: tuple[Any, ...]) -> None:
        kind = cmd[0]
        if kind == "submit":
            _, req, pending = cmd
            try:
                inp = self._validate(req)
                self.engine.submit(inp)
            except RequestError as e:
                pending.fail(e.to_backend_error())
                return
            self._live[req.rid] = _Live(pending, req.stream, req.return_text_in_logprobs, inp.params.n)
        elif kind == "abort":
            self.engine.abort(cmd[1])
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _collect(self, outputs: list[RequestOutput]) -> None:
        from plait.runtime.logprob_text import add_token_text

        for o in outputs:
            lv = self._live.get(o.group)
            if lv is None:
                continue
            if o.error is not None:
                del self._live[o.group]
                lv.pending.fail(o.error.to_backend_error())
                continue
            if lv.stream and (o.text or o.meta):
                if lv.text_in_logprobs:
                    add_token_text(o.meta, self._token_text)
                lv.pending.chunk(o.index, o.text, o.meta)
            if o.result is not None:
                if lv.text_in_logprobs:
                    add_token_text(o.result["meta_info"], self._token_text)
                lv.left -= 1
                if lv.left == 0:
                    del self._live[o.group]
                lv.pending.result(o.index, o.result)

    def _fail_all(self, error: BaseException) -> None:
        live, self._live = self._live, {}
        for lv in live.values():
            lv.pending.fail(error)
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "submit":
                cmd[2].fail(error)
            elif cmd[0] == "call":
                cmd[2].set_exception(error)

    # -- helpers -------------------------------------------------------------------------------------
    def _encode(self, text: str) -> list[int]:
        from plait.runtime.prompt_tokens import encode_prompt

        return encode_prompt(self.engine.tokenizer, text)

    def _validate(self, req: Request) -> GenerateInput:
        from plait.runtime.validation import validate_generate

        ids = req.input_ids if req.input_ids is not None else self._encode(req.text or "")
        return validate_generate(
            req.rid, ids, req.sampling_params, self.engine.limits,
            prompt_param="input_ids" if req.input_ids is not None else "text",
            return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
            top_logprobs_num=req.top_logprobs_num, stream=req.stream,
        )

    def _token_text(self, tid: int) -> str:
        return self.engine.tokenizer.decode([tid])


class OfflineEngine:
    """SGLang's ``sgl.Engine``: a model in this process, for offline ``generate`` calls
    and as the backend of programs (``set_default_backend(engine)``,
    ``f.run(backend=engine)``; ``endpoint`` is the :class:`EngineBackend` they run on).

    ``Engine(model_path=None, **options)`` takes the engine options by plait's names or
    SGLang's (``mem_fraction_static``, ``max_total_tokens``, ``random_seed``,
    ``tp_size=1`` ...), as ``plait serve`` does; ``log_level`` sets the level of the
    ``plait`` logger. Options of a server (``host``, ``port``, ``api_key`` ...) are
    refused: they belong to :class:`plait.Runtime` and ``plait serve``."""

    def __init__(self, model_path: str | None = None, **options: Any) -> None:
        from plait.runtime.server.args import LOG_LEVELS, ServerArgs
        from plait.runtime.server.sglang_options import translate

        opts = translate(options, model_path)
        model_path = opts.pop("model", model_path)
        log_level = opts.pop("log_level", None)
        server_defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
        for name in sorted(set(opts) & set(server_defaults)):
            value = opts.pop(name)
            # a server's option at its default (lm-eval's dp_size=1) changes nothing here
            if value != server_defaults[name]:
                raise ValueError(f"{name}={value!r} is an option of a server; Engine runs the model in this process, "
                                 "as one replica (use plait.Runtime(...) or `plait serve` for a server)")
        if log_level is not None:
            if log_level not in LOG_LEVELS:
                raise ValueError(f"log_level={log_level!r} is invalid; allowed: {', '.join(LOG_LEVELS)}")
            logging.getLogger("plait").setLevel(log_level.upper())
        self.endpoint = EngineBackend(model_path, **opts)

    @property
    def tokenizer(self) -> Any:
        return self.endpoint.engine.tokenizer

    @property
    def tokenizer_manager(self) -> TokenizerInfo:
        """What programs read off SGLang's ``engine.tokenizer_manager`` (lm-eval reads
        ``tokenizer`` and ``context_len``)."""
        return TokenizerInfo(self.endpoint.engine.tokenizer, self.endpoint.engine.context_len)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (SGLang's ``Engine.get_tokenizer``)."""
        return self.tokenizer

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict[str, Any] | list[Any] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                 logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                 return_text_in_logprobs: bool = False, stream: bool = False, **sglang_only: Any) -> Any:
        """SGLang's ``Engine.generate``: one prompt (text or ``input_ids``) gives one
        output dict (``text``, ``output_ids``, ``meta_info``; a list of ``n`` with
        ``n > 1``), a list of prompts a list of outputs in order. Logprob entries are
        ``(logprob, token_id, text)`` tuples, ``text`` None without
        ``return_text_in_logprobs``. With ``stream``, one prompt gives an iterator of
        output dicts, each with the text so far, the last the final output
        (:func:`~plait.backend.stream_outputs`). Invalid requests raise
        :class:`~plait.errors.BackendError` naming the field (``param``). SGLang's
        keywords for what plait does not serve (``image_data``, ``lora_path``,
        ``return_hidden_states`` ...) are refused by name when set."""
        _refuse_sglang_only(sglang_only)
        if stream:
            single, reqs = offline_requests(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                            top_logprobs_num, return_text_in_logprobs)
            if not single:
                raise ValueError(f"stream=True streams one prompt; {len(reqs)} were given (stream each, or "
                                 "generate the list without stream)")
            return stream_outputs(self.endpoint, reqs[0])
        return generate_outputs(self.endpoint, prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                top_logprobs_num, return_text_in_logprobs)

    async def async_generate(self, prompt: str | list[str] | None = None,
                             sampling_params: dict[str, Any] | list[Any] | None = None,
                             input_ids: list[int] | list[list[int]] | None = None, return_logprob: bool = False,
                             logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                             return_text_in_logprobs: bool = False, stream: bool = False, **sglang_only: Any) -> Any:
        """SGLang's ``await engine.async_generate(...)``: :meth:`generate` without
        blocking the event loop (its requests wait in a worker thread). With ``stream``,
        it returns an async iterator of the chunks ``generate(stream=True)`` yields."""
        _refuse_sglang_only(sglang_only)
        loop = asyncio.get_running_loop()
        if stream:
            chunks = self.generate(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                   top_logprobs_num, return_text_in_logprobs, stream=True)
            return _async_chunks(chunks, loop)
        return await loop.run_in_executor(None, lambda: self.generate(
            prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
            return_text_in_logprobs))

    def get_server_info(self) -> dict[str, Any]:
        return self.endpoint.get_server_info()

    def flush_cache(self) -> bool:
        return self.endpoint.flush_cache()

    def shutdown(self) -> None:
        self.endpoint.shutdown()

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


@dataclass(frozen=True)
class TokenizerInfo:
    """``engine.tokenizer_manager``: the tokenizer and the context length, where
    SGLang's engine keeps them (evaluation harnesses read them there)."""

    tokenizer: Any
    context_len: int


async def _async_chunks(chunks: Iterator[dict[str, Any]],
                        loop: asyncio.AbstractEventLoop) -> AsyncIterator[dict[str, Any]]:
    """``chunks`` for ``async for``: each is waited for in a worker thread; leaving the
    loop early closes the iterator (which aborts the request)."""
    end = object()
    try:
        while (chunk := await loop.run_in_executor(None, next, chunks, end)) is not end:
            yield chunk
    finally:
        # (a consumer cancelled while a chunk was awaited leaves the iterator running: it
        # ends with its request)
        with contextlib.suppress(ValueError):
            await loop.run_in_executor(None, chunks.close)


# SGLang's Engine.generate keywords for what plait does not serve, and why; a keyword
# left at its default (None / False) changes nothing and is accepted
_SGLANG_ONLY = {
    "image_data": "plait serves text-only models, so a prompt cannot hold an image",
    "audio_data": "plait serves text-only models, so a prompt cannot hold audio",
    "video_data": "plait serves text-only models, so a prompt cannot hold a video",
    "lora_path": "plait serves no LoRA adapters",
    "custom_logit_processor": "plait runs no custom logit processors",
    "return_hidden_states": "plait does not return hidden states",
    "token_ids_logprob": "plait returns the logprobs of the sampled and the top tokens only (top_logprobs_num)",
    "data_parallel_rank": "plait's in-process engine is one replica",
    "bootstrap_host": "plait has no prefill/decode disaggregation",
    "bootstrap_port": "plait has no prefill/decode disaggregation",
    "bootstrap_room": "plait has no prefill/decode disaggregation",
}


def _refuse_sglang_only(given: dict[str, Any]) -> None:
    for key, value in given.items():
        if key not in _SGLANG_ONLY:
            raise TypeError(f"generate() got an unexpected keyword argument {key!r}")
        if value is not None and value is not False:
            raise ValueError(f"{key}={value!r} is not supported: {_SGLANG_ONLY[key]}")
