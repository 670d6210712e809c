"""The public surface of the language (SGLang's frontend, plus tracing-driven pinning).

Programs written for SGLang's frontend run unchanged after ``import plait as sgl``.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from typing import Any

from plait.backend import BaseBackend, chat_template_of
from plait.choices import ChoicesSamplingMethod, token_length_normalized
from plait.errors import BackendError
from plait.global_config import global_config
from plait.interpreter import ProgramState, iter_program_batch, run_program
from plait.ir import (
    Expr, ExprList, Gen, RoleBegin, RoleEnd, Select, ToolSpec, as_expr, check_choices, check_json_schema, check_name,
    check_stop, check_stop_regex, dtype_regex, dtype_stop, flatten, plain_numbers,
)
from plait.lint import DEFAULT_MIN_TOKENS, LayoutIssue, PromptLayoutWarning, lint_graph, shared_arguments
from plait.regex import check_regex
from plait.tracer import (
    MIN_PIN_CHARS, BatchPlan, ProgramGraph, TracingState, plan_batch, stop_if_tracing, token_safe_cut, trace_program,
)

logger = logging.getLogger("plait")

# How long a batch's pins live if the batch never unpins them (its process died).
PIN_TTL_S = 600.0


def set_default_backend(backend: Any) -> None:
    """The backend programs run on when ``run()`` gets none (a backend, or a
    :class:`Runtime` / :class:`Engine`, whose endpoint is used)."""
    global_config.default_backend = backend


def get_default_backend() -> BaseBackend | None:
    return global_config.default_backend


def _resolve_backend(backend: Any) -> BaseBackend:
    backend = backend if backend is not None else global_config.default_backend
    if backend is None:
        raise RuntimeError(
            "no backend: pass backend= or call plait.set_default_backend(plait.Runtime(...)) "
            "(or RuntimeEndpoint(url), or Engine(model)) first"
        )
    backend = getattr(backend, "endpoint", backend)  # a Runtime or Engine holds its endpoint
    if not isinstance(backend, BaseBackend):
        raise TypeError(f"backend={backend!r} is not a plait backend")
    return backend


def flush_cache(backend: Any = None, empty_cache: bool = True) -> bool:
    """Drop the runtime's cached prefixes (refused while requests run). ``empty_cache``
    is SGLang's (whether its server also hands cached device memory back to the
    driver); it is accepted and changes nothing: plait's KV pool is allocated once."""
    b = backend if backend is not None else global_config.default_backend
    return False if b is None else _resolve_backend(b).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    b = backend if backend is not None else global_config.default_backend
    return None if b is None else _resolve_backend(b).get_server_info()


# -- running defaults (SGLang's run()/run_batch() keywords) ------------------------------------
def _defaults(max_new_tokens: int, stop: Any, stop_token_ids: Any, temperature: float, top_p: float, top_k: int,
              min_p: float, frequency_penalty: float, presence_penalty: float, ignore_eos: bool,
              return_logprob: bool | None, logprob_start_len: int | None, top_logprobs_num: int | None,
              return_text_in_logprobs: bool | None, extra: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens, stop=check_stop(stop),
        stop_token_ids=None if stop_token_ids is None else list(stop_token_ids) or None,
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty, ignore_eos=ignore_eos, return_logprob=return_logprob,
        logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    if not global_config.skip_special_tokens_in_output:
        d["skip_special_tokens"] = False
    if not global_config.spaces_between_special_tokens_in_out:
        d["spaces_between_special_tokens"] = False
    d.update(extra)
    return plain_numbers({k: v for k, v in d.items() if v is not None})


_EXTRA_DEFAULTS = ("seed", "repetition_penalty", "min_new_tokens", "n", "stop_regex")
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


class Function:
    """A program: ``@plait.function`` on a Python function whose first parameter is
    the state ``s``."""

    def __init__(self, func: Callable[..., Any], num_api_spec_tokens: int | None = None,
                 bind_arguments: dict[str, Any] | None = None) -> None:
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise ValueError(f"the first parameter of a plait function must be named 's'; {func.__name__} has "
                             f"{params[0].name if params else 'none'!r}")
        rest = params[1:]
        # named parameters; a *args / **kwargs parameter takes what a call gives beyond them
        self.arg_names = [p.name for p in rest if p.kind not in _VARIADIC]
        self.positional_names = [p.name for p in rest if p.kind in _POSITIONAL]
        self.var_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in rest)
        self.var_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in rest)
        self.arg_defaults = {p.name: p.default for p in rest if p.default is not inspect.Parameter.empty}
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown and not self.var_kwargs:
            raise TypeError(f"{self.__name__}() has no argument(s) {', '.join(unknown)}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def _extra(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Pop the extra sampling defaults (seed, n, ...) that are not program arguments,
        and SGLang's ``use_thread`` (whether its executor runs on a thread of its own;
        plait's always does, and the results are the same either way)."""
        mine = [k for k in (*_EXTRA_DEFAULTS, "use_thread") if k in kwargs and k not in self.arg_names]
        out = {k: kwargs.pop(k) for k in mine}
        out.pop("use_thread", None)
        if "stop_regex" in out:
            out["stop_regex"] = check_stop_regex(out["stop_regex"])
        return out

    @property
    def _free_positional(self) -> list[str]:
        """The positional parameters ``bind`` left open: positional values fill these."""
        return [k for k in self.positional_names if k not in self.bind_arguments]

    def _kwargs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The arguments of a call by name (bound ones first); a ``**kwargs`` program
        takes any name."""
        free = self._free_positional
        if len(args) > len(free):
            raise TypeError(f"{self.__name__}() takes {len(free)} positional arguments after s, got {len(args)}")
        given = dict(zip(free, args))
        out = {**self.bind_arguments, **given}
        for k, v in kwargs.items():
            if k not in self.arg_names and not self.var_kwargs:
                raise TypeError(f"{self.__name__}() got an unexpected argument {k!r}")
            if k in given:
                raise TypeError(f"{self.__name__}() got multiple values for argument {k!r}")
            out[k] = v
        return out

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(positional, keyword)`` arguments of a call. Positional values past the
        named parameters go to ``*args``; then, as Python needs, the named ones before
        it are passed by position too (their defaults where the call leaves them out)."""
        n = len(self._free_positional)
        extra = tuple(args[n:])
        named = self._kwargs(tuple(args[:n]), kwargs)
        if not extra:
            return (), named
        if not self.var_args:
            raise TypeError(f"{self.__name__}() takes {n} positional arguments after s, got {len(args)}")
        missing = [k for k in self.positional_names if k not in named and k not in self.arg_defaults]
        if missing:
            raise TypeError(f"{self.__name__}() is missing argument(s) {', '.join(missing)}")
        head = tuple(named.pop(k) if k in named else self.arg_defaults[k] for k in self.positional_names)
        return head + extra, named

    def run(self, *args: Any, max_new_tokens: int = 128, stop: Any = None, stop_token_ids: Any = None,
            temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, min_p: float = 0.0,
            frequency_penalty: float = 0.0, presence_penalty: float = 0.0, ignore_eos: bool = False,
            return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run once. The keywords are defaults for every gen in the program (a gen's
        own settings win); other keywords are the program's arguments. Called from a
        body that is being traced, it runs nothing: the trace stops there."""
        stop_if_tracing(self.__name__)
        defaults = _defaults(max_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p,
                             frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
                             top_logprobs_num, return_text_in_logprobs, self._extra(kwargs))
        call_args, call = self._call(args, kwargs)
        return run_program(self.func, _resolve_backend(backend), call_args, call, defaults, stream)

    def run_batch(self, batch_kwargs: list[Any], *, max_new_tokens: int = 128, stop: Any = None,
                  stop_token_ids: Any = None, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                  min_p: float = 0.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                  ignore_eos: bool = False, return_logprob: bool | None = None,
                  logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
                  return_text_in_logprobs: bool | None = None, backend: Any = None,
                  num_threads: int | str = "auto", progress_bar: bool = False, pin_prefixes: bool | None = None,
                  generator_style: bool = False, **kwargs: Any) -> Any:
        """Run one instance per item (a dict of arguments, or a list of positional
        ones). The instances are traced first: the prefixes they share are pinned in
        the runtime for the batch's lifetime (``pin_prefixes``; by default
        ``global_config.enable_precache_with_tracing``) and they are submitted grouped
        by shared prefix. Tracing runs each body up to its first model output, so a
        body that does something before that (a retrieval call) does it once more per
        instance (on copies of its plain-data arguments, placeholders for the others:
        an iterator argument reaches the run unconsumed); with ``global_config.enable_precache_with_tracing = False`` (and no
        ``pin_prefixes=True``) nothing is traced, as in SGLang, and instances run in
        input order. States come back in input order: as a list, or with
        ``generator_style=True`` as an iterator that yields each state as soon as it
        (and every one before it) is done; the pins are released when the iterator
        is exhausted or closed."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch takes a list of argument dicts (or of argument lists)")
        if not batch_kwargs:
            return []
        stop_if_tracing(self.__name__)
        defaults = _defaults(max_new_tokens, stop, stop_token_ids, temperature, top_p, top_k, min_p,
                             frequency_penalty, presence_penalty, ignore_eos, return_logprob, logprob_start_len,
                             top_logprobs_num, return_text_in_logprobs, self._extra(kwargs))
        if kwargs:
            raise TypeError(f"run_batch() got unexpected keyword(s) {', '.join(sorted(kwargs))}")
        batch = [self._kwargs(tuple(a), {}) if isinstance(a, (list, tuple)) else self._kwargs((), dict(a))
                 for a in batch_kwargs]
        b = _resolve_backend(backend)
        if pin_prefixes is None:
            pin_prefixes = bool(global_config.enable_precache_with_tracing)
        trace = pin_prefixes or bool(global_config.enable_precache_with_tracing)
        batches = self._iter_batch(b, batch, defaults, num_threads, progress_bar, pin_prefixes, trace)
        return batches if generator_style else list(batches)

    def _iter_batch(self, b: Any, batch: list[dict[str, Any]], defaults: dict[str, Any], num_threads: int | str,
                    progress_bar: bool, pin_prefixes: bool, trace: bool) -> Iterator[ProgramState]:
        plan = self.plan(batch, b) if trace else None
        if trace and len(batch) > 1:
            for issue in self.lint(batch):
                warnings.warn(str(issue), PromptLayoutWarning, stacklevel=3)
        pins: list[str] = []
        if plan is not None and pin_prefixes and len(batch) > 1 and plan.pins and b.supports_pinning:
            # all pins at once; the runtime acknowledges a pin before its prefill ends,
            # and the instances queued behind it share that prefill
            with ThreadPoolExecutor(len(plan.pins), thread_name_prefix="plait-pin") as pool:
                found = list(pool.map(lambda p: _pin(b, p[0], len(p[1])), plan.pins))
            pins = [p for p in found if p is not None]
        try:
            order = plan.order if plan is not None else None
            yield from iter_program_batch(self.func, b, batch, defaults, num_threads, progress_bar, order)
        finally:
            for pin_id in pins:
                _unpin(b, pin_id)

    def trace(self, *, backend: Any = None, **kwargs: Any) -> ProgramGraph:
        """Trace the program with the given arguments (others become placeholders).
        ``backend`` is accepted for SGLang's signature: a graph does not depend on it
        (roles are rendered when a prefix's text is asked for)."""
        return trace_program(self.func, self.__name__, self.arg_names, self.arg_defaults,
                             {**self.bind_arguments, **kwargs}, self.var_kwargs)

    def cache(self, backend: Any = None) -> bool:
        """Prefill the program's constant prefix (its text before the first argument,
        model call or fork, roles rendered) into the runtime's prefix cache, so later
        runs reuse its KV (SGLang's ``cache``). A prefix shorter than ``MIN_PIN_CHARS``
        is not worth a request: returns whether one was prefilled."""
        b = _resolve_backend(backend)
        graph = self.trace()
        text = token_safe_cut(graph.prefix_text(chat_template_of(b) if graph.uses_roles else None))
        if len(text) < MIN_PIN_CHARS:
            return False
        b.cache_prefix(text)
        return True

    def lint(self, instances: list[Any] | None = None, *, min_tokens: int = DEFAULT_MIN_TOKENS,
             count_tokens: Callable[[str], int] | None = None) -> list[LayoutIssue]:
        """Prompt-layout problems (:mod:`plait.lint`): values that differ between calls
        placed before long constant text. With ``instances`` (a batch's arguments),
        arguments they all share count as constants, and so do defaults no instance
        overrides; without, every argument may vary (string defaults included: callers
        pass them). The program is traced twice: text its body computes that differs
        between the two traces (``datetime.now()``, a random id) is a changing value too."""
        given = [self._kwargs(tuple(a), {}) if isinstance(a, (list, tuple)) else self._kwargs((), dict(a))
                 for a in instances or []]
        fixed = {k: v for k, v in self.arg_defaults.items()
                 if not isinstance(v, str) or (given and not any(k in g for g in given))}
        bound = {**self.bind_arguments, **shared_arguments(given)}
        first, second = (trace_program(self.func, self.__name__, self.arg_names, fixed, bound, self.var_kwargs)
                         for _ in range(2))
        return lint_graph(first, min_tokens, count_tokens, again=second)

    def compile(self, *, backend: Any = None) -> CompiledFunction:
        """SGLang's ``compile()``: the program with its graph traced once (tracing is
        plait's compile step); ``run`` / ``run_batch`` run it as this function does."""
        return CompiledFunction(self, backend)

    def plan(self, batch: list[dict[str, Any]], backend: Any = None) -> BatchPlan:
        """The batch plan ``run_batch`` would follow: shared prefixes and order."""
        graphs = [self.trace(**kw) for kw in batch]
        template = None
        if any(g.uses_roles for g in graphs):
            try:
                template = chat_template_of(_resolve_backend(backend))
            except (BackendError, RuntimeError, ValueError):  # run() reports template problems
                template = None
        return plan_batch(graphs, template)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``f(s, ...)`` inside another program runs this one's body on that state;
        ``f(...)`` elsewhere is ``f.run(...)``."""
        if args and isinstance(args[0], (ProgramState, TracingState)):
            call_args, call = self._call(args[1:], kwargs)
            return self.func(args[0], *call_args, **call)
        return self.run(*args, **kwargs)


class CompiledFunction:
    """A :class:`Function` with its traced graph (``graph``; ``print_graph()`` shows
    it). ``run`` / ``run_batch`` take the same keywords as the function's and default
    to the backend given to ``compile``."""

    def __init__(self, function: Function, backend: Any = None) -> None:
        self.function = function
        self.backend = backend
        self.graph = function.trace()

    @property
    def last_node(self) -> Any:
        return self.graph.last_node

    def print_graph(self) -> None:
        print(self.graph.pretty())

    def run(self, *, backend: Any = None, **kwargs: Any) -> ProgramState:
        return self.function.run(backend=backend if backend is not None else self.backend, **kwargs)

    def run_batch(self, batch_kwargs: list[Any], *, backend: Any = None, **kwargs: Any) -> Any:
        return self.function.run_batch(batch_kwargs, backend=backend if backend is not None else self.backend,
                                       **kwargs)


def _pin(backend: BaseBackend, text: str, members: int) -> str | None:
    try:
        return backend.pin(text, PIN_TTL_S)
    except BackendError as e:  # pins are an optimisation: run without
        logger.info("prefix shared by %d instances not pinned: %s", members, e)
        return None


def _unpin(backend: BaseBackend, pin_id: str) -> None:
    try:
        backend.unpin(pin_id)
    except BackendError as e:
        logger.warning("could not unpin %s: %s", pin_id, e)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: ``@function`` or ``@function(...)``. ``num_api_spec_tokens`` is
    SGLang's speculative execution for hosted-API backends (one long call, cut into
    the program's gens afterwards); plait runs each gen as a request of its own that
    reuses the prompt's KV, so the setting is accepted and changes nothing."""
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens)


# -- building blocks -------------------------------------------------------------------------------
def gen(name: str | None = None, max_tokens: int | None = None, min_tokens: int | None = None,
        n: int | None = None, stop: Any = None, stop_token_ids: list[int] | None = None,
        stop_regex: Any = None, temperature: float | None = None, top_p: float | None = None,
        top_k: int | None = None, min_p: float | None = None, frequency_penalty: float | None = None,
        presence_penalty: float | None = None, ignore_eos: bool | None = None,
        return_logprob: bool | None = None, logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
        dtype: Any = None, choices: list[str] | None = None,
        choices_method: ChoicesSamplingMethod | None = None, regex: str | None = None,
        json_schema: Any = None, seed: int | None = None, repetition_penalty: float | None = None,
        ebnf: str | None = None, grammar_backend: str | None = None, tools: list[dict[str, Any]] | None = None,
        tool_choice: Any = None, parallel_tool_calls: bool = True, tool_call_parser: str = "hermes") -> Any:
    """Call the model and store the output as variable ``name``. With ``choices``
    this is :func:`select`. ``regex``/``json_schema``/``ebnf``/``dtype`` constrain the
    output (enforced by the runtime's constrained decoding; ``grammar_backend`` picks
    its engine: auto, outlines or llguidance); a bad pattern raises here.
    ``json_schema`` is a dict, its JSON text, ``True`` (any JSON value) or a pydantic
    model class (its ``model_json_schema()``)."""
    name = check_name(name)
    if choices is not None:
        return select(name, choices, 0.0 if temperature is None else temperature,
                      token_length_normalized if choices_method is None else choices_method)
    if dtype is not None and regex is not None:  # SGLang warns and keeps dtype's regex
        warnings.warn(f"gen({name!r}): both dtype and regex were given; only dtype is used (as in SGLang)",
                      stacklevel=2)
        regex = None
    constraints = [k for k, v in (("regex", regex), ("json_schema", json_schema), ("ebnf", ebnf), ("dtype", dtype))
                   if v is not None]
    if len(constraints) > 1:
        raise ValueError(f"{' and '.join(constraints)} were both given; allowed: at most one constraint per gen")
    if regex is not None:
        regex = check_regex(regex)  # without end anchors
    if json_schema is not None:
        json_schema = check_json_schema(json_schema)
    if dtype is not None:
        dtype_regex(dtype)  # validates
    # tools: the output is parsed for calls (meta info "tool_calls", "content"); a
    # required or named call is forced by a regex in the parser's format
    tool_spec = None
    unique_items = None  # a forced call's uniqueItems, kept beside its regex
    if tools is not None:
        tool_spec = ToolSpec.build(tools, tool_choice, parallel_tool_calls, tool_call_parser)
        forced = tool_spec.constraint()
        if forced is not None:
            if constraints:
                raise ValueError(f"tool_choice={tool_choice!r} forces a call through a constraint; {constraints[0]} "
                                 "cannot be given with it")
            regex, unique_items = forced.regex, forced.unique or None
            from plait.runtime.constrained.holes import backend_refusal, has_holes, holes_to_lark

            if has_holes(regex):  # arguments only llguidance's JSON compiler follows: a Lark grammar
                why = backend_refusal(grammar_backend, f"tool_choice={tool_choice!r}")
                if why is not None:
                    raise ValueError(why)
                ebnf, regex, grammar_backend = holes_to_lark(regex), None, "llguidance"
    elif tool_choice is not None:
        raise ValueError("tool_choice was given without tools")
    if ebnf is not None and not isinstance(ebnf, str):
        raise ValueError(f"ebnf={ebnf!r} is invalid; allowed: a grammar as a string")
    if grammar_backend is not None and grammar_backend not in ("auto", "outlines", "llguidance"):
        raise ValueError(f"grammar_backend={grammar_backend!r} is invalid; allowed: auto, outlines, llguidance")
    params = dict(
        max_new_tokens=max_tokens, min_new_tokens=min_tokens, n=n, stop=check_stop(stop),
        stop_token_ids=stop_token_ids, stop_regex=check_stop_regex(stop_regex), temperature=temperature,
        top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs, regex=regex, json_schema=json_schema, seed=seed,
        repetition_penalty=repetition_penalty, dtype=dtype, ebnf=ebnf, grammar_backend=grammar_backend,
        unique_items=unique_items,
    )
    return Gen(name, plain_numbers({k: v for k, v in params.items() if v is not None}), tool_spec)


def gen_int(name: str | None = None, max_tokens: int | None = None, n: int | None = None, stop: Any = None,
            stop_token_ids: list[int] | None = None, stop_regex: Any = None, temperature: float | None = None,
            top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
            frequency_penalty: float | None = None, presence_penalty: float | None = None,
            ignore_eos: bool | None = None, return_logprob: bool | None = None, logprob_start_len: int | None = None,
            top_logprobs_num: int | None = None, return_text_in_logprobs: bool | None = None,
            **kwargs: Any) -> Any:
    """An integer (``dtype=int``). The parameters, in order, are SGLang's; ``kwargs``
    are :func:`gen`'s other keywords (``seed``, ``min_tokens`` ...)."""
    return _gen_dtype(int, locals())


def gen_string(name: str | None = None, max_tokens: int | None = None, n: int | None = None, stop: Any = None,
               stop_token_ids: list[int] | None = None, stop_regex: Any = None, temperature: float | None = None,
               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
               frequency_penalty: float | None = None, presence_penalty: float | None = None,
               ignore_eos: bool | None = None, return_logprob: bool | None = None,
               logprob_start_len: int | None = None, top_logprobs_num: int | None = None,
               return_text_in_logprobs: bool | None = None, **kwargs: Any) -> Any:
    """A double-quoted string (``dtype=str``); parameters as :func:`gen_int`'s."""
    return _gen_dtype(str, locals())


def _gen_dtype(dtype: type, args: dict[str, Any]) -> Any:
    """``gen(..., dtype=dtype)`` with the arguments of gen_int / gen_string."""
    args = dict(args)
    extra = args.pop("kwargs")
    return gen(**args, **extra, dtype=dtype)


def select(name: str | None = None, choices: list[str] | None = None, temperature: float = 0.0,
           choices_method: ChoicesSamplingMethod = token_length_normalized) -> Any:
    """Pick one of ``choices`` by the model's likelihood of each after the context."""
    name = check_name(name)
    choices = check_choices(choices)
    temperature = plain_numbers({"temperature": temperature})["temperature"]
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} is invalid; allowed: a number >= 0")
    if not callable(choices_method):
        raise ValueError(f"choices_method={choices_method!r} is invalid; allowed: token_length_normalized, "
                         "greedy_token_selection, unconditional_likelihood_normalized or a ChoicesSamplingMethod")
    return Select(name, choices, float(temperature), choices_method)


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> ExprList:
    """SGLang's ``separate_reasoning``: the output of each gen in ``expr`` (a gen, or
    text, roles and gens joined with ``+``) is split by reasoning parser ``model_type``
    (:mod:`plait.reasoning`): the gen's variable holds the answer, variable
    ``<name>_reasoning_content`` the reasoning (None when the output has none), and
    only the answer enters the text and ``messages()``, so later turns do not see the
    reasoning. A gen's regex (or ``dtype=str`` / ``bool``) constrains the answer after
    a free reasoning section. Streams stream the answer (and the reasoning variable)."""
    from plait.reasoning import REASONING_PARSERS

    if model_type not in REASONING_PARSERS:
        raise ValueError(f"model_type={model_type!r} is invalid; allowed: {', '.join(REASONING_PARSERS)}")
    if expr is None:
        raise ValueError("separate_reasoning needs an expression with a named gen, e.g. gen('answer')")
    parser = REASONING_PARSERS[model_type]
    items = [_with_reasoning(e, parser) for e in flatten(as_expr(expr))]
    if not any(isinstance(e, Gen) for e in items):
        raise ValueError(f"separate_reasoning({expr!r}) has no gen whose output it could split")
    return ExprList(items)


def _with_reasoning(e: Expr, parser: Any) -> Expr:
    """``e`` with its output split by ``parser`` (a new Gen); other expressions as they are."""
    if isinstance(e, Select):
        raise ValueError(f"separate_reasoning cannot split select {e.name!r}: it picks one of its choices, "
                         "which hold no reasoning; wrap only the gens")
    if not isinstance(e, Gen):
        return e
    if e.name is None:
        raise ValueError("separate_reasoning needs a named gen (gen('answer')): the reasoning is stored as "
                         "variable '<name>_reasoning_content'")
    if e.reasoning is not None:
        raise ValueError(f"gen {e.name!r} is already inside separate_reasoning")
    params = dict(e.params)
    for key in ("json_schema", "ebnf"):
        if key in params:
            raise ValueError(f"separate_reasoning cannot split gen {e.name!r} with {key}: the {key} would "
                             "constrain the reasoning too; give the answer's format as regex=")
    dtype = params.pop("dtype", None)
    if dtype is not None:
        if dtype_stop(dtype):
            raise ValueError(f"separate_reasoning cannot split gen {e.name!r} with dtype={dtype!r}: a number "
                             "ends at the first space, inside the reasoning; give the answer's format as regex=")
        params["regex"] = dtype_regex(dtype)
    if "regex" in params:  # the constraint applies to the answer, after the reasoning section
        params["regex"] = parser.constraint_prefix() + "(?:" + params["regex"] + ")"
    return Gen(e.name, params, e.tools, parser)


def _role(role: str, expr: Any = None) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)])


def system(expr: Any = None) -> ExprList:
    return _role("system", expr)


def user(expr: Any = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Any = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def image(expr: Any) -> Any:
    raise NotImplementedError(f"image({expr!r}): plait serves text-only models, so a prompt cannot hold an image; "
                              "put a description of the image in the text instead (programs with images need a "
                              "vision-language server, such as SGLang's)")


def video(path: str, num_frames: int) -> Any:
    raise NotImplementedError(f"video({path!r}, {num_frames!r}): plait serves text-only models, so a prompt cannot "
                              "hold a video; put a description of it in the text instead (programs with videos need "
                              "a vision-language server, such as SGLang's)")
