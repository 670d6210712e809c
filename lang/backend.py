"""What a program runs on: the backend interface, and what every backend builds on it
(gen, select, prefix warm-up).

A backend moves :class:`Request` objects (the wire protocol's generate request) and
returns their outputs through :class:`Pending` handles; ``select`` and the rest are
written once, here, on top of that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import random
import threading
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from plait.chat_template import ChatTemplate
from plait.choices import ChoicesDecision, ChoicesSamplingMethod, softmax_sample
from plait.errors import BackendError, ProgramCancelled, RuntimeUnavailableError
from plait.ir import ResolvedParams, plain_numbers
from plait.runtime.logprob_text import map_logprob_entries

# select: prompt tokens re-scored before the end of the context, to find where the
# choice's tokens begin (a choice may merge with the context's last tokens)
BOUNDARY_WINDOW = 8

# (sequence index, new text, the chunk's meta: completion_tokens so far and the new
# output logprob entries, as the runtime streams them)
OnChunk = Callable[[int, str, dict[str, Any]], None]


@dataclass
class Request:
    """One generate request, as the runtime's wire protocol defines it."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def n(self) -> int:
        return int(self.sampling_params.get("n", 1) or 1)


class Pending:
    """Outputs of one submitted request: stream pieces go to ``on_chunk`` as they
    arrive; :meth:`wait` returns one output dict per sequence (``text``,
    ``output_ids``, ``meta_info``) or raises the request's error."""

    def __init__(self, req: Request, on_chunk: OnChunk | None = None) -> None:
        self.rid = req.rid
        self.on_chunk = on_chunk
        self.results: list[dict[str, Any] | None] = [None] * req.n
        self.error: BaseException | None = None
        self._left = req.n
        self._done = threading.Event()
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def chunk(self, index: int, text: str, meta: dict[str, Any] | None = None) -> None:
        # a chunk with no text may still carry logprob entries of held-back tokens
        if (text or meta) and self.on_chunk is not None and not self.done:
            try:
                self.on_chunk(index, text, meta or {})
            except Exception as e:  # noqa: BLE001 - the caller's callback fails its request, not the backend's thread
                self.fail(BackendError(f"the stream's consumer failed: {type(e).__name__}: {e}"))

    def result(self, index: int, out: dict[str, Any]) -> None:
        with self._lock:
            if self.done or not 0 <= index < len(self.results) or self.results[index] is not None:
                return
            self.results[index] = out
            self._left -= 1
            if self._left == 0:
                self._done.set()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if not self.done:
                self.error = error
                self._done.set()

    def wait(self, timeout: float | None = None) -> list[dict[str, Any]]:
        if not self._done.wait(timeout):
            raise RuntimeUnavailableError(f"request {self.rid} got no answer within {timeout} s")
        if self.error is not None:
            raise self.error
        return [r for r in self.results if r is not None]


@dataclass
class TokenUsage:
    """Tokens of the requests a backend ran (SGLang's ``backend.token_usage``): prompt
    tokens (cached ones included) and generated tokens, over every gen, select and
    prefill. ``reset()`` starts again from zero."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


class CancelScope:
    """The in-flight requests of one program; :meth:`cancel` aborts all of them and
    makes later submissions fail with :class:`ProgramCancelled`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active: dict[str, BaseBackend] = {}
        self.reason: BaseException | None = None

    def enter(self, backend: BaseBackend, rid: str) -> None:
        with self._lock:
            if self.reason is not None:
                raise ProgramCancelled(f"the program was cancelled: {self.reason}")
            self._active[rid] = backend

    def exit(self, rid: str) -> None:
        with self._lock:
            self._active.pop(rid, None)

    def cancel(self, reason: BaseException) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            active, self._active = self._active, {}
        for rid, backend in active.items():
            backend.abort(rid)


class BaseBackend(ABC):
    """A place programs run. Subclasses implement the transport: :meth:`submit`,
    :meth:`abort`, :meth:`pin`, :meth:`unpin`, :meth:`flush_cache`,
    :meth:`get_server_info`, :meth:`get_chat_template`, :meth:`shutdown`."""

    is_chat_model = False  # SGLang's attribute: plait backends take text prompts
    supports_pinning = True
    token_usage: TokenUsage

    def __new__(cls, *args: Any, **kwargs: Any) -> BaseBackend:
        # here rather than in __init__, so that every subclass has it whatever its
        # __init__ does
        self = super().__new__(cls)
        self.token_usage = TokenUsage()
        return self

    # -- transport (subclasses) -------------------------------------------------------
    @abstractmethod
    def submit(self, req: Request, on_chunk: OnChunk | None = None) -> Pending:
        """Send ``req``; chunks go to ``on_chunk`` when streaming."""

    @abstractmethod
    def abort(self, rid: str) -> None:
        """Abort request ``rid`` if it is still running."""

    def pin(self, text: str, ttl_s: float) -> str:
        """Prefill ``text`` and hold its KV until :meth:`unpin` or ``ttl_s``; returns
        the pin id. Raises :class:`BackendError` when refused (e.g. over budget)."""
        raise self._unsupported("pin")

    def unpin(self, pin_id: str) -> bool:
        raise self._unsupported("unpin")

    def flush_cache(self) -> bool:
        raise self._unsupported("flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        raise self._unsupported("get_server_info")

    def get_chat_template(self) -> ChatTemplate | None:
        raise self._unsupported("get_chat_template")

    def get_model_name(self) -> str:
        """The served model's path (SGLang's ``get_model_name``)."""
        return str(self.get_server_info()["model_path"])

    @property
    def model_info(self) -> dict[str, Any]:
        """SGLang's ``RuntimeEndpoint.model_info`` (its server's ``/get_model_info``):
        ``model_path``, ``tokenizer_path`` and ``is_generation``."""
        info = with_sglang_info(self.get_server_info())
        return {"model_path": info["model_path"], "tokenizer_path": info["tokenizer_path"], "is_generation": True}

    @property
    def chat_template(self) -> ChatTemplate | None:
        """The template roles render with (SGLang's attribute): one assigned to it (a
        :class:`ChatTemplate`, as SGLang programs assign ``get_chat_template(name)``),
        else :meth:`get_chat_template`, the served model's own."""
        return chat_template_of(self)

    @chat_template.setter
    def chat_template(self, value: Any) -> None:
        if value is not None and not isinstance(value, ChatTemplate):
            raise ValueError(f"{type(self).__name__}.chat_template={value!r:.60} is invalid; allowed: a ChatTemplate "
                             "(plait.chat_template.get_chat_template(name)) or None (the served model's own)")
        self._assigned_template = value

    def shutdown(self) -> None:
        pass

    def _unsupported(self, what: str) -> BackendError:
        return BackendError(f"{type(self).__name__} does not support {what}()")

    def end_program(self, state: Any) -> None:
        """Called when a program ends (SGLang's hook); nothing to do here."""

    # -- built on the transport -----------------------------------------------------------
    def run_requests(self, reqs: list[Request], scope: CancelScope | None = None,
                     on_chunk: OnChunk | None = None) -> list[list[dict[str, Any]]]:
        """Submit all of ``reqs`` at once, then wait for all; outputs in order."""
        pendings: list[Pending] = []
        try:
            for req in reqs:
                if scope is not None:
                    scope.enter(self, req.rid)
                pendings.append(self.submit(req, on_chunk))
            outs = [p.wait() for p in pendings]
        except BaseException:
            for p in pendings:
                if not p.done:
                    self.abort(p.rid)
            raise
        finally:
            if scope is not None:
                for req in reqs:
                    scope.exit(req.rid)
        for seqs in outs:
            for out in seqs:
                meta = out["meta_info"]
                self.token_usage.add(meta.get("prompt_tokens", 0), meta.get("completion_tokens", 0))
        return outs

    def generate(self, prompt: str, params: ResolvedParams, *, on_chunk: OnChunk | None = None,
                 scope: CancelScope | None = None) -> list[dict[str, Any]]:
        """Generate after ``prompt``; one output dict per sequence (``n``)."""
        req = Request(text=prompt, sampling_params=dict(params.sampling), stream=on_chunk is not None, **params.request)
        outs = self.run_requests([req], scope, on_chunk)[0]
        for out in outs:
            _check_not_aborted(out, scope)
            logprob_tuples(out["meta_info"])
        return outs

    def cache_prefix(self, text: str, scope: CancelScope | None = None) -> None:
        """Prefill ``text`` into the prefix cache (nothing is generated)."""
        if text:
            self.run_requests([Request(text=text, sampling_params={"max_new_tokens": 0})], scope)

    def select(self, prompt: str, choices: list[str], temperature: float,
               method: ChoicesSamplingMethod, scope: CancelScope | None = None) -> ChoicesDecision:
        """Score every choice after ``prompt`` with input-token logprobs and let
        ``method`` decide. All choices are submitted together, after the context has
        been prefilled once, so they share its KV through the prefix cache."""
        if prompt:
            first = self.run_requests([Request(text=prompt, sampling_params={"max_new_tokens": 0})], scope)[0][0]
            _check_not_aborted(first, scope)
            start = max(first["meta_info"]["prompt_tokens"] - BOUNDARY_WINDOW, 0)
        else:
            start = 0
        tokens = self._score_choices(prompt, choices, start, scope)
        if tokens is None:  # a choice re-tokenized the context before the window
            tokens = self._score_choices(prompt, choices, 0, scope)
        assert tokens is not None
        normalized = [_mean_logprob(t) for t in tokens]
        # every keyword of SGLang's interface, unconditional_token_logprobs None unless
        # the method asks for it (custom methods may take it without a default)
        kwargs: dict[str, Any] = dict(
            choices=choices,
            normalized_prompt_logprobs=normalized,
            input_token_logprobs=tokens,
            output_token_logprobs=[[] for _ in choices],
            unconditional_token_logprobs=None,
        )
        if getattr(method, "requires_unconditional_logprobs", False):
            reqs = [
                Request(input_ids=[e[1] for e in t], sampling_params={"max_new_tokens": 0},
                        return_logprob=True, logprob_start_len=0, return_text_in_logprobs=True)
                for t in tokens
            ]
            outs = self.run_requests(reqs, scope)
            kwargs["unconditional_token_logprobs"] = [
                [tuple(e) for e in o[0]["meta_info"]["input_token_logprobs"]] for o in outs
            ]
        decision = method(**kwargs)
        if temperature and temperature > 0:
            scores = method.scores(**kwargs) if hasattr(method, "scores") else None
            i = softmax_sample(scores or normalized, float(temperature), random.random())
            decision = ChoicesDecision(choices[i], decision.meta_info)
        return decision

    def _score_choices(self, prompt: str, choices: list[str], start: int,
                       scope: CancelScope | None) -> list[list[tuple[Any, ...]]] | None:
        """Per choice, ``(logprob, token_id, text)`` of the tokens of ``prompt + choice``
        from the first one that differs from the tokens of ``prompt`` alone (SGLang's
        shape). None if some choice differs already at ``start`` (then the window must
        start earlier)."""
        opts = dict(sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start,
                    return_text_in_logprobs=True)
        reqs = [Request(text=prompt + c, **opts) for c in choices]
        if prompt:
            reqs.insert(0, Request(text=prompt, **opts))
        outs = [o[0] for o in self.run_requests(reqs, scope)]
        for o in outs:
            _check_not_aborted(o, scope)
        ctx_ids = [e[1] for e in outs.pop(0)["meta_info"]["input_token_logprobs"]] if prompt else []
        result = []
        for o in outs:
            entries = [tuple(e) for e in o["meta_info"]["input_token_logprobs"]]
            d = 0
            while d < len(ctx_ids) and d < len(entries) and entries[d][1] == ctx_ids[d]:
                d += 1
            if d == 0 and start > 0:
                return None
            result.append(entries[d:])
        return result


def offline_requests(prompt: str | list[str] | None, sampling_params: Any,
                     input_ids: list[int] | list[list[int]] | None, return_logprob: bool = False,
                     logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                     return_text_in_logprobs: bool = False) -> tuple[bool, list[Request]]:
    """The requests of SGLang's offline ``generate`` arguments, and whether one prompt
    (not a list) was given."""
    if (prompt is None) == (input_ids is None):
        raise ValueError("give exactly one of prompt and input_ids")
    if prompt is not None:
        single = isinstance(prompt, str)
        prompts: list[Any] = [prompt] if single else list(prompt)
        key = "text"
    else:
        single = not input_ids or not isinstance(input_ids[0], list)
        prompts = [input_ids] if single else list(input_ids)
        key = "input_ids"
    params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts; they must match")
    opts = dict(return_logprob=return_logprob, return_text_in_logprobs=return_text_in_logprobs,
                logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
                top_logprobs_num=top_logprobs_num or 0)
    return single, [Request(**{key: p}, sampling_params=plain_numbers(dict(sp or {})), **opts)
                    for p, sp in zip(prompts, params)]


def generate_outputs(backend: BaseBackend, prompt: str | list[str] | None, sampling_params: Any,
                     input_ids: list[int] | list[list[int]] | None, return_logprob: bool = False,
                     logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                     return_text_in_logprobs: bool = False) -> Any:
    """SGLang's offline ``generate`` on ``backend`` (``Engine.generate``,
    ``Runtime.generate``): one prompt (text or ``input_ids``) gives one output dict
    (``text``, ``output_ids``, ``meta_info``; a list of ``n`` with ``n > 1``), a list
    of prompts a list of outputs in order; ``sampling_params`` is one dict for all or
    one per prompt. Logprob entries are tuples."""
    single, reqs = offline_requests(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                    top_logprobs_num, return_text_in_logprobs)
    outs = backend.run_requests(reqs)
    for seqs in outs:
        for out in seqs:
            logprob_tuples(out["meta_info"])
    flat = [o if len(o) > 1 else o[0] for o in outs]
    return flat[0] if single else flat


async def stream_text(backend: BaseBackend, prompt: str, sampling_params: dict[str, Any] | None) -> AsyncIterator[str]:
    """SGLang's ``Runtime.async_generate`` on ``backend``: the new text of one
    generation, piece by piece, without blocking the event loop. Pieces concatenate
    to the output's text (what the final output adds to them, such as text held back
    while it could still begin a stop string, comes last). Closing the iterator early
    aborts the request; an invalid request raises :class:`BackendError`."""
    params = dict(sampling_params or {})
    if params.get("n", 1) != 1:
        raise ValueError(f"n={params['n']!r} is invalid for a streamed generate; allowed: 1 (run a program with "
                         "gen(n=...) for several samples)")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()
    end = object()

    closed = threading.Event()  # the consumer left: later chunks go nowhere

    def deliver(item: Any) -> None:
        # runs on the backend's thread, which must never see the consumer's errors
        if not closed.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed after an early exit
                loop.call_soon_threadsafe(queue.put_nowait, item)

    def on_chunk(index: int, piece: str, meta: dict[str, Any]) -> None:
        if index == 0 and piece:
            deliver(piece)

    pending = backend.submit(Request(text=prompt, sampling_params=params, stream=True), on_chunk)

    def wait() -> None:  # in a worker thread: after the last chunk, the end
        try:
            pending.wait()
        except BaseException:  # noqa: BLE001 - read from pending below
            pass
        deliver(end)

    threading.Thread(target=wait, name="plait-stream-wait", daemon=True).start()
    streamed = ""
    try:
        while (piece := await queue.get()) is not end:
            streamed += piece
            yield piece
        out = pending.wait(0)[0]  # raises the request's error
        backend.token_usage.add(out["meta_info"].get("prompt_tokens", 0), out["meta_info"].get("completion_tokens", 0))
        _check_not_aborted(out, None)
        rest = out["text"][len(streamed):] if out["text"].startswith(streamed) else ""
        if rest:
            yield rest
    finally:
        closed.set()
        if not pending.done:
            backend.abort(pending.rid)


def stream_outputs(backend: BaseBackend, req: Request) -> Iterator[dict[str, Any]]:
    """SGLang's ``Engine.generate(..., stream=True)`` on ``backend``: one output dict
    per streamed piece, each with the text so far and the meta info so far (output
    logprob entries of every piece so far), as SGLang's streams them by default
    (not incrementally); the last is the final output (``output_ids``,
    ``finish_reason``). Breaking out of the loop early aborts the request; an invalid
    request raises :class:`BackendError`."""
    if req.n != 1:
        raise ValueError(f"n={req.n!r} is invalid for a streamed generate; allowed: 1 (generate without stream "
                         "for several samples)")
    pieces: queue.SimpleQueue[Any] = queue.SimpleQueue()
    end = object()

    def on_chunk(index: int, piece: str, meta: dict[str, Any]) -> None:  # on the backend's thread: never raises
        if index == 0:
            pieces.put((piece, meta))

    pending = backend.submit(dataclasses.replace(req, stream=True), on_chunk)

    def wait() -> None:  # in a worker thread: after the last chunk, the end
        with contextlib.suppress(BaseException):  # read from pending below
            pending.wait()
        pieces.put(end)

    threading.Thread(target=wait, name="plait-stream-wait", daemon=True).start()
    text, meta = "", None
    try:
        while (item := pieces.get()) is not end:
            text += item[0]
            meta = merge_chunk_meta(meta, item[1])
            yield {"text": text, "meta_info": meta}
        out = pending.wait(0)[0]  # raises the request's error
        backend.token_usage.add(out["meta_info"].get("prompt_tokens", 0), out["meta_info"].get("completion_tokens", 0))
        _check_not_aborted(out, None)
        logprob_tuples(out["meta_info"])
        yield out
    finally:
        if not pending.done:
            backend.abort(pending.rid)


def logprob_tuples(meta: dict[str, Any]) -> None:
    """In place: logprob entries become ``(logprob, token_id, text)`` tuples, as SGLang
    returns them: ``text`` is None without ``return_text_in_logprobs`` (so that
    ``for lp, tid, text in entries`` works either way)."""
    map_logprob_entries(meta, _logprob_entry)


# meta info keys a stream delivers a piece at a time
STREAMED_LOGPROB_KEYS = ("output_token_logprobs", "output_top_logprobs")


def merge_chunk_meta(so_far: dict[str, Any] | None, chunk: dict[str, Any]) -> dict[str, Any]:
    """The meta info of a generation after one more streamed chunk: the chunk's counts,
    and the output logprob entries of every chunk so far (SGLang's tuples)."""
    new = dict(chunk)
    logprob_tuples(new)
    out = {**(so_far or {}), **new}
    for key in STREAMED_LOGPROB_KEYS:
        if key in new:
            out[key] = list((so_far or {}).get(key, [])) + new[key]
    return out


def _logprob_entry(e: Any) -> tuple[Any, ...]:
    t = tuple(e)
    return t + (None,) if len(t) == 2 else t


def _mean_logprob(entries: list[Any]) -> float:
    lps = [e[0] for e in entries if e[0] is not None]
    return sum(lps) / len(lps) if lps else 0.0


def _check_not_aborted(out: dict[str, Any], scope: CancelScope | None) -> None:
    reason = out["meta_info"].get("finish_reason") or {}
    if reason.get("type") != "abort":
        return
    if scope is not None and scope.reason is not None:
        raise ProgramCancelled(f"the program was cancelled: {scope.reason}")
    raise BackendError(f"the runtime aborted the request: {reason.get('message', 'no reason given')}")


def with_sglang_info(info: dict[str, Any]) -> dict[str, Any]:
    """Server info with the keys SGLang's has that programs read: ``tokenizer_path``
    (SGLang's defaults to the model path; its benchmarks load the tokenizer from it)."""
    if isinstance(info, dict) and "model_path" in info and info.get("tokenizer_path") is None:
        info = {**info, "tokenizer_path": info["model_path"]}
    return info


def chat_template_of(backend: Any) -> ChatTemplate | None:
    """The template ``backend``'s roles render with: one assigned to its
    ``chat_template``, else its ``get_chat_template()`` (a backend of the program's own
    that only has that method works too)."""
    assigned = getattr(backend, "_assigned_template", None)
    return assigned if assigned is not None else backend.get_chat_template()
