"""Draft-free speculative decoding (``speculative="ngram"``): the proposer, and outputs
identical to non-speculative decoding under greedy (tokens, text, finish reasons,
logprobs), with constraints, stop strings, jump-forward and retraction; the sampled
acceptance rule keeps the distribution."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from plait.runtime import Engine, EngineConfig
from plait.runtime.request import Req
from plait.runtime.sampler import Sampler
from plait.runtime.sampling_params import SamplingParams
from plait.runtime.server.sglang_options import translate
from plait.runtime.speculative import propose, propose_ngram

GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 40}
NUM_CYCLES, CYCLE = 8, 6


# -- the proposer --------------------------------------------------------------------------------
def test_propose_ngram_takes_the_longest_suffix_seen_before_and_its_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    ctx = [7, 1, 2, 9, 8, 1, 2, 3, 4, 5, 1, 2]
    # suffix [1, 2] occurs at 1 and 5: the latest (5) is followed by 3 4 5
    assert propose_ngram(ctx, 3, 1, 4) == [3, 4, 5]
    assert propose_ngram(ctx, 1, 1, 4) == [3]
    # [9, 1, 2] beats [1, 2] when it occurred: a longer match wins over a later one
    ctx2 = [9, 1, 2, 6, 6, 1, 2, 3, 9, 1, 2]
    assert propose_ngram(ctx2, 2, 1, 3) == [6, 6]
    assert propose_ngram(ctx2, 2, 1, 2) == [3, 9]  # with n <= 2 only [1, 2] is looked up
    assert propose_ngram(ctx2, 2, 4, 5) == []  # no 4-gram repeats
    assert propose_ngram([1, 2, 3], 4, 1, 3) == []
    assert propose_ngram([5], 4, 1, 3) == []
    assert propose_ngram(ctx, 0, 1, 3) == []


def test_propose_ngram_continues_a_short_period_and_ignores_matches_across_token_bytes():
    assert propose_ngram([5, 5, 5, 5], 3, 1, 3) == [5, 5, 5]
    assert propose_ngram([4, 1, 2, 1, 2, 1], 5, 1, 3) == [2, 1, 2, 1, 2]
    # ids 256 and 1 share bytes (int32 little-endian 00 01 00 00 / 01 00 00 00): a byte
    # search that is not aligned on tokens would find [1] inside 256
    assert propose_ngram([256, 7, 1], 2, 1, 1) == []
    assert propose_ngram([1, 7, 256, 3, 1], 2, 1, 1) == [7, 256]


def test_propose_declines_for_opt_out_penalties_and_no_room():
    ctx = [3, 4, 5, 3, 4]
    base = Req("a", ctx, SamplingParams(max_new_tokens=8))
    assert propose(base, 4, 1, 3).tokens == [5, 3, 4, 5]
    assert propose(base, 2, 1, 3).tokens == [5, 3]
    assert propose(base, 0, 1, 3) is None
    assert propose(Req("b", ctx, SamplingParams(max_new_tokens=8, speculative=False)), 4, 1, 3) is None
    assert propose(Req("c", ctx, SamplingParams(max_new_tokens=8, repetition_penalty=1.2)), 4, 1, 3) is None


def test_options_are_validated_and_sglang_names_map_to_them():
    with pytest.raises(ValueError, match="speculative='eagle' is invalid; allowed: none, ngram"):
        EngineConfig(speculative="eagle")
    with pytest.raises(ValueError, match="speculative_ngram_max=1 is invalid"):
        EngineConfig(speculative_ngram_min=3, speculative_ngram_max=1)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens=0"):
        EngineConfig(speculative_num_draft_tokens=0)
    assert translate({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 6,
                      "speculative_ngram_max_match_window_size": 8}) == \
        {"speculative": "ngram", "speculative_num_draft_tokens": 6, "speculative_ngram_max": 8}
    assert translate({"speculative_algorithm": "LOOKAHEAD"}) == {"speculative": "ngram"}
    with pytest.raises(ValueError, match="speculative=1 is invalid"):
        SamplingParams.from_dict({"speculative": 1})


# -- a tiny model that repeats itself ---------------------------------------------------------------
@pytest.fixture(scope="module")
def loopy(tmp_path_factory, tiny_model_factory) -> tuple[str, list[int]]:
    """The tiny random llama, edited so that each of 48 tokens mostly predicts its
    successor on one of 8 cycles of 6 (its embedding scaled up, the successor's LM-head
    row aligned with it); attention and MLPs still move the logits, so outputs depend
    on the context but fall into loops that n-gram drafts predict."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("loopy")
    src = Path(tiny_model_factory("llama"))
    model = AutoModelForCausalLM.from_pretrained(src)
    g = torch.Generator().manual_seed(0)
    cycle = (torch.randperm(40000, generator=g)[: NUM_CYCLES * CYCLE] + 1000).tolist()
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for i, t in enumerate(cycle):
            nxt = cycle[(i + 1) % CYCLE + i // CYCLE * CYCLE]
            emb[t] *= 8
            head[nxt] = 4 * emb[t] / emb[t].norm() * emb.shape[1] ** 0.5
    model.save_pretrained(folder)
    for f in src.iterdir():  # the tokenizer's files
        if not (folder / f.name).exists():
            (folder / f.name).write_bytes(f.read_bytes())
    return str(folder), cycle


def loopy_prompts(cycle: list[int], n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(cycle) for _ in range(3)] + [rng.randrange(3, 900) for _ in range(3)] + [rng.choice(cycle)]
            for _ in range(n)]


@pytest.fixture(scope="module")
def engines(loopy):
    folder, _ = loopy
    with Engine(folder, kv_cache_tokens=4096) as plain, Engine(folder, kv_cache_tokens=4096, speculative="ngram") as spec:
        yield plain, spec


def both(engines, prompts, params, **kw):
    plain, spec = engines
    a = plain.generate(input_ids=prompts, sampling_params=params, **kw)
    b = spec.generate(input_ids=prompts, sampling_params=params, **kw)
    spec.check_invariants()
    return a, b


def opted_out(params):
    """The same params without drafting: the non-speculative path of the same engine."""
    if isinstance(params, list):
        return [opted_out(p) for p in params]
    return {**params, "speculative": False}


def same(a, b):
    """Everything but timing."""
    for x, y in zip(a, b):
        assert y["output_ids"] == x["output_ids"]
        assert y["text"] == x["text"]
        assert y["meta_info"]["finish_reason"] == x["meta_info"]["finish_reason"]
        assert y["meta_info"]["completion_tokens"] == x["meta_info"]["completion_tokens"]


def test_greedy_outputs_are_identical_and_drafts_are_accepted(engines, loopy):
    _, spec = engines
    before = spec.stats()
    a, b = both(engines, loopy_prompts(loopy[1], 4), GREEDY)
    same(a, b)
    s = spec.stats()
    verified = s["spec_verify_steps"] - before["spec_verify_steps"]
    accepted = s["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert verified > 0 and accepted > 0
    assert accepted <= s["spec_draft_tokens"] - before["spec_draft_tokens"]
    # fewer forward steps than tokens: each verify step kept 1 + its accepted drafts
    assert s["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("page_size, draft", [(1, 3), (16, 7)])
def test_page_sizes_draft_lengths_and_max_new_tokens(loopy, page_size, draft):
    folder, cycle = loopy
    prompts = loopy_prompts(cycle, 5, seed=page_size)
    params = [{**GREEDY, "max_new_tokens": m} for m in (1, 2, 5, 17, 33)]
    with Engine(folder, kv_cache_tokens=2048, page_size=page_size, speculative="ngram",
                speculative_num_draft_tokens=draft, speculative_ngram_min=1) as spec:
        a = spec.generate(input_ids=prompts, sampling_params=opted_out(params))
        b = spec.generate(input_ids=prompts, sampling_params=params)
        spec.check_invariants()
        assert spec.stats()["spec_accepted_tokens"] > 0
    same(a, b)
    assert [len(o["output_ids"]) for o in b] == [1, 2, 5, 17, 33]


def test_logprobs_are_those_of_the_non_speculative_run(engines, loopy):
    _, spec = engines
    before = spec.stats()["spec_accepted_tokens"]
    a, b = both(engines, loopy_prompts(loopy[1], 3, seed=5), {**GREEDY, "max_new_tokens": 30},
                return_logprob=True, top_logprobs_num=3)
    same(a, b)
    assert spec.stats()["spec_accepted_tokens"] > before
    for x, y in zip(a, b):
        mx, my = x["meta_info"], y["meta_info"]
        assert len(my["output_token_logprobs"]) == len(my["output_top_logprobs"]) == 30
        assert [t for _, t in my["output_token_logprobs"]] == y["output_ids"]
        for (lx, tx), (ly, ty) in zip(mx["output_token_logprobs"], my["output_token_logprobs"]):
            assert ty == tx and ly == pytest.approx(lx, abs=1e-4)
        for rx, ry in zip(mx["output_top_logprobs"], my["output_top_logprobs"]):
            assert [t for _, t in ry] == [t for _, t in rx]
            assert [v for v, _ in ry] == pytest.approx([v for v, _ in rx], abs=1e-4)


def test_stop_strings_stop_ids_and_min_new_tokens(engines, loopy):
    plain, _ = engines
    prompts = loopy_prompts(loopy[1], 4, seed=9)
    ref = plain.generate(input_ids=prompts, sampling_params=GREEDY)
    params = []
    for i, o in enumerate(ref):
        ids, text = o["output_ids"], o["text"]
        if i == 0:  # a stop string from the middle of the output
            params.append({**GREEDY, "stop": [text[len(text) // 2 : len(text) // 2 + 4]]})
        elif i == 1:  # a stop id that appears late, after loops were drafted
            params.append({**GREEDY, "stop_token_ids": [ids[25]]})
        elif i == 2:  # the first token is a stop id, banned until 10 tokens are out
            params.append({**GREEDY, "stop_token_ids": [ids[0]], "min_new_tokens": 10})
        else:  # stop strings that never match, held back while they might
            params.append({**GREEDY, "stop": ["zz-never", text[-3:] + "q"]})
    a, b = both(engines, prompts, params)
    same(a, b)
    assert a[0]["meta_info"]["finish_reason"]["type"] == "stop" and len(a[0]["output_ids"]) < 40
    assert a[1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ref[1]["output_ids"][25]}
    assert len(a[2]["output_ids"]) >= 10


def test_streamed_pieces_concatenate_to_the_text(engines, loopy):
    _, spec = engines
    prompt = loopy_prompts(loopy[1], 1, seed=3)[0]
    (r,) = spec.add_request(prompt, {**GREEDY, "stop": ["zz-never"]})
    pieces, ids = [], []
    while not r.finished or spec.has_work():
        for o in spec.step():
            if o.rid == r.rid:
                pieces.append(o.text)
                ids += o.token_ids
    final = spec.pop_result(r)
    assert "".join(pieces) == final["text"] and ids == final["output_ids"]


def test_a_stop_string_inside_a_multi_token_step_ends_the_output_at_its_token(engines):
    """Several tokens appended in one step (verified drafts): the output is cut after
    the token that completes the stop string, logprob entries with it, even when the
    step ended on EOS."""
    from plait.runtime.output_processor import OutputProcessor
    from plait.runtime.request import FinishReason, LogprobState, ReqStatus

    _, spec = engines
    tok = spec.tokenizer
    words = [tok.encode(w, add_special_tokens=False) for w in ("Hello", " alpha", " beta", " gamma", " delta")]
    ids = [t for w in words for t in w]
    cut = sum(len(w) for w in words[:4])  # " gamma" completes with the last token of words[3]
    for ended_by_eos in (False, True):
        proc = OutputProcessor(tok, spec.scheduler)
        r = Req("x", [5, 6], SamplingParams(stop=["a gam", "never"]), logprobs=LogprobState(top_n=1))
        r.status = ReqStatus.RUNNING
        proc.start(r)
        for t in ids + ([2] if ended_by_eos else []):
            r.append_token(t)
            r.logprobs.output_token.append([-1.0, t])
            r.logprobs.output_top.append([[-1.0, t]])
        if ended_by_eos:
            r.status, r.finish_reason = ReqStatus.FINISHED, FinishReason.stop(2)
        (out,) = proc.process([r])
        assert out.finish_reason == FinishReason.stop("a gam")
        assert r.output_ids == ids[:cut] and out.result["output_ids"] == ids[:cut]
        assert out.result["text"] == "Hello alpha bet"
        assert [t for _, t in out.result["meta_info"]["output_token_logprobs"]] == ids[:cut]
        assert len(out.result["meta_info"]["output_top_logprobs"]) == cut


SCHEMA = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]},
                                                    "maxItems": 6},
                                           "name": {"type": "string", "maxLength": 12}},
          "required": ["tags", "name"]}


@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_outputs_are_identical(loopy, jump_forward):
    """Both grammar backends (drafts cut by the grammar, a mask per verified position)
    beside a free request, with and without jump-forward."""
    folder, cycle = loopy
    prompts = loopy_prompts(cycle, 4, seed=11)
    params = [{**GREEDY, "max_new_tokens": 60, "json_schema": SCHEMA, "grammar_backend": "outlines"},
              {**GREEDY, "max_new_tokens": 60, "json_schema": SCHEMA, "grammar_backend": "llguidance"},
              {**GREEDY, "max_new_tokens": 30, "regex": "(ab|cd|ef){2,12}"},
              {**GREEDY, "max_new_tokens": 30}]
    with Engine(folder, kv_cache_tokens=2048, disable_jump_forward=not jump_forward, speculative="ngram",
                speculative_ngram_min=1) as spec:
        a = spec.generate(input_ids=prompts, sampling_params=opted_out(params))
        drafted = spec.stats()["spec_draft_tokens"]
        b = spec.generate(input_ids=prompts, sampling_params=params)
        spec.check_invariants()
        assert drafted == 0 and spec.stats()["spec_draft_tokens"] > 0
    same(a, b)
    for o in a[:2]:
        assert set(json.loads(o["text"])) == {"tags", "name"}


def test_opting_out_never_drafts(engines, loopy):
    _, spec = engines
    before = spec.stats()["spec_verify_steps"]
    spec.generate(input_ids=loopy_prompts(loopy[1], 2, seed=4), sampling_params={**GREEDY, "speculative": False})
    assert spec.stats()["spec_verify_steps"] == before


def test_retraction_under_a_small_pool_keeps_outputs_and_invariants(engines, loopy):
    folder, cycle = loopy
    prompts = loopy_prompts(cycle, 6, seed=21)
    params = {**GREEDY, "max_new_tokens": 40}
    opts = dict(kv_cache_tokens=128, page_size=4, max_running_requests=6, chunked_prefill_size=64)
    ref = engines[0].generate(input_ids=prompts, sampling_params=params)
    with Engine(folder, speculative="ngram", **opts) as spec:
        reqs = [spec.add_request(p, params)[0] for p in prompts]
        while spec.has_work():
            spec.step()
            spec.check_invariants()
        out = [spec.pop_result(r) for r in reqs]
        assert spec.stats()["retractions"] > 0 and spec.stats()["spec_accepted_tokens"] > 0
    same(ref, out)


# -- sampled: the acceptance rule keeps the distribution ----------------------------------------
@pytest.mark.parametrize("counter_rng", [False, True])
def test_sampled_verification_draws_from_the_model_distribution(counter_rng):
    """Fixed logits at both verified positions, draft token 2 (likely at row 0) and 0
    (unlikely at row 1): the first token must follow p0 and, after an accepted draft,
    the second must follow p1 — whatever the draft."""
    vocab, n = 6, 12000
    row0 = torch.tensor([0.5, 1.0, 2.0, -1.0, 0.0, 1.5])
    row1 = torch.tensor([-0.5, 2.0, 0.0, 1.0, -2.0, 0.5])
    temp = 0.8
    reqs = [Req(f"r{i}", [1, 2, 3], SamplingParams(temperature=temp, max_new_tokens=8), seed=1000 + i,
                generator=torch.Generator().manual_seed(1000 + i)) for i in range(n)]
    logits = torch.stack([row0, row1]).repeat(n, 1)
    sampler = Sampler(n, torch.device("cpu"), [], counter_rng=counter_rng)
    outs = sampler.verify(logits, reqs, [[2]] * n)
    assert all(1 <= len(o) <= 2 and (len(o) == 1 or o[0] == 2) for o in outs)
    p0, p1 = (row0 / temp).softmax(-1), (row1 / temp).softmax(-1)
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=vocab) / n
    assert first.tolist() == pytest.approx(p0.tolist(), abs=0.02)
    seconds = [o[1] for o in outs if len(o) == 2]
    assert len(seconds) / n == pytest.approx(p0[2].item(), abs=0.02)  # the draft is kept w.p. p0(draft)
    second = torch.bincount(torch.tensor(seconds), minlength=vocab) / len(seconds)
    assert second.tolist() == pytest.approx(p1.tolist(), abs=0.03)
    # an unlikely draft is mostly replaced by a draw from the rest, still following p0
    outs = sampler.verify(torch.stack([row0, row1]).repeat(n, 1), reqs, [[3]] * n)
    first = torch.bincount(torch.tensor([o[0] for o in outs]), minlength=vocab) / n
    assert first.tolist() == pytest.approx(p0.tolist(), abs=0.02)


def test_sampled_requests_draft_and_finish_validly(engines, loopy):
    _, spec = engines
    before = spec.stats()["spec_verify_steps"]
    params = {"temperature": 0.7, "top_k": 20, "ignore_eos": True, "max_new_tokens": 16, "seed": 3}
    outs = spec.generate(input_ids=loopy_prompts(loopy[1], 2, seed=8), sampling_params=params)
    assert all(len(o["output_ids"]) == 16 for o in outs)
    assert spec.stats()["spec_verify_steps"] > before
    spec.check_invariants()


# -- the default model ------------------------------------------------------------------------------
def test_default_model_json_extraction_is_identical():
    text = ("Invoice 2231 from Acme Tools, dated 2024-03-18, total 412.50 EUR, for 3 hammers and 12 boxes of "
            "nails, shipped to Berlin.")
    prompt = (f"<|im_start|>user\nExtract the invoice as JSON with keys number, vendor, date, total, currency, "
              f"city.\n{text}<|im_end|>\n<|im_start|>assistant\n")
    params = {"temperature": 0.0, "max_new_tokens": 32}
    with Engine(None, kv_cache_tokens=1024, speculative="ngram") as spec:
        a = spec.generate(prompt, opted_out(params))
        b = spec.generate(prompt, params)
        s = spec.stats()
        spec.check_invariants()
    same([a], [b])
    assert s["spec_accepted_tokens"] > 0
