"""Tensor parallelism (plait.runtime.tp, gloo on CPU): greedy tokens identical to
tp_size=1 and prompt logprobs within 1e-4 on tiny random Llama / Qwen2 / Qwen3 models
(split KV heads), on one with a single KV head over 3 ranks (replicated KV heads), on
Gemma 3, Phi-3 (fused checkpoint tensors) and the MoE families, and with uneven shards (the default model's
9 q / 3 KV heads over 2 ranks),
under chunked prefill, prefix hits and forced retraction; a killed rank stops the engine
with TPError and leaves no process behind, in-process and behind a server (whose
request fails)."""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import signal
import time

import httpx
import pytest
import torch
from conftest import build_tiny_model
from test_server_failures import pid_alive, wait_dead

from plait.runtime import Engine
from plait.runtime.config import EngineConfig
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.parallel import check_tp, shard_of, shard_weights
from plait.runtime.server.args import add_server_arguments, args_from_namespace
from plait.runtime.tp import TPError

LOGPROB_ATOL = 1e-4
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
SMALL = {"num_threads": 1, "kv_cache_tokens": 4096, "max_running_requests": 16}


def make_prompts(n: int = 6) -> list[list[int]]:
    """Prompts of 1 to ~60 tokens, the odd ones sharing a prefix."""
    g = torch.Generator().manual_seed(99)
    shared = torch.randint(3, 40000, (30,), generator=g).tolist()
    return [(shared[: 6 * i] if i % 2 else []) + torch.randint(3, 40000, (1 + 5 * i,), generator=g).tolist()
            for i in range(n)]


def run(folder: str, prompts: list[list[int]], **options) -> tuple[list[dict], dict[str, int]]:
    """Outputs with prompt logprobs of one round, then the same prompts again (prefix
    hits); returns the first round and the engine's stats after both."""
    with Engine(folder, num_threads=1, **options) as engine:
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                                top_logprobs_num=2)
        engine.check_invariants()
        second = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        for o, w in zip(second, first):
            same_greedy(o["output_ids"], w)
        assert any(o["meta_info"]["cached_tokens"] > 0 for o in second)
        engine.check_invariants()
        assert engine.pool_usage()["locked"] == 0
        return first, engine.stats()


def same_greedy(got: list[int], want: dict) -> int:
    """How many of ``got``'s tokens to compare with ``want``'s output (its top 2
    logprobs at each position): all of them, unless they part where ``want``'s two
    best tokens are within ``LOGPROB_ATOL`` (a tie that fp32 summation order may flip:
    seen on a random model with one KV head, a gap of 2e-6) and ``got`` took the other."""
    ids, tops = want["output_ids"], want["meta_info"]["output_top_logprobs"]
    assert len(got) == len(ids)
    for k, (a, b) in enumerate(zip(got, ids)):
        if a != b:
            (l1, t1), (l2, t2) = tops[k][:2]
            assert l1 - l2 < LOGPROB_ATOL and a in (t1, t2), f"token {k}: {a} against {b} (top 2: {tops[k]})"
            return k
    return len(got)


def assert_same(got: list[dict], want: list[dict]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        n = same_greedy(g["output_ids"], w)
        lg = torch.tensor([lp for lp, _ in g["meta_info"]["input_token_logprobs"][1:]] or [0.0])
        lw = torch.tensor([lp for lp, _ in w["meta_info"]["input_token_logprobs"][1:]] or [0.0])
        torch.testing.assert_close(lg, lw, atol=LOGPROB_ATOL, rtol=0)
        og = torch.tensor([lp for lp, _ in g["meta_info"]["output_token_logprobs"][: n + 1]])  # the tie's own too
        ow = torch.tensor([lp for lp, _ in w["meta_info"]["output_token_logprobs"][: n + 1]])
        torch.testing.assert_close(og, ow, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tp2_matches_tp1(tiny_model_factory, arch):
    folder, prompts = str(tiny_model_factory(arch)), make_prompts()
    want, _ = run(folder, prompts, kv_cache_tokens=4096)
    if arch == "llama":
        # a pool too small for all prompts at once (retraction), 7-token chunks, 4-token pages
        got, stats = run(folder, prompts, tp_size=2, kv_cache_tokens=72, page_size=4, chunked_prefill_size=7,
                         init_new_token_ratio=0.0, min_new_token_ratio=0.0)
        assert stats["retractions"] > 0
    else:
        got, _ = run(folder, prompts, tp_size=2, kv_cache_tokens=4096)
    assert_same(got, want)


def test_tp3_replicates_a_single_kv_head(tmp_path, tokenizer_dir):
    # 6 q heads over 3 ranks, one KV head: every rank keeps a copy of it
    folder = str(build_tiny_model(tmp_path / "mqa", tokenizer_dir, "llama", hidden_size=96, intermediate_size=192,
                                  num_attention_heads=6, num_key_value_heads=1))
    prompts = make_prompts(4)
    want, _ = run(folder, prompts, kv_cache_tokens=2048)
    got, _ = run(folder, prompts, tp_size=3, kv_cache_tokens=2048, chunked_prefill_size=16)
    assert_same(got, want)


def test_tp2_default_model_splits_its_odd_head_counts_unevenly():
    """SmolLM2-135M (GGUF, 9 heads, 3 KV heads) over 2 ranks: 6 q heads and 2 KV heads on
    rank 0, 3 and 1 on rank 1 (vLLM and SGLang refuse a size that does not divide them)."""
    prompts = [list(range(1000, 1040)), [504, 2116, 314, 260, 1345]]
    want, _ = run(None, prompts, kv_cache_tokens=1024)
    got, _ = run(None, prompts, tp_size=2, kv_cache_tokens=1024)
    assert_same(got, want)


def _saved(folder, tokenizer_dir, config) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return str(folder)


def test_gemma3_phi3_and_uneven_shards_match_tp1(tmp_path, tokenizer_dir):
    """Gemma 3 (sliding windows, q/k norms, sandwich norms, soft-capping) with 3 KV heads
    over 2 ranks; Phi-3, whose checkpoint fuses q/k/v and gate/up, with an odd
    intermediate size (65 + 64 features); 5 q heads reading one KV head over 3 ranks
    (2 + 2 + 1)."""
    from families import COMMON
    from transformers import Gemma3TextConfig, LlamaConfig, Phi3Config

    wide = {**COMMON, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
    cases = [
        (Gemma3TextConfig(**{**wide, "num_hidden_layers": 4}, head_dim=16, sliding_window=16,
                          layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                          rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=24,
                          final_logit_softcapping=30.0, architectures=["Gemma3ForCausalLM"]), 2),
        (Phi3Config(**{**wide, "intermediate_size": 129}, rope_theta=10000.0, architectures=["Phi3ForCausalLM"]), 2),
        (LlamaConfig(**{**COMMON, "hidden_size": 80, "num_attention_heads": 5, "num_key_value_heads": 1},
                     head_dim=16, rope_theta=10000.0), 3),
    ]
    prompts = make_prompts(4)
    for i, (config, size) in enumerate(cases):
        folder = _saved(tmp_path / str(i), tokenizer_dir, config)
        want, _ = run(folder, prompts, kv_cache_tokens=2048)
        got, _ = run(folder, prompts, tp_size=size, kv_cache_tokens=2048, chunked_prefill_size=16)
        assert_same(got, want)


def test_moe_families_match_tp1(tmp_path, tokenizer_dir):
    """Qwen3-MoE, Mixtral (w1/w2/w3 names) and Qwen2-MoE (a gated shared expert): every
    rank holds every expert with half of its features; the router is whole on each."""
    from test_models_moe import KINDS, _config

    prompts = make_prompts(4)
    for kind in KINDS:
        folder = _saved(tmp_path / kind, tokenizer_dir, _config(kind))
        want, _ = run(folder, prompts, kv_cache_tokens=2048)
        got, _ = run(folder, prompts, tp_size=2, kv_cache_tokens=2048, chunked_prefill_size=16)
        assert_same(got, want)


def test_stacked_and_per_expert_tensors_shard_alike():
    cfg = ModelConfig("qwen3_moe", vocab_size=100, hidden_size=8, intermediate_size=12, num_layers=1, head_dim=4,
                      num_heads=2, num_kv_heads=2, num_experts=3, num_experts_per_tok=1, moe_intermediate_size=5)
    g = torch.Generator().manual_seed(0)
    gate, up, down = (torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g),
                      torch.randn(3, 8, 5, generator=g))
    per_expert = [(f"model.layers.0.mlp.experts.{e}.{p}.weight", t[e])
                  for e in range(3) for p, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down))]
    stacked = [("model.layers.0.mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1)),
               ("model.layers.0.mlp.experts.down_proj", down)]
    for rank, (start, n) in enumerate([(0, 3), (3, 2)]):  # 5 features over 2 ranks
        parts = dict(shard_weights(per_expert, cfg, rank, 2))
        got = dict(shard_weights(stacked, cfg, rank, 2))
        for e in range(3):
            want_gate_up = torch.cat([gate[e, start : start + n], up[e, start : start + n]])
            assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"][e], want_gate_up)
            assert torch.equal(parts[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"], gate[e, start : start + n])
            assert torch.equal(got["model.layers.0.mlp.experts.down_proj"][e], down[e][:, start : start + n])
            assert torch.equal(parts[f"model.layers.0.mlp.experts.{e}.down_proj.weight"], down[e][:, start : start + n])


@pytest.mark.parametrize("heads,kv_heads,size", [(9, 3, 2), (8, 8, 3), (32, 8, 6), (4, 1, 3), (12, 2, 4), (6, 3, 3)])
def test_shards_cover_every_head_and_feature_once(heads, kv_heads, size):
    cfg = ModelConfig("llama", vocab_size=100, hidden_size=64, intermediate_size=101, num_layers=1, head_dim=16,
                      num_heads=heads, num_kv_heads=kv_heads)
    check_tp(cfg, size)
    shards = [shard_of(cfg, r, size) for r in range(size)]
    q = [h for s in shards for h in range(s.q_start, s.q_start + s.q_heads)]
    inter = [f for s in shards for f in range(s.inter_start, s.inter_start + s.inter)]
    assert q == list(range(heads)) and inter == list(range(101))
    assert max(s.inter for s in shards) - min(s.inter for s in shards) <= 1
    group = heads // kv_heads
    for s in shards:
        assert s.q_heads >= 1 and s.kv_heads >= 1
        # every q head of the rank reads one of the rank's KV heads, the one it reads in the full model
        local_group = s.q_heads // s.kv_heads if kv_heads >= size else s.q_heads
        for i, h in enumerate(range(s.q_start, s.q_start + s.q_heads)):
            assert h // group == s.kv_start + i // local_group
    kv = sorted({h for s in shards for h in range(s.kv_start, s.kv_start + s.kv_heads)})
    assert kv == list(range(kv_heads))


def test_a_killed_rank_stops_the_engine_and_leaves_no_process(tiny_model_factory):
    engine = Engine(str(tiny_model_factory("llama")), tp_size=2, **SMALL)
    try:
        worker = engine._tp.procs[0]
        (r,) = engine.add_request([5, 6, 7], {**GREEDY, "max_new_tokens": 500})
        for _ in range(3):
            engine.step()
        assert r.output_len > 0 and not r.finished
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(TPError, match="rank 1"):
            for _ in range(500):  # the step after the kill raises
                engine.step()
        with pytest.raises(TPError):  # and every later one
            engine.step()
    finally:
        engine.shutdown()
    assert worker.poll() is not None and not pid_alive(worker.pid)


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_a_killed_rank_behind_a_server_fails_its_request_and_leaves_no_process(tiny_model_factory):
    from plait.runtime.server import launch

    long = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 900}
    with launch(str(tiny_model_factory("llama")), echo_logs=False, restart_engine=False, tp_size=2, **SMALL) as rt:
        engine = rt.engine_pid
        (worker,) = _children(engine)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            plain = pool.submit(httpx.post, rt.url + "/generate", timeout=60.0,
                                json={"text": "in flight", "sampling_params": long})
            for _ in range(600):
                if httpx.get(rt.url + "/server_info", timeout=30).json()["running"] == 1:
                    break
                time.sleep(0.05)
            os.kill(worker, signal.SIGKILL)
            r = plain.result()
            assert r.status_code >= 500 and "tensor-parallel rank 1" in r.json()["error"]["message"]
        # the engine process exits with its rank (a server with restart_engine starts another)
        assert wait_dead(engine)
        # (/proc calls a process dead once its main thread is a zombie, which can be before
        # the parent can reap it: /health was once still 200 right then; it must turn 503)
        deadline = time.monotonic() + 10.0
        while httpx.get(rt.url + "/health", timeout=30.0).status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.get(rt.url + "/health", timeout=30.0).status_code == 503
    assert not pid_alive(worker) and not pid_alive(rt.pid)


def parse(argv: list[str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    return args_from_namespace(parser.parse_args(argv)).engine


def test_options_and_refusals():
    assert parse(["--tp", "2"]).tp_size == 2 and parse(["--tp-size", "3"]).tp_size == 3
    assert parse(["--tensor-parallel-size", "2"]).tp_size == 2
    with pytest.raises(ValueError, match="tp_size"):
        EngineConfig(tp_size=0)
    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        EngineConfig(tp_size=2, enable_hierarchical_cache=True)
    with pytest.raises(ValueError, match="quantization='int8' is invalid; allowed: none with tp_size > 1"):
        EngineConfig(tp_size=2, quantization="int8")
    dense = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1, head_dim=16)
    check_tp(ModelConfig("llama", num_heads=4, num_kv_heads=2, **dense), 4)  # replicated KV heads
    check_tp(ModelConfig("qwen2", num_heads=6, num_kv_heads=3, **dense), 2)  # uneven: 2 + 1 GQA groups
    with pytest.raises(ValueError, match=r"tp_size=3 .* 2 KV heads: a larger tp_size must be a multiple"):
        check_tp(ModelConfig("llama", num_heads=4, num_kv_heads=2, **dense), 3)
    with pytest.raises(ValueError, match=r"tp_size=8 .* 4 attention heads are too few"):
        check_tp(ModelConfig("llama", num_heads=4, num_kv_heads=2, **dense), 8)
    with pytest.raises(ValueError, match="expert intermediate size is smaller"):
        check_tp(ModelConfig("qwen3_moe", num_heads=4, num_kv_heads=2, num_experts=2, num_experts_per_tok=1,
                             moe_intermediate_size=1, **dense), 2)


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_cpu_ranks_share_the_machines_kv_budget_and_commit_pages_lazily(tiny_model_factory, monkeypatch):
    # every rank sized its pool from the whole machine's budget, and the worker ranks zeroed
    # theirs at start-up: tp_size 3 took ~0.9 of RAM (probe of 2026-12-04)
    import plait.runtime.engine as engine_mod

    folder = str(tiny_model_factory("llama"))
    monkeypatch.setattr(engine_mod, "_available_system_memory", lambda: 2 << 30)
    sized = {}
    for tp in (1, 2):
        with Engine(folder, tp_size=tp, num_threads=1, mem_fraction_static=0.03, max_running_requests=512) as e:
            sized[tp] = e.server_info()["max_total_num_tokens"]
    # a rank holds half of each token's KV heads, and half of the budget: about as many
    # tokens (rank 0's weights, half of them, count in its budget; before: twice as many)
    assert 0.75 * sized[1] <= sized[2] <= 1.25 * sized[1], sized
    # a 512 MB pool per rank (2M tokens x 256 bytes), none of it touched yet: the worker
    # takes about what it takes with a 1 MB pool
    rss = {}
    for tokens in (4096, 2_000_000):
        with Engine(folder, tp_size=2, num_threads=1, kv_cache_tokens=tokens) as e:
            e.generate(input_ids=[[5, 6, 7]], sampling_params=GREEDY)
            rss[tokens] = _rss_mb(e._tp.procs[0].pid)
    assert rss[2_000_000] < rss[4096] + 100, rss
