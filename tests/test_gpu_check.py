"""benchmarks/gpu_check.py stays runnable: its engine comparison works on CPU (torch vs
triton under the interpreter on a tiny model), and without CUDA it exits 0 at once."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from plait.runtime import Engine  # noqa: E402

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_engine_comparison_matches_on_cpu(tiny_model_factory):
    gpu_check = load_script()
    folder = str(tiny_model_factory("llama"))
    cmp = gpu_check.compare_engine_backends(
        lambda backend: Engine(folder, attention_backend=backend, kv_cache_tokens=256, page_size=4),
        ["The capital of France is", "def fibonacci(n):"], max_new_tokens=4,
    )
    assert cmp["match"] and cmp["num_prompts"] == 2 and cmp["mismatches"] == []


def test_without_cuda_the_script_exits_cleanly(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert load_script().main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_engine_profile_runs_on_cpu(tiny_model_factory):
    """profile_engine's bookkeeping on a tiny model (timings are only printed)."""
    gpu_check = load_script()
    folder = str(tiny_model_factory("llama"))
    with Engine(folder, kv_cache_tokens=2048, page_size=4, chunked_prefill_size=16, max_running_requests=8) as e:
        prof = gpu_check.profile_engine(e, batch_sizes=(1, 4, 16), prompt_len=8, new_tokens=4, bw=1e10)
        e.check_invariants()
    assert set(prof["decode"]) == {1, 4}  # 16 > max_running_requests: skipped
    for row in prof["decode"].values():
        assert row["greedy_tok_per_s"] > 0 and row["sampled_sample_ms_per_step"] > 0 and row["roofline_fraction"] > 0
    assert prof["kv_pool_tokens"] >= 2048 and prof["weights_bytes"] > 0
    assert prof["mixed_graph_steps"] == 0 and prof["graph_replays"] == 0  # no graphs on CPU


def test_cuda_graph_comparison_bookkeeping_on_cpu(tiny_model_factory, monkeypatch):
    """compare_cuda_graphs' outputs on CPU (no graphs there: both engines run eagerly, so
    they agree exactly), and the pass rule for a batch size: replays needed; in fp32 a
    difference passes only at near ties with the logprobs close elsewhere."""
    gpu_check = load_script()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    folder = str(tiny_model_factory("llama"))
    res = gpu_check.compare_cuda_graphs(["Hi there", "def f(x):"], batch_sizes=(1, 3), max_new_tokens=2,
                                        model=folder, dtype="float32")
    assert set(res) == {1, 3}
    for row in res.values():
        assert row["match"] and row["first_diffs"] == [] and row["tie_gaps"] == []
        assert row["max_logprob_diff"] == 0.0 and row["replays"] == 0
        assert not gpu_check.graphs_agree(row, must_match=True)  # no replays: nothing was checked
    ok = {"match": True, "replays": 5, "max_logprob_diff": 2e-5, "tie_gaps": []}
    assert gpu_check.graphs_agree(ok, True)
    tie = {**ok, "match": False, "tie_gaps": [2e-5]}
    assert gpu_check.graphs_agree(tie, True)
    assert not gpu_check.graphs_agree({**tie, "tie_gaps": [0.05]}, True)  # a clear choice changed
    assert not gpu_check.graphs_agree({**tie, "max_logprob_diff": 0.3}, True)  # far apart elsewhere
    assert gpu_check.graphs_agree({**tie, "max_logprob_diff": 0.3, "tie_gaps": [0.5]}, False)  # bf16: reported


def test_random_default_shaped_model_loads(tokenizer_dir, tmp_path):
    """The GPU machine's stand-in for the default model: the default model's shapes (two
    of its 30 layers here), the tokenizer given, loadable by the engine."""
    gpu_check = load_script()
    folder = gpu_check.random_default_shaped_model(tmp_path / "m", tokenizer_dir, num_layers=2)
    with Engine(str(folder), kv_cache_tokens=256, page_size=4) as e:
        mc = e.model_config
        assert (mc.hidden_size, mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.intermediate_size) == (576, 9, 3, 64, 1536)
        assert mc.vocab_size == 49152 and mc.tie_word_embeddings and mc.num_layers == 2
        out = e.generate(["The capital of France is"], {"max_new_tokens": 6, "temperature": 0})
    assert len(out[0]["output_ids"]) == 6


def test_tokenizer_dir_can_be_given(monkeypatch, tmp_path):
    """PLAIT_TEST_TOKENIZER_DIR names a saved tokenizer (the GPU machine has no GGUF)."""
    import conftest

    monkeypatch.setenv("PLAIT_TEST_TOKENIZER_DIR", str(tmp_path))
    assert conftest.tokenizer_dir.__wrapped__(None) == tmp_path
