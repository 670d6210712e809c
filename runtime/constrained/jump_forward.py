"""Jump-forward: where a constraint admits exactly one continuation, write it without
asking the model.

The character automaton comes from interegular (a DFA over characters, with
equivalence classes of characters as its alphabet). It is compressed to what
jump-forward needs: for every live state, the longest string of forced characters
that follows it (a state is forced when it is not final and has exactly one live
transition, on a class of exactly one character). Torch-free.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MAX_FORCED_CHARS = 512  # one jump writes at most this much text


@dataclass
class CharAutomaton:
    """A DFA over characters with its forced strings. States are ints; dead states are
    removed, so a missing transition means the text left the language."""

    initial: int
    finals: frozenset[int]
    transitions: dict[int, dict[int, int]]  # state -> class -> state (live states only)
    classes: dict[str, int]  # character -> class
    other: int | None  # class of every character not in ``classes``
    forced: dict[int, str] = field(default_factory=dict)  # state -> forced text (non-empty)

    @classmethod
    def from_regex(cls, pattern: str) -> "CharAutomaton | None":
        """The automaton of ``pattern``, or None when interegular cannot read it (then
        there is no jump-forward for that constraint, decoding is unaffected)."""
        import interegular
        from interegular.fsm import anything_else

        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception:
            return None
        live = _live_states(fsm.map, fsm.finals)
        if fsm.initial not in live:
            return None
        transitions = {
            s: {k: t for k, t in fsm.map.get(s, {}).items() if t in live} for s in live
        }
        classes: dict[str, int] = {}
        other = None
        by_class: dict[int, list] = {}
        for sym, k in fsm.alphabet.items():
            by_class.setdefault(k, []).append(sym)
            if sym is anything_else:
                other = k
            else:
                classes[sym] = k
        single = {k: syms[0] for k, syms in by_class.items() if len(syms) == 1 and syms[0] is not anything_else}
        auto = cls(fsm.initial, frozenset(fsm.finals) & live, transitions, classes, other)
        for s in live:
            text = auto._forced_from(s, single)
            if text:
                auto.forced[s] = text
        return auto

    def _forced_from(self, s: int, single: dict[int, str]) -> str:
        out: list[str] = []
        while s not in self.finals and len(self.transitions[s]) == 1 and len(out) < MAX_FORCED_CHARS:
            (k, t), = self.transitions[s].items()
            if k not in single:
                break
            out.append(single[k])
            s = t
        return "".join(out)

    def extends_past_a_match(self) -> bool:
        """Whether some match of the pattern is the start of a longer one (a final state
        with a way on): where outlines-core's index drops tokens (``worker.py``)."""
        return any(self.transitions.get(s) for s in self.finals)

    def step(self, state: int, char: str) -> int | None:
        k = self.classes.get(char, self.other)
        if k is None:
            return None
        return self.transitions[state].get(k)

    def walk(self, state: int, text: str) -> int | None:
        for c in text:
            nxt = self.step(state, c)
            if nxt is None:
                return None
            state = nxt
        return state


def _live_states(fsm_map: dict[int, dict[int, int]], finals: frozenset[int]) -> set[int]:
    """States from which a final state can be reached."""
    reverse: dict[int, set[int]] = {}
    for s, row in fsm_map.items():
        for t in row.values():
            reverse.setdefault(t, set()).add(s)
    live = set(finals)
    todo = deque(finals)
    while todo:
        t = todo.popleft()
        for s in reverse.get(t, ()):
            if s not in live:
                live.add(s)
                todo.append(s)
    return live


class CharTracker:
    """Follows a request's constrained text through a ``CharAutomaton``, byte by byte
    (tokens may split a UTF-8 character). ``state`` is None once the text left the
    automaton (a dialect difference with outlines-core): jump-forward then stops for
    that request, decoding goes on under the index."""

    __slots__ = ("auto", "state", "pending")

    def __init__(self, auto: CharAutomaton) -> None:
        self.auto = auto
        self.state: int | None = auto.initial
        self.pending = b""  # bytes of an incomplete UTF-8 character

    def snapshot(self) -> tuple[int | None, bytes]:
        return self.state, self.pending

    def restore(self, snap: tuple[int | None, bytes]) -> None:
        self.state, self.pending = snap

    def feed(self, data: bytes) -> None:
        if self.state is None:
            return
        buf = self.pending + data
        try:
            text, self.pending = buf.decode("utf-8"), b""
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data":
                self.state = None
                return
            text, self.pending = buf[: e.start].decode("utf-8"), buf[e.start :]
        self.state = self.auto.walk(self.state, text)

    def forced(self) -> str:
        """The text the constraint forces next ('' if none or unknown)."""
        if self.state is None or self.pending:
            return ""
        return self.auto.forced.get(self.state, "")
