"""Data parallel (``dp_size``): one front, several engine replicas. Outputs equal one
replica's; requests are spread by load; each replica is watched, restarted and
reported (/metrics ``replica`` label, /server_info ``replicas``) on its own."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time
from typing import Any

import httpx
import pytest

from plait.runtime.server import launch

OPTS = {"num_threads": 1, "kv_cache_tokens": 4096, "max_running_requests": 16, "echo_logs": False}
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}
LONG = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 900}
PROMPTS = [f"Replica test {i}: the {w} is" for i, w in enumerate(["sky", "sea", "hill", "road", "tree", "lake"])]


@pytest.fixture(scope="module")
def servers(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    with launch(model, dp_size=2, **OPTS) as two, launch(model, **OPTS) as one:
        yield two, one


def metric(url: str, name: str, replica: int) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf'^{name}{{[^}}]*replica="{replica}"[^}}]*}} ([0-9.e+]+)$', text, re.M)
    assert m, f"{name} of replica {replica} missing"
    return float(m.group(1))


def test_two_replicas_serve_what_one_serves(servers):
    two, one = servers
    assert len(two.engine_pids) == 2 and two.engine_pid == two.engine_pids[0]
    body = {"text": PROMPTS, "sampling_params": GREEDY}
    # one batch: all its prompts are dispatched while the others are in flight
    got = httpx.post(two.url + "/generate", json=body, timeout=120)
    want = httpx.post(one.url + "/generate", json=body, timeout=120)
    assert got.status_code == want.status_code == 200, got.text
    assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in want.json()]
    # concurrent single requests, n > 1 included
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futs = {url: [pool.submit(httpx.post, url + "/generate", timeout=120,
                                  json={"text": p, "sampling_params": {**GREEDY, "n": 2}}) for p in PROMPTS]
                for url in (two.url, one.url)}
        outs = {url: [f.result().json() for f in fs] for url, fs in futs.items()}
    assert [[o["output_ids"] for o in r] for r in outs[two.url]] == [[o["output_ids"] for o in r] for r in outs[one.url]]
    # both replicas did work, and each reports its own
    for rank in (0, 1):
        assert metric(two.url, "plait_prefix_cache_queried_tokens_total", rank) > 0
        assert metric(two.url, "plait_kv_pages_total", rank) > 0
    info = _idle(two.url)
    assert info["dp_size"] == 2 and [r["dp_rank"] for r in info["replicas"]] == [0, 1]
    assert [r["engine_pid"] for r in info["replicas"]] == two.engine_pids
    assert info["cache_queried_tokens"] == sum(r["cache_queried_tokens"] for r in info["replicas"])
    assert info["pool"]["total"] == sum(r["pool"]["total"] for r in info["replicas"])
    assert all(r["load_tokens"] == 0 and r["load_requests"] == 0 for r in info["replicas"])
    assert info["invariant_ok"], info["invariant_error"]
    # a flush reaches every replica
    assert httpx.post(two.url + "/flush_cache", timeout=30).json()["success"] is True
    assert all(r["pool"]["evictable"] == 0 for r in httpx.get(two.url + "/server_info", timeout=30).json()["replicas"])


def test_a_flush_or_update_a_busy_replica_refuses_changes_no_replica(servers, tiny_model_factory):
    # each replica refused only for its own requests: a whole flush (or a weight update)
    # while replica 0 was busy flushed replica 1 and answered 400 naming replica 0
    two, _ = servers
    _idle(two.url)
    warm = httpx.post(two.url + "/generate", timeout=120,
                      json={"text": [p * 6 for p in PROMPTS[:4]], "sampling_params": GREEDY, "cache_salt": "t"})
    assert warm.status_code == 200
    cached = [r["pool"]["evictable"] for r in _idle(two.url)["replicas"]]
    assert all(c > 0 for c in cached), cached
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        a = pool.submit(httpx.post, two.url + "/generate", timeout=120,
                        json={"text": "busy one", "sampling_params": LONG, "rid": "busy-a", "cache_salt": "u"})
        info = _wait(lambda i: sum(r["running"] for r in i["replicas"]) == 1, two.url)
        busy = next(r["dp_rank"] for r in info["replicas"] if r["running"] == 1)
        for path, body in (("/flush_cache", None), ("/flush_cache?cache_salt=u", None),
                           ("/update_weights_from_disk", {"model_path": str(tiny_model_factory("llama"))})):
            r = httpx.post(two.url + path, json=body, timeout=30)
            assert r.status_code == 400 and f"replica {busy}:" in r.text and "no replica was" in r.text, (path, r.text)
        assert [r["pool"]["evictable"] for r in httpx.get(two.url + "/server_info", timeout=30).json()["replicas"]
                if r["dp_rank"] != busy] == [c for i, c in enumerate(cached) if i != busy]
        # another tenant's flush does not touch the busy request's: it goes through
        assert httpx.post(two.url + "/flush_cache?cache_salt=t", timeout=30).json()["success"] is True
        httpx.post(two.url + "/abort_request", json={"rid": "busy-a"}, timeout=10)
        assert a.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    _idle(two.url)
    assert httpx.post(two.url + "/flush_cache", timeout=30).json()["success"] is True


def test_a_dead_replica_fails_its_requests_and_restarts_while_the_other_serves(servers):
    two, _ = servers
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        # the first long request goes to replica 0; while it runs, the next goes to replica 1
        a = pool.submit(httpx.post, two.url + "/generate", timeout=120,
                        json={"text": "long one", "sampling_params": LONG, "rid": "long-a"})
        _wait(lambda i: i["replicas"][0]["load_requests"] == 1, two.url)
        b = pool.submit(httpx.post, two.url + "/generate", timeout=120,
                        json={"text": "long two", "sampling_params": LONG, "rid": "long-b"})
        _wait(lambda i: i["replicas"][1]["running"] == 1, two.url)
        victim = two.engine_pids[1]
        os.kill(victim, signal.SIGKILL)
        r = b.result()
        assert r.status_code == 503 and "engine process exited" in r.json()["error"]["message"]
        # the server stays up on replica 0: health is ok, new requests are served there
        assert httpx.get(two.url + "/health", timeout=10).status_code == 200
        ok = httpx.post(two.url + "/generate", json={"text": "hi", "sampling_params": GREEDY}, timeout=60)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 6
        httpx.post(two.url + "/abort_request", json={"rid": "long-a"}, timeout=10)
        assert a.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    info = _wait(lambda i: i["replicas"][1]["engine_state"] == "ok", two.url)
    assert info["replicas"][1]["engine_pid"] != victim and info["replicas"][0]["engine_pid"] == two.engine_pids[0]
    assert metric(two.url, "plait_engine_restarts_total", 1) == 1 and metric(two.url, "plait_engine_restarts_total", 0) == 0
    # the restarted replica takes requests again
    outs = httpx.post(two.url + "/generate", json={"text": PROMPTS[:2], "sampling_params": GREEDY}, timeout=60)
    assert outs.status_code == 200
    assert _wait(lambda i: i["replicas"][1]["cache_queried_tokens"] > 0, two.url)


def _wait(cond: Any, url: str, seconds: float = 90.0) -> dict[str, Any]:
    for _ in range(int(seconds / 0.05)):
        info = httpx.get(url + "/server_info", timeout=10).json()
        try:
            if cond(info):
                return info
        except (KeyError, IndexError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"condition not reached: {info}")


def _idle(url: str) -> dict[str, Any]:
    return _wait(lambda i: i["running"] == 0 and i["waiting"] == 0 and i["in_flight"] == 0, url)


def test_replicas_of_tensor_parallel_engines_serve_what_one_engine_serves(tiny_model_factory):
    """dp_size x tp_size: two replicas, each two tensor-parallel ranks (four rank
    processes); greedy outputs equal one plain engine's, and stopping the server leaves
    no rank behind."""
    model = str(tiny_model_factory("llama"))
    body = {"text": PROMPTS[:4], "sampling_params": GREEDY}
    with launch(model, **OPTS) as one:
        want = httpx.post(one.url + "/generate", json=body, timeout=120)
    with launch(model, dp_size=2, tp_size=2, **OPTS) as both:
        info = httpx.get(both.url + "/server_info", timeout=10).json()
        assert info["dp_size"] == 2 and info["tp_size"] == 2
        got = httpx.post(both.url + "/generate", json=body, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            singles = list(pool.map(lambda p: httpx.post(both.url + "/generate", timeout=120,
                                                         json={"text": p, "sampling_params": GREEDY}), PROMPTS[:4]))
        pids = list(both.engine_pids)
    assert got.status_code == want.status_code == 200, got.text
    assert [o["output_ids"] for o in got.json()] == [o["output_ids"] for o in want.json()]
    assert [r.json()["output_ids"] for r in singles] == [o["output_ids"] for o in want.json()]
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_cpu_replicas_share_the_machines_kv_budget(tiny_model_factory, monkeypatch):
    # every replica sized its KV pool from the whole machine's free memory (divided by its
    # tensor-parallel ranks only): --dp-size 2 on CPU could claim about twice the budget
    import plait.runtime.engine as engine_mod
    from plait.runtime import Engine

    folder = str(tiny_model_factory("llama"))
    sizing = {"num_threads": 1, "mem_fraction_static": 0.03, "max_running_requests": 512}
    monkeypatch.setattr(engine_mod, "_available_system_memory", lambda: 2 << 30)
    sized = {}
    for dp in (1, 2):
        with Engine(folder, dp_size=dp, **sizing) as e:
            sized[dp] = e.server_info()["max_total_num_tokens"]
    assert 0.4 * sized[1] <= sized[2] <= 0.6 * sized[1], sized
    # an explicit pool every replica takes must fit the machine that many times over
    per_token = 256  # (this model's KV bytes a token)
    with pytest.raises(ValueError, match="for each of the 2 replicas"):
        Engine(folder, dp_size=2, num_threads=1, kv_cache_tokens=(3 << 30) // (2 * per_token))
    with pytest.raises(ValueError, match="dp_size=0 is invalid"):
        Engine(folder, dp_size=0)
    # the server tells each replica how many there are (the real machine's memory here:
    # a fraction small enough that the budget, not max_running_requests x context, sizes it)
    monkeypatch.undo()
    sizing["mem_fraction_static"] = 0.002
    with launch(folder, dp_size=2, **sizing, echo_logs=False) as two:
        info = httpx.get(two.url + "/server_info", timeout=10).json()
    with Engine(folder, **sizing) as e:
        alone = e.server_info()["max_total_num_tokens"]
    each = [r["max_total_num_tokens"] for r in info["replicas"]]
    # (the free memory moves a little between the three start-ups)
    assert all(0.35 * alone <= t <= 0.65 * alone for t in each), (each, alone)
