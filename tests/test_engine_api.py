"""The Engine's public surface: sampling parameters, stop handling, n, seeds,
logprobs, bad input (a clear ValueError, and the engine serves correctly afterwards)."""

from __future__ import annotations

import re

import pytest
import torch

from plait.errors import RequestError
from plait.runtime import Engine, EngineConfig

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=4096, max_running_requests=16) as e:
        yield e


@pytest.fixture(scope="module")
def baseline(engine):
    return engine.generate("The weather today is", GREEDY)


def test_single_and_batch_shapes(engine, baseline):
    assert isinstance(baseline, dict)
    assert set(baseline) == {"text", "output_ids", "meta_info"}
    meta = baseline["meta_info"]
    assert meta["completion_tokens"] == 12 == len(baseline["output_ids"])
    assert meta["prompt_tokens"] == len(engine.tokenizer.encode("The weather today is", add_special_tokens=False))
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert baseline["text"] == engine.tokenizer.decode(baseline["output_ids"])
    outs = engine.generate(["The weather today is", "Another prompt"], [GREEDY, {**GREEDY, "max_new_tokens": 3}])
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0]["output_ids"] == baseline["output_ids"]
    assert len(outs[1]["output_ids"]) == 3
    by_ids = engine.generate(input_ids=engine.tokenizer.encode("The weather today is", add_special_tokens=False),
                             sampling_params=GREEDY)
    assert by_ids["output_ids"] == baseline["output_ids"]


def test_stop_string_is_trimmed(engine, baseline):
    text = baseline["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip()
    out = engine.generate("The weather today is", {**GREEDY, "stop": [stop, "zzzz-never"]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    assert stop not in out["text"]
    # SGLang's no_stop_trim (vLLM's include_stop_str_in_output): the stop string stays, streamed too
    kept = engine.generate("The weather today is", {**GREEDY, "stop": [stop], "no_stop_trim": True})
    assert kept["text"] == text[: text.index(stop) + len(stop)], kept
    assert kept["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    (r,) = engine.add_request(engine.tokenizer.encode("The weather today is", add_special_tokens=False),
                              {**GREEDY, "stop": [stop], "no_stop_trim": True})
    pieces = []
    while engine.has_work():
        pieces += [o.text for o in engine.step() if o.rid == r.rid]
    assert "".join(pieces) == kept["text"]  # the deltas: the held-back stop string is sent at the end


def test_stop_token_ids_and_min_new_tokens(engine, baseline):
    ids = baseline["output_ids"]
    out = engine.generate("The weather today is", {**GREEDY, "stop_token_ids": [ids[2]]})
    assert out["output_ids"] == ids[:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    # the first greedy token is a stop token: min_new_tokens forbids it at step 0
    out = engine.generate("The weather today is", {**GREEDY, "stop_token_ids": [ids[0]], "min_new_tokens": 4})
    assert out["output_ids"][0] != ids[0]
    assert len(out["output_ids"]) >= 4


def test_eos_ends_generation_unless_ignored(engine, baseline):
    ids = baseline["output_ids"]
    saved = engine.scheduler.eos_ids, engine.runner.sampler.eos_ids
    # pretend the model's EOS is the third greedy token
    engine.scheduler.eos_ids, engine.runner.sampler.eos_ids = frozenset({ids[2]}), [ids[2]]
    try:
        stopped = engine.generate("The weather today is", {**GREEDY, "ignore_eos": False})
        ignored = engine.generate("The weather today is", GREEDY)
        delayed = engine.generate("The weather today is", {**GREEDY, "ignore_eos": False, "min_new_tokens": 5})
    finally:
        engine.scheduler.eos_ids, engine.runner.sampler.eos_ids = saved
    assert stopped["output_ids"] == ids[:3]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[2]}
    assert ignored["output_ids"] == ids
    assert len(delayed["output_ids"]) >= 5 and delayed["output_ids"][2] != ids[2]


def test_seeded_sampling_is_reproducible_and_n_copies_differ(engine):
    p = {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True, "seed": 42}
    a = engine.generate("Tell me a story", p)
    b = engine.generate("Tell me a story", p)
    assert a["output_ids"] == b["output_ids"]
    c = engine.generate("Tell me a story", {**p, "seed": 43})
    assert c["output_ids"] != a["output_ids"]
    many = engine.generate("Tell me a story", {**p, "n": 3})
    assert isinstance(many, list) and len(many) == 3
    assert len({tuple(o["output_ids"]) for o in many}) == 3
    assert many[0]["output_ids"] == a["output_ids"]  # copy i uses seed + i
    assert many[1]["output_ids"] == c["output_ids"]
    # negative seeds are seeds (vLLM and OpenAI take a signed 64-bit integer), each its own
    neg = [engine.generate("Tell me a story", {**p, "seed": s})["output_ids"] for s in (-1, -1, -2, -(2**63))]
    assert neg[0] == neg[1] and len({tuple(o) for o in neg[1:] + [a["output_ids"]]}) == 4


def test_top_k_one_is_greedy_and_filters_restrict(engine, baseline):
    out = engine.generate("The weather today is", {**GREEDY, "temperature": 0.8, "top_k": 1, "seed": 1})
    assert out["output_ids"] == baseline["output_ids"]
    out = engine.generate("The weather today is", {**GREEDY, "temperature": 0.7, "top_p": 1e-6, "seed": 5})
    assert out["output_ids"] == baseline["output_ids"]  # top_p that keeps only the top token
    out = engine.generate("The weather today is", {**GREEDY, "temperature": 0.7, "min_p": 1.0, "seed": 9})
    assert out["output_ids"] == baseline["output_ids"]


def test_output_logprobs_and_top_logprobs(engine, baseline):
    out = engine.generate("The weather today is", GREEDY, return_logprob=True, top_logprobs_num=3, logprob_start_len=2)
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t in lps] == out["output_ids"] == baseline["output_ids"]
    for (lp, tok), top in zip(lps, meta["output_top_logprobs"]):
        assert len(top) == 3
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp)  # greedy picks the top token
        assert top[0][0] >= top[1][0] >= top[2][0]
    n_prompt = meta["prompt_tokens"]
    assert [t for _, t in meta["input_token_logprobs"]] == engine.tokenizer.encode(
        "The weather today is", add_special_tokens=False)[2:]
    assert len(meta["input_top_logprobs"]) == n_prompt - 2


def test_max_new_tokens_zero_scores_the_prompt(engine):
    out = engine.generate("Score this prompt please", {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(out["meta_info"]["input_token_logprobs"]) == out["meta_info"]["prompt_tokens"]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "x " * 1100}, "context length"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0.0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"temperature": float("nan")}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"not_a_param": 1}}, "not_a_param"),
        ({"prompt": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": 2.5}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"stop": [1, 2]}}, "stop"),
        ({"prompt": "hi", "sampling_params": {"n": 0}}, "n"),
        ({"prompt": "hi", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, "min_new_tokens"),
        ({"prompt": 5}, "prompt"),
        ({"input_ids": [1, -3]}, "input_ids"),
        ({"input_ids": [1, 10**9]}, "input_ids"),
        ({"prompt": "hi", "logprob_start_len": 99, "return_logprob": True}, "logprob_start_len"),
        ({"prompt": "hi", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"prompt": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ],
)
def test_bad_input_is_rejected_and_engine_keeps_serving(engine, baseline, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    assert not engine.scheduler.has_work()
    engine.check_invariants()
    assert engine.generate("The weather today is", GREEDY)["output_ids"] == baseline["output_ids"]


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"page_size": 0}, "page_size"),
        ({"schedule_policy": "random"}, "schedule_policy"),
        ({"device": "tpu"}, "device"),
        ({"dtype": "int8"}, "dtype"),
        ({"chunked_prefill_size": -5}, "chunked_prefill_size"),
        ({"attention_backend": "flash"}, "attention_backend"),
        ({"mem_fraction_static": 2.0}, "mem_fraction_static"),
        ({"num_threads": 0}, "num_threads"),
        ({"bogus": 1}, "bogus"),
        ({"cpu_gemm": "blas"}, "cpu_gemm"),
        ({"cpu_gemm": "onednn", "dtype": "bfloat16"}, "cpu_gemm"),
        ({"cpu_gemm": "native", "dtype": "bfloat16"}, "cpu_gemm"),
    ],
)
def test_bad_config_is_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig.from_kwargs(**kwargs)


def test_missing_model_path_is_a_clear_error():
    with pytest.raises((ValueError, FileNotFoundError), match="no/such/model/path.gguf"):
        Engine("/no/such/model/path.gguf")


def test_shutdown_and_context_manager(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=256) as e:
        assert e.generate("hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    with pytest.raises(RuntimeError, match="shut down"):
        e.generate("hi")


def test_weights_are_cast_before_they_are_materialised(tiny_model_factory, monkeypatch):
    """A model built on the meta device gets its target dtype before memory is allocated
    (allocating float32 and casting after needs both copies at once: OOM on big GPUs)."""
    from plait.runtime.model_loader import resolve_model
    from plait.runtime.models.llama import CausalLM

    cfg = resolve_model(str(tiny_model_factory("llama"))).load_config()
    seen: list[set[torch.dtype]] = []
    real = torch.nn.Module.to_empty

    def spy(self, *, device, recurse=True):
        seen.append({p.dtype for p in self.parameters()})
        return real(self, device=device, recurse=recurse)

    monkeypatch.setattr(torch.nn.Module, "to_empty", spy)
    with torch.device("meta"):
        model = CausalLM(cfg, max_pos=64)
    model.materialize(torch.device("cpu"), torch.bfloat16)
    assert seen == [{torch.bfloat16}]
    assert model.model.rotary.cos_sin_cache.dtype == torch.float32  # recomputed, on the device
    assert model.model.rotary.cos_sin_cache.device.type == "cpu"


def test_kv_pool_budget_follows_mem_fraction_static():
    """SGLang's rule: everything in use plus the pool stays within fraction * total."""
    from plait.runtime.memory import kv_pool_budget

    assert kv_pool_budget(0.85, free=60, total=100) == 45  # 40 in use + 45 = 85
    assert kv_pool_budget(0.95, free=100, total=100) == 95
    assert kv_pool_budget(0.3, free=50, total=100) <= 0  # 50 in use already exceeds 30
    assert EngineConfig(device="cpu").resolved_mem_fraction_static() == 0.3
    assert EngineConfig(device="cpu", mem_fraction_static=0.5).resolved_mem_fraction_static() == 0.5


def test_server_info_has_sglangs_top_level_names(engine):
    """SGLang's get_server_info puts its server args and scheduler facts at the top
    level (``info["max_total_num_tokens"]``, ``info["chunked_prefill_size"]``); plait
    kept its configuration under ``config`` only, so SGLang scripts reading them got a
    KeyError."""
    info = engine.server_info()
    pages = info["pool"]["total"]
    assert info["max_total_num_tokens"] == pages * engine.config.page_size > 0
    assert info["max_req_input_len"] == min(engine.context_len - 1, info["max_total_num_tokens"] - 1)
    for name in ("chunked_prefill_size", "max_running_requests", "page_size", "schedule_policy", "tp_size"):
        assert info[name] == info["config"][name] == getattr(engine.config, name)


def test_context_length_past_the_models_is_refused(tiny_model_factory, engine):
    """A context_length longer than the model's own is refused by name (SGLang and vLLM
    refuse it too); it was capped silently. Shorter ones are taken as given."""
    own = engine.model_config.context_length
    with pytest.raises(ValueError, match=rf"context_length={own + 1} .*at most {own}"):
        Engine(str(tiny_model_factory("llama")), kv_cache_tokens=256, context_length=own + 1)
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=256, context_length=own // 2) as shorter:
        assert shorter.context_len == own // 2


def test_logit_bias_bans_and_forces_tokens_and_keeps_logprobs(engine, baseline):
    ids = baseline["output_ids"]
    # -100 on the greedy first token: another first token; +100 on a token: it is chosen
    banned = engine.generate("The weather today is", {**GREEDY, "logit_bias": {str(ids[0]): -100}})
    assert banned["output_ids"][0] != ids[0]
    forced = engine.generate("The weather today is", {**GREEDY, "max_new_tokens": 4, "logit_bias": {"1234": 100}})
    assert forced["output_ids"] == [1234] * 4
    # under sampling, in a batch beside an unbiased request, with logprobs of the model's own
    # distribution (the bias is a sampling choice, as penalties are)
    both = engine.generate(["The weather today is"] * 2, [
        {**GREEDY, "temperature": 0.9, "seed": 5, "logit_bias": {1234: 100, 99: -100}},
        GREEDY,
    ], return_logprob=True)
    assert set(both[0]["output_ids"]) == {1234} and both[1]["output_ids"] == ids
    lp = both[0]["meta_info"]["output_token_logprobs"][0][0]
    assert lp < -1.0, lp  # the model's own logprob of token 1234, not ~0 after the bias
    # a grammar's mask wins over a bias
    out = engine.generate("Pick:", {**GREEDY, "regex": "(yes|no)", "logit_bias": {1234: 100}})
    assert out["text"] in ("yes", "no")
    for bad, says in (({"1234": 101}, "[-100, 100]"), ({"-1": 1}, "token id"), ({"x": 1}, "token id"),
                      ({"49152": 1}, "outside the vocabulary"), ({"1": float("nan")}, "[-100, 100]"), ([1], "object")):
        with pytest.raises(RequestError, match=re.escape(says)) as e:
            engine.generate("x", {**GREEDY, "logit_bias": bad})
        assert e.value.param == "logit_bias"


def test_add_request_with_text_says_it_takes_token_ids(engine):
    with pytest.raises(RequestError, match=r"got a str: add_request takes token ids \(engine.tokenizer.encode"):
        engine.add_request("The weather today is", GREEDY)
    engine.check_invariants()
