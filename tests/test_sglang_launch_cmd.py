"""SGLang's docs start their server from a script: ``server_process, port =
launch_server_cmd("python3 -m sglang.launch_server --model-path ... --host 0.0.0.0")``,
then ``wait_for_server(f"http://localhost:{port}")``, requests, and
``terminate_process(server_process)`` (``sglang.utils``; ``sglang.test.doc_patch`` in
newer docs). ``plait.utils`` has the three: the SGLang (or vLLM, or plait) launch
command runs plait's server with the same options, in a process group that
``terminate_process`` stops whole; ``wait_for_server`` on a launched port stops waiting
with an error naming the exit when the server dies (a bad flag), instead of waiting
for ever.
"""

from __future__ import annotations

import json
import sys
import urllib.request

import pytest

from plait.utils import _server_argv, _split, launch_server_cmd, terminate_process, wait_for_server

from lang_fixtures import folder, ref  # noqa: F401  (pytest fixtures)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_launch_commands_become_plait_server():
    cmd = """
python3 -m sglang.launch_server --model-path qwen/qwen2.5-0.5b-instruct \\
 --host 0.0.0.0 --log-level warning
"""
    assert _server_argv(_split(cmd)) == [sys.executable, "-m", "plait.runtime.server", "--model-path",
                                         "qwen/qwen2.5-0.5b-instruct", "--host", "0.0.0.0", "--log-level", "warning"]
    for launcher in ("vllm serve", "plait serve", "sglang serve", "/usr/bin/python3.12 -m sglang.launch_server",
                     "python -m vllm.entrypoints.openai.api_server"):
        assert _server_argv(_split(f"{launcher} M --port 8000"))[3:] == ["M", "--port", "8000"], launcher
    # another command runs as given
    assert _server_argv(["python", "myserver.py", "--port", "1"]) == ["python", "myserver.py", "--port", "1"]


def test_launch_wait_request_terminate(folder, ref):
    cmd = (f"python3 -m sglang.launch_server --model-path {folder} --host 127.0.0.1 --log-level warning "
           "--max-total-tokens 4096 --num-threads 1 --attention-backend torch")
    process, port = launch_server_cmd(cmd)
    try:
        assert process.poll() is None and port > 0
        wait_for_server(f"http://localhost:{port}", timeout=180)
        params = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
        out = post(f"http://localhost:{port}/generate", {"text": "Hello, my name is", "sampling_params": params})
        assert out["text"] == ref.generate("Hello, my name is", params)["text"]
    finally:
        terminate_process(process)
    assert process.poll() is not None
    with pytest.raises(TimeoutError):  # nothing answers there any more (the engine went with the front)
        wait_for_server(f"http://localhost:{port}", timeout=1)
    terminate_process(process)  # a second call is harmless


def test_a_server_that_dies_is_reported_not_waited_for(folder):
    process, port = launch_server_cmd(f"python -m sglang.launch_server --model-path {folder} --no-such-flag 1")
    try:
        with pytest.raises(RuntimeError, match="exited with code 2"):
            wait_for_server(f"http://localhost:{port}", timeout=120)
    finally:
        terminate_process(process)


def test_port_choice():
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    process, port = launch_server_cmd([*sleeper, "--port", "4321"])  # the command's own port
    terminate_process(process)
    assert port == 4321 and process.args[-2:] == ["--port", "4321"]
    process, port = launch_server_cmd(sleeper, port=4444)  # an explicit one wins
    terminate_process(process)
    assert port == 4444 and process.args[-2:] == ["--port", "4444"]
    with pytest.raises(ValueError, match="not a port number"):
        launch_server_cmd([*sleeper, "--port", "http"])
    with pytest.raises(ValueError, match="empty"):
        launch_server_cmd("  ")
