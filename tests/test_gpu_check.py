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
