"""The HTTP API: OpenAI-compatible routes, SGLang-shaped native routes, metrics.

Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``,
with a 4xx code for client mistakes. A client that disconnects (streaming or not)
aborts its requests, so their KV memory returns to the pool.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plait import protocol as P
from plait.runtime.server import openai_api as oa
from plait.runtime.server import responses_api as ra
from plait.errors import RequestError, is_int
from plait.runtime.logprob_text import pad_logprob_text
from plait.runtime.server.front import COSTLY_TEXT_CHARS, Front, ReqState
from plait.runtime.validation import check_cache_salt, check_text
from plait.runtime.server.metrics import CONTENT_TYPE

logger = logging.getLogger("plait.http")

MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_BODIES_BYTES = 512 * 1024 * 1024  # bodies read and parsed at once, all requests (BodyBudget)
MAX_HEADER_BYTES = 64 * 1024
# a body whose next bytes take longer than this is a 408 (nginx's client_body_timeout):
# a client that stalls mid-body held its bytes of the BodyBudget for ever, so a few
# such clients could leave every later request a 503
BODY_IDLE_TIMEOUT_S = 60.0
RETRY_AFTER_S = 2  # what a 503 (engine restarting or down) tells clients
PARSE_OFF_LOOP_BYTES = 256 * 1024  # bodies larger than this are parsed in a worker thread
SUBMIT_BATCH = 64  # a request with more prompts than this lets the loop run between each 64
LARGE_RESPONSE_ENTRIES = 16_384  # a response carrying more token entries is built in a worker thread
_json = msgspec.json.Encoder()


def error_response(message: str, code: int = 400, param: str | None = None,
                   error_type: str = "invalid_request_error") -> JSONResponse:
    return error_json(RequestError(message, param, code, error_type))


def error_json(e: RequestError) -> JSONResponse:
    """The one place a typed error becomes an HTTP response (a 503 says when to retry)."""
    headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
    return JSONResponse(P.error_body(e), status_code=e.status, headers=headers)


def sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class ApiKeyMiddleware:
    """Bearer auth on every route but the probes: ``/health``, ``/health_generate`` and
    ``/metrics`` stay open, as SGLang leaves them, so that load balancers, routers and
    Prometheus reach a keyed server (they report liveness and counts, never a request's
    content; ``/health_generate`` runs one token)."""

    OPEN = frozenset({"/health", "/health_generate", "/metrics"})

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.OPEN:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                resp = error_response("invalid or missing API key: send 'Authorization: Bearer <key>'", 401,
                                      None, "authentication_error")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AnsweredErrorMiddleware:
    """Keeps an unexpected exception that was already answered (the 500 of
    :func:`on_error`) from reaching the HTTP server. Starlette re-raises it after
    answering, and uvicorn then closes the connection, so the client's next request on
    that keep-alive connection was reset (``Connection reset by peer``) although it was
    fine. Any other exception (a stream cut short) still goes on: that connection must
    close."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        complete = False

        async def watch(message: Message) -> None:
            nonlocal status, complete
            await send(message)
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True

        try:
            await self.app(scope, receive, watch)
        except Exception:
            if not (complete and status == 500):
                raise
            # answered (and logged) by on_error


class BrowserOriginGuard:
    """403 for a request a web page of another origin made (its ``Origin`` header, or
    ``Sec-Fetch-Site: cross-site`` where a browser sends no Origin, as for an image)
    unless ``--allowed-origins`` allows that origin. CORS only hides answers from such
    a page; a "simple" request (a form, a text/plain fetch, an ``<img>``) still ran, so
    any site the user visited could generate on, abort every request of, or flush a
    keyless server on the user's machine. Clients outside browsers send neither header."""

    def __init__(self, app: ASGIApp, origins: list[str]) -> None:
        self.app = app
        self.origins = set(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.origins:
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1")
            if origin:  # ("null": a sandboxed frame or a file:// page, refused unless allowed by name)
                foreign = origin not in self.origins
            else:
                foreign = headers.get(b"sec-fetch-site") == b"cross-site"
            if foreign:
                shown = origin or "a cross-site page"
                resp = error_response(f"requests from web pages of other origins ({shown}) are refused; allowed: "
                                      f"origins the server was started with --allowed-origins", 403, None,
                                      "permission_error")
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeaderLimitMiddleware:
    """431 for requests whose headers exceed MAX_HEADER_BYTES in all."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(k) + len(v) for k, v in scope["headers"])
            if size > MAX_HEADER_BYTES:
                resp = error_response(f"the request headers have {size} bytes; at most {MAX_HEADER_BYTES} are allowed",
                                      431)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyBudget:
    """The bytes of request bodies being read and parsed at once, all requests together.

    One body is at most MAX_BODY_BYTES, but nothing bounded how many arrive together:
    a hundred clients each sending 64 MiB would hold 6.4 GiB of raw bytes and several
    times that once parsed, and the front would be killed for memory with every
    request in it. A body that would take the total past ``limit`` is a 503 (with
    Retry-After) naming the limit; each body's share is given back once it is parsed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, n: int) -> None:
        if self.used + n > self.limit:
            raise RequestError(f"the server is reading {self.used} bytes of other request bodies, and at most "
                               f"{self.limit} are read at once; retry later", None, 503, "server_error")
        self.used += n

    def give(self, n: int) -> None:
        self.used -= n


async def _next_chunk(stream: AsyncIterator[bytes]) -> bytes:
    """The body's next chunk, or TimeoutError after BODY_IDLE_TIMEOUT_S (no task per
    chunk where asyncio.timeout exists)."""
    if hasattr(asyncio, "timeout"):  # Python 3.11+
        async with asyncio.timeout(BODY_IDLE_TIMEOUT_S):
            return await stream.__anext__()
    return await asyncio.wait_for(stream.__anext__(), BODY_IDLE_TIMEOUT_S)


def body_given(request: Request) -> bool:
    """Whether the request carries a body (a Content-Length other than 0, or a chunked one)."""
    length = request.headers.get("content-length")
    return (length is not None and length.strip() != "0") or "transfer-encoding" in request.headers


async def read_json(request: Request, budget: BodyBudget | None = None) -> tuple[dict[str, Any], int]:
    """The JSON object of a request body and the body's size in bytes (as read: a
    chunked body has no Content-Length): size checked before reading (Content-Length)
    and while reading, and against ``budget`` (bodies in flight) as it arrives; a large
    body is parsed off the event loop. Every malformed body is a 400 (413 when too
    large, 415 when compressed, 503 over the budget, 408 when it stops arriving for
    BODY_IDLE_TIMEOUT_S)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise RequestError(f"Content-Encoding {encoding!r} is not supported; allowed: identity (send the body "
                           f"uncompressed)", None, 415)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(f"the request body has {declared} bytes; at most {MAX_BODY_BYTES} are allowed", None, 413)
    chunks, size = [], 0
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                chunk = await _next_chunk(stream)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise RequestError(f"the request body stopped arriving: no bytes came for {BODY_IDLE_TIMEOUT_S:g} s "
                                   f"(after {size} bytes); send the whole body without pausing", None, 408) from None
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError(f"the request body has more than {MAX_BODY_BYTES} bytes; at most "
                                   f"{MAX_BODY_BYTES} are allowed", None, 413)
            if budget is not None:
                budget.take(len(chunk))
            chunks.append(chunk)
        body = b"".join(chunks)
        obj = await asyncio.to_thread(parse_json, body) if size > PARSE_OFF_LOOP_BYTES else parse_json(body)
    finally:
        if budget is not None:
            budget.give(sum(len(c) for c in chunks))
    if not isinstance(obj, dict):
        raise RequestError("the request body must be a JSON object", None)
    return obj, size


def _meta_entries(meta: dict[str, Any]) -> int:
    """The logprob entries of a result's or chunk's ``meta``: one per token entry, every
    pair of a top-logprobs row."""
    return sum(sum(len(x or ()) for x in v) if k.endswith("top_logprobs") else len(v)
               for k, v in meta.items() if isinstance(v, list))


def _entries(results: Iterable[P.GenerateResult]) -> int:
    """The token entries a response of ``results`` carries: output tokens and logprob
    entries."""
    return sum(len(r.output_ids) + _meta_entries(r.meta_info) for r in results)


async def off_loop(work: Callable[[], Any], entries: int) -> Any:
    """``work()``, run in a worker thread when the response it builds carries more than
    LARGE_RESPONSE_ENTRIES token entries (128 choices of 1000 tokens with 20 top logprobs
    are 2.7M entries: seconds of work that would stall every other client on this loop)."""
    return await asyncio.to_thread(work) if entries > LARGE_RESPONSE_ENTRIES else work()


async def json_reply(build: Callable[[], Any], entries: int) -> Response:
    """The JSON response of ``build()``, built and encoded off the loop when large (:func:`off_loop`)."""
    body = await off_loop(lambda: _json.encode(build()), entries)
    return Response(body, media_type="application/json")


# fields whose parse checks or translates a schema: tools (each parameters schema checked
# against its metaschema; a forced call's schemas translated to one regex, ~60 ms for a
# 17 KB schema) and a response schema (translated to a regex under a reasoning parser)
SCHEMA_FIELDS = ("tools", "response_format", "text")


def parse_off_loop(body: dict[str, Any], size: int) -> bool:
    """Whether an OpenAI or Responses body is parsed in a worker thread instead of on
    the event loop: a long prompt or chat to render and tokenize (judged by the bytes
    read: a chunked body has no Content-Length), or a schema to check or translate."""
    return size > COSTLY_TEXT_CHARS or any(body.get(k) is not None for k in SCHEMA_FIELDS)


def parse_json(body: bytes) -> Any:
    try:
        text = body.decode("utf-8-sig")  # a leading byte order mark is ignored (RFC 8259 allows it)
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8 (byte {e.start}: {e.reason})", None) from None
    try:
        return json.loads(text)
    except RecursionError:
        raise RequestError("the request body is not valid JSON: it is nested too deeply", None) from None
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {str(e)[:200]}", None) from None
    except ValueError:  # an integer literal past Python's limit (its advice to raise it is no client's)
        raise RequestError(f"the request body holds an integer literal of more than {sys.get_int_max_str_digits()} "
                           "digits; allowed: integers within the range each field states", None) from None


class Submission:
    """The engine requests of one HTTP request; their outputs arrive on one queue."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.states: list[ReqState] = []
        self.prompt_of: dict[str, int] = {}  # rid -> prompt position

    async def submit(self, reqs: list[P.GenerateRequest], prompt_param: str | None = None) -> None:
        """Submit every request, or none: the first refused aborts those before it. In a
        batch the refusal names the prompt it is about (its position, from 0)."""
        i = 0
        try:
            for i, r in enumerate(reqs):
                if i and i % SUBMIT_BATCH == 0:
                    await asyncio.sleep(0)  # other clients run between the slices of a large batch
                self.states.append(await self.front.submit(r, self.queue.put_nowait, prompt_param=prompt_param))
                self.prompt_of[r.rid] = i
        except RequestError as e:
            self.abort()
            if len(reqs) > 1 and e.status < 500:
                where = prompt_param or ("text" if reqs[i].text is not None else "input_ids")
                raise e.with_param(e.param, f"{where}[{i}] (of {len(reqs)}): {e.message}") from None
            raise

    @property
    def total(self) -> int:
        return sum(st.n for st in self.states)

    def abort(self) -> None:
        for st in self.states:
            if len(st.done) < st.n:
                self.front.abort(st.rid)

    async def events(self) -> AsyncIterator[Any]:
        """Chunks and results until every sequence finished; raises on an error."""
        remaining = self.total
        while remaining:
            msg = await self.queue.get()
            if isinstance(msg, P.ErrorResponse):
                self.abort()
                raise P.request_error(msg)
            if isinstance(msg, P.GenerateResult):
                remaining -= 1
            yield msg

    async def results(self, request: Request) -> dict[tuple[int, int], P.GenerateResult]:
        """Wait for every result; a client disconnect aborts the requests."""
        async def collect() -> dict[tuple[int, int], P.GenerateResult]:
            out = {}
            async for msg in self.events():
                if isinstance(msg, P.GenerateResult):
                    out[(self.prompt_of[msg.rid], msg.index)] = msg
            return out

        return await _unless_disconnected(request, collect(), self)


async def _unless_disconnected(request: Request, work: Any, sub: Submission) -> Any:
    """Await ``work`` while watching the client: if it disconnects first, the
    submission's requests are aborted and a 499 is raised (nothing is computed for a
    client that is gone, from the moment the request was accepted)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            sub.abort()
            await asyncio.gather(task, return_exceptions=True)  # let the cancellation land
    if task.cancelled():
        raise RequestError("the client disconnected", None, 499)
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _first_then(request: Request, sub: Submission, gen: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Start a stream only once it is known not to fail at once (so that a request the
    engine rejects gets a 400, not a 200 stream with an error in it); a client that
    disconnects before its first token aborts its requests."""

    async def first_piece() -> bytes | None:
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            return None

    try:
        first = await _unless_disconnected(request, first_piece(), sub)
    except RequestError:
        await gen.aclose()
        raise

    async def rest() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first
                async for piece in gen:
                    yield piece
                    # the loop runs between pieces: events already queued came without one, so
                    # a client gone mid-stream was seen (its connection_lost, then Starlette's
                    # disconnect listener) only after all of them, each write to the dead
                    # socket past the fifth logged by asyncio (505 lines for one disconnect)
                    await asyncio.sleep(0)
        finally:
            sub.abort()  # no-op for finished requests; a disconnect lands here
            await gen.aclose()

    return rest()


def _stream_error(e: RequestError) -> bytes:
    return sse(P.error_body(e))


# -- errors: every exception a route raises becomes an OpenAI-shaped response ---------
async def on_bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_json(exc)

async def on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code, None, kind)

async def on_timeout(request: Request, exc: Exception) -> Response:
    return error_response("the engine did not answer in time", 504, None, "server_error")

async def on_disconnect(request: Request, exc: Exception) -> Response:
    # the client went away while sending its body: nothing to answer, nothing went wrong
    # here (it was logged as an internal error with a traceback: any client could flood
    # the log); 499 is what nginx records for it, and nobody reads the response
    logger.info("client disconnected while sending its request to %s", request.url.path)
    return Response(status_code=499)

async def on_error(request: Request, exc: Exception) -> Response:
    logger.exception("internal error on %s", request.url.path)
    return error_response(f"internal server error: {type(exc).__name__}: {exc}", 500, None, "server_error")

EXCEPTION_HANDLERS: dict[Any, Any] = {
    RequestError: on_bad_request, HTTPException: on_http_exception, asyncio.TimeoutError: on_timeout,
    ClientDisconnect: on_disconnect, Exception: on_error,
}


def build_app(front: Front) -> ASGIApp:
    bodies = BodyBudget(MAX_BODIES_BYTES)

    # -- native -----------------------------------------------------------------------------
    async def generate(request: Request) -> Response:
        body, _ = await read_json(request, bodies)
        reqs, single, stream = parse_native(front, body)
        sub = Submission(front)
        await sub.submit(reqs)
        if not stream:
            results = [r for _, r in sorted((await sub.results(request)).items())]

            def build() -> Any:
                outs = [_native_out(r) for r in results]
                return outs[0] if single and len(outs) == 1 else outs

            return await json_reply(build, _entries(results))

        first_index, total = {}, 0
        for st in sub.states:
            first_index[st.rid] = total
            total += st.n

        async def events() -> AsyncIterator[bytes]:
            acc: dict[tuple[str, int], NativeStreamState] = {}
            yielded = False
            try:
                async for msg in sub.events():
                    key = (msg.rid, msg.index)
                    index = first_index[msg.rid] + msg.index
                    yielded = True
                    if isinstance(msg, P.StreamChunk):
                        event = acc.setdefault(key, NativeStreamState(msg.rid)).add(msg)
                        if event is not None:
                            yield sse({**event, "index": index})
                    else:
                        yield sse({**_native_out(msg), "index": index})
            except RequestError as e:
                if not yielded:
                    raise  # nothing sent yet: the client gets a plain error response
                yield _stream_error(e)
            yield SSE_DONE

        return StreamingResponse(await _first_then(request, sub, events()), media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def model_info(request: Request) -> Response:
        info = front.model_info
        return JSONResponse({
            "model_path": info.get("model_path"),
            "served_model_name": front.args.model_name,
            "architecture": info.get("architecture"),
            "context_len": front.context_len,
            "vocab_size": front.vocab_size,
            "eos_token_ids": info.get("eos_token_ids"),
            "is_generation": True,
            "chat_template": bool(getattr(front.tokenizer, "chat_template", None)),
        })

    async def health(request: Request) -> Response:
        try:
            front.check_up()
        except RequestError as e:
            return error_json(e)
        return JSONResponse({"status": "ok"})

    async def health_generate(request: Request) -> Response:
        sub = Submission(front)
        await sub.submit([P.GenerateRequest(front.new_rid("health"), input_ids=[0],
                                      sampling_params={"max_new_tokens": 1, "temperature": 0.0})])
        await sub.results(request)
        return JSONResponse({"status": "ok"})

    async def server_info(request: Request) -> Response:
        return JSONResponse(await front.server_info())

    async def flush_cache(request: Request) -> Response:
        # only that namespace (absent: everything); a misspelt or repeated parameter must
        # not turn a one-tenant flush into a flush of every tenant's cache
        query = request.scope.get("query_string", b"").decode("latin-1")
        try:  # strict: an undecodable salt must not become another salt (U+FFFD) and be flushed
            pairs = parse_qsl(query, keep_blank_values=True, encoding="utf-8", errors="strict")
        except UnicodeDecodeError:
            raise RequestError("the query string of /flush_cache is not valid UTF-8 once percent-decoded",
                               "cache_salt") from None
        unknown = sorted({k for k, _ in pairs} - {"cache_salt"})
        if unknown:
            names = ", ".join(map(repr, unknown))
            raise RequestError(f"/flush_cache takes only cache_salt; unknown parameter(s): {names}", unknown[0] or None)
        salts = [v for k, v in pairs if k == "cache_salt"]
        if body_given(request):  # a salt sent in a JSON body counts too; anything else there is refused
            body, _ = await read_json(request, bodies)
            extra = sorted(set(body) - {"cache_salt"})
            if extra:
                raise RequestError(f"/flush_cache takes only cache_salt; unknown field(s) in the body: "
                                   f"{', '.join(map(repr, extra))}", extra[0])
            if "cache_salt" in body:
                if not isinstance(body["cache_salt"], str):  # null would mean every tenant: leave the field out
                    raise RequestError(f"cache_salt={body['cache_salt']!r} is invalid; allowed: a string (leave it out "
                                       "to flush every namespace)", "cache_salt")
                salts.append(body["cache_salt"])
        if len(salts) > 1:
            raise RequestError(f"cache_salt was given {len(salts)} times (query and body together); flush one salt "
                               "per request", "cache_salt")
        salt = check_cache_salt(salts[0] if salts else None)
        reply = await front.control(P.FlushCacheRequest("", cache_salt=salt))
        if isinstance(reply, P.ErrorResponse):
            raise P.request_error(reply)
        if not reply.ok:
            return error_response(f"cache not flushed: {reply.message}", 400, None)
        return JSONResponse({"success": True,
                             "message": "Cache flushed." if salt is None else f"Cache of cache_salt {salt!r} flushed."})

    async def update_weights_from_disk(request: Request) -> Response:
        body, _ = await read_json(request, bodies)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise RequestError("model_path must be a path (a Hugging Face folder or a .gguf file)", "model_path")
        reply = await front.control(P.UpdateWeightsRequest("", check_text(path, "model_path")))
        if isinstance(reply, P.ErrorResponse):
            raise P.request_error(reply)
        if not reply.ok:
            return error_response(f"weights not updated: {reply.message}", 400, None)
        return JSONResponse({"success": True, "message": "Weights updated."})

    async def abort_request(request: Request) -> Response:
        body, _ = await read_json(request, bodies)
        abort_all = oa.get_field(body, "abort_all", "bool", False)
        if abort_all:
            return JSONResponse({"aborted": front.abort_all(everyone=True)})
        rid = oa.get_field(body, "rid", "str")
        if rid is None:
            raise RequestError("rid is required (or abort_all: true)", "rid")
        return JSONResponse({"aborted": [rid] if front.abort(rid) else []})

    async def version(request: Request) -> Response:
        import plait

        return JSONResponse({"version": plait.__version__, "protocol_version": P.PROTOCOL_VERSION})

    async def loads(request: Request) -> Response:
        return JSONResponse(front.loads())

    async def metrics(request: Request) -> Response:
        return Response(front.metrics.render(), media_type=CONTENT_TYPE)

    # -- OpenAI -------------------------------------------------------------------------------
    def model_card(name: str) -> dict[str, Any]:
        # "sglang": routers (SMG) read it to pick the worker protocol, and plait speaks SGLang's
        return {"id": name, "object": "model", "created": 0, "owned_by": "sglang",
                "root": front.model_info.get("model_path"), "max_model_len": front.context_len}

    async def models(request: Request) -> Response:
        """Every served name (several with ``--served-model-name a b``, as vLLM lists them)."""
        return JSONResponse({"object": "list", "data": [model_card(n) for n in front.args.model_names]})

    async def model(request: Request) -> Response:
        """OpenAI's retrieve (``client.models.retrieve``): the served model, by any name a
        request may use for it; another name is a 404 ``model_not_found``."""
        name = request.path_params["model"]
        oa.check_model(front, {"model": name})
        return JSONResponse(model_card(name if name in front.args.model_names else front.args.model_name))

    async def completions(request: Request) -> Response:
        return await _openai(request, oa.parse_completion)

    async def chat_completions(request: Request) -> Response:
        return await _openai(request, oa.parse_chat)

    async def _openai(request: Request, parse: Any) -> Response:
        body, size = await read_json(request, bodies)
        job = await asyncio.to_thread(parse, front, body) if parse_off_loop(body, size) else parse(front, body)
        sub = Submission(front)
        try:  # errors found at admission or later (a constraint's compile) by OpenAI's names
            await sub.submit(job.reqs, "messages" if job.chat else "prompt")
            if not job.stream:
                results = await sub.results(request)
                return await json_reply(lambda: oa.response(front, job, results), _entries(results.values()))
            stream = await _first_then(request, sub, _openai_stream(front, job, sub))
        except RequestError as e:
            raise oa.openai_error(e, job) from None
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    store = ra.ResponseStore()  # this server's responses, for previous_response_id

    async def responses(request: Request) -> Response:
        body, size = await read_json(request, bodies)
        parse = ra.parse_response_request
        rj = (await asyncio.to_thread(parse, front, store, body, size) if parse_off_loop(body, size)
              else parse(front, store, body, size))
        sub = Submission(front)

        async def events() -> AsyncIterator[bytes]:
            # (an error before the first event is raised: a 400; one after it, an error event)
            async for e in ra.stream(store, rj, sub.events()):
                head = b"event: " + e["type"].encode() + b"\n"
                if rj.logprobs is not None and e["type"] in ra.WHOLE_OUTPUT_EVENTS:
                    # (each repeats every token's logprobs so far: 900 tokens with 20 top ones
                    # were 8 MB encoded on the loop at the end of the stream)
                    yield head + await asyncio.to_thread(sse, e)
                else:
                    yield head + sse(e)

        try:  # as in _openai: errors at admission or later by the Responses API's names
            await sub.submit(rj.job.reqs, "input")
            if not rj.job.stream:
                result = (await sub.results(request))[(0, 0)]
                # (a large one, logprobs, is built off the loop, as chat's; stored on it)
                obj = ra.keep(store, rj, await off_loop(lambda: ra.build_response(rj, result), _entries([result])),
                              result)
                return await json_reply(lambda: obj, _entries([result]))
            stream = await _first_then(request, sub, events())
        except RequestError as e:
            raise oa.openai_error(e, rj.job) from None
        return StreamingResponse(stream, media_type="text/event-stream", headers=SSE_HEADERS)

    async def stored_response(request: Request) -> Response:
        rid = request.path_params["response_id"]
        if request.method == "DELETE":
            if not store.delete(rid):
                raise ra.not_held(store, rid)
            return JSONResponse({"id": rid, "object": "response", "deleted": True})
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):
            raise RequestError("stream=true is not supported when retrieving a stored response; allowed: false "
                               "(the response is returned whole)", "stream")
        obj = store.response(rid)
        if obj is None:
            raise ra.not_held(store, rid)
        return await json_reply(lambda: obj, ra.logprob_entries(obj))  # (with its logprobs: encoded off the loop)

    async def cancel_response(request: Request) -> Response:
        raise ra.cancel(store, request.path_params["response_id"])

    async def input_items(request: Request) -> Response:
        return JSONResponse(ra.input_items_page(store, request.path_params["response_id"], request.query_params))

    routes = [
        Route("/generate", generate, methods=["POST"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health_generate, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["POST", "GET"]),
        Route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"]),
        Route("/abort_request", abort_request, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/loads", loads, methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/responses/{response_id}/input_items", input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", cancel_response, methods=["POST"]),
    ]

    app: ASGIApp = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    if front.args.api_key:
        app = ApiKeyMiddleware(app, front.args.api_key)
    origins = getattr(front.args, "origins", [])
    app = BrowserOriginGuard(app, origins)
    if origins:  # outside the key check: a browser's preflight carries no Authorization
        app = CORSMiddleware(app, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
    return AnsweredErrorMiddleware(HeaderLimitMiddleware(app))


# -- native /generate -------------------------------------------------------------------------
def _per_item(body: dict[str, Any], name: str, count: int, kind: str, default: Any) -> list[Any]:
    """A field given once for all prompts, or as a list with one entry per prompt."""
    v = body.get(name)
    if isinstance(v, list) and kind != "list":
        if len(v) != count:
            raise RequestError(f"{name} has {len(v)} entries for {count} prompts; they must match", name)
        return [oa.get_field({name: x}, name, kind, default) for x in v]
    return [oa.get_field(body, name, kind, default)] * count


NATIVE_FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
                 "return_text_in_logprobs", "stream", "rid", "cache_salt", "model", "log_metrics", "no_logs",
                 "background", "return_bytes", "return_entropy"}
# SGLang's /generate fields that routers (SMG) forward at their defaults: accepted at
# any value where nothing changes (metrics and logs are always on), refused when true
_OFF_ONLY = ("background", "return_bytes", "return_entropy")


def parse_native(front: Front, body: dict[str, Any]) -> tuple[list[P.GenerateRequest], bool, bool]:
    """Native ``/generate`` body -> engine requests, whether it was a single prompt,
    and whether to stream."""
    oa.check_fields(body, NATIVE_FIELDS)
    for name in _OFF_ONLY:
        if oa.get_field(body, name, "bool", False):
            raise RequestError(f"{name}=true is not supported by plait; allowed: false", name)
    oa.get_field(body, "log_metrics", "bool", True)
    oa.get_field(body, "no_logs", "bool", False)
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise RequestError("exactly one of text and input_ids is required", "text" if text is None else "input_ids")
    if text is not None:
        if isinstance(text, str):
            prompts: list[Any] = [text]
            single = True
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, single = text, False
        else:
            raise RequestError("text is invalid; allowed: a string or a non-empty array of strings", "text")
        for t in prompts:
            check_text(t, "text")
    else:
        if isinstance(ids, list) and ids and all(is_int(t) for t in ids):
            prompts, single = [ids], True
        elif isinstance(ids, list) and ids and all(isinstance(p, list) and all(is_int(t) for t in p) for p in ids):
            prompts, single = ids, False
        else:
            raise RequestError("input_ids is invalid; allowed: an array of token ids or an array of such arrays",
                             "input_ids")
    count = len(prompts)
    oa.check_batch_size(count, "text" if text is not None else "input_ids")
    sps = _per_item(body, "sampling_params", count, "dict", {})
    oa.check_sequences(count, [sp.get("n", 1) for sp in sps], "sampling_params.n")
    lp = _per_item(body, "return_logprob", count, "bool", False)
    start = _per_item(body, "logprob_start_len", count, "int", -1)
    top = _per_item(body, "top_logprobs_num", count, "int", 0)
    rids = _per_item(body, "rid", count, "str", None)
    if not single and body.get("rid") is not None and not isinstance(body.get("rid"), list):
        rids = [f"{body['rid']}-{i}" for i in range(count)]
    seen: set[str] = set()
    for r in rids:
        if r is not None and r in seen:  # refused before any is submitted (not as 'in use' by its twin)
            raise RequestError(f"rid={r!r} is given for more than one prompt; allowed: a distinct rid per prompt",
                               "rid")
        seen.add(r)
    salt = oa.get_field(body, "cache_salt", "str")
    text_lp = oa.get_field(body, "return_text_in_logprobs", "bool", False)
    stream = oa.get_field(body, "stream", "bool", False)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(P.GenerateRequest(
            rid=rids[i] if rids[i] is not None else front.new_rid("gen"),
            text=p if text is not None else None, input_ids=None if text is not None else list(p),
            sampling_params=dict(sps[i]), stream=stream, return_logprob=lp[i], logprob_start_len=start[i],
            top_logprobs_num=top[i], return_text_in_logprobs=text_lp, cache_salt=salt,
        ))
    return reqs, single, stream


class NativeStreamState:
    """One sequence of a streamed ``/generate``. SGLang's events carry everything so
    far (text, output ids, logprob lists), so one event per chunk costs the square of
    the output; with logprobs that is many times the text (n=8 x 500 tokens x top-20
    logprobs sent 582 MB against 13 MB without), all encoded on the front's loop while
    every other client waits. So the logprob entries sent are budgeted: an event goes
    out while the entries sent so far, with it, stay within ``4 x`` the entries it holds
    plus ``FREE_ENTRIES``; past that, chunks are coalesced until a quarter more has
    arrived. Each event still holds everything so far, and the final result follows as
    always. Streams without logprobs send every chunk, as SGLang does."""

    FREE_ENTRIES = 65_536

    def __init__(self, rid: str) -> None:
        self.out: dict[str, Any] = {"text": "", "output_ids": [], "meta_info": {"id": rid}}
        self.entries = 0  # logprob entries so far (a top-logprobs row counts each of its pairs)
        self.spent = 0  # logprob entries sent in events so far

    def add(self, msg: P.StreamChunk) -> dict[str, Any] | None:
        """Take a chunk; the event to send now, or None while coalescing."""
        a = self.out
        a["text"] += msg.text
        a["output_ids"] += msg.token_ids
        for k, v in pad_logprob_text(msg.meta).items():
            if isinstance(v, list):
                a["meta_info"].setdefault(k, []).extend(v)
            elif k == "id":  # the request's id, as its final event has it (not its sample's, with n > 1)
                continue
            else:
                a["meta_info"][k] = v
        self.entries += _meta_entries(msg.meta)
        a["meta_info"]["finish_reason"] = None
        if self.spent + self.entries > 4 * self.entries + self.FREE_ENTRIES:
            return None
        self.spent += self.entries
        return a


def _native_out(r: P.GenerateResult) -> dict[str, Any]:
    return {"text": r.text, "output_ids": r.output_ids, "meta_info": pad_logprob_text(r.meta_info)}


class _StreamOffsets:
    """Streamed completions' ``logprobs``, each choice's ``text_offset`` continuing where
    its tokens so far (its echoed prompt's, then its output's) left off: the characters
    their bytes decode to, as the non-streamed response counts them in one
    :meth:`~oa.LogprobFormatter.text_offsets` over all of them. Not the text sent so far:
    a stop string holds text back (``"\\n"`` while it may begin ``"\\n\\n"``), and a
    chunk's tokens still follow it."""

    def __init__(self, fmt: oa.LogprobFormatter) -> None:
        self.fmt = fmt
        self.written: dict[int, int] = {}  # choice index -> characters its tokens have written
        self.decoders: dict[int, codecs.IncrementalDecoder] = {}  # (holding a character's first bytes)

    def completion(self, index: int, pairs: list[list[Any]], tops: list[Any] | None) -> dict[str, Any]:
        """Choice ``index``'s ``logprobs`` for its next tokens ``pairs``."""
        offset = self.written.get(index, 0)
        lp = self.fmt.completion(pairs, tops, offset)
        dec = self.decoders.get(index)
        if dec is None:
            dec = self.decoders[index] = codecs.getincrementaldecoder("utf-8")("replace")
        self.written[index] = offset + sum(len(dec.decode(self.fmt.front.token_bytes(p[1]))) for p in pairs)
        return lp


async def _openai_stream(front: Front, job: oa.Job, sub: Submission) -> AsyncIterator[bytes]:
    fmt = oa.LogprobFormatter(front)
    offsets = _StreamOffsets(fmt)
    completion = cached = reasoning = 0
    started: set[int] = set()
    chats: dict[int, oa.ChatStream] = {}  # choice index -> its chat deltas (reasoning, tool calls)
    yielded = False
    echoes: dict[int, str] = {}  # choice index -> its echoed prompt, sent with the prompt's logprobs
    written: dict[int, int] = {}  # choice index -> its tokens so far (continuous_usage_stats)

    def out(chunk: dict[str, Any], prompt_i: int, index: int) -> bytes:
        if job.continuous_usage:
            chunk["usage"] = oa.chunk_usage(job, prompt_i, written.get(index, 0))
        return sse(chunk)

    try:
        async for msg in sub.events():
            if not yielded and job.echo_texts:
                # (sent once the engine answered: a request it refuses at admission, a
                # constraint that cannot compile, is a 400, not a 200 stream ending in an error)
                for pi, text in enumerate(job.echo_texts):
                    for idx in range(job.n):
                        index = oa.choice_index(job, pi, idx)
                        if job.logprobs is None:
                            yield out(oa.stream_chunk(job, index, text, None), pi, index)
                        else:  # the prompt's logprobs come with the first output of the choice
                            echoes[index] = text
            yielded = True
            pi = sub.prompt_of[msg.rid]
            index = oa.choice_index(job, pi, msg.index)
            meta = msg.meta if isinstance(msg, P.StreamChunk) else msg.meta_info
            written[index] = meta.get("completion_tokens", written.get(index, 0))
            if index in echoes:
                tops = meta.get("input_top_logprobs") if job.logprobs else None
                lp = offsets.completion(index, meta.get("input_token_logprobs", []), tops)
                yield out(oa.stream_chunk(job, index, echoes.pop(index), None, logprobs=lp), pi, index)
            role = job.chat and index not in started
            started.add(index)
            if isinstance(msg, P.StreamChunk):
                lp = None
                if job.logprobs is not None:
                    pairs = msg.meta.get("output_token_logprobs", [])
                    tops = msg.meta.get("output_top_logprobs") if job.logprobs else None
                    if job.chat:
                        lp = {"content": fmt.chat(pairs, tops)}
                    else:
                        lp = offsets.completion(index, pairs, tops)
                if job.chat:
                    cs = chats.setdefault(index, (job.output or oa.ChatOutput()).stream())
                    for c in oa.chat_chunks(job, cs, index, msg.text, role=role, logprobs=lp):
                        yield out(c, pi, index)
                elif msg.text or lp is not None:
                    yield out(oa.stream_chunk(job, index, msg.text, None, logprobs=lp), pi, index)
            else:
                completion += meta.get("completion_tokens", 0)
                if job.output is not None:
                    reasoning += job.output.reasoning_tokens(msg.output_ids)
                if msg.index == 0:
                    cached += meta.get("cached_tokens", 0)
                if job.chat:
                    cs = chats.setdefault(index, (job.output or oa.ChatOutput()).stream())
                    for c in oa.chat_chunks(job, cs, index, None, role=role, meta=meta):
                        yield out(c, pi, index)
                else:
                    yield out(oa.stream_chunk(job, index, "", oa.finish_reason(meta),
                                              matched_stop=(meta.get("finish_reason") or {}).get("matched")), pi, index)
        if job.include_usage:
            yield sse(oa.usage_chunk(job, completion, cached, reasoning))
    except RequestError as e:
        if not yielded:
            raise
        yield _stream_error(oa.openai_error(e, job))
    yield SSE_DONE
