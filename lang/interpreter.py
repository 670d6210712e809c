"""Running programs: the program state ``s``, its executor, ``run`` and ``run_batch``.

Each state has an executor with a worker thread that executes what the program
appends, in order, while the program body runs ahead; reading a variable
(``s["x"]``) waits for it. Forks get their own executors, so their model calls run
in parallel. A program that is aborted, or whose body raises, aborts its in-flight
requests; except a streamed one (``run(stream=True)``) whose body raises: what it
appended before raising still runs and streams, as in SGLang, and the exception is
raised to the consumer once the stream ends (see :class:`ProgramState`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
import queue
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from plait.backend import STREAMED_LOGPROB_KEYS, BaseBackend, CancelScope, chat_template_of, merge_chunk_meta
from plait.chat_template import ChatTemplate, ChatTemplateError, Transcript
from plait.errors import ProgramCancelled, ProgramError, UnknownVariableError
from plait.global_config import global_config
from plait.ir import (
    CONSTRAINT_PARAMS, Expr, Gen, RoleBegin, RoleEnd, RoleScopes, Select, Text, VarScopeBegin, VarScopeEnd,
    as_expr, defined_names, dtype_regex, dtype_stop, flatten, reasoning_var, resolve_params,
)

logger = logging.getLogger("plait")

_END = object()
_UNFETCHED = object()
# run_batch(num_threads="auto"): programs in flight at once
AUTO_THREADS = 64


class Executor:
    """Executes one program state's expressions in order on a worker thread."""

    def __init__(self, backend: BaseBackend, defaults: dict[str, Any], stream: bool,
                 template: Any = _UNFETCHED, parent: Executor | None = None) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self._template = template  # ChatTemplate | None once fetched from the backend
        self.ts = Transcript()
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.partial: dict[str, str] = {}  # streamed text of gens still running
        self.partial_meta: dict[str, dict[str, Any]] = {}  # their meta info so far (merge_chunk_meta)
        self.scopes: dict[str, int] = {}  # var_scope name -> start position
        self.pending: Counter[str] = Counter()  # names still being computed
        self.error: BaseException | None = None
        self.scope = CancelScope()
        self.children: list[Executor] = []
        self.fork_start = 0
        self.cond = threading.Condition()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._unfinished = 0
        self.closed = False  # no more submissions
        self.finished = False  # worker exited
        if parent is not None:
            parent.children.append(self)
        self._worker = threading.Thread(target=self._work, name="plait-program", daemon=True)
        self._worker.start()

    # -- template ------------------------------------------------------------------------
    @property
    def template(self) -> ChatTemplate | None:
        if self._template is _UNFETCHED:  # fetched by the first gen or role
            try:
                self._template = chat_template_of(self.backend)
            except ChatTemplateError as e:
                self._template = e
        if isinstance(self._template, ChatTemplateError):
            raise self._template
        return self._template

    def _chat_stop(self) -> tuple[str, ...]:
        """The template's end-of-turn text, an implicit stop string of unconstrained gens;
        a gen runs without it if the template is unavailable (only roles need the
        template)."""
        try:
            template = self.template
        except ChatTemplateError:
            return ()
        return template.stop_str if template is not None else ()

    # -- submission (program thread) -----------------------------------------------------
    def submit(self, expr: Expr) -> None:
        with self.cond:
            if self.closed:
                raise RuntimeError("this program has ended; nothing more can be appended to its state")
            for name in defined_names(expr):
                self.pending[name] += 1
            self._unfinished += 1
        self._queue.put(expr)

    def end(self) -> None:
        """No more submissions; the worker exits once the queue is done."""
        with self.cond:
            if self.closed:
                return
            self.closed = True
            children = list(self.children)
        self._queue.put(_END)
        for child in children:  # forks that were never joined
            child.end()

    def sync(self) -> None:
        with self.cond:
            while self._unfinished > 0:
                self.cond.wait()

    def cancel(self, reason: BaseException) -> None:
        """Abort: stop executing, abort in-flight requests, fail pending variables."""
        with self.cond:
            if self.error is None:
                self.error = reason
            self.cond.notify_all()
        self.scope.cancel(reason)
        for child in list(self.children):
            child.cancel(reason)

    # -- variables -----------------------------------------------------------------------
    def get_var(self, name: str) -> Any:
        with self.cond:
            while self.pending[name] > 0 and self.error is None:
                self.cond.wait()
            if self.pending[name] == 0 and name in self.variables:
                return self.variables[name]
            if self.error is not None:
                raise ProgramError(f"variable {name!r} is unavailable: the program failed: {self.error}") from self.error
            raise UnknownVariableError(name, sorted(self.variables))

    def set_var(self, name: str, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.cond.notify_all()

    def get_meta_info(self, name: str) -> Any:
        """The variable's meta info once it is done; None for a name the program never
        defines (SGLang's ``meta_info.get(name)``)."""
        try:
            self.get_var(name)
        except UnknownVariableError:
            return None
        return self.meta_info.get(name)

    def has_var(self, name: str) -> bool:
        with self.cond:
            return name in self.variables or self.pending[name] > 0

    @property
    def is_finished(self) -> bool:
        """SGLang's executor field (its RAG example polls it, then reads ``variables``):
        the program has ended and everything it appended is done."""
        with self.cond:
            return self.finished or (self.closed and self._unfinished == 0)

    @property
    def variable_event(self) -> dict[str, VariableEvent]:
        """SGLang's executor field (its docs print its keys): one event per variable
        the program defined or is computing, set once the variable is computed."""
        with self.cond:
            names = list(dict.fromkeys([*self.variables, *(k for k, v in self.pending.items() if v > 0)]))
        return {name: VariableEvent(self, name) for name in names}

    # -- worker ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            if expr is _END:
                break
            if self.error is None:
                try:
                    self._execute(expr)
                except BaseException as e:  # noqa: BLE001 - recorded, surfaced on read
                    if not isinstance(e, ProgramCancelled):
                        # as SGLang warns: a failure whose variables the caller never
                        # reads would otherwise leave text() silently cut short
                        logger.warning("program failed: %s: %s (its text stops there; reading the variables it "
                                       "left unset raises ProgramError, state.error() returns it)",
                                       type(e).__name__, e)
                        logger.debug("program failure", exc_info=True)
                    with self.cond:
                        if self.error is None:
                            self.error = e
            with self.cond:
                if self.error is not None:
                    for name in defined_names(expr):
                        self.pending[name] = 0
                self._unfinished -= 1
                self.cond.notify_all()
        with self.cond:
            self.finished = True
            self.cond.notify_all()
        self.backend.end_program(self)

    def _execute(self, expr: Expr) -> None:
        for e in flatten(expr):
            if self.error is not None:
                return
            if isinstance(e, Text):
                self._fill(e.value)
            elif isinstance(e, Gen):
                self._gen(e)
            elif isinstance(e, Select):
                self._select(e)
            elif isinstance(e, RoleBegin):
                template = self.template
                with self.cond:
                    self.ts.begin_role(e.role, template)
                    self.cond.notify_all()
            elif isinstance(e, RoleEnd):
                template = self.template
                with self.cond:
                    self.ts.end_role(e.role, template)
                    self.cond.notify_all()
            elif isinstance(e, VarScopeBegin):
                self.scopes[e.name] = len(self.ts.text)
            elif isinstance(e, VarScopeEnd):
                start = self.scopes.pop(e.name, None)
                if start is None:
                    raise ValueError(f"var_scope {e.name!r} ends but never began")
                self._define(e.name, self.ts.text[start:], None)
            else:  # pragma: no cover - as_expr admits nothing else
                raise TypeError(f"cannot execute {e!r}")

    def _fill(self, text: str) -> None:
        with self.cond:
            self.ts.fill(text)
            self.cond.notify_all()

    def _define(self, name: str | None, value: Any, meta: Any) -> None:
        with self.cond:
            if name is not None:
                self.partial.pop(name, None)
                self.partial_meta.pop(name, None)
                self.variables[name] = value
                self.meta_info[name] = meta
                self.pending[name] = max(self.pending[name] - 1, 0)
            self.cond.notify_all()

    def _gen(self, e: Gen) -> None:
        own = dict(e.params)
        dtype = own.pop("dtype", None)
        extra_stop: tuple[str, ...] = ()
        if dtype is not None:
            own["regex"] = dtype_regex(dtype)
            extra_stop = dtype_stop(dtype)
        # the end-of-turn stop ends free text; a constraint decides where its own output
        # ends, and that output may contain the end-of-turn text (a stop string would cut it
        # and break the constraint). The user's stop strings still apply.
        if not any(k in own for k in CONSTRAINT_PARAMS):
            extra_stop += self._chat_stop()
        params = resolve_params(self.defaults, own, extra_stop)
        # separate_reasoning: the answer is streamed and filled, the reasoning kept aside
        rname = reasoning_var(e.name) if e.reasoning is not None and e.name is not None else None
        split = e.reasoning.stream() if e.reasoning is not None and self.stream else None
        on_chunk = None
        streamed = [""]
        if self.stream:
            with self.cond:
                if e.name is not None:
                    self.partial[e.name] = ""
                if rname is not None:
                    self.partial[rname] = ""

            def on_chunk(index: int, piece: str, meta: dict[str, Any]) -> None:
                if index != 0:
                    return
                reasoning = ""
                if split is not None:
                    reasoning, piece = split.feed(piece)
                with self.cond:
                    self.ts.fill(piece)
                    streamed[0] += piece
                    if e.name is not None:
                        self.partial[e.name] = streamed[0]
                        self.partial_meta[e.name] = merge_chunk_meta(self.partial_meta.get(e.name), meta)
                    if rname is not None:
                        self.partial[rname] += reasoning
                    self.cond.notify_all()

        outs = self.backend.generate(self.ts.text, params, on_chunk=on_chunk, scope=self.scope)
        texts = [o["text"] for o in outs]
        metas = [o["meta_info"] for o in outs]
        reasonings: list[str | None] = []
        if e.reasoning is not None:
            parsed = [e.reasoning.parse(t) for t in texts]
            reasonings, texts = [r for r, _ in parsed], [c for _, c in parsed]
        if e.tools is not None:
            metas = [{**m, **e.tools.parse(t)} for t, m in zip(texts, metas)]
        with self.cond:
            # streamed pieces concatenate to the final text; add what was not streamed
            # (and should a backend ever stream something else, the final text wins)
            if not texts[0].startswith(streamed[0]):
                self.ts.text = self.ts.text[: len(self.ts.text) - len(streamed[0])]
                streamed[0] = ""
            self.ts.fill(texts[0][len(streamed[0]):])
        multi = len(outs) > 1
        if rname is not None:
            self._define(rname, reasonings if multi else reasonings[0], None)
        self._define(e.name, texts if multi else texts[0], metas if multi else metas[0])

    def _select(self, e: Select) -> None:
        decision = self.backend.select(self.ts.text, e.choices, e.temperature, e.choices_method, scope=self.scope)
        with self.cond:
            self.ts.fill(decision.decision)
        self._define(e.name, decision.decision, decision.meta_info)

    # -- fork --------------------------------------------------------------------------------
    def fork(self, n: int) -> list[Executor]:
        self.sync()
        if self.error is not None:
            raise ProgramError(f"cannot fork: the program failed: {self.error}") from self.error
        if n > 1 and self.ts.text:
            # prefill the shared text once, so the branches share its KV
            self.backend.cache_prefix(self.ts.text, self.scope)
        kids = []
        for _ in range(n):
            kid = Executor(self.backend, self.defaults, self.stream, self._template, parent=self)
            kid.ts = self.ts.copy()
            kid.variables = dict(self.variables)
            kid.meta_info = dict(self.meta_info)
            kid.fork_start = len(self.ts.text)
            kids.append(kid)
        return kids


class VariableEvent:
    """Whether a variable of a program is computed, read as a ``threading.Event``
    (``is_set``, ``wait``); set by the program's executor only."""

    def __init__(self, executor: Executor, name: str) -> None:
        self.executor = executor
        self.name = name

    def _done(self) -> bool:
        ex = self.executor
        return ex.pending[self.name] == 0 or ex.error is not None

    def is_set(self) -> bool:
        with self.executor.cond:
            return self._done()

    def wait(self, timeout: float | None = None) -> bool:
        with self.executor.cond:
            return self.executor.cond.wait_for(self._done, timeout)


class ProgramState(RoleScopes):
    """The state ``s`` of a running program: ``s += ...`` appends, ``s["name"]`` reads
    a variable (waiting for it), ``s.fork(n)`` branches. ``program``: the thread a
    streamed program's body runs on (``run(stream=True)``); reading the state from
    elsewhere waits for the body where what it reads may not be appended yet.

    A streamed body that raises (``body_error``, written by the body's thread only)
    does not take back what it appended: that still runs, and ``text()`` and the
    streams have it. The exception is logged when it happens (SGLang's body thread
    prints its traceback) and raised again where the caller would otherwise never
    see it: by ``text_iter()`` / ``text_async_iter()`` once the stream has ended
    (a variable's stream: only if the variable never came), by ``sync()``, and as
    the ``__cause__`` of the ``ProgramError`` that reading a variable the body never
    appended raises. SGLang only prints it, and its streams end as if nothing had
    happened; plait raises it, as ``run()`` without ``stream`` does. ``error()``
    returns it (or the executor's own error, which comes first)."""

    def __init__(self, executor: Executor, program: threading.Thread | None = None) -> None:
        self.executor = executor
        self.program = program
        self.ret_value: Any = None
        self.body_error: BaseException | None = None

    @property
    def stream_executor(self) -> Executor:
        """SGLang's name for the state's executor: programs read its ``meta_info`` and
        ``variables`` dicts (by variable name) once the program is done."""
        return self.executor

    # -- building ------------------------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        self.executor.submit(as_expr(other))
        return self

    def _append(self, expr: Expr) -> None:
        self.executor.submit(expr)

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        # size 0 (a fork per item of an empty list) is an empty group, as in SGLang; an
        # integer of another type (numpy's) counts as its value, as SGLang's int(size)
        try:
            n = operator.index(size)
        except TypeError:
            n = -1
        if isinstance(size, bool) or n < 0:
            raise ValueError(f"fork size={size!r} is invalid; allowed: an integer >= 0")
        return ProgramStateGroup([ProgramState(x) for x in self.executor.fork(n)], self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # -- reading ---------------------------------------------------------------------------------
    def _body_running_elsewhere(self) -> bool:
        return self.program is not None and self.program is not threading.current_thread() and self.program.is_alive()

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return self.executor.has_var(name)

    def get_var(self, name: str) -> Any:
        if self._body_running_elsewhere() and not self.executor.has_var(name):
            assert self.program is not None
            self.program.join()  # a streamed body may not have reached the gen yet
        try:
            return self.executor.get_var(name)
        except UnknownVariableError:
            if self.body_error is None:
                raise
            raise ProgramError(f"variable {name!r} is unavailable: the program raised before appending it: "
                               f"{self.body_error!r}") from self.body_error

    def set_var(self, name: str, value: Any) -> None:
        self.executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """The variable's meta info once it is done; None for a name the program never
        defines (as SGLang); a program that failed before defining it raises."""
        try:
            self.get_var(name)
        except UnknownVariableError:
            return None
        return self.executor.get_meta_info(name)

    def text(self) -> str:
        self._wait()
        return self.executor.ts.text

    def messages(self) -> list[dict[str, str]]:
        self._wait()
        return self.executor.ts.chat_messages()

    def sync(self) -> None:
        """Wait until everything appended so far is done (for a streamed program read
        from outside its body: until the body has returned, and then its work). A
        streamed body that raised raises here."""
        self._wait()
        if self.body_error is not None:
            raise self.body_error

    def _wait(self) -> None:
        if self._body_running_elsewhere():
            assert self.program is not None
            self.program.join()
        self.executor.sync()

    def error(self) -> BaseException | None:
        self._wait()
        return self.executor.error if self.executor.error is not None else self.body_error

    def abort(self, reason: str = "aborted by the caller") -> None:
        """Cancel the program: in-flight requests are aborted, nothing more runs."""
        self.executor.cancel(ProgramCancelled(reason))

    # -- streaming --------------------------------------------------------------------------------
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """New text as it is produced: of the whole program, or of one variable. On a
        state that was not run with ``stream=True``, yields the final text once. A
        streamed body that raised raises here once the stream is over. A variable the
        finished program never set yields one ``""`` (as SGLang's iterator does)."""
        ex = self.executor
        if not ex.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        pos = 0
        while True:
            piece, done, _ = self._next_piece(var_name, pos, None)
            pos += len(piece)
            if piece:
                yield piece
            if done:
                error = self._stream_error(var_name)
                if error is not None:
                    raise error
                if pos == 0 and var_name is not None and not ex.has_var(var_name):
                    yield ""  # as SGLang's: one empty piece for a variable the program never set
                return

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """``text_iter`` for asyncio. Cancelling the consuming task aborts the program.
        With ``var_name`` and ``return_meta_data``, yields ``(piece, meta_info)``: the
        variable's meta info so far (``completion_tokens`` ...), whose output logprob
        entries are those of the tokens not yet yielded (as SGLang merges them), so
        that they concatenate over the pieces. Each piece is held until the next one
        comes, so that the last one carries the final meta info (``finish_reason``)."""
        ex = self.executor
        loop = asyncio.get_running_loop()
        if not ex.stream:
            value = await loop.run_in_executor(None, lambda: self.text() if var_name is None else self.get_var(var_name))
            yield (value, self.get_meta_info(var_name)) if return_meta_data and var_name else value
            return
        pos = 0
        sent: dict[str, int] = {}  # logprob entries yielded so far, per key
        held: tuple[str, Any] | None = None  # (piece, meta) waiting for the next piece
        with_meta = return_meta_data and var_name is not None
        try:
            while True:
                piece, done, meta = await loop.run_in_executor(None, self._next_piece, var_name, pos, 0.5)
                pos += len(piece)
                if piece and not with_meta:
                    yield piece
                elif piece:
                    if held is not None:
                        yield held[0], _unsent(held[1], sent)
                    held = (piece, meta)
                if done:
                    if held is not None:
                        yield held[0], _unsent(meta if isinstance(meta, dict) else held[1], sent)
                    error = await loop.run_in_executor(None, self._stream_error, var_name)
                    if error is not None:
                        raise error
                    if pos == 0 and var_name is not None and not ex.has_var(var_name):
                        yield ""  # as SGLang's (with return_meta_data too): the variable was never set
                    return
        except asyncio.CancelledError:
            self.abort("the streaming consumer was cancelled")
            raise

    def _stream_error(self, var_name: str | None) -> BaseException | None:
        """At the end of a stream: what the body raised (waiting for the body, where
        the executor's own error ended the stream first), or None. A variable's stream
        that delivered the variable ends without it."""
        if var_name is not None:
            with self.executor.cond:
                if var_name in self.executor.variables:
                    return None
        if self._body_running_elsewhere():
            assert self.program is not None
            self.program.join()
        return self.body_error

    def _next_piece(self, var_name: str | None, pos: int, timeout: float | None) -> tuple[str, bool, Any]:
        """Wait until there is text beyond ``pos`` (or the end); return it, whether
        the stream is over, and the variable's meta info so far."""
        ex = self.executor
        with ex.cond:
            while True:
                meta = None
                if var_name is None:
                    current = ex.ts.text
                    over = ex.finished or ex.error is not None
                else:
                    running = ex.pending[var_name] > 0
                    current = ex.partial.get(var_name, "") if running else ex.variables.get(var_name, "")
                    current = current if isinstance(current, str) else ""
                    meta = ex.partial_meta.get(var_name) if running else ex.meta_info.get(var_name)
                    over = ex.error is not None or (not running and (var_name in ex.variables or ex.finished))
                if len(current) > pos or over:
                    return current[pos:], over, meta
                if not ex.cond.wait(timeout) and timeout is not None:
                    return "", False, None

    def __repr__(self) -> str:
        # SGLang's form, unquoted: programs slice it (its cot_decoding example)
        return f"ProgramState({self.text()})"


class ProgramStateGroup:
    """The states made by ``s.fork(n)``: index them, ``+=`` to all, ``join()``."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("a fork's states cannot be replaced; use += on them")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Expr):
            for i, st in enumerate(self.states):
                st += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"+= with {len(other)} items on a fork of {len(self.states)}; they must match")
            for st, x in zip(self.states, other):
                st += x
        else:
            for st in self.states:
                st += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """``gather_variable``: each variable the forks defined becomes a list (one
        entry per fork) on the parent. ``concate_and_append``: the forks' new text is
        appended to the parent, in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode={mode!r} is invalid; allowed: gather_variable, concate_and_append")
        parent = self.parent.executor
        for st in self.states:
            st.executor.end()
            st.executor.sync()
        if mode == "gather_variable":
            with parent.cond:
                before = set(parent.variables)
            gathered: dict[str, list[Any]] = {}
            errors = [st.executor.error for st in self.states if st.executor.error is not None]
            for st in self.states:
                kid = st.executor
                for k in kid.variables:
                    if k not in before:
                        gathered.setdefault(k, []).append(kid.variables[k])
            for k, values in gathered.items():
                parent.set_var(k, values)
            if errors:
                parent.cancel(errors[0])
        else:
            text = "".join(st.executor.ts.text[st.executor.fork_start:] for st in self.states)
            self.parent += text
        for st in self.states:
            if st.executor in parent.children:
                parent.children.remove(st.executor)


# -- streamed meta info -----------------------------------------------------------------------------
def _unsent(meta: Any, sent: dict[str, int]) -> Any:
    """``meta`` with only the logprob entries past ``sent`` (updated), so that the
    entries of the pieces of a stream concatenate to the whole list."""
    if not isinstance(meta, dict):
        return meta
    out = dict(meta)
    for key in STREAMED_LOGPROB_KEYS:
        if key in meta:
            out[key] = list(meta[key][sent.get(key, 0):])
            sent[key] = len(meta[key])
    return out


# -- running ---------------------------------------------------------------------------------------
def run_program(fn: Callable[..., Any], backend: BaseBackend, args: tuple[Any, ...], kwargs: dict[str, Any],
                defaults: dict[str, Any], stream: bool) -> ProgramState:
    """Run ``fn(s, *args, **kwargs)``. Without ``stream``, returns when it is done;
    with it, returns at once and the program runs in a thread."""
    program = threading.Thread(target=lambda: body(), name="plait-stream", daemon=True) if stream else None
    state = ProgramState(Executor(backend, defaults, stream), program)

    def body() -> None:
        ex = state.executor
        try:
            state.ret_value = fn(state, *args, **kwargs)
        except BaseException as e:
            if not stream:
                ex.cancel(e)
                raise
            # streamed: what the body appended still runs; the consumer gets the error
            # at the end of the stream (ProgramState); after an abort it is expected
            state.body_error = e
            aborted = isinstance(ex.error, ProgramCancelled)
            logger.log(logging.DEBUG if aborted else logging.ERROR, "the streamed program %s raised",
                       getattr(fn, "__name__", fn), exc_info=e)
        finally:
            ex.end()

    if program is not None:
        program.start()
    else:
        body()
        state.executor.sync()
        if global_config.verbosity >= 2:
            print(state.executor.ts.text)
    return state


def iter_program_batch(fn: Callable[..., Any], backend: BaseBackend, batch: list[dict[str, Any]],
                       defaults: dict[str, Any], num_threads: int | str, progress_bar: bool,
                       order: list[int] | None = None) -> Iterator[ProgramState]:
    """Run one program per dict of ``batch`` and yield the states in ``batch`` order,
    each as soon as it and the ones before it are done. All instances are submitted at
    once (in ``order``); closing the iterator early cancels the ones not started."""
    order = list(range(len(batch))) if order is None else order
    if num_threads == "auto":
        num_threads = AUTO_THREADS
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads={num_threads!r} is invalid; allowed: 'auto' or an integer >= 1")
    num_threads = min(num_threads, max(len(batch), 1))
    bar = None
    if progress_bar:
        import tqdm

        bar = tqdm.tqdm(total=len(batch))

    def one(i: int) -> ProgramState:
        try:
            return run_program(fn, backend, (), batch[i], defaults, False)
        finally:
            if bar is not None:
                bar.update()

    try:
        if num_threads == 1:
            # sequential: in submission order, yielded in batch order once ready
            done: dict[int, ProgramState] = {}
            nxt = 0
            for i in order:
                done[i] = one(i)
                while nxt in done:
                    yield done.pop(nxt)
                    nxt += 1
            return
        pool = ThreadPoolExecutor(num_threads, thread_name_prefix="plait-batch")
        try:
            futures = {i: pool.submit(one, i) for i in order}
            for i in range(len(batch)):
                yield futures[i].result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    finally:
        if bar is not None:
            bar.close()
