"""Multi-node tensor parallelism (nnodes, node_rank, dist_init_addr; plait.runtime.tp):
two "nodes" on loopback — a server with --node-rank 0 and `python -m plait.runtime.server
--node-rank 1` — give the greedy tokens of tp_size=1; killing node 1 mid-request fails the
request within seconds and leaves no process behind; a node whose options differ from
node 0's (or whose node_rank is taken) is refused by name on both nodes; the options are
validated where they enter."""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server_failures import pid_alive, wait_dead
from test_tp import GREEDY, SMALL, _children, make_prompts

from plait.runtime import Engine
from plait.runtime.config import EngineConfig
from plait.runtime.server import launch
from plait.runtime.server.args import ServerArgs, add_server_arguments, args_from_namespace
from plait.runtime.tp import GROUP_KEY, TPError, _group_options, follow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_flags(addr: str, rank: int) -> list[str]:
    return ["--tp-size", "2", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr", addr,
            "--num-threads", "1", "--kv-cache-tokens", str(SMALL["kv_cache_tokens"]),
            "--max-running-requests", str(SMALL["max_running_requests"])]


def test_two_nodes_match_tp1_and_a_killed_node_fails_requests_and_leaves_no_process(tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    prompts = make_prompts(4)
    with Engine(folder, **SMALL) as engine:
        want = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    addr = f"127.0.0.1:{free_port()}"
    # node 1 first: it waits for node 0 to listen at addr
    node1 = subprocess.Popen([sys.executable, "-m", "plait.runtime.server", "--model", folder, *node_flags(addr, 1)])
    try:
        with launch(folder, echo_logs=False, restart_engine=False, tp_size=2, nnodes=2, node_rank=0,
                    dist_init_addr=addr, **SMALL) as rt:
            assert _children(rt.engine_pid) == []  # node 0 runs rank 0 only; rank 1 is node 1's
            (rank1,) = _children(node1.pid)
            got = httpx.post(rt.url + "/generate", json={"input_ids": prompts, "sampling_params": GREEDY}, timeout=120)
            assert got.status_code == 200, got.text
            assert [o["output_ids"] for o in got.json()] == want
            long = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 900}
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(httpx.post, rt.url + "/generate", timeout=60.0,
                                      json={"text": "in flight", "sampling_params": long})
                for _ in range(600):
                    if httpx.get(rt.url + "/server_info", timeout=30).json()["running"] == 1:
                        break
                    time.sleep(0.05)
                os.kill(node1.pid, signal.SIGKILL)
                r = pending.result()
            assert r.status_code >= 500 and "tensor-parallel collective failed" in r.json()["error"]["message"]
            assert wait_dead(rt.engine_pid) and wait_dead(rank1)
            assert httpx.get(rt.url + "/health", timeout=30.0).status_code == 503
        assert not pid_alive(rt.pid) and not pid_alive(rt.engine_pid) and not pid_alive(rank1)
    finally:
        if node1.poll() is None:
            node1.kill()
        node1.wait()


def test_a_node_with_other_options_or_a_taken_rank_is_refused_on_both_nodes(tiny_model_factory):
    import torch
    import torch.distributed as dist

    folder = str(tiny_model_factory("llama"))
    addr = f"127.0.0.1:{free_port()}"
    multi = dict(tp_size=2, nnodes=2, dist_init_addr=addr, **SMALL)
    # the follower first (it waits for node 0), then node 0's engine, which learns of the refusal
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(
        follow(folder, EngineConfig(node_rank=1, **{**multi, "page_size": 4}))))
    thread.start()
    with pytest.raises(TPError, match=r"node 1 did not join .*page_size=4 \(node 0: 16\); run the same command"):
        Engine(folder, **multi)
    thread.join()
    assert codes == [2]
    # a second node claiming node_rank=1 (a store standing in for node 0)
    port = free_port()
    multi["dist_init_addr"] = f"127.0.0.1:{port}"
    store = dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    store.set(GROUP_KEY, json.dumps(_group_options(EngineConfig(**multi), torch.device("cpu"))))
    store.add("node/1", 1)
    assert follow(folder, EngineConfig(node_rank=1, **multi)) == 2
    assert "node_rank=1 was given to two nodes" in store.get("refused/1").decode()


def parse(argv: list[str]) -> ServerArgs:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return args_from_namespace(parser.parse_args(argv))


def test_options_are_validated_where_they_enter(tiny_model_factory, capsys):
    cfg = parse(node_flags("10.0.0.1:5000", 1)).engine
    assert (cfg.tp_size, cfg.nnodes, cfg.node_rank, cfg.dist_init_addr, cfg.local_tp_size) == \
        (2, 2, 1, "10.0.0.1:5000", 1)
    assert EngineConfig(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="[::1]:29500").local_tp_size == 2
    with pytest.raises(ValueError, match=r"tp_size=3 is invalid; allowed: a multiple of nnodes=2"):
        EngineConfig(tp_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match=r"dist_init_addr=None is invalid; allowed: HOST:PORT of node 0"):
        EngineConfig(tp_size=2, nnodes=2)
    with pytest.raises(ValueError, match=r"node_rank=2 is invalid; allowed: an integer in \[0, nnodes=2\)"):
        EngineConfig(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")
    for bad in ("localhost", "h:0", "h:70000", ":5000", "h:port"):
        with pytest.raises(ValueError, match="dist_init_addr=.* is invalid; allowed: None or HOST:PORT"):
            EngineConfig(dist_init_addr=bad)
    with pytest.raises(ValueError, match="nnodes=0 is invalid"):
        EngineConfig(nnodes=0)
    with pytest.raises(ValueError, match="dp_size=2 is invalid with nnodes=2"):
        ServerArgs.from_kwargs(None, dp_size=2, tp_size=2, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match="node_rank=1 is invalid for launch.*plait serve --node-rank 1"):
        launch(None, tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")  # refused before a process starts
    with pytest.raises(ValueError, match="node_rank=1 is invalid for an engine"):
        Engine(str(tiny_model_factory("llama")), tp_size=2, nnodes=2, node_rank=1, dist_init_addr="h:1")
    from plait.cli import main

    with pytest.raises(SystemExit):  # the command line refuses with the same message
        main(["serve", "--nnodes", "2", "--tp-size", "2"])
    assert "dist_init_addr=None is invalid; allowed: HOST:PORT of node 0" in capsys.readouterr().err
