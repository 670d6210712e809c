"""``launch()``: start the runtime (front + engine processes) as a sidecar of this process."""

from __future__ import annotations

import collections
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import IO, Any

from plait.runtime.server.args import ServerArgs

LOG_TAIL_LINES = 40


class _LogPump(threading.Thread):
    """Forwards the server's output to this process's stderr and keeps its tail for
    error messages."""

    def __init__(self, stream: IO[bytes], echo: bool) -> None:
        super().__init__(daemon=True, name="plait-server-log")
        self.stream = stream
        self.echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)

    def run(self) -> None:
        for raw in iter(self.stream.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.tail.append(line.rstrip("\n"))
            if self.echo:
                try:
                    sys.stderr.write(line)
                except (ValueError, OSError):  # stderr closed at interpreter exit
                    pass
        self.stream.close()


def _stop(proc: subprocess.Popen, timeout: float, private_dir: str | None = None) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if private_dir is not None:  # the server removes it itself, unless it was killed
        shutil.rmtree(private_dir, ignore_errors=True)


def _private_ipc_dir(zmq_address: str) -> str | None:
    """The folder of the server's own ipc sockets (``serve`` makes one per run under the
    temp dir, named ``plait-*``), or None for an address the user chose."""
    if not zmq_address.startswith("ipc://"):
        return None
    folder = os.path.dirname(zmq_address[len("ipc://"):])
    if os.path.basename(folder).startswith("plait-") and os.path.dirname(folder) == tempfile.gettempdir():
        return folder
    return None


class RuntimeProcess:
    """A running plait server: ``url`` (HTTP base), ``zmq_address`` (for language
    clients), ``pid`` (front process), ``engine_pid`` (the first engine replica's) and
    ``engine_pids`` (all of them, ``dp_size`` > 1). ``shutdown()`` stops every process;
    so does leaving a ``with`` block, or this process exiting."""

    def __init__(self, proc: subprocess.Popen, info: dict[str, Any], args: ServerArgs, pump: _LogPump) -> None:
        self._proc = proc
        self._pump = pump
        self.args = args
        self.url: str = info["url"]
        self.zmq_address: str = info["zmq_address"]
        self.pid: int = info["pid"]
        self.engine_pid: int = info["engine_pid"]
        self.engine_pids: list[int] = info["engine_pids"]  # one per --dp-size replica, engine_pid first
        self._private_dir = None if args.zmq_address else _private_ipc_dir(self.zmq_address)
        self._finalizer = weakref.finalize(self, _stop, proc, 15.0, self._private_dir)

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def log_tail(self) -> str:
        return "\n".join(self._pump.tail)

    def shutdown(self, timeout: float = 15.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL after ``timeout`` s); returns its exit code."""
        self._finalizer.detach()
        _stop(self._proc, timeout, self._private_dir)
        self._pump.join(timeout=2)
        return self._proc.returncode

    def __enter__(self) -> "RuntimeProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"RuntimeProcess(url={self.url!r}, zmq_address={self.zmq_address!r}, pid={self.pid})"


def launch(model: str | None = None, *, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 600.0,
           echo_logs: bool = True, **options: Any) -> RuntimeProcess:
    """Start a plait server in a child process and return once it serves.

    ``options`` are the other server options (``api_key``, ``served_model_name``,
    ``zmq_address``, ``log_level``) and the engine's (:class:`EngineConfig` fields, such
    as ``kv_cache_tokens`` or ``num_threads``), by plait's names or SGLang's
    (``model_path``, ``max_total_tokens``, ``random_seed``, ``tp_size=1`` ...: see
    :mod:`plait.runtime.server.sglang_options`). Bad options raise ``ValueError`` here;
    a server that cannot start (a bad model path, a port in use) raises
    ``RuntimeError`` with its error text; one that is not up within
    ``startup_timeout`` seconds is killed and raises ``TimeoutError``. The server's log
    goes to this process's stderr unless ``echo_logs`` is False.
    """
    args = ServerArgs.from_kwargs(model, host=host, port=port, **options)
    if args.engine.node_rank > 0:
        raise ValueError(f"node_rank={args.engine.node_rank} is invalid for launch(); allowed: 0 (node 0 serves; "
                         f"another node runs no server: start it with `plait serve --node-rank "
                         f"{args.engine.node_rank} ...`)")
    read_fd, write_fd = os.pipe()
    # validated here, once: the server process rebuilds them without checking again
    cmd = [sys.executable, "-m", "plait.runtime.server", "--ready-fd", str(write_fd),
           "--parent-pid", str(os.getpid()), "--validated-args", args.to_json()]
    try:
        proc = subprocess.Popen(cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT)
    finally:
        os.close(write_fd)
    pump = _LogPump(proc.stdout, echo_logs)
    pump.start()
    try:
        line = _read_ready(read_fd, proc, startup_timeout)
    except BaseException:
        _stop(proc, 5.0)
        raise
    finally:
        os.close(read_fd)
    info = json.loads(line) if line else {}
    if "url" not in info:
        try:
            proc.wait(10)  # it reported and is cleaning up; let it finish
        except subprocess.TimeoutExpired:
            pass
        _stop(proc, 5.0)
        pump.join(timeout=2)
        reason = info.get("error") or f"the server process exited with code {proc.returncode} before it was ready"
        tail = "\n".join(pump.tail)
        raise RuntimeError(f"plait server failed to start: {reason}" + (f"\n--- server log ---\n{tail}" if tail else ""))
    return RuntimeProcess(proc, info, args, pump)


def _read_ready(fd: int, proc: subprocess.Popen, timeout: float) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"plait server did not start within {timeout:.0f} s")
        ready, _, _ = select.select([fd], [], [], min(left, 0.2))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:  # the child closed its end: it exited (or reported)
                break
            buf += chunk
    return buf.decode("utf-8", "replace").strip()
