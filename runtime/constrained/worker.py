"""The index-building process: ``python -m plait.runtime.constrained.worker MEM_MB``.

Reads length-prefixed pickled requests on stdin, answers on stdout:

- ``("vocab", key, eos_id, {bytes: [ids]})`` -> ``("ready", key)`` (keeps an outlines Vocabulary)
- ``("build", job, key, regex, jf_seconds, timeout_s)`` -> ``("ok", job, Index, CharAutomaton|None)``
  (the jump-forward automaton only if ``jf_seconds`` > 0 and it is built within the
  time left of them after the index)
  or ``("error", job, message)``

Its address space is capped at MEM_MB (``RLIMIT_AS``): a build that needs more dies,
and the engine reports the limit. The engine kills it on timeout, and the worker
enforces its own limits too, so it never outlives a dead engine's bounds: each build
runs under a CPU-time limit (``RLIMIT_CPU``: the kernel ends the process, even inside
native code), and the worker dies with its parent (parent-death signal and a pid
watch). Imports no torch.
"""

from __future__ import annotations

import pickle
import resource
import signal
import struct
import sys
import time
from typing import IO, Any

_HEADER = struct.Struct("<Q")


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


def _limit_cpu(seconds: float) -> None:
    """Let this process use ``seconds`` more CPU time, then be killed by SIGXCPU."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    total = used.ru_utime + used.ru_stime + seconds
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(total) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


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
    while True:
        msg = read_frame(inp)
        if msg is None:
            return
        if msg[0] == "vocab":
            _, key, eos_id, mapping = msg
            vocabs[key] = outlines_core.Vocabulary(eos_id, mapping)
            write_frame(out, ("ready", key))
            continue
        _, job, key, regex, jump_forward, timeout_s = msg
        _limit_cpu(timeout_s + 1.0)
        try:
            t0 = time.monotonic()
            index = outlines_core.Index(regex, vocabs[key])
            # jump-forward is an optimisation: its automaton (pure Python) gets a bounded
            # share of the time; without it the constraint works, unaccelerated
            budget = min(JUMP_FORWARD_BUDGET_S, jump_forward - (time.monotonic() - t0)) if jump_forward else 0.0
            auto = _with_alarm(budget, CharAutomaton.from_regex, regex) if budget > 0.05 else None
            reply: tuple = ("ok", job, index, auto)
        except MemoryError:
            reply = ("error", job, "memory")
        except Exception as e:
            reply = ("error", job, str(e))
        write_frame(out, reply)


if __name__ == "__main__":
    main(sys.argv)
