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

