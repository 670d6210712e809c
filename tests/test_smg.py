"""plait servers as workers of SMG, SGLang's model gateway (``pip install smg``): SMG
registers them (health, /v1/models, /server_info, /model_info, /v1/loads), and OpenAI
and native requests sent through it come back as the workers answer them directly."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import time

import httpx
import openai
import pytest

from plait.runtime.server import launch

OPTS = {"num_threads": 1, "kv_cache_tokens": 4096, "max_running_requests": 16, "echo_logs": False,
        "served_model_name": "tiny"}
PROMPTS = [f"Gateway prompt {i}: the {w} is" for i, w in enumerate(["sky", "sea", "hill", "road"])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gateway(tiny_model_factory, tmp_path_factory):
    smg = shutil.which("smg")
    if smg is None:
        pytest.skip("the smg gateway is not installed (pip install smg)")
    model = str(tiny_model_factory("llama"))
    with launch(model, **OPTS) as a, launch(model, **OPTS) as b:
        port = free_port()
        log = tmp_path_factory.mktemp("smg") / "smg.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([smg, "launch", "--worker-urls", a.url, b.url, "--policy", "cache_aware",
                                     "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
                                     "--log-level", "warn"], stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_registered(url, proc, log)
            yield url, (a, b)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_registered(url: str, proc: subprocess.Popen, log) -> None:
    for _ in range(600):
        assert proc.poll() is None, f"smg exited: {log.read_text()[-2000:]}"
        try:
            r = httpx.get(url + "/workers", timeout=2)
            if r.status_code == 200 and _healthy_workers(r.json()) == 2:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"smg did not register both workers: {log.read_text()[-2000:]}")


def _healthy_workers(body) -> int:
    workers = body.get("workers", body) if isinstance(body, dict) else body
    return sum(1 for w in workers if isinstance(w, dict) and w.get("is_healthy", True))


def test_openai_requests_through_smg_match_the_workers(gateway):
    url, (a, _) = gateway
    via = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in via.models.list().data] == ["tiny"]
    for p in PROMPTS:
        kw = dict(model="tiny", max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        got, want = via.completions.create(prompt=p, **kw), direct.completions.create(prompt=p, **kw)
        assert got.choices[0].text == want.choices[0].text and got.usage.completion_tokens == 6
        msgs = [{"role": "user", "content": p}]
        got, want = via.chat.completions.create(messages=msgs, **kw), direct.chat.completions.create(messages=msgs, **kw)
        assert got.choices[0].message.content == want.choices[0].message.content
    stream = via.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[0]}], stream=True, **kw)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == direct.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[0]}],
                                                  **kw).choices[0].message.content


def test_native_generate_and_loads_through_smg(gateway):
    url, (a, b) = gateway
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    got = httpx.post(url + "/generate", json=body, timeout=120)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == httpx.post(a.url + "/generate", json=body, timeout=120).json()["output_ids"]
    # what SMG's load-aware policies read
    loads = httpx.get(a.url + "/v1/loads?include=core", timeout=10).json()
    assert loads["dp_rank_count"] == 1 and loads["loads"][0]["dp_rank"] == 0
    assert loads["aggregate"]["total_tokens"] == loads["loads"][0]["num_total_tokens"] == 0
    # each request was served once: the 10 sent through SMG (by either worker) and the 10 sent to a directly
    assert sum(_finished(s.url) for s in (a, b)) == 20


def _finished(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^plait_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))
