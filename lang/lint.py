"""Prompt-layout lint: dynamic values placed before long constant text.

The prefix cache shares a prompt's KV only up to the first token where two prompts
differ. A value that changes per call (an argument such as a timestamp or a user id,
or a model output) placed before a long constant instruction makes every instance
recompute that instruction: moved after it, the instruction would be shared.

:func:`lint_graph` reads a traced program (:class:`~plait.tracer.ProgramGraph`) and
reports, for each dynamic value followed by at least ``min_tokens`` of constant text
before the next model call, where it is and how many tokens of reuse it costs each
instance. Tokens are estimated from the text (``CHARS_PER_TOKEN`` characters a token,
English BPE's average) unless a ``count_tokens`` function is given. Arguments with the
same value in every instance of a batch are constants here (they are shared).

Values the program computes itself (``f"Time: {datetime.now()}"``) look like constant
text in one trace; given a second trace of the same call (``again``), the text that
differs between the two is a changing value as well (:func:`mark_changing`). A value
that happens to be equal in both traces (``date.today()``) is not seen here; the
runtime's early-divergence counter (``/metrics``) sees it in served traffic.

``plait lint module:function`` runs it from the command line; ``run_batch`` warns
with :class:`PromptLayoutWarning`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from plait.tracer import ArgNode, ForkNode, GenNode, JoinNode, Node, ProgramGraph, RoleNode, SelectNode, StopNode, TextNode

CHARS_PER_TOKEN = 4
DEFAULT_MIN_TOKENS = 32


class PromptLayoutWarning(UserWarning):
    """A dynamic value before long constant text (see :mod:`plait.lint`)."""


@dataclass
class LayoutIssue:
    program: str
    value: str  # "argument 'now'" or "output of gen 'answer'"; several: "argument 'a', argument 'b'"
    offset: int  # characters of constant text before the (first) value; values' own lengths are not known
    tokens_lost: int  # estimated tokens of constant text after it, recomputed per instance
    following: str  # the start of that text
    count: int = 1  # dynamic values (arguments, model outputs) no earlier report named, all before that text

    def __str__(self) -> str:
        verb = "comes" if self.count == 1 else "come"
        return (f"{self.program}: {self.value}, after {self.offset} characters of constant text, {verb} before "
                f"~{self.tokens_lost} tokens of constant text ({self.following!r}...); every instance recomputes them. "
                "Put the constant text first to share its KV across calls.")


@dataclass
class ChangingText:
    """Text the program computed that differed between two traces of the same call."""

    text: str


def mark_changing(nodes: list[Node], again: list[Node]) -> list[Node]:
    """``nodes`` with the text that differs in ``again`` (a second trace of the same
    call) as :class:`ChangingText`: each differing text node split into its common start,
    the changing middle and its common end. Compared node by node up to where the two
    traces stop having the same shape (the rest is kept as it is)."""
    out: list[Node] = []
    for i, n in enumerate(nodes):
        m = again[i] if i < len(again) else None
        if type(m) is not type(n):
            return out + nodes[i:]
        if isinstance(n, TextNode) and n.text != m.text:
            a, b = n.text, m.text
            start = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            end = 0
            while end < min(len(a), len(b)) - start and a[len(a) - 1 - end] == b[len(b) - 1 - end]:
                end += 1
            stop = len(a) - end
            # widen to the whole value ("2026-12-02T09:00:01.5", not the digits that differed)
            while start > 0 and (a[start - 1].isalnum() or a[start - 1] in "-:._+"):
                start -= 1
            while stop < len(a) and a[stop].isalnum():
                stop += 1
            out += [TextNode(a[:start]), ChangingText(a[start:stop]), TextNode(a[stop:])]
        elif isinstance(n, ForkNode) and len(n.branches) == len(m.branches):
            out.append(ForkNode(n.size, [mark_changing(x, y) for x, y in zip(n.branches, m.branches)]))
        else:
            out.append(n)
    return out


def _describe(n: Node) -> str | None:
    """What makes ``n`` differ between calls, or None if it is constant."""
    if isinstance(n, ChangingText):
        return f"text that changes from call to call ({n.text[:24]!r}: computed in the program, e.g. a timestamp)"
    if isinstance(n, ArgNode):
        return f"argument {n.name!r}" if n.value is None else None
    if isinstance(n, GenNode):
        return f"output of gen {n.name!r}" if n.name else "output of a gen"
    if isinstance(n, SelectNode):
        return f"output of select {n.name!r}" if n.name else "output of a select"
    return None


def _constant_text(n: Node) -> str | None:
    if isinstance(n, TextNode):
        return n.text
    if isinstance(n, ArgNode) and n.value is not None:
        return n.value
    if isinstance(n, RoleNode):
        return ""  # the template's role text is constant too, but not counted
    return None


def lint_graph(graph: ProgramGraph, min_tokens: int = DEFAULT_MIN_TOKENS,
               count_tokens: Callable[[str], int] | None = None,
               again: ProgramGraph | None = None) -> list[LayoutIssue]:
    """The layout issues of ``graph``; ``again``: a second trace of the same call, whose
    differences from ``graph`` are values the program computes (:func:`mark_changing`)."""
    count = count_tokens or (lambda text: len(text) // CHARS_PER_TOKEN)
    issues: list[LayoutIssue] = []
    nodes = graph.nodes if again is None else mark_changing(graph.nodes, again.nodes)

    def scan(nodes: list[Node], offset: int, pending: list[tuple[str, int]]) -> None:
        # pending: the dynamic values (description, offset), model outputs included, that
        # no report has named yet; every one of them keeps the text after it from being
        # shared, so a report names them all (moving only the last would not help)
        pending = list(pending)
        for i, n in enumerate(nodes):
            if isinstance(n, ForkNode):
                for branch in n.branches:
                    scan(branch, offset, pending)
                continue
            if isinstance(n, (StopNode, JoinNode)):
                return
            what = _describe(n)
            if what is None:
                offset += len(_constant_text(n) or "")
                continue
            # a model call's output is one more value: the text after it is shared only when it
            # moves before the call and before every unreported value that came earlier
            pending.append((what, offset))
            after: list[str] = []
            for m in nodes[i + 1 :]:
                text = _constant_text(m)
                if text is None:
                    break
                after.append(text)
            following = "".join(after)
            tokens = count(following)
            if tokens >= min_tokens:
                issues.append(LayoutIssue(graph.name, ", ".join(w for w, _ in pending), pending[0][1], tokens,
                                          following.strip()[:40], len(pending)))
                pending = []

    scan(nodes, 0, [])
    return issues


def shared_arguments(instances: list[dict[str, object]]) -> dict[str, object]:
    """Arguments every instance gives the same value (constants for the batch)."""
    if not instances:
        return {}
    first = instances[0]
    return {k: v for k, v in first.items() if all(k in inst and inst[k] == v for inst in instances[1:])}
