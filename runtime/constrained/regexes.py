"""Regex building blocks shared by the runtime, the language and the HTTP front.

Every regex here is written in the dialect both outlines-core (Rust ``regex``) and
interegular read: no look-around, no back-references, no ``\\p{..}``. Torch-free.
Patterns from users are checked by :func:`plait.regex.check_regex` (re-exported here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plait.regex import ascii_classes, check_regex  # noqa: F401  (runtime/sampling_params.py imports them from here)

# Characters with a meaning in a regex outside a class. Only these are escaped:
# Rust's regex treats some escaped punctuation as assertions (``\\<``, ``\\>``).
_META = set("\\.+*?()|[]{}^$")

# JSON numbers have at most 16 integer and 16 fraction digits (more is past float
# precision anyway): a model cannot loop on digits.
MAX_DIGITS = 16
INTEGER = r"-?(?:0|[1-9][0-9]{0,15})"
NUMBER = r"-?(?:0|[1-9][0-9]{0,15})(?:\.[0-9]{1,16})?(?:[eE][+-]?[0-9]{1,3})?"
BOOLEAN = r"(?:true|false)"
NULL = r"null"
# One character of a JSON string: anything but a quote, a backslash or a control
# character, or a short escape. (\\uXXXX escapes are left out: a lone surrogate
# half would make the output invalid.)
JSON_CHAR = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt])'
JSON_STRING = rf'"{JSON_CHAR}*"'


def escape(text: str) -> str:
    """A regex matching exactly ``text``."""
    return "".join("\\" + c if c in _META else c for c in text)


def union(parts: list[str]) -> str:
    """The alternation of ``parts``, grouped (so concatenating unions needs no more groups)."""
    parts = sorted(set(parts))
    return parts[0] if len(parts) == 1 else "(?:" + "|".join(parts) + ")"


def eliminate(edges: dict[tuple[Any, Any], list[str]], states: list[Any], *, max_chars: int,
              too_large: Callable[[], Exception], fixed_order: bool = False) -> dict[tuple[Any, Any], list[str]]:
    """State elimination over a generalized automaton: ``edges`` maps (from, to) to the
    regexes of its transitions; each of ``states`` is removed, its paths folded into
    its neighbours' edges, in the order given (``fixed_order``) or the state with the
    fewest paths through it first. Returns the edges left (between the states not
    eliminated); ``too_large()`` is raised once their regexes pass ``max_chars``."""
    outs: dict[Any, dict[Any, list[str]]] = {}
    ins: dict[Any, set[Any]] = {}

    def add(a: Any, b: Any, r: str) -> None:
        outs.setdefault(a, {}).setdefault(b, []).append(r)
        ins.setdefault(b, set()).add(a)

    for (a, b), rs in edges.items():
        for r in rs:
            add(a, b, r)
    total = sum(len(r) for rs in edges.values() for r in rs)
    todo = list(states) if fixed_order else set(states)
    while todo:
        if fixed_order:
            state = todo.pop(0)
        else:
            state = min(todo, key=lambda q: (len(ins.get(q, set()) - {q}) * len(set(outs.get(q, {})) - {q}), str(q)))
            todo.discard(state)
        loop = outs.get(state, {}).pop(state, [])
        ins.get(state, set()).discard(state)
        self_r = f"(?:{union(loop)})*" if loop and union(loop) else ""
        into = [(a, outs[a].pop(state)) for a in ins.pop(state, set())]
        out = list(outs.pop(state, {}).items())
        for b, _ in out:
            ins[b].discard(state)
        total -= sum(len(r) for rs in [loop] + [rs for _, rs in into] + [rs for _, rs in out] for r in rs)
        for a, ra in into:
            for b, rb in out:
                r = union(ra) + self_r + union(rb)
                add(a, b, r)
                total += len(r)
        if total > max_chars:
            raise too_large()
    return {(a, b): rs for a, row in outs.items() for b, rs in row.items()}
