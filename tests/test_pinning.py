"""Pinned prefixes in the engine: a pin prefills a prefix and holds a radix lock on it
until unpinned or its TTL passes, bounded by a pin budget."""

from __future__ import annotations

import pytest
import torch

from plait.errors import RequestError
from plait.runtime import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 2}
POOL_TOKENS = 512  # 32 pages of 16


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture
def engine(folder):
    with Engine(folder, kv_cache_tokens=POOL_TOKENS, page_size=16, num_threads=1) as e:
        yield e


def settle(engine: Engine) -> None:
    while engine.scheduler.has_work():
        engine.step()


def cached_len(engine: Engine, ids: list[int]) -> int:
    return engine.cache.match_prefix(ids).length


def pressure(engine: Engine, seed: int, rounds: int = 6) -> None:
    """Run unrelated prompts that together need more than the free pool."""
    for i in range(rounds):
        engine.generate(input_ids=rand_ids(150, seed + i), sampling_params=GREEDY)
        engine.check_invariants()


def test_pinned_prefix_survives_eviction_and_unpinned_one_does_not(engine):
    pinned, loose = rand_ids(128, 1), rand_ids(128, 2)
    engine.generate(input_ids=loose + [5], sampling_params=GREEDY)  # cached, not pinned
    pin_id = engine.pin_prefix(pinned, ttl_s=60)
    assert engine.pin_info(pin_id)["state"] == "pending"
    settle(engine)
    info = engine.pin_info(pin_id)
    assert info["state"] == "active" and info["num_tokens"] == 128
    assert engine.pool_usage()["locked"] == 128 // 16
    engine.check_invariants()

    pressure(engine, seed=100)
    assert cached_len(engine, pinned) == 128  # survived
    assert cached_len(engine, loose) == 0  # evicted under the same pressure

    # a request on the pinned prefix is served from it
    out = engine.generate(input_ids=pinned + [7, 8], sampling_params=GREEDY)
    assert out["meta_info"]["cached_tokens"] == 128


def test_unpinned_prefix_becomes_evictable(engine):
    prefix = rand_ids(96, 3)
    pin_id = engine.pin_prefix(prefix, ttl_s=60)
    settle(engine)
    usage = engine.pool_usage()
    assert usage["locked"] == 96 // 16 and usage["evictable"] == 0
    assert engine.unpin(pin_id) is True
    assert engine.unpin(pin_id) is False  # already released
    usage = engine.pool_usage()
    assert usage["locked"] == 0 and usage["evictable"] == 96 // 16
    engine.check_invariants()
    pressure(engine, seed=200)
    assert cached_len(engine, prefix) == 0


def test_ttl_expiry_releases_the_lock(engine):
    now = [1000.0]
    engine.pins.clock = lambda: now[0]
    pin_id = engine.pin_prefix(rand_ids(64, 4), ttl_s=5)
    settle(engine)
    assert engine.pin_info(pin_id)["state"] == "active"
    now[0] += 4.0
    assert engine.expire_pins() == []
    now[0] += 2.0
    engine.generate(input_ids=rand_ids(20, 5), sampling_params=GREEDY)  # step() expires pins
    assert engine.pin_info(pin_id) is None
    assert engine.pool_usage()["locked"] == 0
    engine.check_invariants()


def test_pin_budget_bounds_pins(engine):
    budget = engine.pins.budget_tokens
    assert 0 < budget < POOL_TOKENS + 16  # a fraction of the pool
    first = engine.pin_prefix(rand_ids(budget - 32, 6), ttl_s=60)
    with pytest.raises(ValueError, match="pin budget"):
        engine.pin_prefix(rand_ids(64, 7), ttl_s=60)
    settle(engine)
    small = engine.pin_prefix(rand_ids(32, 8), ttl_s=60)  # exactly fits
    engine.unpin(first)
    engine.pin_prefix(rand_ids(64, 9), ttl_s=60)  # fits again
    settle(engine)
    assert engine.pins.used_tokens <= budget
    # requests still run with the pinned share held
    out = engine.generate(input_ids=rand_ids(100, 10), sampling_params=GREEDY)
    assert out["meta_info"]["completion_tokens"] == 2
    engine.unpin(small)
    engine.check_invariants()


@pytest.mark.parametrize("kwargs,field", [
    ({"ttl_s": 0}, "ttl_s"), ({"ttl_s": float("nan")}, "ttl_s"), ({"ttl_s": "long"}, "ttl_s"),
    ({"input_ids": []}, "prompt is empty"), ({"input_ids": [1, -2]}, "input_ids"),
    ({"cache_salt": 3}, "cache_salt"),
])
def test_bad_pins_are_rejected(engine, kwargs, field):
    args = {"input_ids": rand_ids(20, 11), "ttl_s": 10.0, **kwargs}
    with pytest.raises(ValueError, match=field):
        engine.pin_prefix(**args)
    assert len(engine.pins) == 0 and not engine.scheduler.has_work()


def test_pin_of_cached_prefix_is_immediate_and_unpin_of_pending_aborts(engine):
    prefix = rand_ids(80, 12)
    engine.generate(input_ids=prefix + [3], sampling_params=GREEDY)
    pin_id = engine.pin_prefix(prefix, ttl_s=60)
    assert engine.pin_info(pin_id)["state"] == "active" and not engine.scheduler.has_work()
    engine.unpin(pin_id)

    pending = engine.pin_prefix(rand_ids(80, 13), ttl_s=60)
    assert engine.scheduler.has_work()
    assert engine.unpin(pending)
    assert not engine.scheduler.has_work()
    assert engine.pool_usage()["locked"] == 0
    engine.check_invariants()


def test_pins_share_with_requests_queued_behind_them_and_stay_internal(engine):
    prefix = rand_ids(128, 14)
    pin_id = engine.pin_prefix(prefix, ttl_s=60)
    reqs = [engine.add_request(prefix + rand_ids(8, 20 + i), GREEDY)[0] for i in range(3)]
    finished = []
    while engine.scheduler.has_work():
        finished += [o for o in engine.step() if o.finished]
    assert {o.rid for o in finished} == {r.rid for r in reqs}  # the pin's prefill is not reported
    assert sum(r.cached_tokens for r in reqs) >= 2 * 128  # all but at most one reused the prefix
    assert engine.pin_info(pin_id)["state"] == "active"


def test_flush_cache_releases_pins(engine):
    pin_id = engine.pin_prefix(rand_ids(64, 15), ttl_s=60)
    settle(engine)
    assert engine.flush_cache() is True
    assert engine.pin_info(pin_id) is None
    usage = engine.pool_usage()
    assert usage["locked"] == usage["evictable"] == 0
    engine.check_invariants()


def test_refused_salt_flush_keeps_that_salts_pins(folder):
    # a flush refused because the salt's requests run changes nothing: the pins stay
    with Engine(folder, kv_cache_tokens=POOL_TOKENS, page_size=16, num_threads=1, chunked_prefill_size=32) as engine:
        refused_salt_flush(engine)


def refused_salt_flush(engine: Engine) -> None:
    pin_id = engine.pin_prefix(rand_ids(64, 16), ttl_s=60, cache_salt="a")
    settle(engine)
    (req,) = engine.add_request(rand_ids(40, 17), {**GREEDY, "max_new_tokens": 32}, cache_salt="a")
    engine.step()
    assert req in engine.scheduler.running
    assert engine.flush_cache("a") is False
    assert engine.pin_info(pin_id)["state"] == "active"
    engine.abort(req.rid)
    settle(engine)
    assert engine.flush_cache("a") is True and engine.pin_info(pin_id) is None
    # a pin still prefilling is released with the flush, not counted as a running request
    pending = engine.pin_prefix(rand_ids(96, 18), ttl_s=60, cache_salt="b")
    engine.step()  # its first 32-token chunk: the pin's prefill runs
    assert engine.pin_info(pending)["state"] == "pending" and engine.scheduler.running
    assert engine.flush_cache("b") is True and engine.pin_info(pending) is None
    settle(engine)
    engine.check_invariants()


def test_pin_budget_fraction_is_a_config_field(folder):
    with Engine(folder, kv_cache_tokens=256, page_size=16, num_threads=1, pin_budget_fraction=0.25) as e:
        pool_tokens = e.allocator.total_pages * 16
        assert e.pins.budget_tokens == pool_tokens // 4
        with pytest.raises(ValueError, match="pin budget"):
            e.pin_prefix(rand_ids(pool_tokens // 4 + 16, 30), ttl_s=60)
    with Engine(folder, kv_cache_tokens=256, page_size=16, num_threads=1, pin_budget_fraction=0) as e:
        with pytest.raises(ValueError, match="pin budget"):  # 0 turns pinning off
            e.pin_prefix(rand_ids(16, 31), ttl_s=60)
    for bad in (-0.1, 0.95, "half", True):
        with pytest.raises(ValueError, match="pin_budget_fraction"):
            Engine(folder, kv_cache_tokens=256, pin_budget_fraction=bad)


def test_pin_prefill_that_cannot_fit_fails_cleanly(folder):
    with Engine(folder, kv_cache_tokens=64, page_size=16, num_threads=1, context_length=256) as e:
        e.pins.budget_tokens = 10_000
        with pytest.raises(RequestError, match="KV cache holds 64 tokens"):  # refused up front, as requests are
            e.pin_prefix(rand_ids(200, 16), ttl_s=60)
        assert e.pins.used_tokens == 0 and not e.scheduler.has_work()
        e.check_invariants()
