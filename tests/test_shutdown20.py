"""A server stopped (SIGTERM / Ctrl-C) while a request streams ends that request with an
abort whose message says the server is shutting down, not "aborted by request" (which
would tell the client it cancelled the request itself)."""

from __future__ import annotations

import json
import threading

import httpx

from plait.runtime import launch


def test_a_stream_cut_by_shutdown_says_so(tiny_model_factory):
    rt = launch(str(tiny_model_factory("llama")), num_threads=1, kv_cache_tokens=4096)
    events: list[dict] = []
    first = threading.Event()

    def stream() -> None:
        with httpx.Client(base_url=rt.url, timeout=120) as c, c.stream("POST", "/generate", json={
                "text": "Once upon a time", "stream": True,
                "sampling_params": {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 3000}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[len("data: "):]))
                    first.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first.wait(120), "no first piece"
    finally:
        code = rt.shutdown()
    t.join(60)
    assert not t.is_alive() and code == 0
    reason = events[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "shutting down" in reason["message"], reason
    assert len(events[-1]["output_ids"]) < 3000


def test_plait_serve_says_it_stopped(tiny_model_factory):
    """``plait serve`` announces its start (stderr) and ready line (stdout); on SIGTERM it
    now says it stopped too (it went quiet, which reads as a hang in a terminal)."""
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-c", "import sys; from plait.cli import main; sys.exit(main())", "serve",
           "--model", str(tiny_model_factory("llama")), "--port", "0", "--num-threads", "1", "--kv-cache-tokens", "4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("plait server ready at ")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and err.strip().splitlines()[-1] == "plait server stopped", err[-2000:]
