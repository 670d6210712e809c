"""The host-memory tier under the prefix cache: round trips, invariants, outputs."""

from __future__ import annotations

import random

import pytest
import torch

from plait.runtime import Engine
from plait.runtime.hicache import HostTier
from plait.runtime.memory import KVPool

PARAMS = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def _pool(pages: int, ps: int = 2) -> KVPool:
    pool = KVPool(pages * ps, num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu", page_size=ps)
    for buf in pool.k_buffers + pool.v_buffers:
        buf.copy_(torch.randn_like(buf))
    return pool


def test_round_trip_copies_kv_bit_for_bit_and_only_what_is_missing():
    pool = _pool(16)
    tier = HostTier(pool, num_pages=8)
    tokens = [5, 6, 7, 8, 9]  # two whole pages; the tail is not kept
    slots = torch.arange(2, 7)
    tier.save(tokens, slots, None)
    assert tier.saved_tokens == 4 and tier.usage()["cached"] == 2
    tier.save(tokens[:4] + [1, 2], torch.tensor([2, 3, 4, 5, 12, 13]), None)  # shares two pages
    assert tier.saved_tokens == 6  # only the new page was copied
    m = tier.match([5, 6, 7, 8, 1, 2], None, None)
    assert m.length == 6
    dest = torch.tensor([20, 21, 22, 23, 24, 25])
    tier.load(m.slots, dest)
    src = torch.tensor([2, 3, 4, 5, 12, 13])
    for layer in range(2):
        assert torch.equal(pool.k_buffers[layer][dest], pool.k_buffers[layer][src])
        assert torch.equal(pool.v_buffers[layer][dest], pool.v_buffers[layer][src])
    assert tier.match([5, 6], "other-salt", None).length == 0
    tier.check_invariants()


def test_a_full_host_pool_drops_its_least_recent_prefixes():
    pool = _pool(32)
    tier = HostTier(pool, num_pages=4)  # 3 usable pages
    rng = random.Random(0)
    for i in range(30):
        tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
        tier.save(tokens, torch.arange(2, 2 + len(tokens)), rng.choice([None, "s"]))
        tier.check_invariants()
    assert tier.usage()["cached"] <= 3
    with pytest.raises(ValueError, match="hicache_write_policy"):
        HostTier(pool, 4, "sometimes")


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_evicted_prefixes_come_back_from_the_host(tiny_model_factory, policy):
    """A device pool too small for the working set: with the tier, a prompt seen
    before is served by a copy (cached tokens, fewer prefill tokens) with the same
    output tokens as without the tier."""
    folder = str(tiny_model_factory("llama"))
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(3, 200, (40,), generator=g).tolist() for _ in range(4)]  # 4 x 40 tokens > the pool
    runs = {}
    for tier in (False, True):
        with Engine(folder, kv_cache_tokens=96, page_size=4, max_running_requests=2, enable_hierarchical_cache=tier,
                    hicache_ratio=4.0, hicache_write_policy=policy) as e:
            outs, cached = [], []
            for _ in range(2):  # the second round finds every doc evicted from the device
                for d in docs:
                    o = e.generate(input_ids=d + [7], sampling_params=PARAMS)
                    outs.append(o["output_ids"])
                    cached.append(o["meta_info"]["cached_tokens"])
                    e.check_invariants()
            runs[tier] = (outs, cached, e.scheduler.prefill_tokens_computed, e.stats())
    (off_out, off_cached, off_prefill, _), (on_out, on_cached, on_prefill, stats) = runs[False], runs[True]
    assert on_out == off_out
    assert sum(off_cached[4:]) < sum(on_cached[4:]) and all(c == 40 for c in on_cached[4:])
    assert on_prefill < off_prefill
    assert stats["hicache_loaded_tokens"] >= 4 * 40 - 40 and stats["hicache_saved_tokens"] > 0


def test_flush_empties_both_tiers(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=96, page_size=4, enable_hierarchical_cache=True,
                hicache_write_policy="write_through") as e:
        e.generate(input_ids=list(range(10, 50)), sampling_params=PARAMS, cache_salt="a")
        assert e.tier.usage()["cached"] > 0
        assert e.flush_cache("a") is True and e.tier.usage()["cached"] == 0
        e.generate(input_ids=list(range(10, 50)), sampling_params=PARAMS)
        assert e.flush_cache() is True and e.tier.usage()["cached"] == 0
        e.check_invariants()


def test_options_are_validated():
    from plait.runtime import EngineConfig

    with pytest.raises(ValueError, match="enable_hierarchical_cache"):
        EngineConfig(enable_hierarchical_cache=True, prefix_cache_mode="block_hash")
    with pytest.raises(ValueError, match="hicache_ratio"):
        EngineConfig(hicache_ratio=0)
    with pytest.raises(ValueError, match="hicache_prefetch_policy.*best_effort, off"):
        EngineConfig(hicache_prefetch_policy="wait_complete")  # nothing to wait for: copies are synchronous



def _offload(e: Engine, docs: list[list[int]]) -> None:
    """Serve ``docs`` one by one: on a device pool too small for them, the earlier ones
    end up on the host only."""
    for d in docs:
        e.generate(input_ids=d + [7], sampling_params=PARAMS)


@pytest.mark.parametrize("policy", ["best_effort", "off"])
def test_a_waiting_requests_prefix_is_prefetched_before_admission(tiny_model_factory, policy):
    """While a request waits (no free row), its host-held prefix is copied to the device
    in steps of at most the per-step budget and held there (locked, counted as such);
    admission then copies nothing. The outputs are those of prefetch off."""
    from plait.runtime.hicache import PREFETCH_TOKENS_PER_STEP

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(3, 200, (300,), generator=g).tolist() for _ in range(2)]
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=400, page_size=4, max_running_requests=1,
                enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_prefetch_policy=policy) as e:
        _offload(e, docs)
        host = e.scheduler.host
        assert e.cache.match_prefix(docs[0]).length < 300 <= e.tier.match(docs[0], None, None).length
        runner = e.add_request([9, 8, 7, 6, 5], {**PARAMS, "max_new_tokens": 12})[0]
        waiter = e.add_request(docs[0] + [7], PARAMS)[0]
        loaded_before, seen = e.tier.loaded_tokens, []
        while waiter.cached_tokens == 0 and not waiter.finished:
            e.step()
            e.check_invariants()
            if not waiter.admitted_once:
                seen.append(host.prefetched_tokens)
                u = e.pool_usage()
                assert u["free"] + u["evictable"] + u["locked"] == u["total"]
        assert waiter.admitted_once
        if policy == "off":
            assert host.prefetched_tokens == 0 and e.tier.loaded_tokens - loaded_before == 300
        else:
            # one budget per step, all 300 tokens before admission, none copied at admission
            assert seen[0] == PREFETCH_TOKENS_PER_STEP and seen[-1] == 300
            assert all(b - a <= PREFETCH_TOKENS_PER_STEP for a, b in zip([0] + seen, seen))
            assert e.tier.loaded_tokens - loaded_before == 300 and waiter.cached_tokens == 300
        while e.has_work():
            e.step()
        e.check_invariants()
        assert host.locks == 0 and runner.finished
        out = e.result(waiter)["output_ids"]
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, page_size=4) as ref:
        assert ref.generate(input_ids=docs[0] + [7], sampling_params=PARAMS)["output_ids"] == out


def test_a_waiting_request_probes_the_host_tree_once_until_it_changes(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, page_size=4, max_running_requests=1,
                enable_hierarchical_cache=True) as e:
        host = e.scheduler.host
        runner = e.add_request([9, 8, 7, 6, 5], {**PARAMS, "max_new_tokens": 10})[0]
        e.step()
        before = host.probes
        waiter = e.add_request(list(range(20, 60)), PARAMS)[0]
        for _ in range(4):
            e.step()
        assert not waiter.admitted_once and host.probes == before + 1
        # the host tree changes (a prefix saved): the next step looks again, once
        e.tier.save(list(range(20, 40)), torch.arange(4, 24), None)
        for _ in range(3):
            e.step()
        assert host.probes == before + 2 and not waiter.admitted_once
        while e.has_work():
            e.step()
        assert runner.finished and waiter.cached_tokens == 20  # the saved prefix was copied back at admission


def test_a_namespace_flush_takes_what_a_waiting_request_holds(tiny_model_factory):
    """A waiting request's prefetch lock does not block ``flush_cache(salt)`` (only running
    requests do): the flush drops the lock with the namespace, in both tiers."""
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, page_size=4, max_running_requests=1,
                enable_hierarchical_cache=True, hicache_write_policy="write_through") as e:
        prompt = list(range(20, 60)) + [7]
        first = e.generate(input_ids=prompt, sampling_params=PARAMS, cache_salt="t")["output_ids"]
        runner = e.add_request([9, 8, 7, 6, 5], {**PARAMS, "max_new_tokens": 10})[0]
        e.step()
        waiter = e.add_request(prompt, PARAMS, cache_salt="t")[0]
        e.step()
        assert not waiter.admitted_once and e.scheduler.host.locks == 1
        assert e.flush_cache("t")
        e.check_invariants()
        assert e.scheduler.host.locks == 0 and e.tier.match(prompt, "t", None).length == 0
        while e.has_work():
            e.step()
        assert runner.finished and waiter.cached_tokens == 0 and e.result(waiter)["output_ids"] == first


def _random_run(folder: str, prefetch: str, seed: int) -> dict[str, list[int]]:
    """Random arrivals (shared prefixes, two salts), aborts, per-salt flushes and steps on
    a device pool a fraction of the working set; both tiers' invariants after every
    operation. Returns the outputs of the requests that ran to their length."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    bases = [torch.randint(3, 200, (rng.randint(20, 70),), generator=g).tolist() for _ in range(5)]
    done: dict[str, list[int]] = {}
    with Engine(folder, kv_cache_tokens=128, page_size=4, max_running_requests=4, chunked_prefill_size=64,
                enable_hierarchical_cache=True, hicache_ratio=3.0, hicache_prefetch_policy=prefetch) as e:
        for i in range(70):
            op = rng.random()
            if op < 0.35:
                tail = [rng.randint(3, 200) for _ in range(rng.randint(1, 9))]
                e.add_request(rng.choice(bases) + tail, {**PARAMS, "max_new_tokens": rng.randint(1, 16)},
                              rid=f"r{i}", cache_salt=rng.choice([None, None, "t"]))
            elif op < 0.42 and e.scheduler.waiting:
                e.abort(rng.choice(list(e.scheduler.waiting)).rid)  # it may hold a prefetch
            elif op < 0.45:
                e.flush_cache("t")
            for o in e.step():
                if o.finished and o.finish_reason.type == "length":
                    done[o.rid] = o.result["output_ids"]
            e.check_invariants()
            assert e.scheduler.host.locks <= len(e.scheduler.waiting)
        while e.has_work():
            for o in e.step():
                if o.finished and o.finish_reason.type == "length":
                    done[o.rid] = o.result["output_ids"]
            e.check_invariants()
        assert e.scheduler.host.locks == 0 and e.cache.locked_pages == 0
        assert e.flush_cache() and e.pool_usage()["free"] == e.pool_usage()["total"]
        if prefetch == "best_effort":
            assert e.scheduler.host.prefetched_tokens > 0
        assert e.stats()["hicache_prefetched_tokens"] == e.scheduler.host.prefetched_tokens
    return done


def test_random_operations_keep_both_tiers_accounted_and_outputs_unchanged(tiny_model_factory):
    folder = str(tiny_model_factory("llama"))
    on, off = _random_run(folder, "best_effort", 11), _random_run(folder, "off", 11)
    both = on.keys() & off.keys()
    assert len(both) >= 10
    assert {rid: on[rid] for rid in both} == {rid: off[rid] for rid in both}
