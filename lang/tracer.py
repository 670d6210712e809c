"""Tracing is plait's compile step.

``f.trace(**args)`` runs a program's body against a symbolic state that calls no
model and records a :class:`ProgramGraph`: constant text, argument slots, gen and
select sites, role boundaries, variable scopes and forks. Arguments that are not
given are placeholders that mark where they land in the text (they also survive
f-strings and ``+``); given arguments are used as they are. Reading a model output
(``s["answer"]``) is known only at run time: the trace stops there with a
:class:`StopNode` saying why.

Prefix analysis then derives, for each call site, the longest prompt prefix known
before run time, and for a batch of instances the prefixes they share
(:func:`plan_batch`), which ``run_batch`` pins in the runtime before submitting the
instances grouped by shared prefix.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Union

from plait.chat_template import ChatTemplate, Transcript
from plait.ir import (
    Expr, Gen, RoleBegin, RoleEnd, RoleScopes, Select, Text, VarScopeBegin, VarScopeEnd, as_expr, flatten,
)

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around an unbound argument's name
_ARG_RE = re.compile(f"{_OPEN}([^{_OPEN}{_CLOSE}]*){_CLOSE}")

# A shared prefix shorter than this is not worth a pin (about one KV page of tokens).
MIN_PIN_CHARS = 64
# Pin a prefix only if at least this share of the batch (and 2 instances) starts with
# it: smaller groups are submitted next to each other and share through the prefix
# cache anyway.
MIN_PIN_SHARE = 0.25
MAX_PINS = 8


# -- graph nodes -------------------------------------------------------------------------------
@dataclass
class TextNode:
    text: str


@dataclass
class ArgNode:
    """Where an argument's value lands in the text; ``value`` None when unbound."""

    name: str
    value: str | None = None


@dataclass
class GenNode:
    name: str | None
    params: dict[str, Any]


@dataclass
class SelectNode:
    name: str | None
    choices: list[str]


@dataclass
class RoleNode:
    role: str
    begin: bool


@dataclass
class VarScopeNode:
    name: str
    begin: bool


@dataclass
class ForkNode:
    size: int
    branches: list[list[Node]]


@dataclass
class JoinNode:
    mode: str


@dataclass
class StopNode:
    """Tracing stopped here: what follows depends on run-time values."""

    reason: str


Node = Union[TextNode, ArgNode, GenNode, SelectNode, RoleNode, VarScopeNode, ForkNode, JoinNode, StopNode]


@dataclass
class CallSite:
    """A gen or select in the graph. ``path`` locates it: ``()`` for the main line,
    ``((fork_node_index, branch), ...)`` inside forks. ``known_prefix`` are the nodes
    before it whose text is known before run time (it stops at the first model output
    or unbound argument that precedes the site)."""

    kind: str
    name: str | None
    path: tuple[tuple[int, int], ...]
    index: int
    known_prefix: list[Node]
    complete: bool  # the known prefix reaches the site (nothing dynamic before it)


@dataclass
class ProgramGraph:
    """The recorded structure of one program (for one binding of its arguments)."""

    name: str
    arg_names: list[str]
    bound: dict[str, Any]
    nodes: list[Node] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """True when the whole body was traced (no :class:`StopNode`)."""
        return not any(isinstance(n, StopNode) for n in _walk(self.nodes))

    @property
    def stop_reason(self) -> str | None:
        return next((n.reason for n in _walk(self.nodes) if isinstance(n, StopNode)), None)

    @property
    def uses_roles(self) -> bool:
        return any(isinstance(n, RoleNode) for n in _walk(self.nodes))

    def call_sites(self) -> list[CallSite]:
        sites: list[CallSite] = []
        _collect_sites(self.nodes, (), [], False, sites)
        return sites

    def known_prefix(self) -> list[Node]:
        """Nodes of the main line before its first run-time value (model output,
        unbound argument, fork or the end of tracing): the text every call of this
        instance starts with."""
        out: list[Node] = []
        for n in self.nodes:
            if _is_dynamic(n) or isinstance(n, (ForkNode, JoinNode)):
                break
            out.append(n)
        return out

    def static_prefix(self) -> list[Node]:
        """The leading constant part: text and roles before any argument or call."""
        out: list[Node] = []
        for n in self.nodes:
            if not isinstance(n, (TextNode, RoleNode, VarScopeNode)):
                break
            out.append(n)
        return out

    def prefix_text(self, template: ChatTemplate | None = None, site: CallSite | None = None) -> str:
        """Text of the known prefix of ``site`` (default: of the whole instance),
        roles rendered through ``template``."""
        return render_nodes(site.known_prefix if site is not None else self.known_prefix(), template)

    def pretty(self) -> str:
        lines: list[str] = [f"program {self.name}({', '.join(self.arg_names)})"]
        _pretty(self.nodes, 1, lines)
        return "\n".join(lines)

    @property
    def last_node(self) -> LastNode:
        """SGLang's ``trace().last_node``: the end of the traced main line."""
        return LastNode(self)


@dataclass
class LastNode:
    """The end of a traced program (SGLang's tracer state's ``last_node``): ``node`` is
    the last recorded node of the main line (None for an empty body);
    ``print_graph_dfs()`` renders the graph that leads to it."""

    graph: ProgramGraph

    @property
    def node(self) -> Node | None:
        return self.graph.nodes[-1] if self.graph.nodes else None

    def print_graph_dfs(self) -> str:
        return self.graph.pretty() + "\n"


def _walk(nodes: list[Node]) -> Iterator[Node]:
    for n in nodes:
        yield n
        if isinstance(n, ForkNode):
            for b in n.branches:
                yield from _walk(b)


def _is_dynamic(n: Node) -> bool:
    return isinstance(n, (GenNode, SelectNode, StopNode)) or (isinstance(n, ArgNode) and n.value is None)


def _collect_sites(nodes: list[Node], path: tuple[tuple[int, int], ...], prefix: list[Node], blocked: bool,
                   out: list[CallSite]) -> None:
    prefix = list(prefix)
    for i, n in enumerate(nodes):
        if isinstance(n, (GenNode, SelectNode)):
            out.append(CallSite("gen" if isinstance(n, GenNode) else "select", n.name, path, i, list(prefix), not blocked))
            blocked = True
        elif isinstance(n, ForkNode):
            for b, branch in enumerate(n.branches):
                _collect_sites(branch, path + ((i, b),), prefix, blocked, out)
        elif isinstance(n, JoinNode):
            blocked = blocked or n.mode != "gather_variable"
        elif _is_dynamic(n):
            blocked = True
        elif not blocked:
            prefix.append(n)


def render_nodes(nodes: list[Node], template: ChatTemplate | None) -> str:
    """Text of static nodes (text, bound arguments, roles)."""
    ts = Transcript()
    for n in nodes:
        if isinstance(n, TextNode):
            ts.fill(n.text)
        elif isinstance(n, ArgNode):
            if n.value is None:
                raise ValueError(f"argument {n.name!r} is unbound; its text is known only at run time")
            ts.fill(n.value)
        elif isinstance(n, RoleNode):
            if n.begin:
                ts.begin_role(n.role, template)
            else:
                ts.end_role(n.role, template)
    return ts.text


def _pretty(nodes: list[Node], depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    for n in nodes:
        if isinstance(n, TextNode):
            lines.append(f"{pad}text {n.text!r}")
        elif isinstance(n, ArgNode):
            lines.append(f"{pad}arg {n.name}" + ("" if n.value is None else f" = {n.value!r}"))
        elif isinstance(n, GenNode):
            lines.append(f"{pad}gen {n.name!r} {n.params}")
        elif isinstance(n, SelectNode):
            lines.append(f"{pad}select {n.name!r} {n.choices}")
        elif isinstance(n, RoleNode):
            lines.append(f"{pad}{'begin' if n.begin else 'end'} {n.role}")
        elif isinstance(n, VarScopeNode):
            lines.append(f"{pad}{'begin' if n.begin else 'end'} var_scope {n.name!r}")
        elif isinstance(n, ForkNode):
            lines.append(f"{pad}fork {n.size}")
            for b, branch in enumerate(n.branches):
                lines.append(f"{pad}  branch {b}")
                _pretty(branch, depth + 2, lines)
        elif isinstance(n, JoinNode):
            lines.append(f"{pad}join {n.mode}")
        elif isinstance(n, StopNode):
            lines.append(f"{pad}stop: {n.reason}")


# -- the symbolic state -------------------------------------------------------------------------
class _StopTracing(Exception):
    pass


# The name of the program whose body this thread is tracing (None: not tracing). Set
# only by trace_program, for the length of the body's call.
_TRACING: ContextVar[str | None] = ContextVar("plait_tracing", default=None)


def stop_if_tracing(program: str) -> None:
    """Where a program is about to run: inside a body being traced, stop the trace
    instead. Tracing calls no model, and the program's outputs are known only at run
    time (SGLang's tracer likewise does not run a program called from a traced body)."""
    if _TRACING.get() is not None:
        raise _StopTracing(f"runs program {program!r}, whose outputs are known only at run time")


class _ArgPlaceholder(str):
    """An argument not given to ``trace``: a string that marks where it lands. Used as
    a sequence (a list argument: ``for q in questions``, ``", ".join(choices)``,
    ``s.fork(len(docs))`` then ``docs[i]``) it is one item, itself, so the text it
    contributes is still marked as the argument's (iterating the mark's characters
    traced one chat turn or fork per character, and a layout warning named an argument
    ``', c, h, o, ...'``). A slice that keeps that item (``context[:2000]``) is the
    mark; indexing past it stops the trace: the items are known only at run time."""

    arg_name: str

    def __new__(cls, name: str) -> _ArgPlaceholder:
        mark = super().__new__(cls, f"{_OPEN}{name}{_CLOSE}")
        mark.arg_name = name
        return mark

    def __iter__(self) -> Iterator[str]:
        return iter((self,))

    def __len__(self) -> int:
        return 1

    def __getitem__(self, key: Any) -> str:
        if isinstance(key, slice):
            return self if range(1)[key] else ""
        if key in (0, -1) and not isinstance(key, bool):
            return self
        raise _StopTracing(f"indexes argument {self.arg_name!r} at {key!r}, which is known only at run time")


class TracingState(RoleScopes):
    """Stands in for ``s`` while tracing: records instead of running."""

    def __init__(self, nodes: list[Node], known: dict[str, Any] | None = None) -> None:
        self.nodes = nodes
        self.outputs: set[str] = set()  # variables that are model outputs
        self.known: dict[str, Any] = dict(known or {})  # variables set by the program itself
        self.ret_value: Any = None

    def __iadd__(self, other: Any) -> TracingState:
        for e in flatten(as_expr(other)):
            self._record(e)
        return self

    def _record(self, e: Expr) -> None:
        if isinstance(e, Text):
            self.nodes.extend(split_arg_marks(str.__str__(e.value)))  # (a placeholder as plain text)
        elif isinstance(e, Gen):
            self.nodes.append(GenNode(e.name, dict(e.params)))
            self._output(e.name)
        elif isinstance(e, Select):
            self.nodes.append(SelectNode(e.name, list(e.choices)))
            self._output(e.name)
        elif isinstance(e, RoleBegin):
            self.nodes.append(RoleNode(e.role, True))
        elif isinstance(e, RoleEnd):
            self.nodes.append(RoleNode(e.role, False))
        elif isinstance(e, VarScopeBegin):
            self.nodes.append(VarScopeNode(e.name, True))
            self._output(e.name)
        elif isinstance(e, VarScopeEnd):
            self.nodes.append(VarScopeNode(e.name, False))

    def _output(self, name: str | None) -> None:
        if name is not None:
            self.outputs.add(name)
            self.known.pop(name, None)

    # roles and scopes come from RoleScopes; forks: the same surface as ProgramState
    def _append(self, expr: Expr) -> None:
        self += expr

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TracingGroup:
        if size == 0 and isinstance(size, int) and not isinstance(size, bool):
            return TracingGroup([], self)  # no branches: nothing to record, its join adds nothing
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise _StopTracing(f"fork size {size!r} is known only at run time")
        node = ForkNode(size, [[] for _ in range(size)])
        self.nodes.append(node)
        kids = [TracingState(b, self.known) for b in node.branches]
        for k in kids:
            k.outputs = set(self.outputs)
        return TracingGroup(kids, self)

    @contextlib.contextmanager
    def copy(self, position_ids_offset: Any = None) -> Iterator[TracingState]:
        group = self.fork(1)
        yield group[0]
        group.join()

    # reading: only what the program itself set is known
    def __getitem__(self, name: str) -> Any:
        if name in self.known:
            return self.known[name]
        raise _StopTracing(f"reads variable {name!r}, which is known only at run time")

    def get_var(self, name: str) -> Any:
        return self[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.known[name] = value

    def set_var(self, name: str, value: Any) -> None:
        self[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.known or name in self.outputs

    def get_meta_info(self, name: str) -> Any:
        raise _StopTracing(f"reads meta info of {name!r}, which is known only at run time")

    def text(self) -> str:
        raise _StopTracing("reads the program's text, which is known only at run time")

    def messages(self) -> list[dict[str, str]]:
        raise _StopTracing("reads the program's messages, which are known only at run time")

    def sync(self) -> None:
        pass

    def error(self) -> None:
        return None

    def abort(self, reason: str = "") -> None:
        pass


class TracingGroup:
    def __init__(self, states: list[TracingState], parent: TracingState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: int) -> TracingState:
        return self.states[i]

    def __setitem__(self, i: int, value: TracingState) -> None:
        pass

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[TracingState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> TracingGroup:
        if callable(other) and not isinstance(other, Expr):
            for i, st in enumerate(self.states):
                st += other(i)
        elif isinstance(other, (list, tuple)):
            for st, x in zip(self.states, other):
                st += x
        else:
            for st in self.states:
                st += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        if not self.states:
            return
        self.parent.nodes.append(JoinNode(mode))
        for st in self.states:
            self.parent.outputs |= st.outputs


def split_arg_marks(text: str) -> list[Node]:
    """Split text at unbound-argument marks into text and argument nodes."""
    out: list[Node] = []
    pos = 0
    for m in _ARG_RE.finditer(text):
        if m.start() > pos:
            out.append(TextNode(text[pos:m.start()]))
        out.append(ArgNode(m.group(1)))
        pos = m.end()
    if pos < len(text):
        out.append(TextNode(text[pos:]))
    return out


def _mark_bound_args(nodes: list[Node], bound: dict[str, Any]) -> list[Node]:
    """Label where the bound string arguments' values appear in the text (the text
    itself is unchanged; a constant equal to an argument's value would be labelled
    too, which is harmless)."""
    values = sorted(((v, k) for k, v in bound.items() if isinstance(v, str) and v), key=lambda x: -len(x[0]))
    if not values:
        return nodes
    pattern = re.compile("|".join(re.escape(v) for v, _ in values))
    by_value = {v: k for v, k in values}
    out: list[Node] = []
    for n in nodes:
        if isinstance(n, TextNode):
            pos = 0
            for m in pattern.finditer(n.text):
                if m.start() > pos:
                    out.append(TextNode(n.text[pos:m.start()]))
                out.append(ArgNode(by_value[m.group(0)], m.group(0)))
                pos = m.end()
            if pos < len(n.text):
                out.append(TextNode(n.text[pos:]))
        elif isinstance(n, ForkNode):
            n.branches = [_mark_bound_args(b, bound) for b in n.branches]
            out.append(n)
        else:
            out.append(n)
    return out


def trace_program(fn: Callable[..., Any], name: str, arg_names: list[str], defaults: dict[str, Any],
                  kwargs: dict[str, Any], var_kwargs: bool = False) -> ProgramGraph:
    """Run ``fn`` on a :class:`TracingState`. Never raises for the body's sake: an
    error in the body ends the trace with a :class:`StopNode` naming it. A program
    with ``**kwargs`` (``var_kwargs``) takes other names too, as given arguments."""
    unknown = sorted(set(kwargs) - set(arg_names))
    if unknown and not var_kwargs:
        raise TypeError(f"{name}() got unexpected argument(s) {', '.join(unknown)}; its arguments: {', '.join(arg_names)}")
    arg_names = list(arg_names) + unknown
    given = {k: kwargs[k] if k in kwargs else defaults[k] for k in arg_names if k in kwargs or k in defaults}
    # the trace runs the body once more than the program does (run_batch plans with each
    # instance's arguments): it gets copies of plain data, never the caller's objects
    bound = {k: c for k, c in ((k, _traceable(v)) for k, v in given.items()) if c is not _OPAQUE}
    call_args = {k: bound.get(k, _ArgPlaceholder(k)) for k in arg_names}
    graph = ProgramGraph(name, list(arg_names), bound)
    state = TracingState(graph.nodes)
    token = _TRACING.set(name)
    try:
        fn(state, **call_args)
    except _StopTracing as e:
        graph.nodes.append(StopNode(str(e)))
    except Exception as e:  # noqa: BLE001 - the body may do anything with placeholders
        graph.nodes.append(StopNode(f"the body raised {type(e).__name__}: {e}"))
    finally:
        _TRACING.reset(token)
    graph.nodes[:] = _mark_bound_args(graph.nodes, bound)
    return graph


_OPAQUE = object()
_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def _traceable(value: Any, depth: int = 0) -> Any:
    """``value`` for a trace to use without touching the caller's: plain data (strings,
    numbers, None) as it is, lists / tuples / dicts / sets of plain data copied; anything
    else, ``_OPAQUE`` (the argument is then a placeholder, as SGLang's tracer passes for
    every argument). A one-shot iterator (``map(...)``, a generator) the trace consumed
    reached the real run empty, and a body's ``options.append(...)`` on the caller's list
    ran twice; an object's methods may do anything."""
    if isinstance(value, _PLAIN):  # immutable
        return value
    if depth > 8 or type(value) not in (list, tuple, dict, set, frozenset):
        return _OPAQUE
    if isinstance(value, dict):
        items = [(_traceable(k, depth + 1), _traceable(v, depth + 1)) for k, v in value.items()]
        return _OPAQUE if any(k is _OPAQUE or v is _OPAQUE for k, v in items) else dict(items)
    items = [_traceable(v, depth + 1) for v in value]
    return _OPAQUE if any(v is _OPAQUE for v in items) else type(value)(items)


# -- batches ----------------------------------------------------------------------------------------
@dataclass
class BatchPlan:
    """How a batch runs: ``prefixes[i]`` is instance i's text known before its first
    model call; ``order`` submits instances that share prefixes next to each other;
    ``pins`` are the shared prefixes to pin, deepest first, each with its instances."""

    prefixes: list[str]
    order: list[int]
    pins: list[tuple[str, list[int]]]


def plan_batch(graphs: list[ProgramGraph | None], template: ChatTemplate | None,
               min_pin_chars: int = MIN_PIN_CHARS, min_pin_share: float = MIN_PIN_SHARE,
               max_pins: int = MAX_PINS) -> BatchPlan:
    prefixes = []
    for g in graphs:
        try:
            prefixes.append(g.prefix_text(template) if g is not None else "")
        except ValueError:  # roles without a template, or a role misuse: run will say
            prefixes.append("")
    order = sorted(range(len(prefixes)), key=lambda i: prefixes[i])
    # every prefix shared by neighbours in sorted order is a node of the prefix tree
    candidates = {token_safe_cut(prefixes[a][: _common_prefix_len(prefixes[a], prefixes[b])])
                  for a, b in zip(order, order[1:])}
    min_group = max(2, math.ceil(min_pin_share * len(prefixes)))
    groups = {c: [i for i in order if prefixes[i].startswith(c)] for c in candidates if len(c) >= min_pin_chars}
    kept = {c: g for c, g in groups.items() if len(g) >= min_group}
    # a prefix that a kept one extends is covered by that one's lock (locks hold ancestors)
    pins = [(c, g) for c, g in kept.items() if not any(o != c and o.startswith(c) for o in kept)]
    pins.sort(key=lambda x: (-len(x[1]), -len(x[0])))
    return BatchPlan(prefixes, order, pins[:max_pins])


def token_safe_cut(text: str) -> str:
    """Cut ``text`` back to a point where tokenization cannot change when different
    text follows: right after a non-space character that whitespace follows in every
    continuation (word-level pre-tokenizers never merge across that point)."""
    if text and not text[-1].isspace():
        i = len(text) - 1
        while i >= 0 and not text[i].isspace():
            i -= 1
        text = text[: i + 1]
    return text.rstrip()


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
