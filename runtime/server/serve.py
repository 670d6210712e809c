"""The front process's main: bind sockets, start the engine processes (``--dp-size``
replicas), serve until told to stop, then shut everything down (the engines included).

Run as ``python -m plait.runtime.server [flags]`` (what ``launch()`` does) or through
``plait serve``. With ``--ready-fd`` it writes one JSON line to that file descriptor:
``{"url", "zmq_address", "pid", "engine_pid", "engine_pids"}`` once it serves (``engine_pid``:
the first of the ``--dp-size`` engine replicas), or ``{"error"}`` if it
cannot start. With ``--parent-pid`` it exits when that process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

import msgspec
import uvicorn
import zmq
import zmq.asyncio

from plait import protocol as P
from plait.runtime.process import freeze_startup_objects
from plait.runtime.server.args import ServerArgs, setup_logging
from plait.runtime.server.front import Front, Replica, start_engine
from plait.runtime.server.http_api import build_app
from plait.runtime.server.http_protocol import MAX_HEAD_BYTES, GuardedH11Protocol

logger = logging.getLogger("plait.serve")

ENGINE_STOP_TIMEOUT_S = 5.0
PARENT_CHECK_INTERVAL_S = 0.5


class StartupError(Exception):
    pass


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: this process handles signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def bind_http(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise StartupError(f"cannot bind the HTTP server to {host}:{port}: {e}") from None
    sock.set_inheritable(False)
    return sock


def http_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


SOCKET_DIR_PREFIX = "plait-"
OWNER_FILE = "owner.pid"


def sweep_stale_socket_dirs(root: str | None = None) -> list[str]:
    """Remove this user's socket folders whose server died without cleaning up (a
    SIGKILLed front): those whose owner pid no longer runs. Returns what it removed."""
    root = root or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(root, name)
        if not name.startswith(SOCKET_DIR_PREFIX):
            continue
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            with open(os.path.join(path, OWNER_FILE)) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            continue  # not one of ours (or still being set up)
        try:
            os.kill(pid, 0)
            continue  # its server runs
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def bind_zmq(router: zmq.Socket, address: str | None, tmpdir: str) -> str:
    if address is None:
        address = f"ipc://{tmpdir}/client.sock"
    elif address.startswith("tcp://") and address.rsplit(":", 1)[-1] in ("0", "*"):
        address = address.rsplit(":", 1)[0] + ":*"
    try:
        router.bind(address)
    except zmq.ZMQError as e:
        raise StartupError(f"cannot bind the language-client socket to {address}: {e}") from None
    return router.getsockopt(zmq.LAST_ENDPOINT).decode()


async def _wait_engine(pull: zmq.asyncio.Socket, proc: Any) -> dict[str, Any]:
    decoder = msgspec.msgpack.Decoder(P.EngineMessage)
    while True:
        if await pull.poll(100):
            msg = decoder.decode(await pull.recv())
            if isinstance(msg, P.EngineReady):
                return msg.info
            if isinstance(msg, P.EngineStartupError):
                raise StartupError(f"the engine failed to start: {msg.message}")
        elif proc.poll() is not None:
            raise StartupError(f"the engine process exited with code {proc.returncode} while starting (see its log above)")


async def _serve(args: ServerArgs, tmpdir: str, report: Any, parent_pid: int | None) -> int:
    from plait.runtime.model_loader import resolve_model

    try:
        source = resolve_model(args.model)
    except (OSError, ValueError) as e:
        # the loader's messages name the model already; say it once
        raise StartupError(str(e) if repr(args.model) in str(e) else f"model {args.model!r}: {e}") from None
    ctx = zmq.asyncio.Context()
    sockets: list[zmq.asyncio.Socket] = []

    def socket(kind: int, address: str) -> zmq.asyncio.Socket:
        s = ctx.socket(kind)
        s.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(address)
        sockets.append(s)
        return s

    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.SNDHWM, 100_000)
    router.setsockopt(zmq.LINGER, 0)
    sockets.append(router)
    # one private pair of sockets per engine replica: requests in, outputs out
    addrs = [(f"ipc://{tmpdir}/engine-{i}-in.sock", f"ipc://{tmpdir}/engine-{i}-out.sock") for i in range(args.dp_size)]
    pushes = [socket(zmq.PUSH, a_in) for a_in, _ in addrs]
    pulls = [socket(zmq.PULL, a_out) for _, a_out in addrs]
    procs: list[Any] = []
    front: Front | None = None
    tasks: list[asyncio.Task] = []
    try:
        zmq_address = bind_zmq(router, args.zmq_address, tmpdir)
        sock = bind_http(args.host, args.port)
        procs = [start_engine(args, source.path, a_in, a_out, rank) for rank, (a_in, a_out) in enumerate(addrs)]
        tokenizer_task = asyncio.ensure_future(asyncio.to_thread(
            lambda: source.load_tokenizer(args.engine.resolved_chat_template())))
        try:
            infos = await asyncio.gather(*(_wait_engine(pull, proc) for pull, proc in zip(pulls, procs)))
        except BaseException:
            tokenizer_task.cancel()
            raise
        try:
            tokenizer = await tokenizer_task
        except Exception as e:  # noqa: BLE001
            raise StartupError(f"cannot load the tokenizer of {source.path}: {type(e).__name__}: {e}") from None

        def restarter(rank: int) -> Any:
            a_in, a_out = addrs[rank]
            return (lambda: start_engine(args, source.path, a_in, a_out, rank)) if args.restart_engine else None

        replicas = [Replica(rank, proc, push, restarter(rank)) for rank, (proc, push) in enumerate(zip(procs, pushes))]
        front = Front(args, tokenizer, infos[0], replicas=replicas, router=router, zmq_address=zmq_address,
                      replica_infos=list(infos))
        stop = asyncio.Event()
        watchdog = asyncio.ensure_future(front.watchdog())
        tasks = [watchdog, *(asyncio.ensure_future(c) for c in (
            *(front.engine_reader(r, pull) for r, pull in zip(replicas, pulls)),
            front.client_loop(), front.client_watchdog()))]

        def on_signal() -> None:
            # NOTE: the watchdog stops first: a signal sent to the whole process group
            # (systemd, timeout, kill -- -PGID) has killed the engines too, and they must
            # not be restarted during shutdown
            watchdog.cancel()
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        if parent_pid is not None:
            tasks.append(asyncio.ensure_future(_watch_parent(parent_pid, stop)))
        config = uvicorn.Config(build_app(front), log_level=args.log_level_http or args.log_level, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=3, timeout_keep_alive=30,
                                http=GuardedH11Protocol, h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        server = _Server(config)
        serve_task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            if serve_task.done():
                serve_task.result()
                raise StartupError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        url = http_url(sock)
        freeze_startup_objects()  # before the first request: the startup objects leave the collector's passes
        report({"url": url, "zmq_address": zmq_address, "pid": os.getpid(), "engine_pid": procs[0].pid,
                "engine_pids": [p.pid for p in procs]})
        logger.info("plait server ready: %s (language clients: %s, %d engine replicas)", url, zmq_address,
                    len(procs))
        stop_task = asyncio.ensure_future(stop.wait())
        await asyncio.wait({stop_task, serve_task}, return_when=asyncio.FIRST_COMPLETED)
        # shut down: no more restarts, end in-flight requests, stop HTTP, then the engines
        watchdog.cancel()
        front.abort_all(everyone=True, reason="the server is shutting down")
        await asyncio.sleep(0.05)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve_task, 10)
        return 0
    finally:
        for t in tasks:
            t.cancel()
        if front is not None:
            procs = [r.proc for r in front.replicas]  # the current ones, after any restarts
        await asyncio.gather(*(_stop_engine(push, proc) for push, proc in zip(pushes, procs)))
        for s in sockets:
            s.close(linger=0)
        ctx.term()


async def _stop_engine(push: zmq.asyncio.Socket, proc: Any) -> None:
    if proc.poll() is None:
        with contextlib.suppress(zmq.ZMQError):  # Again: the engine is not connected (yet)
            await push.send(P.encode(P.EngineShutdown()), zmq.NOBLOCK)
        for _ in range(int(ENGINE_STOP_TIMEOUT_S / 0.05)):
            if proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        else:
            logger.warning("the engine process did not stop in %.0f s; killing it", ENGINE_STOP_TIMEOUT_S)
            proc.kill()
    proc.wait()


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while os.getppid() == parent_pid:
        await asyncio.sleep(PARENT_CHECK_INTERVAL_S)
    logger.warning("the launching process %d is gone; shutting down", parent_pid)
    stop.set()


def run(args: ServerArgs, ready_fd: int | None = None, parent_pid: int | None = None,
        announce: bool = False) -> int:
    """Serve until SIGTERM/SIGINT (or the parent's death). Returns the exit code."""
    setup_logging(args.log_level)
    if args.engine.node_rank > 0:  # another node of a multi-node tensor-parallel group: its ranks, no front
        from plait.runtime.tp import follow

        return follow(args.model, args.engine, announce=announce)

    def report(obj: dict[str, Any]) -> None:
        if announce and "url" in obj:
            print(f"plait server ready at {obj['url']}  (language clients: {obj['zmq_address']})", flush=True)
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, (json.dumps(obj) + "\n").encode())
                os.close(ready_fd)

    if announce:  # the model loads (and kernels build) before the ready line, tens of seconds on a CPU;
        # stderr: stdout's first line stays the ready line scripts wait for
        print(f"plait server starting: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'}...",
              file=sys.stderr, flush=True)
    sweep_stale_socket_dirs()
    tmpdir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)  # 0700: only this user reaches the ipc sockets
    with open(os.path.join(tmpdir, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    try:
        code = asyncio.run(_serve(args, tmpdir, report, parent_pid))
        if announce:
            print("plait server stopped", file=sys.stderr, flush=True)
        return code
    except StartupError as e:
        if ready_fd is None:  # a terminal: one line (the log line said the same again)
            print(f"error: {e}", file=sys.stderr)
        else:
            logger.error("%s", e)
        report({"error": str(e)})
        return 1
    except Exception as e:  # noqa: BLE001  (report anything that stops start-up to the launcher)
        logger.exception("the server failed")
        report({"error": f"{type(e).__name__}: {e}"})
        return 1
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
