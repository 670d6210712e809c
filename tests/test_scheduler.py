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
