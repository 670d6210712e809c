"""Greedy tokens identical to Hugging Face transformers and prompt logprobs close, on
tiny random Llama / Llama-3 (rope scaling, tied embeddings) / Qwen2 / Qwen3 models,
under prefix hits, chunked prefill, page sizes 1 and 16, arrivals during decode and
forced retraction."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs

from plait.runtime import Engine
from plait.runtime.models.linear import Linear

# fp32 on both sides; differences come only from summation order.
LOGPROB_ATOL = 1e-4
MAX_NEW = 10


def make_prompts(n: int = 8) -> list[list[int]]:
    """Prompts of different lengths (1 to ~90 tokens) sharing some prefixes."""
    g = torch.Generator().manual_seed(1234)
    shared = torch.randint(3, 40000, (40,), generator=g).tolist()
    prompts = []
    for i in range(n):
        tail = torch.randint(3, 40000, (1 + 7 * i,), generator=g).tolist()
        prompts.append((shared[: 5 * i] + tail) if i % 2 else tail)
    return prompts


@pytest.fixture(scope="module")
def refs(tiny_model_factory):
    """HF greedy continuations and prompt logprobs per architecture, computed once."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            folder = tiny_model_factory(arch)
            hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            prompts = make_prompts()
            greedy = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
            lps = [hf_prompt_logprobs(hf, p) for p in prompts]
            cache[arch] = (folder, prompts, greedy, lps)
        return cache[arch]

    return get


GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


def check_outputs(engine: Engine, outs: list[dict], greedy: list[list[int]]) -> None:
    for i, (o, ref) in enumerate(zip(outs, greedy)):
        assert o["output_ids"] == ref, f"prompt {i}: {o['output_ids']} != HF {ref}"
    engine.check_invariants()
    assert engine.pool_usage()["locked"] == 0


@pytest.mark.parametrize("cpu_gemm", ["native", "onednn", "torch"])
@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3"])
def test_greedy_and_logprobs_match_hf(refs, arch, cpu_gemm):
    folder, prompts, greedy, lps = refs(arch)
    with Engine(str(folder), kv_cache_tokens=4096, cpu_gemm=cpu_gemm) as engine:
        packed = [m.packed is not None for m in engine.model.modules() if isinstance(m, Linear)]
        assert packed and all(packed) == (cpu_gemm != "torch") and any(packed) == all(packed)
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        check_outputs(engine, outs, greedy)
        for o, ref_lp, p in zip(outs, lps, prompts):
            inp = o["meta_info"]["input_token_logprobs"]
            assert len(inp) == len(p)
            assert inp[0] == [None, p[0]]
            assert [t for _, t in inp] == p
            if len(p) > 1:
                got = torch.tensor([lp for lp, _ in inp[1:]])
                torch.testing.assert_close(got, ref_lp, atol=LOGPROB_ATOL, rtol=0)
            out_lp = o["meta_info"]["output_token_logprobs"]
            assert [t for _, t in out_lp] == o["output_ids"]
            assert all(lp <= 0.0 for lp, _ in out_lp)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [7, 2048])
def test_prefix_hits_chunking_and_page_sizes(refs, page_size, chunk):
    folder, prompts, greedy, _ = refs("llama")
    with Engine(str(folder), kv_cache_tokens=4096, page_size=page_size, chunked_prefill_size=chunk) as engine:
        first = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        check_outputs(engine, first, greedy)
        # a second round hits the prefixes the first one cached
        second = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        check_outputs(engine, second, greedy)
        long_prompts = [i for i, p in enumerate(prompts) if len(p) >= page_size + 1]
        assert all(second[i]["meta_info"]["cached_tokens"] > 0 for i in long_prompts)
        assert all(
            second[i]["meta_info"]["cached_tokens"] >= (len(prompts[i]) - 1) // page_size * page_size
            for i in long_prompts
        )


def test_requests_arriving_while_others_decode(refs):
    folder, prompts, greedy, _ = refs("qwen2")
    with Engine(str(folder), kv_cache_tokens=4096, chunked_prefill_size=16) as engine:
        pending = list(range(len(prompts)))
        reqs = {}
        steps = 0
        while pending or not all(r.finished for r in reqs.values()):
            if pending and steps % 2 == 0:  # a new request every other step
                i = pending.pop(0)
                reqs[i] = engine.add_request(prompts[i], GREEDY)[0]
            engine.step()
            engine.check_invariants()  # after every step, not only at the end
            steps += 1
        for i, r in reqs.items():
            assert r.output_ids == greedy[i]
        engine.check_invariants()


def test_forced_retraction_keeps_outputs(refs):
    folder, prompts, greedy, _ = refs("llama")
    # 8 long-ish requests in a pool that cannot hold all of them at full length
    with Engine(str(folder), kv_cache_tokens=160, page_size=4, init_new_token_ratio=0.0,
                min_new_token_ratio=0.0) as engine:
        reqs = [engine.add_request(p, GREEDY)[0] for p in prompts]
        while not all(r.finished for r in reqs):
            engine.step()
            engine.check_invariants()
        assert engine.scheduler.num_retractions > 0
        assert any(r.num_retractions > 0 for r in reqs)
        check_outputs(engine, [engine.result(r) for r in reqs], greedy)


def test_retraction_with_radix_cache_disabled(refs):
    folder, prompts, greedy, _ = refs("llama")
    with Engine(str(folder), kv_cache_tokens=100, page_size=1, disable_radix_cache=True,
                init_new_token_ratio=0.0, min_new_token_ratio=0.0) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert engine.scheduler.num_retractions > 0
        check_outputs(engine, outs, greedy)
        u = engine.pool_usage()
        assert u["free"] == u["total"]  # nothing is cached when the cache is off
