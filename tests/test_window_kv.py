"""Sliding-window layers with KV bounded by the window (plait.runtime.memory.WindowPages):
a tiny Gemma 3 (window 16, three windowed layers and one global) against Hugging Face
transformers with a windowed-layer pool far smaller than the prompts, under concurrent
requests, chunking, retraction and prefix-cache reuse -- including reuse of a cached
prefix part of whose windowed KV was given back."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, hf_prompt_logprobs
from families import COMMON, GREEDY, MAX_NEW, RETRACT_LEN, RETRACT_PROMPTS, build_refs, retraction_prompts
from test_engine_exactness import LOGPROB_ATOL, check_outputs

from plait.runtime import Engine

WINDOW, PS = 16, 4
LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    """The saved tiny Gemma 3, HF loaded from it, and long prompts (4-8 windows)."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW, layer_types=LAYERS,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, architectures=["Gemma3ForCausalLM"],
    )
    refs = build_refs(tmp_path_factory.mktemp("tiny-gemma3-window"), tokenizer_dir, config, n_prompts=2)
    hf = AutoModelForCausalLM.from_pretrained(refs.folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (64, 97, 128, 75, 110, 83)]
    return refs.folder, hf, prompts, refs.retract_greedy


def greedy_of(hf, prompt: list[int]) -> list[int]:
    return hf_greedy(hf, prompt, MAX_NEW)


def run_all(engine: Engine, prompts: list[list[int]], **kw) -> list[dict]:
    """Queue all, step to the end checking the pools' invariants every step."""
    reqs = [engine.add_request(p, GREEDY, **kw)[0] for p in prompts]
    while not all(r.finished for r in reqs):
        engine.step()
        engine.check_invariants()
    return [engine.result(r) for r in reqs]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_windowed_layers_hold_only_their_window_and_match_hf(model, backend):
    folder, hf, prompts, _ = model
    with Engine(str(folder), kv_cache_tokens=2048, page_size=PS, swa_full_tokens_ratio=0.01,
                attention_backend=backend) as engine:
        window = engine.pool.window
        # the floor: one window and two pages to grow into, far less than one prompt
        assert window.total_pages == WINDOW // PS + 2
        assert window.total_pages * PS < min(len(p) for p in prompts) / 2
        for layer, kind in enumerate(LAYERS):
            rows = engine.pool.k_buffers[layer].shape[0]
            assert rows == (window.num_slots if kind == "sliding_attention" else engine.pool.num_slots)
        outs = run_all(engine, prompts, return_logprob=True, logprob_start_len=0)
        check_outputs(engine, outs, [greedy_of(hf, p) for p in prompts])
        for o, p in zip(outs, prompts):
            got = torch.tensor([lp for lp, _ in o["meta_info"]["input_token_logprobs"][1:]])
            torch.testing.assert_close(got, hf_prompt_logprobs(hf, p), atol=LOGPROB_ATOL, rtol=0)
        assert window.num_free == window.total_pages - sum(window.attached(list(range(1, window.num_full_pages))))
        info = engine.server_info()
        assert info["window_pool"]["total"] == window.total_pages and info["invariant_ok"]
        assert info["window_pages_total"] == window.total_pages
        assert info["window_pages_attached"] == window.total_pages - window.num_free


def test_retraction_and_small_chunks_with_a_small_window_pool(model):
    """Eight requests whose windows do not all fit in the windowed layers' pool (13
    pages for 8 x 5): decodes retract, prefills wait or take smaller chunks."""
    folder, _, _, retract_greedy = model
    with Engine(str(folder), kv_cache_tokens=RETRACT_PROMPTS * RETRACT_LEN + 16, page_size=PS,
                swa_full_tokens_ratio=0.2, chunked_prefill_size=24, init_new_token_ratio=0.0,
                min_new_token_ratio=0.0, attention_backend="cpu") as engine:
        assert engine.pool.window.total_pages < RETRACT_PROMPTS * (WINDOW // PS + 1)
        outs = run_all(engine, retraction_prompts())
        check_outputs(engine, outs, retract_greedy)
        assert engine.scheduler.num_retractions > 0


def cached_pages(engine: Engine, tokens: list[int]) -> list[int]:
    m = engine.cache.match_prefix(tokens)
    return engine.allocator.slots_to_pages(m.slots)


def test_a_cached_prefix_is_reused_up_to_where_its_window_is_whole(model):
    """The documented rule: a cached prefix is used up to the longest page-aligned end
    whose W - 1 positions before it still hold windowed KV; a request that computes the
    rest again gives the dropped windowed KV back to the cached pages."""
    folder, hf, prompts, _ = model
    a = prompts[2]  # 128 tokens
    g = torch.Generator().manual_seed(3)

    def tail(n: int) -> list[int]:
        return torch.randint(3, 40000, (n,), generator=g).tolist()

    with Engine(str(folder), kv_cache_tokens=2048, page_size=PS, swa_full_tokens_ratio=1.0,
                attention_backend="cpu") as engine:
        check_outputs(engine, run_all(engine, [a]), [greedy_of(hf, a)])
        window = engine.pool.window
        pages = cached_pages(engine, a)
        assert all(window.attached(pages))  # nothing pressed the window pool
        window.detach(pages[10:15])  # positions 40..59 give their windowed KV back
        engine.check_invariants()

        cases = [
            (a[:80] + tail(9), 80),  # the hole lies before the window of 80: all of it
            (a[:44] + tail(9), 40),  # the window of 44 reaches into the hole: up to it
            # that request computed 40..43 again and gave page 10 its windowed KV back;
            # the window of 56 still reaches pages 11..13: up to 44
            (a[:56] + tail(9), 44),
        ]
        outs = [run_all(engine, [p])[0] for p, _ in cases]
        check_outputs(engine, outs, [greedy_of(hf, p) for p, _ in cases])
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [n for _, n in cases]
        # computing 40..55 again restored those pages' windowed KV in the tree, not 56..59's
        assert window.attached(cached_pages(engine, a)[10:15]) == [True] * 4 + [False]
        again = a[:56] + tail(9)
        out = run_all(engine, [again])[0]
        check_outputs(engine, [out], [greedy_of(hf, again)])
        assert out["meta_info"]["cached_tokens"] == 56


def test_windowed_kv_stays_in_the_main_pool_where_the_engine_cannot_split_it(model):
    """With the host tier (which copies every layer's KV by page) the windowed layers
    keep their KV in the main pool, as before, and still match HF."""
    folder, hf, prompts, _ = model
    with Engine(str(folder), kv_cache_tokens=1024, page_size=PS, enable_hierarchical_cache=True,
                attention_backend="cpu") as engine:
        assert engine.pool.window is None and engine.allocator.window is None
        assert {b.shape[0] for b in engine.pool.k_buffers} == {engine.pool.num_slots}
        outs = run_all(engine, prompts[:2])
        check_outputs(engine, outs, [greedy_of(hf, p) for p in prompts[:2]])


def test_swa_full_tokens_ratio_is_validated():
    from plait.runtime.config import EngineConfig

    for bad in (0, 1.5, "half"):
        with pytest.raises(ValueError, match="swa_full_tokens_ratio"):
            EngineConfig(swa_full_tokens_ratio=bad)


@pytest.mark.parametrize("seed,page_size", [(1, 4), (2, 1)])
def test_random_arrivals_aborts_and_shared_prefixes_stay_exact(model, seed, page_size):
    """Requests with shared prefixes of random lengths arrive while others run, some
    are aborted, the main pool retracts and the window pool (one window and two pages
    over the floor) detaches cached windowed KV: every step keeps both pools' invariants
    and every finished request has transformers' greedy tokens."""
    import random

    folder, hf, prompts, _ = model
    rng = random.Random(seed)
    bases = [p[:n] for p, n in zip(prompts, (60, 90, 40))]
    work = []
    for i in range(14):
        base = rng.choice(bases)
        cut = rng.randrange(0, len(base) + 1)
        tail = [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 30))]
        work.append((base[:cut] + tail, rng.randrange(1, MAX_NEW + 1), rng.random() < 0.15, rng.randrange(0, 25)))
    with Engine(str(folder), kv_cache_tokens=320, page_size=page_size, swa_full_tokens_ratio=0.05,
                chunked_prefill_size=24, attention_backend="cpu", init_new_token_ratio=0.0,
                min_new_token_ratio=0.0) as engine:
        detach, freed = engine.cache.detach_window, []
        engine.cache.detach_window = lambda n, protected: freed.append(detach(n, protected)) or freed[-1]
        pending = sorted(range(len(work)), key=lambda i: work[i][3])
        live: dict[int, object] = {}
        step = 0
        while pending or engine.has_work():
            while pending and work[pending[0]][3] <= step:
                i = pending.pop(0)
                prompt, n, _, _ = work[i]
                live[i] = engine.add_request(prompt, {**GREEDY, "max_new_tokens": n})[0]
            for i, r in live.items():
                if work[i][2] and not r.finished and r.output_len >= 1:
                    engine.abort(r.rid)
            engine.step()
            engine.check_invariants()
            step += 1
        checked = 0
        for i, r in live.items():
            out = engine.result(r)
            if out["meta_info"]["finish_reason"]["type"] == "abort":
                continue
            prompt, n, _, _ = work[i]
            assert out["output_ids"] == hf_greedy(hf, prompt, n), f"request {i}"
            checked += 1
        assert checked >= 8
        assert sum(freed) > 0  # cached windowed KV was given back under pressure
        assert engine.pool_usage()["locked"] == 0


def test_a_full_window_pool_gives_back_a_batch_at_a_time(model):
    """Once cached windowed KV fills the window pool, it is given back up to a
    watermark (1/8 of the pool) at once: the tree is walked for about one admission in
    two or fewer (giving back only what each check needs walks it on more checks than
    there are requests here), not on every check of every step."""
    folder, hf, prompts, _ = model
    with Engine(str(folder), kv_cache_tokens=4096, page_size=PS, swa_full_tokens_ratio=0.25,
                attention_backend="cpu") as engine:
        assert engine.pool.window.total_pages // 8 >= 16
        detach, freed = engine.cache.detach_window, []
        engine.cache.detach_window = lambda n, protected: freed.append(detach(n, protected)) or freed[-1]
        steps, requests = 0, prompts * 3
        for p in requests:  # distinct prompts (rotated), all cached: the pool fills
            r = engine.add_request(p[steps % 7:] + p[: steps % 7], GREEDY)[0]
            while not r.finished:
                engine.step()
                steps += 1
            engine.check_invariants()
        assert sum(freed) > 0 and len(freed) <= len(requests) // 2, (len(freed), len(requests), steps)
        check_outputs(engine, run_all(engine, prompts[:2]), [greedy_of(hf, p) for p in prompts[:2]])
