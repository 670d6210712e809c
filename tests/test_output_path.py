"""The one output path: Engine.step() returns outputs for exactly the requests that
changed, and those outputs are everything a driver needs (deltas, final results,
errors)."""

from __future__ import annotations

import pytest
import torch

from plait.runtime.engine import Engine

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def rand_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 40000, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=8192, max_running_requests=1,
                num_threads=1) as e:
        yield e


def test_step_outputs_hold_only_requests_that_changed(engine):
    """One request decodes while 50 others wait for a running slot: every step's outputs
    name only the decoding request (the waiting ones are not looked at)."""
    dec = engine.add_request(rand_ids(6, 1), {**GREEDY, "max_new_tokens": 12}, rid="dec")[0]
    while dec.output_len == 0:
        engine.step()
    idle = [engine.add_request(rand_ids(8, 100 + i), {**GREEDY, "max_new_tokens": 2}, rid=f"idle-{i}")[0]
            for i in range(50)]
    steps = 0
    while not dec.finished:
        outs = engine.step()
        steps += 1
        assert [o.rid for o in outs] == ["dec"], [o.rid for o in outs]
        assert all(r.output_len == 0 and not r.finished for r in idle)
    assert steps == 11  # one output per step, each with one new token
    final = engine.pop_result(dec)
    assert final["meta_info"]["completion_tokens"] == 12
    for r in idle:
        engine.abort(r.rid)
    outs = engine.step()  # aborted while waiting: reported once, by the next step
    assert sorted(o.rid for o in outs) == sorted(r.rid for r in idle)
    assert all(o.finished and o.finish_reason.type == "abort" and o.result is not None for o in outs)
    assert not engine.has_work() and engine.step() == []
    engine.check_invariants()


def test_deltas_concatenate_to_the_result_and_n_copies_are_grouped(engine):
    ids = rand_ids(7, 2)
    reqs = engine.add_request(ids, {**GREEDY, "max_new_tokens": 9, "n": 2}, rid="grp", return_logprob=True)
    texts: dict[int, str] = {0: "", 1: ""}
    tokens: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, int] = {0: 0, 1: 0}
    finals = {}
    while len(finals) < 2:
        for o in engine.step():
            assert o.group == "grp" and o.rid == f"grp#{o.index}"
            texts[o.index] += o.text
            tokens[o.index] += o.token_ids
            logprobs[o.index] += len(o.meta["output_token_logprobs"])
            if o.finished:
                finals[o.index] = o.result
    for i, r in enumerate(reqs):
        assert finals[i] == engine.pop_result(r)
        assert texts[i] == finals[i]["text"] and tokens[i] == finals[i]["output_ids"]
        assert logprobs[i] == 9 == len(finals[i]["meta_info"]["output_token_logprobs"])
        assert finals[i]["meta_info"]["finish_reason"] == {"type": "length", "length": 9}


def test_stop_string_ends_the_request_through_the_output_processor(engine):
    """Stop strings are matched on text after the step; the request then ends at once
    (its KV released) with the stop string trimmed, and nothing after it is streamed."""
    probe = engine.generate(input_ids=rand_ids(6, 3), sampling_params={**GREEDY, "max_new_tokens": 24})
    text = probe["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    r = engine.add_request(rand_ids(6, 3), {**GREEDY, "max_new_tokens": 24, "stop": stop}, rid="stop")[0]
    streamed = ""
    while not r.finished:
        for o in engine.step():
            streamed += o.text
    out = engine.pop_result(r)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == streamed == text[: text.index(stop)]
    assert r.row is None and out["meta_info"]["completion_tokens"] < 24  # ended early, KV returned
    engine.check_invariants()
