"""Random strings of a regex's language, generated from its parse tree (Python's own
regex parser), so it scales to the megabyte regexes of real schemas where building an
automaton would not. Used by tests/test_json_schema_coverage.py and the corpus section
of benchmarks/bench_constrained.py; each sample is also checked with ``re.fullmatch``
there, so a mistake here cannot hide an unsound regex.

The regexes plait writes (outlines-core's dialect minus look-around) parse the same in
Python's ``re``: ``(?:..)``, classes, ``{m,n}``, escapes."""

from __future__ import annotations

import random
import re
from typing import Any

try:
    from re import _constants as C, _parser as P  # Python 3.11+
except ImportError:  # pragma: no cover
    import sre_constants as C  # type: ignore[no-redef]
    import sre_parse as P  # type: ignore[no-redef]

# characters tried for negated classes and categories: printable ASCII, JSON's
# whitespace, a few multi-byte ones
POOL = [chr(c) for c in range(0x20, 0x7F)] + ["\t", "\n", "é", "ß", "日", "€", "😀"]


def _in_class(ch: str, items: list[tuple[Any, Any]]) -> bool:
    c, neg, hit = ord(ch), False, False
    for op, av in items:
        if op is C.NEGATE:
            neg = True
        elif op is C.LITERAL:
            hit |= c == av
        elif op is C.RANGE:
            hit |= av[0] <= c <= av[1]
        elif op is C.CATEGORY:
            hit |= bool(re.fullmatch(_CATEGORY[av], ch))
        else:
            raise ValueError(f"unsupported class item {op}")
    return hit != neg


_CATEGORY = {C.CATEGORY_DIGIT: r"\d", C.CATEGORY_NOT_DIGIT: r"\D", C.CATEGORY_SPACE: r"\s",
             C.CATEGORY_NOT_SPACE: r"\S", C.CATEGORY_WORD: r"\w", C.CATEGORY_NOT_WORD: r"\W"}


def _pick_class(items: list[tuple[Any, Any]], rng: random.Random) -> str:
    if items and items[0][0] is not C.NEGATE and rng.random() < 0.7:  # a listed member
        op, av = rng.choice(items)
        if op is C.LITERAL:
            return chr(av)
        if op is C.RANGE:
            return chr(rng.randint(av[0], min(av[1], av[0] + 0x2000)))
    options = [ch for ch in POOL if _in_class(ch, items)]
    if not options:
        raise ValueError("a character class with no member in the sample pool")
    return rng.choice(options)


class _Gen:
    def __init__(self, rng: random.Random, mean_repeat: float) -> None:
        self.rng = rng
        self.mean_repeat = mean_repeat

    def seq(self, nodes: Any, out: list[str]) -> None:
        for op, av in nodes:
            self.node(op, av, out)

    def node(self, op: Any, av: Any, out: list[str]) -> None:
        rng = self.rng
        if op is C.LITERAL:
            out.append(chr(av))
        elif op is C.NOT_LITERAL:
            out.append(rng.choice([ch for ch in POOL if ord(ch) != av]))
        elif op is C.IN:
            out.append(_pick_class(av, rng))
        elif op is C.ANY:
            out.append(rng.choice([ch for ch in POOL if ch != "\n"]))
        elif op is C.BRANCH:
            self.seq(rng.choice(av[1]), out)
        elif op is C.SUBPATTERN:
            self.seq(av[-1], out)
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT, getattr(C, "POSSESSIVE_REPEAT", None)):
            lo, hi, body = av
            n = lo
            if hi is C.MAXREPEAT or hi > lo:
                top = lo + 8 if hi is C.MAXREPEAT else hi
                while n < top and rng.random() < self.mean_repeat / (1 + self.mean_repeat):
                    n += 1
            for _ in range(n):
                self.seq(body, out)
        elif op is C.CATEGORY:
            out.append(rng.choice([ch for ch in POOL if re.fullmatch(_CATEGORY[av], ch)]))
        elif op is C.AT:
            pass  # anchors: plait's regexes match whole outputs anyway
        else:
            raise ValueError(f"unsupported regex construct {op}")


def sample(regex: str, n: int, seed: int = 0, mean_repeat: float = 1.5) -> list[str]:
    """``n`` random strings matched in full by ``regex`` (repeats short on average)."""
    tree = P.parse(regex)
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts: list[str] = []
        _Gen(rng, mean_repeat).seq(tree, parts)
        out.append("".join(parts))
    return out
