"""The index-building process: ``python -m plait.runtime.constrained.worker MEM_MB``.

Reads length-prefixed pickled requests on stdin, answers on stdout:

- ``("vocab", key, eos_id, {bytes: [ids]})`` -> ``("ready", key)`` (keeps an outlines Vocabulary)
- ``("build", job, key, regex, jf_seconds, timeout_s)`` ->
  ``("ok", job, Index, CharAutomaton|None, sentinel_id|None)`` (the jump-forward
  automaton only if ``jf_seconds`` > 0 and it is built within the time left of them
  after the index; the sentinel below) or ``("error", job, message)``

**The end sentinel.** outlines-core (0.2.x) drops every token that leads out of a state
where the pattern could already end into one where it cannot yet (its DFA reports a
match one byte late, and a token whose last byte leaves a match state is taken for
neither an intermediate nor a matching step): with ``[0-9]+([.][0-9]+)?`` the token
``.`` after ``3`` was never allowed, so a float never got its decimal point, and
``(ab)?`` could not write ``a``. So the index is built for ``(?:regex)`` followed by
:data:`SENTINEL` (U+10FFFF, a noncharacter no text holds), with a pseudo-token (its id
in the reply, past every real id) for it: no state but the sentinel's end is a match
state, so no token is dropped, and a state is final for ``regex`` exactly when the
pseudo-token may follow and ends the match there (a pattern that allows U+10FFFF itself,
in a JSON string, takes it elsewhere too) (``compiler.CompiledGrammar`` reads it so and never offers the
pseudo-token, nor any real token holding the sentinel's first byte, 0xF4: U+100000 to
U+10FFFF, private use plane 16, cannot be written). A pattern that names a character of
that plane itself is built without the sentinel, and so is one whose build with it runs
past a budget (``SENTINEL_MIN_S``) where the jump-forward automaton was not built: the
plain index, with outlines-core's gap, serves it. Where the automaton shows that a match
can go on (the gap would cut replies), the build gets ``SENTINEL_NEEDED_S``, and where
it fails (its memory limit: some patterns need far more than their plain index, an int64
range's tens of GB) the constraint is refused (:data:`GAP_REFUSAL`); one past its time
(which a busy machine may cause) is served by the plain index as before.

Its address space is capped at MEM_MB (``RLIMIT_AS``): a build that needs more dies,
and the engine reports the limit. The engine kills it on timeout, and the worker
enforces its own limits too, so it never outlives a dead engine's bounds: each build
runs under a CPU-time limit (``RLIMIT_CPU``: the kernel ends the process, even inside
native code), and the worker dies with its parent (parent-death signal and a pid
watch). Imports no torch.
"""

from __future__ import annotations

import os
import pickle
import re
import resource
import select
import signal
import struct
import sys
import time
from typing import IO, Any

_HEADER = struct.Struct("<Q")

SENTINEL = "\U0010FFFF"  # see the module docstring
# the index with the sentinel is built after the plain one, in a child, within
# max(SENTINEL_MIN_S, SENTINEL_FACTOR x the plain build) (and a third of the limit): on
# some patterns it is far slower (a recursive schema's regex: 1.5 s plain, past 200 s),
# and then the plain index serves
SENTINEL_MIN_S = 1.0
SENTINEL_NEEDED_S = 5.0  # ... and where the plain index would cut replies (or a sixth of the limit)
SENTINEL_FACTOR = 5.0  # (and only for a pattern whose matches can go on: CharAutomaton.extends_past_a_match)
SENTINEL_FIRST_BYTE = SENTINEL.encode()[0]  # 0xF4
GAP_REFUSAL = ("outlines-core's whole index for it needs more than the memory limit (grammar_compile_memory_mb; "
               "some patterns, such as long counted digit runs in alternatives, need tens of GB), and its partial "
               "index drops the tokens that continue a match past a point where it could end, cutting replies short; "
               "grammar_backend 'llguidance' compiles it")
# a pattern naming a character of plane 16 (literally or by escape) is built without it
_PLANE16 = re.compile(r"[\U00100000-\U0010FFFF]|\\U0010[0-9a-fA-F]{4}|\\[xuU]\{0*10[0-9a-fA-F]{4}\}")


def uses_sentinel(regex: str) -> bool:
    """Whether ``regex`` is built with the end sentinel (module docstring)."""
    return _PLANE16.search(regex) is None


def write_frame(out: IO[bytes], msg: Any) -> None:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def read_frame(inp: IO[bytes]) -> Any | None:
    """The next message, or None at end of stream."""
    head = _read_exact(inp, _HEADER.size)
    if head is None:
        return None
    data = _read_exact(inp, _HEADER.unpack(head)[0])
    return None if data is None else pickle.loads(data)


def _read_exact(inp: IO[bytes], n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = inp.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


JUMP_FORWARD_BUDGET_S = 10.0


class _Alarm(Exception):
    pass


def _with_alarm(seconds: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)``, or None if it runs past ``seconds`` (SIGALRM; main thread only)."""

    def ring(signum: int, frame: Any) -> None:
        raise _Alarm

    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return fn(*args)
    except _Alarm:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


TIMED_OUT = object()  # _in_child's answer for a child past its time


def _in_child(seconds: float, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` computed in a forked child and unpickled here; None if the child
    fails (its memory limit), :data:`TIMED_OUT` if it runs past ``seconds`` (then it is
    killed: native code ignores SIGALRM)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write, leave without cleanup of the parent's state
        code = 1
        try:
            os.close(r)
            data = pickle.dumps(fn(*args), protocol=pickle.HIGHEST_PROTOCOL)
            with os.fdopen(w, "wb") as f:
                f.write(data)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    timed_out = False
    deadline = time.monotonic() + seconds
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                timed_out = True
                break
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if timed_out:
        return TIMED_OUT
    if not chunks or not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        return None
    return pickle.loads(b"".join(chunks))


def _limit_cpu(seconds: float) -> None:
    """Let this process use ``seconds`` more CPU time, then be killed by SIGXCPU."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    total = used.ru_utime + used.ru_stime + seconds
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(total) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


MAX_REPEAT_EXPANSION = 10_000  # positions one counted repetition adds to the automaton outlines builds


def counted_repetition_too_large(regex: str) -> str | None:
    """Why ``regex`` is refused before its build, or None: a counted repetition
    (``{n}``, ``{n,}``, ``{n,m}``) that adds more than :data:`MAX_REPEAT_EXPANSION`
    positions (copies of what it repeats, each counted with the repetitions inside it).
    outlines-core writes every copy into its automaton and walks the vocabulary from each
    state: ``a{100000}`` ran into the time limit, holding the one compile worker all that
    time. Checked here, before the build (one linear pass: a second for a megabyte
    regex, kept off the engine loop); the dialect is checked at the edge (an unknown
    construct counts as one position)."""
    frames = [[0, 0]]  # per open group: [its positions so far, the size of its last item]
    i, n = 0, len(regex)
    while i < n:
        c, top = regex[i], frames[-1]
        size = 1
        if c == "\\":
            j = i + 2
            if regex[i + 1:i + 2] in ("x", "u", "U", "p", "P") and regex[j:j + 1] == "{":
                j = regex.find("}", j) + 1 or n
            i = j
        elif c == "[":
            j = i + 1 + (regex[i + 1:i + 2] == "^")
            j += regex[j:j + 1] == "]"  # a ']' first is a member
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            i = j + 1
        elif c == "(":
            i += 1
            if regex.startswith("?", i):  # (?:..), (?i:..), (?P<name>..): past the opening; (?i): no item
                k = i + 1
                while k < n and regex[k] not in ":)<":
                    k += 1
                if regex[k:k + 1] == ")":
                    i = k + 1
                    top[1] = 0
                    continue
                i = k + 1 if regex[k:k + 1] == ":" else regex.find(">", k) + 1 or n
            frames.append([0, 0])
            continue
        elif c == ")" and len(frames) > 1:
            size = frames.pop()[0]
            top = frames[-1]
            i += 1
        elif c == "|":
            top[1] = 0
            i += 1
            continue
        elif c in "*+?":
            i += 1
            continue
        elif c == "{" and (m := _COUNTED.match(regex, i)):
            lo, comma, hi = m.groups()
            copies = int(hi) if hi else int(lo) + (1 if comma else 0)
            added = top[1] * max(copies - 1, 0)
            if added > MAX_REPEAT_EXPANSION:
                return (f"the counted repetition {m.group()} at position {i} adds {added} positions to the automaton "
                        f"outlines builds; allowed: at most {MAX_REPEAT_EXPANSION} (fewer copies, or grammar_backend "
                        "llguidance, which does not write each copy out)")
            top[0] += added
            top[1] += added
            i = m.end()
            continue
        else:
            i += 1
        top[0] += size
        top[1] = size
    return None


_COUNTED = re.compile(r"\{([0-9]+)(,?)([0-9]*)\}")  # any number of digits: {0,9007199254740991} counts


def main(argv: list[str]) -> None:
    from plait.runtime.process import exit_when_parent_is_gone, set_parent_death_signal

    set_parent_death_signal()
    if len(argv) > 2:
        exit_when_parent_is_gone(int(argv[2]))
    mem_mb = int(argv[1]) if len(argv) > 1 else 0
    if mem_mb > 0:
        limit = mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames goes to the engine

    import outlines_core

    from plait.runtime.constrained.jump_forward import CharAutomaton

    vocabs: dict[str, Any] = {}
    # key -> (the vocabulary with the sentinel pseudo-token, its id)
    sentinel_vocabs: dict[str, tuple[Any, int]] = {}
    while True:
        msg = read_frame(inp)
        if msg is None:
            return
        if msg[0] == "vocab":
            _, key, eos_id, mapping = msg
            vocabs[key] = outlines_core.Vocabulary(eos_id, mapping)
            pseudo = max([eos_id, *(i for ids in mapping.values() for i in ids)]) + 1
            sentinel_vocabs[key] = (outlines_core.Vocabulary(eos_id, {**mapping, SENTINEL.encode(): [pseudo]}), pseudo)
            write_frame(out, ("ready", key))
            continue
        _, job, key, regex, jump_forward, timeout_s = msg
        _limit_cpu(timeout_s + 1.0)
        try:
            t0 = time.monotonic()
            too_large = counted_repetition_too_large(regex)
            if too_large is not None:
                raise ValueError(too_large)
            index, sentinel = outlines_core.Index(regex, vocabs[key]), None
            plain_s = time.monotonic() - t0
            # jump-forward is an optimisation: its automaton (pure Python) gets a bounded
            # share of the time; without it the constraint works, unaccelerated
            budget = min(JUMP_FORWARD_BUDGET_S, jump_forward - plain_s) if jump_forward else 0.0
            auto = _with_alarm(budget, CharAutomaton.from_regex, regex) if budget > 0.05 else None
            # the sentinel build only where a match can go on (the automaton, when built, tells:
            # a JSON object's regex cannot, and its index is the plain one)
            if uses_sentinel(regex) and (auto is None or auto.extends_past_a_match()):
                vocab, pseudo = sentinel_vocabs[key]
                left = timeout_s - (time.monotonic() - t0)
                # where the automaton shows a match that goes on, the plain index would cut
                # replies short: the sentinel build gets longer, and where it fails (not where
                # it runs out of time, which load may cause) the constraint is refused
                needed = auto is not None
                least = max(SENTINEL_NEEDED_S, timeout_s / 6) if needed else SENTINEL_MIN_S
                budget = min(max(least, SENTINEL_FACTOR * plain_s), timeout_s / 3, left / 2)
                fixed = _in_child(budget, outlines_core.Index, f"(?:{regex}){SENTINEL}", vocab) if budget > 0 else None
                if fixed is None and needed:  # it failed, past the memory limit: not a matter of load
                    raise ValueError(GAP_REFUSAL)
                if fixed is not None and fixed is not TIMED_OUT:
                    index, sentinel = fixed, pseudo
            reply: tuple = ("ok", job, index, auto, sentinel)
        except MemoryError:
            reply = ("error", job, "memory")
        except Exception as e:
            reply = ("error", job, str(e))
        write_frame(out, reply)


if __name__ == "__main__":
    main(sys.argv)
