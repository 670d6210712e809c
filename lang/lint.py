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
    value: str  # "argument 'now'" or "output of gen 'answer'"
    offset: int  # characters of known text before the value
    tokens_lost: int  # estimated tokens of constant text after it, recomputed per instance
    following: str  # the start of that text

    def __str__(self) -> str:
        return (f"{self.program}: {self.value} at character {self.offset} comes before ~{self.tokens_lost} tokens of "
                f"constant text ({self.following!r}...); every instance recomputes them. Put the constant text first "
                "to share its KV across calls.")


def _describe(n: Node) -> str | None:
    """What makes ``n`` differ between calls, or None if it is constant."""
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
               count_tokens: Callable[[str], int] | None = None) -> list[LayoutIssue]:
    count = count_tokens or (lambda text: len(text) // CHARS_PER_TOKEN)
    issues: list[LayoutIssue] = []

    def scan(nodes: list[Node], offset: int) -> None:
        for i, n in enumerate(nodes):
            if isinstance(n, ForkNode):
                for branch in n.branches:
                    scan(branch, offset)
                continue
            if isinstance(n, (StopNode, JoinNode)):
                return
            what = _describe(n)
            if what is None:
                offset += len(_constant_text(n) or "")
                continue
            after: list[str] = []
            for m in nodes[i + 1 :]:
                text = _constant_text(m)
                if text is None:
                    break
                after.append(text)
            following = "".join(after)
            tokens = count(following)
            if tokens >= min_tokens:
                issues.append(LayoutIssue(graph.name, what, offset, tokens, following.strip()[:40]))

    scan(graph.nodes, 0)
    return issues


def shared_arguments(instances: list[dict[str, object]]) -> dict[str, object]:
    """Arguments every instance gives the same value (constants for the batch)."""
    if not instances:
        return {}
    first = instances[0]
    return {k: v for k, v in first.items() if all(k in inst and inst[k] == v for inst in instances[1:])}
