"""Scheduler behaviour on the real classes: chunking beside decode, policy order,
cache_salt isolation, abort."""

from __future__ import annotations

import pytest
import torch

from plait.runtime import Engine
from plait.runtime.request import Req
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.schedule_policy import order_waiting

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_a_short_prompt_starts_beside_a_long_one_being_filled(folder):
    """A prompt being filled took each step's whole budget first: a short one arriving
    during an 8,000-token prompt waited for all of it (24 s). Now it starts in the next
    step, the long one taking the rest of the budget; n > 1 siblings of the long one,
    which wait for its prefix anyway, keep nothing from it."""
    chunk = 64
    with Engine(folder, kv_cache_tokens=4096, chunked_prefill_size=chunk) as engine:
        long = engine.add_request(rand_ids(600, 3), {**GREEDY, "max_new_tokens": 2})[0]
        engine.step()
        short = engine.add_request(rand_ids(5, 4), {**GREEDY, "max_new_tokens": 2})[0]
        batch = engine.scheduler.schedule()
        assert {r.rid: n for r, n in batch.extends} == {long.rid: chunk - 5, short.rid: 5}
        engine.scheduler.process_batch(batch, engine.runner.forward(batch))
        assert short.output_len == 1 and long.output_len == 0
        engine.run_until_done([long, short])
        siblings = engine.add_request(rand_ids(600, 5), {**GREEDY, "max_new_tokens": 2, "n": 2})
        engine.step()
        batch = engine.scheduler.schedule()
        assert [(r.rid, n) for r, n in batch.extends] == [(siblings[0].rid, chunk)]
        engine.scheduler.process_batch(batch, engine.runner.forward(batch))
        engine.run_until_done(siblings)
        engine.check_invariants()


def test_long_prompt_is_chunked_while_decodes_advance(folder):
    chunk = 32
    with Engine(folder, kv_cache_tokens=4096, chunked_prefill_size=chunk) as engine:
        dec = engine.add_request(rand_ids(5, 1), {**GREEDY, "max_new_tokens": 40})[0]
        while dec.output_len == 0:
            engine.step()
        long = engine.add_request(rand_ids(300, 2), {**GREEDY, "max_new_tokens": 4})[0]
        chunks = []
        while long.output_len == 0:
            before_out, before_comp = dec.output_len, long.num_computed
            batch = engine.scheduler.schedule()
            assert dec in batch.decodes  # decoding never stalls behind the long prompt
            assert batch.num_tokens <= chunk
            engine.scheduler.process_batch(batch, engine.runner.forward(batch))
            assert dec.output_len == before_out + 1
            chunks.append(long.num_computed - before_comp)
        assert len(chunks) >= 300 // chunk
        assert max(chunks) <= chunk - 1  # the decode token takes one slot of the budget
        assert sum(chunks) == 300
        engine.run_until_done([dec, long])
        engine.check_invariants()


def test_no_chunking_prefills_a_long_prompt_in_one_step_beside_decodes(folder):
    """``chunked_prefill_size=-1`` (SGLang's "no chunking", as ``sgl.Runtime`` passes it)."""
    from plait.runtime.server.sglang_options import translate

    assert translate({"chunked_prefill_size": -1})["chunked_prefill_size"] == -1
    with Engine(folder, kv_cache_tokens=4096, chunked_prefill_size=-1, context_length=1024) as engine:
        decs = [engine.add_request(rand_ids(5 + i, i), {**GREEDY, "max_new_tokens": 40})[0] for i in range(2)]
        while any(d.output_len == 0 for d in decs):
            engine.step()
        long = engine.add_request(rand_ids(1020, 2), {**GREEDY, "max_new_tokens": 4})[0]  # all but 4 of the context
        batch = engine.scheduler.schedule()
        assert set(decs) <= set(batch.decodes) and batch.extends == [(long, 1020)]
        engine.scheduler.process_batch(batch, engine.runner.forward(batch))
        assert long.num_computed == 1020 and long.output_len == 1
        engine.run_until_done([*decs, long])
        engine.check_invariants()
    with pytest.raises(ValueError, match="chunked_prefill_size.*-1 .no chunking"):
        Engine(folder, chunked_prefill_size=-2)


def test_lpm_and_fcfs_order_differently(folder):
    shared = rand_ids(64, 3)
    with Engine(folder, kv_cache_tokens=4096, page_size=16) as engine:
        engine.generate(input_ids=shared + rand_ids(4, 4), sampling_params={**GREEDY, "max_new_tokens": 1})
        params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 1})
        cold = Req("cold", rand_ids(70, 5), params)  # arrives first, shares nothing
        warm = Req("warm", shared + rand_ids(6, 6), params)
        assert [r.rid for r in order_waiting("fcfs", [cold, warm], engine.cache)] == ["cold", "warm"]
        assert [r.rid for r in order_waiting("lpm", [cold, warm], engine.cache)] == ["warm", "cold"]
        assert [r.rid for r in order_waiting("dfs-weight", [cold, warm], engine.cache)][0] == "warm"


@pytest.mark.parametrize("policy,first", [("lpm", "warm"), ("fcfs", "cold")])
def test_policy_decides_admission(folder, policy, first):
    shared = rand_ids(64, 7)
    with Engine(folder, kv_cache_tokens=4096, max_running_requests=1, schedule_policy=policy) as engine:
        engine.generate(input_ids=shared + rand_ids(4, 8), sampling_params={**GREEDY, "max_new_tokens": 1})
        cold = engine.add_request(rand_ids(70, 9), {**GREEDY, "max_new_tokens": 2}, rid="cold")[0]
        warm = engine.add_request(shared + rand_ids(6, 10), {**GREEDY, "max_new_tokens": 2}, rid="warm")[0]
        engine.step()
        assert [r.rid for r in engine.scheduler.running] == [first]
        engine.run_until_done([cold, warm])
        assert warm.cached_tokens >= 64 and cold.cached_tokens == 0


def test_dfs_weight_keeps_sharers_together(folder):
    a, b = rand_ids(48, 11), rand_ids(48, 12)
    with Engine(folder, kv_cache_tokens=4096, schedule_policy="dfs-weight") as engine:
        engine.generate(input_ids=[a + [5], b + [5]], sampling_params={**GREEDY, "max_new_tokens": 1})
        params = SamplingParams.from_dict({**GREEDY, "max_new_tokens": 1})
        # arrival order interleaves the two groups; group b is heavier
        reqs = [Req(f"{g}{i}", (a if g == "a" else b) + rand_ids(3, 20 + i), params)
                for i, g in enumerate("abbab b".replace(" ", ""))]
        order = [r.rid[0] for r in order_waiting("dfs-weight", reqs, engine.cache)]
        assert order == ["b"] * 4 + ["a"] * 2


def test_cache_salt_isolates_namespaces(folder):
    prompt = rand_ids(80, 13)
    p = {**GREEDY, "max_new_tokens": 3}
    with Engine(folder, kv_cache_tokens=4096) as engine:
        first = engine.generate(input_ids=prompt, sampling_params=p, cache_salt="alice")
        other = engine.generate(input_ids=prompt, sampling_params=p, cache_salt="bob")
        again = engine.generate(input_ids=prompt, sampling_params=p, cache_salt="alice")
        plain = engine.generate(input_ids=prompt, sampling_params=p)
        assert first["meta_info"]["cached_tokens"] == 0
        assert other["meta_info"]["cached_tokens"] == 0
        assert again["meta_info"]["cached_tokens"] >= 64
        assert plain["meta_info"]["cached_tokens"] == 0
        assert first["output_ids"] == other["output_ids"] == again["output_ids"] == plain["output_ids"]
        engine.check_invariants()


def test_abort_waiting_and_running_frees_everything(folder):
    with Engine(folder, kv_cache_tokens=4096, max_running_requests=2, page_size=4) as engine:
        reqs = [engine.add_request(rand_ids(40 + i, 30 + i), {**GREEDY, "max_new_tokens": 50}, rid=f"r{i}")[0]
                for i in range(4)]
        for _ in range(3):
            engine.step()
        running = [r for r in reqs if r in engine.scheduler.running]
        waiting = [r for r in reqs if r in engine.scheduler.waiting]
        assert running and waiting
        assert engine.pool_usage()["locked"] > 0
        assert engine.abort(running[0].rid) and engine.abort(waiting[0].rid)
        assert not engine.abort("no-such-request")
        for r in (running[0], waiting[0]):
            assert r.finished and r.finish_reason.type == "abort"
        engine.check_invariants()
        rest = [r for r in reqs if not r.finished]
        engine.run_until_done(rest)
        assert all(r.finish_reason.to_dict() == {"type": "length", "length": 50} for r in rest)
        engine.check_invariants()
        usage = engine.pool_usage()
        assert usage["locked"] == 0 and usage["free"] + usage["evictable"] == usage["total"]
        assert engine.req_to_token.num_free_rows == 2
        # everything is returnable: a flush empties the cache completely
        assert engine.flush_cache()
        assert engine.pool_usage()["free"] == engine.pool_usage()["total"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_gets_host_tensors_when_the_page_table_is_on_another_device(page_size):
    """The page table lives on the device (CUDA in production; ``meta`` here, which has
    no data to read back), the radix cache on the host: the scheduler must never hand
    the cache a device tensor (that crashed the first CUDA prefill of 16+ tokens)."""
    from plait.runtime.config import EngineConfig
    from plait.runtime.memory import PageAllocator, ReqToToken
    from plait.runtime.radix_cache import RadixCache
    from plait.runtime.scheduler import Scheduler

    cfg = EngineConfig(page_size=page_size, chunked_prefill_size=24, max_running_requests=4)
    allocator = PageAllocator(512 // page_size + 1, page_size)
    cache = RadixCache(allocator)
    handed: list[torch.Tensor] = []
    real_insert, real_match = cache.insert, cache.match_prefix

    def insert(tokens, slots, salt=None):
        handed.append(slots)
        return real_insert(tokens, slots, salt)

    def match(*args, **kwargs):
        m = real_match(*args, **kwargs)
        handed.append(m.slots)
        return m

    cache.insert, cache.match_prefix = insert, match
    sched = Scheduler(cfg, allocator, ReqToToken(4, 256, "meta"), cache, 256, eos_ids=frozenset({2}))
    shared = rand_ids(40, 7)
    reqs = [Req(f"r{i}", shared + rand_ids(5 + i, 50 + i), SamplingParams(max_new_tokens=6, ignore_eos=True))
            for i in range(6)]
    for r in reqs[:3]:
        sched.add_request(r)
    steps = 0
    while sched.has_work():
        batch = sched.schedule()
        sched.process_batch(batch, {r.rid: [3 + steps % 50] for r in batch.reqs})  # a fake model: fixed ids
        steps += 1
        if steps == 2:
            for r in reqs[3:]:  # queued while the first ones hold the shared prefix
                sched.add_request(r)
        sched.check_invariants()
    assert all(r.finished and r.output_len == 6 for r in reqs)
    assert sum(r.cached_tokens for r in reqs[3:]) >= 3 * (40 // page_size * page_size)  # the prefix was shared
    assert handed and all(t.device.type == "cpu" for t in handed)
    u = sched.pool_usage()
    assert u["locked"] == 0 and u["free"] + u["evictable"] == u["total"]
