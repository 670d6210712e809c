"""End to end: the engine with the triton attention backend (under the Triton
interpreter on CPU) gives the same greedy tokens as the torch backend."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from plait.runtime import Engine  # noqa: E402


def test_triton_backend_matches_torch_backend(tiny_model_factory):
    folder = str(tiny_model_factory("qwen2"))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (3, 17, 33)]
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        # chunk 16 forces chunked prefill over a cached prefix; page 4 exercises paging
        with Engine(folder, kv_cache_tokens=512, page_size=4, chunked_prefill_size=16, dtype="float32",
                    attention_backend=backend) as engine:
            first = engine.generate(input_ids=prompts, sampling_params=params)
            again = engine.generate(input_ids=prompts[1], sampling_params=params)  # prefix hit
            assert again["meta_info"]["cached_tokens"] > 0
            outs[backend] = [o["output_ids"] for o in first] + [again["output_ids"]]
            engine.check_invariants()
    assert outs["triton"] == outs["torch"]


def test_decode_graph_path_pads_to_buckets_and_matches(tiny_model_factory):
    """The static-buffer, bucket-padded decode path that CUDA graphs replay, run eagerly
    on CPU: same greedy tokens as the torch backend, with batches that need padding."""
    from plait.runtime.cuda_graph import DecodeGraphRunner, graph_buckets
    from plait.runtime.forward_batch import ForwardBatch

    folder = str(tiny_model_factory("llama"))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (5, 9, 14)]
    # different lengths, so the decode batch shrinks 3 -> 2 -> 1 (buckets 4, 2, 1)
    params = [{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in (3, 6, 9)]
    outs = {}
    for backend in ("torch", "triton"):
        with Engine(folder, kv_cache_tokens=512, page_size=4, attention_backend=backend, dtype="float32") as engine:
            if backend == "triton":
                graphs = DecodeGraphRunner(engine.model, engine.runner.attn, engine.req_to_token, 5,
                                           engine.device, mode="eager")
                assert graphs.buckets == [1, 2, 4, 5]
                graphs.capture()
                engine.runner.graphs = graphs
            outs[backend] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
            engine.check_invariants()
            if backend == "triton":
                assert graphs.replays >= 8  # every decode-only step went through the padded path
                zeros = torch.zeros(6, dtype=torch.long)
                too_big = ForwardBatch(zeros, zeros, zeros, zeros, engine.req_to_token.table, 0, [], [], [1] * 6)
                with pytest.raises(ValueError, match="decode-only steps of 1..5 requests"):
                    graphs.run(too_big)
    assert outs["triton"] == outs["torch"]
    assert graph_buckets(1) == [1] and graph_buckets(20)[-3:] == [12, 16, 20]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        graph_buckets(0)


def test_mixed_steps_replay_the_decode_rows(tiny_model_factory):
    """A step with prefill chunks and decodes: the decode rows go through the graph path
    (eager stand-in on CPU), the extend rows run beside them, and the tokens are those
    of the torch backend running the same steps as one batch."""
    from plait.runtime.cuda_graph import DecodeGraphRunner

    folder = str(tiny_model_factory("llama"))
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (4, 7, 24)]
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        with Engine(folder, kv_cache_tokens=512, page_size=4, attention_backend=backend, dtype="float32",
                    chunked_prefill_size=8) as engine:
            if backend == "triton":
                graphs = DecodeGraphRunner(engine.model, engine.runner.attn, engine.req_to_token, 4,
                                           engine.device, mode="eager")
                graphs.capture()
                engine.runner.graphs = graphs
            first = engine.add_request(prompts[0], params)[0]
            second = engine.add_request(prompts[1], params)[0]
            while first.output_len < 2:  # both decoding, then a long prompt arrives in chunks
                engine.step()
            third = engine.add_request(prompts[2], params)[0]
            while engine.has_work():
                engine.step()
            outs[backend] = [engine.pop_result(r)["output_ids"] for r in (first, second, third)]
            engine.check_invariants()
            if backend == "triton":
                assert engine.runner.mixed_graph_steps >= 2  # the 24-token prompt took 3 chunks
    assert outs["triton"] == outs["torch"]


def test_graph_path_reads_the_window_pool_for_windowed_layers(tmp_path, tokenizer_dir):
    """A tiny Gemma 3 (window 16) whose windowed layers keep their KV in a small pool of
    their own: the recorded decode path (eager stand-in) reads that pool's page table
    and slots and gives the torch backend's tokens, in decode-only and mixed steps."""
    from families import COMMON
    from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

    from plait.runtime.cuda_graph import DecodeGraphRunner

    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 3}, head_dim=16, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], query_pre_attn_scalar=24,
        architectures=["Gemma3ForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (40, 23, 57)]
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        with Engine(str(tmp_path), kv_cache_tokens=512, page_size=4, attention_backend=backend, dtype="float32",
                    chunked_prefill_size=16, swa_full_tokens_ratio=0.05) as engine:
            assert engine.pool.window is not None and engine.pool.window.total_pages * 4 < 57
            if backend == "triton":
                graphs = DecodeGraphRunner(engine.model, engine.runner.attn, engine.req_to_token, 4,
                                           engine.device, mode="eager", window_table=engine.window_table)
                graphs.capture()
                engine.runner.graphs = graphs
            reqs = [engine.add_request(p, params)[0] for p in prompts[:2]]
            while reqs[0].output_len < 2:
                engine.step()
            reqs.append(engine.add_request(prompts[2], params)[0])  # chunks beside decodes
            while engine.has_work():
                engine.step()
                engine.check_invariants()
            outs[backend] = [engine.pop_result(r)["output_ids"] for r in reqs]
            if backend == "triton":
                assert graphs.replays >= 5 and engine.runner.mixed_graph_steps >= 2
    assert outs["triton"] == outs["torch"]
