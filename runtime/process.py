"""Child-process hygiene shared by the engine and the compile worker (torch-free)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends ``sig`` to this process when the thread that started it
    exits (works even while this process runs native code)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        except OSError:
            pass


def exit_when_parent_is_gone(parent_pid: int, interval_s: float = 0.5) -> None:
    """A backup for the parent-death signal (other platforms, or a parent that was
    re-parented before the signal was set): a daemon thread that exits the process
    once its parent pid changes."""
    if os.getppid() != parent_pid:
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)

    threading.Thread(target=watch, name="plait-parent-watch", daemon=True).start()


def freeze_startup_objects() -> int:
    """Move every object alive now (a loaded model's modules and tensors' wrappers, the
    tokenizer's tables, imported modules: ~850k objects in the engine process with the
    default model) out of the garbage collector's generations, as vLLM and SGLang do once
    a server has started. Otherwise the collector's full (generation 2) passes, which
    the objects made while serving still trigger, walk all of them: 110-280 ms pauses
    measured in the engine process on the 2-core Xeon, each a stall of every stream.
    Returns how many objects were frozen."""
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
