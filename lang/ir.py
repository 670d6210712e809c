"""The building blocks of a program: expressions appended to a state with ``s += ...``.

``gen``, ``select``, roles and constant text build :class:`Expr` objects; ``+``
concatenates them (``"Q: " + gen("a")`` is an :class:`ExprList`). The interpreter
executes them against a backend; the tracer records them into a program graph.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import operator
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.reasoning import ReasoningParser
    from plait.tool_parsers import CallConstraint

# Per-request options that are not sampling parameters.
REQUEST_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
# A gen's params that constrain its output (a dtype becomes a regex): such a gen ends
# where its constraint does, without the template's end-of-turn stop string.
CONSTRAINT_PARAMS = ("regex", "json_schema", "ebnf")

# Regexes for ``dtype`` (and gen_int / gen_string); enforced by the runtime's
# constrained decoding. Numbers are written as JSON writes them (no "+", no leading
# zeros), so that they parse in a JSON text and with int() / float(). A number ends
# at the first character that cannot continue it (whitespace or punctuation,
# ``DTYPE_STOP``): that character is a stop string, so it is not part of the value,
# and whatever its token carries after it is allowed (a token such as " hours" may
# end "24"). A number with no way out would leave the model nothing but more digits
# up to max_tokens.
DTYPE_REGEX = {
    "int": r"-?(0|[1-9][0-9]*)([ \n,.;:)\]}](?s:.*))?",
    "float": r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?([ \n,;:)\]}](?s:.*))?",
    "bool": r"(True|False)",
    "str": r'"([^"\\\n]|\\["\\/bfnrt])*"',
}
DTYPE_STOP = {"int": (" ", "\n", ",", ".", ";", ":", ")", "]", "}"), "float": (" ", "\n", ",", ";", ":", ")", "]", "}")}

# SGLang's regexes by SGLang's names (``from sglang.lang.ir import REGEX_INT`` becomes
# ``from plait.ir import REGEX_INT``): plain patterns, which SGLang's programs end with
# ``stop=[" ", "\n"]`` or with text of their own (``REGEX_INT + ","``).
REGEX_INT = r"-?(0|[1-9][0-9]*)[ \n]*"
REGEX_FLOAT = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?[ \n]*"
REGEX_BOOL = DTYPE_REGEX["bool"]
REGEX_STR = DTYPE_REGEX["str"]


class Expr:
    """Something that can be appended to a program state."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([as_expr(other), self])


class ExprList(Expr):
    def __init__(self, items: list[Expr]) -> None:
        self.items: list[Expr] = []
        for x in items:
            self.items.extend(x.items if isinstance(x, ExprList) else [x])

    def __repr__(self) -> str:
        return f"ExprList({self.items!r})"


class Text(Expr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Text({self.value!r})"


class Gen(Expr):
    """A model call. ``params`` holds only what the call sets, by runtime names
    (sampling fields and request fields); the rest comes from ``run()``'s defaults.
    ``tools``: the functions the call offers the model (its output is parsed for calls).
    ``reasoning``: the parser that splits the output's reasoning section off
    (``separate_reasoning``): the variable and the text get the answer, variable
    :func:`reasoning_var` the reasoning."""

    def __init__(self, name: str | None, params: dict[str, Any], tools: ToolSpec | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.name = name
        self.params = params
        self.tools = tools
        self.reasoning = reasoning

    def __repr__(self) -> str:
        return f"Gen({self.name!r}, {self.params!r})"


TOOL_CHOICES = ("auto", "none", "required")


@dataclass(frozen=True)
class ToolSpec:
    """The tools of one gen: OpenAI function tools (checked), ``choice`` (``auto``:
    the model may call; ``none``: its output is not parsed for calls; ``required``: it
    must call one; ``function``: it must call ``function``), whether several calls may
    come at once, and the format calls are written in (``parser``, a name of
    :mod:`plait.tool_parsers`). ``required`` and a named function are enforced by the
    gen's regex (:meth:`constraint`)."""

    tools: list[dict[str, Any]]
    choice: str
    function: str | None
    parallel: bool
    parser: str

    @classmethod
    def build(cls, tools: Any, tool_choice: Any, parallel: Any, parser: Any) -> ToolSpec:
        """Check a gen's tool arguments (``ValueError`` naming the one at fault)."""
        from plait.tool_parsers import TOOL_PARSERS, check_tools

        if isinstance(tools, (list, tuple)):
            for i, t in enumerate(tools):
                if callable(t):
                    raise ValueError(f"tools[{i}] is a Python function ({getattr(t, '__name__', t)!r}); allowed: "
                                     "OpenAI function tools, {'type': 'function', 'function': {'name': NAME, "
                                     "'description': ..., 'parameters': JSON_SCHEMA}}")
        check_tools(tools)
        if parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={parser!r} is invalid; allowed: {', '.join(TOOL_PARSERS)}")
        if not isinstance(parallel, bool):
            raise ValueError(f"parallel_tool_calls={parallel!r} is invalid; allowed: True or False")
        choice = "auto" if tool_choice is None else tool_choice
        if isinstance(choice, dict):
            fn = choice.get("function") if choice.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if not isinstance(name, str):
                raise ValueError(f"tool_choice={tool_choice!r} is invalid; allowed: auto, none, required or "
                                 "{'type': 'function', 'function': {'name': NAME}}")
            if name not in {t["function"]["name"] for t in tools}:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
            return cls(list(tools), "function", name, parallel, parser)
        if choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice={tool_choice!r} is invalid; allowed: auto, none, required or "
                             "{'type': 'function', 'function': {'name': NAME}}")
        return cls(list(tools), choice, None, parallel, parser)

    def constraint(self) -> CallConstraint | None:
        """What forces the calls (``required`` / a named function), or None."""
        if self.choice not in ("required", "function"):
            return None
        from plait.tool_parsers import get_tool_parser

        return get_tool_parser(self.parser).constraint(self.tools, self.function, self.parallel)

    def parse(self, text: str) -> dict[str, Any]:
        """Meta info of one output: ``tool_calls`` (OpenAI's shape: ``id``, ``type``,
        ``function.name``, ``function.arguments`` as a JSON text) and ``content``, the
        text outside the calls. Malformed calls stay content."""
        if self.choice == "none":
            return {"tool_calls": [], "content": text}
        from plait.tool_parsers import get_tool_parser

        content, calls = get_tool_parser(self.parser).parse(text, self.tools)
        if not self.parallel:
            calls = calls[:1]
        return {"tool_calls": [c.to_openai() for c in calls], "content": content}


class Select(Expr):
    def __init__(self, name: str | None, choices: list[str], temperature: float, choices_method: Any) -> None:
        self.name = name
        self.choices = choices
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, {self.choices!r})"


@dataclass(repr=True)
class RoleBegin(Expr):
    role: str


@dataclass(repr=True)
class RoleEnd(Expr):
    role: str


@dataclass(repr=True)
class VarScopeBegin(Expr):
    name: str


@dataclass(repr=True)
class VarScopeEnd(Expr):
    name: str


class AppendError(TypeError, ValueError):
    """Something a program state cannot hold was appended (``s += None``, a number).
    Both a ``TypeError`` and the ``ValueError`` SGLang raises for it, so a program that
    catches either keeps working."""


def as_expr(x: Any) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, str):
        return Text(x)
    if x is None:
        raise AppendError("cannot append None to a program state; allowed: a string or a plait expression")
    raise AppendError(
        f"cannot append a {type(x).__name__} to a program state; allowed: a string or a plait "
        f"expression (gen, select, a role); convert it with str() first"
    )


class RoleScopes:
    """Roles and variable scopes of a program state, written once for the running state
    and the tracing one: both only differ in what appending an expression does."""

    def _append(self, expr: Expr) -> None:
        raise NotImplementedError

    def _role(self, role: str, expr: Any = None) -> Any:
        """``s.user(x)`` appends the turn at once; what it returns appends nothing, so
        ``s += s.user(x)`` (as SGLang's frontend tutorial writes it) is the same turn,
        once. ``s.user()`` is a ``with`` block."""
        if expr is not None:
            self._append(ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return ExprList([])
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._append(RoleBegin(role))
        yield
        self._append(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextlib.contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Everything appended inside the block becomes variable ``name``."""
        self._append(VarScopeBegin(name))
        yield
        self._append(VarScopeEnd(name))

    def begin_debug_region(self, name: str) -> None:
        """SGLang's debug-studio marker (its prompts from here on go to
        ``sglang.launch_debug_server``). plait has no debug studio: the call changes
        nothing but a warning; ``text()`` and ``trace()`` show what a program sends."""
        warnings.warn(f"begin_debug_region({name!r}): plait has no debug studio, the region is ignored (the "
                      "program runs as written; read state.text() or f.trace() to see its prompts)", stacklevel=2)


def flatten(x: Expr) -> list[Expr]:
    return list(x.items) if isinstance(x, ExprList) else [x]


def reasoning_var(name: str) -> str:
    """The variable holding the reasoning of gen ``name`` (SGLang's name for it)."""
    return f"{name}_reasoning_content"


def defined_names(x: Expr) -> list[str]:
    """Variables that executing ``x`` defines."""
    out = []
    for e in flatten(x):
        if isinstance(e, (Gen, Select)) and e.name is not None:
            out.append(e.name)
            if isinstance(e, Gen) and e.reasoning is not None:
                out.append(reasoning_var(e.name))
        elif isinstance(e, VarScopeBegin):
            out.append(e.name)
    return out


# -- validation at gen() time -------------------------------------------------------------
def check_json_schema(schema: Any) -> str:
    """The JSON text a gen sends as its ``json_schema``, from a dict, JSON text, a bool
    (true: any JSON value) or a pydantic model class or ``TypeAdapter`` (its JSON Schema,
    as outlines, vLLM and SGLang take one). Raises ``ValueError`` for a value that is no
    schema (JSON text of an array, ``false``...), ``TypeError`` for any other object."""
    from plait.runtime.constrained.json_schema import check_schema_size, load_schema

    if isinstance(schema, type) and callable(getattr(schema, "model_json_schema", None)):
        schema = schema.model_json_schema()  # a pydantic BaseModel class
    elif type(schema).__name__ == "TypeAdapter" and callable(getattr(schema, "json_schema", None)):
        schema = schema.json_schema()  # a pydantic TypeAdapter
    elif not isinstance(schema, (dict, bool, str)):
        allowed = "allowed: a dict, JSON text, true/false, or a pydantic model class"
        if callable(getattr(schema, "model_json_schema", None)):
            raise TypeError(f"json_schema={schema!r:.80} is a pydantic model instance; {allowed} "
                            f"(here {type(schema).__name__})")
        raise TypeError(f"json_schema={schema!r:.80} ({type(schema).__name__}) is invalid; {allowed}")
    value = load_schema(schema)  # text: parsed to check it; the runtime reads the text as given
    check_schema_size(value)  # before json.dumps recurses into it
    return schema if isinstance(schema, str) else json.dumps(value)


def _dtype_key(dtype: Any) -> str:
    key = dtype.__name__ if isinstance(dtype, type) else dtype
    if key not in DTYPE_REGEX:
        raise ValueError(f"dtype={dtype!r} is invalid; allowed: int, float, bool, str (or their names)")
    return key


def dtype_regex(dtype: Any) -> str:
    return DTYPE_REGEX[_dtype_key(dtype)]


def dtype_stop(dtype: Any) -> tuple[str, ...]:
    """The stop strings that end a gen of ``dtype`` (the characters that end a number)."""
    return DTYPE_STOP.get(_dtype_key(dtype), ())


def check_choices(choices: Any, param: str = "choices") -> list[str]:
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError(f"{param}={choices!r} is invalid; allowed: a non-empty list of strings")
    out = list(choices)
    bad = [c for c in out if not isinstance(c, str) or not c]
    if bad:
        raise ValueError(f"{param} contains {bad[0]!r}; allowed: non-empty strings")
    return out


def check_name(name: Any) -> str | None:
    if name is not None and not isinstance(name, str):
        raise ValueError(f"name={name!r} is invalid; allowed: a string or None")
    return name


# Sampling settings that are integers / real numbers (runtime names).
INT_PARAMS = ("max_new_tokens", "min_new_tokens", "n", "top_k", "seed", "logprob_start_len", "top_logprobs_num")
REAL_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def plain_numbers(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with numbers of other types (numpy's ``int64`` / ``float32``, as read
    from a data frame) as the Python ints and floats that the runtime checks and its
    wire protocol carries, and ``stop_token_ids`` (any sequence of them) as a list. An
    integer setting is converted only from a type that is an integer (``__index__``:
    ``5.0`` is left for the runtime to refuse by name); anything else is left as it is,
    for validation to name."""
    out = dict(params)
    for k, v in params.items():
        if v is None or isinstance(v, bool):
            continue
        # (numpy's float64 is a float, but not one the wire protocol encodes: exact types)
        if k in INT_PARAMS and type(v) is not int and hasattr(type(v), "__index__"):
            out[k] = int(operator.index(v))
        elif k in REAL_PARAMS and type(v) is not float and isinstance(v, numbers.Real):
            out[k] = float(v)
        elif k == "stop_token_ids" and not isinstance(v, (str, bytes, dict)) and hasattr(v, "__iter__"):
            ids = list(v)
            if all(hasattr(type(t), "__index__") and not isinstance(t, bool) for t in ids):
                out[k] = [int(operator.index(t)) for t in ids]
    return out


def check_stop(stop: Any, param: str = "stop") -> list[str] | None:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"{param}={stop!r} is invalid; allowed: a string or a list of strings")
    return [s for s in stop if s]


def check_stop_regex(stop_regex: Any) -> list[str] | None:
    """``stop_regex`` (a pattern or a list of them) as a list, compiled here so that a bad
    pattern raises where the program names it (the runtime compiles it the same way)."""
    if stop_regex is None:
        return None
    patterns = [stop_regex] if isinstance(stop_regex, str) else stop_regex
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise ValueError(f"stop_regex={stop_regex!r} is invalid; allowed: a regular expression or a list of them")
    if not patterns:
        return None
    from plait.runtime.stop_regex import compile_stop_regex  # the standard library only

    compile_stop_regex(tuple(patterns))
    return list(patterns)


@dataclass
class ResolvedParams:
    """What one gen sends: sampling params and request options, runtime names."""

    sampling: dict[str, Any] = field(default_factory=dict)
    request: dict[str, Any] = field(default_factory=dict)


def resolve_params(defaults: dict[str, Any], own: dict[str, Any], extra_stop: tuple[str, ...] = ()) -> ResolvedParams:
    """Merge ``run()``'s defaults with one gen's settings (the gen wins), and add the
    implicit stop strings ``extra_stop`` (a dtype's, the chat template's end-of-turn
    text) to the stop strings."""
    merged = {**defaults, **{k: v for k, v in own.items() if v is not None}}
    out = ResolvedParams()
    for k, v in merged.items():
        if v is None:
            continue
        (out.request if k in REQUEST_FIELDS else out.sampling)[k] = v
    stop = list(out.sampling.get("stop") or [])
    for s in extra_stop:
        if s not in stop:
            stop.append(s)
    if stop:
        out.sampling["stop"] = stop
    else:
        out.sampling.pop("stop", None)
    if not out.sampling.get("stop_token_ids"):
        out.sampling.pop("stop_token_ids", None)
    return out
