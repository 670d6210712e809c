"""interegular automata built under a wall-time limit.

The front builds small character automata to check what a request gives it: that
``patternProperties`` keys are exclusive, that a ``whitespace_pattern`` matches only
whitespace. interegular determinizes in Python (``interegular.fsm.crawl``), and a short
pattern can have an exponential automaton (``^(a|b)*a(a|b){15}$`` has 2**16 states): one
such key held a front thread for minutes. Inside :func:`fsm_deadline` every automaton
interegular builds in that thread stops with :class:`FsmTooLarge` past the limit;
elsewhere it builds as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

MAX_FSM_S = 2.0  # wall time of the automata one check builds

_local = threading.local()
_install_lock = threading.Lock()
_original_crawl: Any = None


class FsmTooLarge(ValueError):
    """An automaton took longer than the limit to build."""


@contextmanager
def fsm_deadline(seconds: float | None = None) -> Iterator[None]:
    """Automata built in this thread inside the block raise :class:`FsmTooLarge` once
    ``seconds`` (default :data:`MAX_FSM_S`) have passed (an enclosing block's earlier
    deadline stays)."""
    _install()
    prev = getattr(_local, "deadline", None)
    mine = time.monotonic() + (MAX_FSM_S if seconds is None else seconds)
    _local.deadline = mine if prev is None else min(prev, mine)
    try:
        yield
    finally:
        _local.deadline = prev


def _install() -> None:
    global _original_crawl
    import interegular.fsm

    with _install_lock:
        if _original_crawl is None:
            _original_crawl = interegular.fsm.crawl
            interegular.fsm.crawl = _crawl  # FSM's operations call the module's crawl by name


def _crawl(alphabet: Any, initial: Any, final: Any, follow: Any) -> Any:
    """interegular's ``crawl`` (same states, same order), checking the thread's deadline
    as states are found."""
    from interegular.fsm import FSM, OblivionError

    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return _original_crawl(alphabet, initial, final, follow)
    states = [initial]
    finals = set()
    transitions: dict[int, dict[Any, int]] = {}
    i = 0
    while i < len(states):
        if i % 32 == 0 and time.monotonic() > deadline:
            raise FsmTooLarge(f"its automaton has more than {len(states)} states after the time limit")
        state = states[i]
        if final(state):
            finals.add(i)
        transitions[i] = {}
        for transition in alphabet.by_transition:
            try:
                nxt = follow(state, transition)
            except OblivionError:
                continue
            try:
                j = states.index(nxt)
            except ValueError:
                j = len(states)
                states.append(nxt)
            transitions[i][transition] = j
        i += 1
    return FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=transitions,
               __no_validation__=True)
