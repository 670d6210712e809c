"""No accepted request may break the engine: numerically extreme sampling parameters,
ids at the edge of the vocabulary, and a step that raises."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.errors import RequestError
from plait.runtime.engine import Engine
from plait.runtime.sampling_params import MAX_STOP_STRINGS

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, num_threads=1) as e:
        yield e


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40000, (n,), generator=g).tolist()


@pytest.mark.parametrize("params", [
    {"temperature": 1e-300, "max_new_tokens": 4},
    {"temperature": 5e-324, "max_new_tokens": 4},  # the smallest subnormal
    {"temperature": 1.0, "repetition_penalty": 1e-300, "max_new_tokens": 4},
    {"temperature": 100.0, "repetition_penalty": 2.0, "frequency_penalty": -2.0, "presence_penalty": -2.0,
     "max_new_tokens": 4},
    {"temperature": 1e-4, "top_p": 1e-300, "min_p": 1.0, "top_k": 10**9, "max_new_tokens": 4},
])
def test_extreme_accepted_sampling_values_generate(engine, params):
    out = engine.generate(input_ids=rand_ids(8, 1), sampling_params={**params, "seed": 3})
    assert out["meta_info"]["completion_tokens"] == 4
    assert all(0 <= t < engine.model_config.vocab_size for t in out["output_ids"])
    engine.check_invariants()


def test_tiny_temperature_is_greedy(engine):
    ids = rand_ids(8, 2)
    greedy = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 6})
    tiny = engine.generate(input_ids=ids, sampling_params={**GREEDY, "temperature": 1e-300, "max_new_tokens": 6})
    assert tiny["output_ids"] == greedy["output_ids"]


def test_stop_token_id_past_the_vocabulary_is_a_clear_error(engine):
    with pytest.raises(RequestError, match="stop_token_ids") as info:
        engine.generate(input_ids=rand_ids(4, 3), sampling_params={"min_new_tokens": 2, "stop_token_ids": [1000000]})
    assert info.value.param == "stop_token_ids" and info.value.status == 400
    assert not engine.has_work()


finite = st.floats(allow_nan=False, allow_infinity=False)
PARAMS = st.fixed_dictionaries({
    "max_new_tokens": st.integers(0, 6),
    "temperature": st.one_of(st.sampled_from([0.0, 5e-324, 1e-300, 1e-5, 100.0]), st.floats(0, 100)),
    "top_p": st.one_of(st.sampled_from([5e-324, 1e-300, 1.0]), st.floats(0, 1, exclude_min=True)),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2**62]), st.integers(-1, 100)),
    "min_p": st.one_of(st.sampled_from([0.0, 1.0, 5e-324]), st.floats(0, 1)),
    "frequency_penalty": st.one_of(st.sampled_from([-2.0, 2.0]), st.floats(-2, 2)),
    "presence_penalty": st.one_of(st.sampled_from([-2.0, 2.0]), st.floats(-2, 2)),
    "repetition_penalty": st.one_of(st.sampled_from([5e-324, 1e-300, 2.0]), st.floats(0, 2, exclude_min=True)),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "seed": st.one_of(st.none(), st.sampled_from([0, 2**63 - 1]), st.integers(0, 2**63 - 1)),
    "n": st.integers(1, 3),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, 2, 49151]), max_size=3),
}).flatmap(lambda d: st.integers(0, d["max_new_tokens"]).map(lambda m: {**d, "min_new_tokens": m}))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=PARAMS, logprobs=st.booleans(), top_n=st.integers(0, 5), length=st.integers(1, 12),
       seed=st.integers(0, 1000))
def test_fuzz_accepted_sampling_params_never_break_the_engine(engine, params, logprobs, top_n, length, seed):
    """Random, extreme but accepted parameters: each request completes with valid
    ids, and the engine keeps its accounting and keeps serving."""
    assert len(params["stop"]) <= MAX_STOP_STRINGS
    outs = engine.generate(input_ids=rand_ids(length, seed), sampling_params=params, return_logprob=logprobs,
                           top_logprobs_num=top_n if logprobs else 0)
    outs = outs if isinstance(outs, list) else [outs]
    assert len(outs) == params["n"]
    for o in outs:
        assert o["meta_info"]["completion_tokens"] <= params["max_new_tokens"]
        assert all(0 <= t < engine.model_config.vocab_size for t in o["output_ids"])
        assert o["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert not engine.has_work()
    engine.check_invariants()


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    baseline = engine.generate(input_ids=rand_ids(6, 4), sampling_params={**GREEDY, "max_new_tokens": 5})
    real = engine.runner.forward

    def forward(batch):
        if any(r.rid == "doomed" for r in batch.reqs):
            raise RuntimeError("simulated device fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "forward", forward)
    doomed = engine.add_request(rand_ids(9, 5), {**GREEDY, "max_new_tokens": 5}, rid="doomed")[0]
    outs = []
    while not doomed.finished:
        outs += engine.step()
    (failed,) = [o for o in outs if o.rid == "doomed"]
    assert failed.error is not None and failed.error.status == 500 and "simulated device fault" in failed.error.message
    with pytest.raises(RequestError, match="internal error"):
        engine.result(doomed)
    engine.check_invariants()
    again = engine.generate(input_ids=rand_ids(6, 4), sampling_params={**GREEDY, "max_new_tokens": 5})
    assert again["output_ids"] == baseline["output_ids"]


def test_a_decode_step_moves_results_to_the_host_once(engine, monkeypatch):
    """16 sampled requests decoding: each step transfers device results to the host at
    most once (the sampled ids); sampling, filters, min_new_tokens bans and penalties stay
    batched tensor ops.
    Counted by wrapping the tensor methods that copy to the host."""
    penalties = [{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.2}]
    reqs = [engine.add_request(rand_ids(6 + i, 200 + i), {"temperature": 0.9, "top_p": 0.9, "top_k": 40,
                                                          "min_p": 0.01, "max_new_tokens": 12, "ignore_eos": i % 2 == 0,
                                                          "min_new_tokens": 3,
                                                          "seed": i, **penalties[i % 3]})[0] for i in range(16)]
    while any(r.output_len == 0 for r in reqs):  # prefills done: every step from here decodes all 16
        engine.step()
    counts: list[int] = []
    calls = [0]
    for name in ("item", "tolist", "cpu", "numpy"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, **k):
            calls[0] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    while not all(r.finished for r in reqs):
        calls[0] = 0
        engine.step()
        counts.append(calls[0])
    monkeypatch.undo()
    assert len(counts) >= 5 and max(counts) <= 1, counts
    for r in reqs:
        engine.pop_result(r)
