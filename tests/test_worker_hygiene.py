"""The constrained-decoding compile worker never outlives its bounds: it dies with the
engine that started it, and it ends a build that runs past its own time limit even when
nobody is left to kill it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from plait.runtime.constrained.worker import read_frame, write_frame
from plait.runtime.server import launch

SLOW = r'"[^"\\]{0,800}"'  # seconds to build over a real vocabulary


def children(pid: int, needle: str) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and needle in cmd:
            out.append(int(entry))
    return out


def gone(pid: int, seconds: float) -> bool:
    for _ in range(int(seconds / 0.05)):
        try:
            with open(f"/proc/{pid}/status") as f:
                if "\nState:\tZ" in f.read():
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_worker_dies_with_a_killed_engine(tiny_model_factory):
    with launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096, restart_engine=False,
                echo_logs=False) as rt:
        with httpx.Client(base_url=rt.url, timeout=60) as http:
            # starts the worker and keeps it busy with a long build
            with pytest.raises(httpx.ReadTimeout):
                http.post("/generate", json={"text": "x", "sampling_params": {"regex": SLOW, "max_new_tokens": 4}},
                          timeout=1.0)
        workers = []
        for _ in range(200):
            workers = children(rt.engine_pid, "plait.runtime.constrained.worker")
            if workers:
                break
            time.sleep(0.05)
        assert workers, "the compile worker did not start"
        os.kill(rt.engine_pid, signal.SIGKILL)
        assert gone(workers[0], 5.0), "the compile worker outlived the engine"


def test_worker_enforces_its_own_time_limit(tokenizer_dir):
    """A worker whose engine never kills it ends a build past its limit by itself."""
    from transformers import AutoTokenizer

    from plait.runtime.constrained.vocab import TokenVocab

    vocab = TokenVocab.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir), [2], 49152)
    proc = subprocess.Popen([sys.executable, "-m", "plait.runtime.constrained.worker", "0", str(os.getpid())],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        write_frame(proc.stdin, ("vocab", vocab.fingerprint, vocab.outlines_eos_id, vocab.outlines_map()))
        assert read_frame(proc.stdout)[0] == "ready"
        write_frame(proc.stdin, ("build", 1, vocab.fingerprint, SLOW, 0.0, 0.5))
        assert proc.wait(timeout=30) == -signal.SIGXCPU  # the kernel's CPU limit, not us
    finally:
        proc.kill()
