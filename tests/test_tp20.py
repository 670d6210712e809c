"""Tensor parallelism under configurations a user may pass (probe of 2026-12-06): tied
embeddings with a vocabulary the rank count does not divide, workers closed before the
engine served them, an engine whose start fails after its ranks started, and a rank
killed with two requests in flight behind a restarting server (then flush_cache and
update_weights_from_disk on the new engine)."""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import time

import httpx
import pytest
import torch
from conftest import build_tiny_model
from test_server_failures import pid_alive
from test_tp import SMALL, _children, assert_same, make_prompts, run

from plait.runtime import Engine
from plait.runtime.config import EngineConfig
from plait.runtime.tp import TPWorkers


def test_tied_embeddings_with_a_vocabulary_tp_does_not_divide_match_tp1(tmp_path, tokenizer_dir):
    # 49153 rows: 16385 on each of 3 ranks (two padding rows), 24577 on each of 2 (one);
    # the LM head is the sharded embedding itself
    folder = str(build_tiny_model(tmp_path / "tied", tokenizer_dir, "llama", hidden_size=96, intermediate_size=190,
                                  num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True,
                                  vocab_size=49153))
    prompts = make_prompts(4)
    want, _ = run(folder, prompts, kv_cache_tokens=2048)
    for size in (3, 2):
        got, _ = run(folder, prompts, tp_size=size, kv_cache_tokens=2048)
        assert_same(got, want)


def test_workers_closed_before_serve_are_killed_not_aborted(tiny_model_factory):
    # before: close() broadcast a 6-long STOP header to workers waiting in the 3-long
    # geometry broadcast, and gloo aborted them (SIGABRT, "gloo::EnforceNotMet")
    workers = TPWorkers.start(str(tiny_model_factory("llama")), EngineConfig(tp_size=2, num_threads=1),
                              torch.device("cpu"))
    try:
        (worker,) = workers.procs
        assert worker.poll() is None
    finally:
        workers.close()
    assert worker.returncode == -signal.SIGKILL
    assert not pid_alive(worker.pid)


def test_an_engine_that_fails_after_its_ranks_started_leaves_no_process(tiny_model_factory):
    before = set(_children(os.getpid()))
    with pytest.raises(ValueError, match="mem_fraction_static") as caught:  # raised once the weights are loaded
        Engine(str(tiny_model_factory("llama")), tp_size=2, num_threads=1, mem_fraction_static=1e-9)
    try:
        left = set(_children(os.getpid())) - before
        for _ in range(60):
            left = {pid for pid in left if pid_alive(pid)}
            if not left:
                break
            time.sleep(0.05)
        assert not left, f"tensor-parallel workers {sorted(left)} outlived the failed engine"
    finally:
        del caught  # the traceback holds the engine: dropping it lets the workers go
        import gc

        gc.collect()


def test_a_killed_rank_fails_every_in_flight_request_and_the_restarted_engine_serves(tiny_model_factory):
    from plait.runtime.server import launch

    long = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 900}
    folder = str(tiny_model_factory("llama"))
    with launch(folder, echo_logs=False, restart_engine=True, tp_size=2, **SMALL) as rt:
        (worker,) = _children(rt.engine_pid)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(httpx.post, rt.url + "/generate", timeout=60.0,
                                   json={"text": f"in flight {i}", "sampling_params": long}) for i in range(2)]
            for _ in range(600):
                if httpx.get(rt.url + "/server_info", timeout=5).json()["running"] == 2:
                    break
                time.sleep(0.05)
            os.kill(worker, signal.SIGKILL)
            for f in futures:
                r = f.result()
                assert r.status_code >= 500 and "tensor-parallel rank 1" in r.json()["error"]["message"]
        # the front restarts the engine (and its rank): a request succeeds within a minute
        deadline = time.monotonic() + 60.0
        while True:
            r = httpx.post(rt.url + "/generate", timeout=60.0,
                           json={"text": "after", "sampling_params": {"max_new_tokens": 4}})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
        assert httpx.post(rt.url + "/flush_cache", timeout=60.0).status_code == 200
        r = httpx.post(rt.url + "/update_weights_from_disk", json={"model_path": folder}, timeout=60.0)
        assert r.status_code == 400 and "tp_size > 1" in r.json()["error"]["message"]
        r = httpx.post(rt.url + "/generate", timeout=60.0,
                       json={"text": "after", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200
        # the restarted engine is another child of the server (rt.engine_pid names the first)
        new_workers = [w for e in _children(rt.pid) if pid_alive(e) for w in _children(e)]
        assert len(new_workers) == 1
    assert not pid_alive(worker) and not any(pid_alive(w) for w in new_workers)


def test_a_rank_killed_while_idle_restarts_the_engine_before_a_request_fails(tiny_model_factory):
    """An idle engine noticed a dead rank only in the next request's step: /health said ok
    and that request was a 500. The idle loop checks its ranks, so the engine exits and is
    restarted, and a request sent later is served."""
    from plait.runtime.server import launch

    with launch(str(tiny_model_factory("llama")), echo_logs=False, restart_engine=True, tp_size=2, **SMALL) as rt:
        (worker,) = _children(rt.engine_pid)
        os.kill(worker, signal.SIGKILL)
        deadline = time.monotonic() + 90.0
        while time.monotonic() < deadline:  # the engine exits: the front restarts it (another pid)
            info = httpx.get(rt.url + "/server_info", timeout=30).json()
            if info["engine_pids"] != [rt.engine_pid] and info["engine_state"] == "ok":
                break
            time.sleep(0.2)
        assert info["engine_pids"] != [rt.engine_pid] and info["engine_state"] == "ok", info
        # why the engine went is reported (it was only in the log), after the restart too
        assert re.fullmatch(rf"exit code 1: TPError: tensor-parallel rank 1 \(pid {worker}\) exited with code -9",
                            info["last_engine_exit"]), info["last_engine_exit"]
        assert info["replicas"][0]["last_engine_exit"] == info["last_engine_exit"]
        r = httpx.post(rt.url + "/generate", timeout=60.0, json={"text": "after", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
