"""Failure handling of the server: start-up errors raise in the caller, a dead engine
fails in-flight requests (never hangs) and turns /health unhealthy, a dead front takes
its engine with it, and two servers on one machine never collide."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest
import zmq

from plait import protocol as P
from plait.runtime.server import launch

SMALL = {"num_threads": 1, "kv_cache_tokens": 4096, "max_running_requests": 16}
LONG = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 900}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_dead(pid: int, seconds: float = 15.0) -> bool:
    for _ in range(int(seconds / 0.05)):
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


# -- start-up ------------------------------------------------------------------------------------
def test_bad_options_raise_before_any_process_starts():
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        launch(None, kv_cache_tokens=-1)
    with pytest.raises(ValueError, match="port"):
        launch(None, port=70000)
    with pytest.raises(ValueError, match="no_such_option"):
        launch(None, no_such_option=1)
    for address in ("tcp://0.0.0.0:0", "tcp://*:5555", "tcp://10.1.2.3:5555"):  # reachable from elsewhere
        with pytest.raises(ValueError, match="api_key"):
            launch(None, zmq_address=address)
    with pytest.raises(ValueError, match="client_timeout_s"):
        launch(None, client_timeout_s=0)


def test_bad_model_path_raises_with_the_childs_error(tmp_path):
    with pytest.raises(RuntimeError, match="does not exist"):
        launch(str(tmp_path / "missing-model"), startup_timeout=120, echo_logs=False, **SMALL)


def test_engine_start_failure_raises_with_the_engines_error(tmp_path, tiny_model_factory):
    broken = tmp_path / "no-weights"
    shutil.copytree(tiny_model_factory("llama"), broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(RuntimeError, match="engine failed to start") as e:
        launch(str(broken), startup_timeout=120, echo_logs=False, **SMALL)
    # the engine process exits at once (it held the front for 5 s, then was killed: its
    # unclosed input socket blocked the ZMQ context's teardown)
    assert "did not stop" not in str(e.value), str(e.value)[-1500:]


def test_memory_options_past_the_machine_fail_at_start_up_naming_them(tiny_model_factory):
    # a traceback from numpy or a MemoryError before; a host pool larger than RAM started and
    # would have failed once prefixes spilled into it
    model = str(tiny_model_factory("llama"))
    for options, needle in (({"kv_cache_tokens": 10**11}, "kv_cache_tokens=100000000000 needs"),
                            ({"kv_cache_tokens": 4096, "enable_hierarchical_cache": True, "hicache_size": 10**5},
                             "hicache_size=100000 asks for a host KV pool")):
        with pytest.raises(RuntimeError, match=needle):
            launch(model, startup_timeout=120, echo_logs=False, num_threads=1, **options)
    for options, field in (({"kv_cache_tokens": 10**20}, "kv_cache_tokens"), ({"chunked_prefill_size": 10**20},
                           "chunked_prefill_size"), ({"hicache_size": 1e9}, "hicache_size")):
        with pytest.raises(ValueError, match=field):  # out of range: before any process starts
            launch(model, **options)


def test_a_prompt_longer_than_the_kv_pool_is_a_400(tiny_model_factory):
    # it could never be admitted: a 200 with finish_reason "abort" and no text before
    with launch(str(tiny_model_factory("llama")), echo_logs=False, num_threads=1, kv_cache_tokens=256) as rt:
        ids = list(range(5, 305))
        for path, body, param in (("/generate", {"input_ids": ids}, "input_ids"),
                                  ("/v1/completions", {"model": "default", "prompt": ids, "max_tokens": 2}, "prompt")):
            r = httpx.post(rt.url + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "KV cache holds 256 tokens" in err["message"], err
        ok = httpx.post(rt.url + "/generate", json={"input_ids": ids[:200], "sampling_params": {"max_new_tokens": 2}},
                        timeout=60)
        assert ok.status_code == 200 and ok.json()["meta_info"]["finish_reason"]["type"] == "length", ok.text


# -- engine death ---------------------------------------------------------------------------------
def _read_stream(url: str, body: dict[str, Any], seen_first: Any) -> list[str]:
    """Stream /generate; after the first event call ``seen_first``; return all events."""
    events = []
    with httpx.stream("POST", url + "/generate", json=body, timeout=5.0) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    seen_first()
    return events


def test_engine_death_fails_requests_and_leaves_other_servers_alone(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    with launch(model, echo_logs=False, restart_engine=False, **SMALL) as a, \
            launch(model, echo_logs=False, **SMALL) as b:
        assert a.url != b.url and a.zmq_address != b.zmq_address and a.engine_pid != b.engine_pid
        zc = zmq.Context()
        dealer = zc.socket(zmq.DEALER)
        dealer.connect(a.zmq_address)
        try:
            dealer.send(P.encode(P.GenerateRequest("z", text="the long one", sampling_params=LONG, stream=True)))
            assert dealer.poll(30000)
            killed = []
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                # an in-flight non-streaming request; the stream below kills the engine
                plain = pool.submit(httpx.post, a.url + "/generate", timeout=30.0,
                                    json={"text": "another", "sampling_params": LONG})
                events = _read_stream(a.url, {"text": "a stream", "stream": True, "sampling_params": LONG},
                                      lambda: killed.append(os.kill(a.engine_pid, signal.SIGKILL)))
                # the stream ended (httpx's 5 s read timeout would have raised otherwise)
                assert killed and events[-1] == "[DONE]"
                err = json.loads(events[-2])["error"]
                assert err["code"] == 503 and "engine process exited" in err["message"]
                r = plain.result()
                assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
            msg = None
            while dealer.poll(5000):
                msg = P.decode_response(dealer.recv())
                if not isinstance(msg, P.StreamChunk):
                    break
            assert isinstance(msg, P.ErrorResponse) and msg.code == 503
        finally:
            dealer.close(linger=0)
            zc.term()
        health = httpx.get(a.url + "/health", timeout=30.0)
        assert health.status_code == 503 and health.json()["error"]["type"] == "server_error"
        r = httpx.post(a.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=5.0)
        assert r.status_code == 503
        assert "plait_requests_total" in httpx.get(a.url + "/metrics", timeout=5.0).text
        # the other server is untouched
        ok = httpx.post(b.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=30)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3
        b_front, b_engine = b.pid, b.engine_pid
    # leaving the block shut both down, engine processes included
    assert wait_dead(b_front) and wait_dead(b_engine) and not pid_alive(a.pid)


def _wait_health(url: str, status: int, seconds: float = 60.0) -> httpx.Response:
    for _ in range(int(seconds / 0.1)):
        r = httpx.get(url + "/health", timeout=30.0)
        if r.status_code == status:
            return r
        time.sleep(0.1)
    raise AssertionError(f"/health did not answer {status} within {seconds} s: {r.status_code} {r.text}")


def test_engine_restarts_after_death_and_stops_in_a_crash_loop(tiny_model_factory):
    """--restart-engine (the default): in-flight requests fail fast with 503, /health
    answers 503 with Retry-After at once, a new engine serves again and /metrics counts
    the restart; three deaths within a minute leave the server down with the reason."""
    model = str(tiny_model_factory("llama"))
    with launch(model, echo_logs=False, **SMALL) as rt:
        first = rt.engine_pid
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, rt.url + "/generate", timeout=30.0,
                                json={"text": "in flight " * 20, "sampling_params": LONG})
            for _ in range(400):
                if httpx.get(rt.url + "/server_info", timeout=30).json()["running"] == 1:
                    break
                time.sleep(0.05)
            for _ in range(400):  # the engine reports its counters with its outputs
                queried = _counter(rt.url, "plait_prefix_cache_queried_tokens_total")
                if queried >= 20:
                    break
                time.sleep(0.05)
            assert queried >= 20
            os.kill(first, signal.SIGKILL)
            health = _wait_health(rt.url, 503, seconds=5.0)  # as soon as the process is gone
            assert health.headers["Retry-After"].isdigit() and "restarting" in health.json()["error"]["message"]
            assert "killed by SIGKILL" in health.json()["error"]["message"]
            r = plain.result()
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
        _wait_health(rt.url, 200)
        info = httpx.get(rt.url + "/server_info", timeout=30).json()
        assert info["engine_pid"] != first and info["engine_state"] == "ok"
        assert info["last_engine_exit"] == "exit code -9: killed by SIGKILL"  # (kept after the restart)
        ok = httpx.post(rt.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=30)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3
        assert re.search(r"^plait_engine_restarts_total\{[^}]*\} 1\.0$",
                         httpx.get(rt.url + "/metrics", timeout=5).text, re.M)
        # the engine's counters carry on from the dead process's (they went back to 0)
        assert _counter(rt.url, "plait_prefix_cache_queried_tokens_total") > queried
        for _ in range(2):  # two more deaths within the window: a crash loop
            os.kill(httpx.get(rt.url + "/server_info", timeout=30).json()["engine_pid"], signal.SIGKILL)
            _wait_health(rt.url, 503, seconds=5.0)
            settled = _wait_any_health(rt.url)
        assert settled == 503
        down = httpx.get(rt.url + "/health", timeout=30.0)
        assert down.status_code == 503 and "not restarting" in down.json()["error"]["message"]
        assert httpx.get(rt.url + "/server_info", timeout=30).json()["engine_state"] == "down"


def _counter(url: str, name: str) -> float:
    """The one sample of ``name`` in /metrics (a single replica)."""
    (value,) = re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", httpx.get(url + "/metrics", timeout=30).text, re.M)
    return float(value)


def _wait_any_health(url: str, seconds: float = 60.0) -> int:
    """Wait until /health settles: 200 (restarted) or a 503 that says it stopped."""
    for _ in range(int(seconds / 0.1)):
        r = httpx.get(url + "/health", timeout=30.0)
        if r.status_code == 200 or "not restarting" in r.text:
            return r.status_code
        time.sleep(0.1)
    raise AssertionError("the server neither came back nor stopped restarting")


# -- front death and the CLI ---------------------------------------------------------------------------
def test_cli_serve_and_engine_exits_with_its_front(tiny_model_factory):
    cmd = [sys.executable, "-c", "import sys; from plait.cli import main; sys.exit(main())", "serve",
           "--model", str(tiny_model_factory("llama")), "--port", "0", "--num-threads", "1",
           "--kv-cache-tokens", "4096", "--api-key", "k"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    engine_pid = None
    ipc_dir = ""
    try:
        line = proc.stdout.readline()
        assert line.startswith("plait server ready at http://127.0.0.1:"), line
        url = line.split()[4]
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=30,
                       json={"prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        info = httpx.get(url + "/server_info", headers=auth, timeout=30).json()
        engine_pid = info["engine_pid"]
        ipc_dir = os.path.dirname(info["zmq_address"][len("ipc://"):])
        assert pid_alive(engine_pid)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_dead(engine_pid), "the engine outlived its front process"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if engine_pid is not None and pid_alive(engine_pid):
            os.kill(engine_pid, signal.SIGKILL)
        proc.stdout.close()
        if ipc_dir:  # a killed front cannot remove its private socket folder
            shutil.rmtree(ipc_dir, ignore_errors=True)


def test_serve_help_explains_every_option():
    from plait.runtime.config import EngineConfig
    from plait.runtime.server.args import ENGINE_HELP
    import dataclasses

    out = subprocess.run([sys.executable, "-c", "import sys; from plait.cli import main; sys.exit(main())",
                          "serve", "--help"], capture_output=True, text=True, check=True).stdout
    for f in dataclasses.fields(EngineConfig):
        assert "--" + f.name.replace("_", "-") in out
        assert f.name in ENGINE_HELP, f"no help text for engine option {f.name}"
    for flag in ("--model", "--host", "--port", "--api-key", "--served-model-name", "--zmq-address", "--log-level"):
        assert flag in out


def test_a_message_to_an_engine_that_exited_is_refused_not_lost(tmp_path):
    # the front's asyncio PUSH socket answers a send nobody can take with a future holding
    # zmq.Again: unawaited, the message was lost silently and asyncio logged "Future
    # exception was never retrieved" (seen in crash loops)
    import asyncio
    import gc

    import zmq
    import zmq.asyncio

    from plait.runtime.server.front import _push

    unretrieved = []

    async def main() -> tuple[bool, bool]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: unretrieved.append(ctx))
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 0)
        push.bind(f"ipc://{tmp_path}/engine-in.sock")
        alone = _push(push, b"lost")  # no engine connected
        pull = ctx.socket(zmq.PULL)
        pull.connect(f"ipc://{tmp_path}/engine-in.sock")
        await asyncio.sleep(0.2)
        taken = _push(push, b"taken")
        got = await asyncio.wait_for(pull.recv(), 5)
        push.close(0)
        pull.close(0)
        ctx.term()
        gc.collect()
        await asyncio.sleep(0)
        return alone, taken and got == b"taken"

    assert asyncio.run(main()) == (False, True)
    assert not unretrieved, unretrieved
