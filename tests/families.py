"""Shared checks for the model-family tests (test_models_*.py): a tiny random model of a
family built with transformers and saved as a folder, its Hugging Face greedy
continuations and prompt logprobs, and the engine runs compared against them (fresh and
from the prefix cache, with the engine options a test picks -- small prefill chunks,
page sizes, attention backends -- and under forced retraction)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from conftest import TINY_VOCAB, hf_greedy, hf_prompt_logprobs
from test_engine_exactness import LOGPROB_ATOL, check_outputs, make_prompts

from plait.runtime import Engine

MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}
COMMON = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)


RETRACT_PROMPTS, RETRACT_LEN = 8, 30


def retraction_prompts() -> list[list[int]]:
    """Distinct prompts of one length: a pool that holds all of them and little more
    admits them all, and their decodes must then retract some."""
    g = torch.Generator().manual_seed(99)
    return [torch.randint(3, 40000, (RETRACT_LEN,), generator=g).tolist() for _ in range(RETRACT_PROMPTS)]


class FamilyRefs:
    """A saved tiny model and transformers' outputs for :func:`make_prompts` (greedy and
    prompt logprobs) and for :func:`retraction_prompts` (greedy)."""

    def __init__(self, folder: Path, prompts: list[list[int]], greedy: list[list[int]], logprobs: list[torch.Tensor],
                 retract_greedy: list[list[int]]):
        self.folder, self.prompts, self.greedy, self.logprobs = folder, prompts, greedy, logprobs
        self.retract_greedy = retract_greedy


def build_refs(folder: Path, tokenizer_dir: Path, config: Any, seed: int = 0, n_prompts: int = 8) -> FamilyRefs:
    """Save a random model of ``config`` (+ the tokenizer) into ``folder``; HF references."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # as saved
    prompts = make_prompts(n_prompts)
    greedy = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    lps = [hf_prompt_logprobs(hf, p) for p in prompts]
    return FamilyRefs(folder, prompts, greedy, lps, [hf_greedy(hf, p, MAX_NEW) for p in retraction_prompts()])


def check_logprobs(outs: list[dict], refs: FamilyRefs) -> None:
    for o, ref_lp, p in zip(outs, refs.logprobs, refs.prompts):
        inp = o["meta_info"]["input_token_logprobs"]
        assert [t for _, t in inp] == p
        if len(p) > 1:
            got = torch.tensor([lp for lp, _ in inp[1:]])
            torch.testing.assert_close(got, ref_lp, atol=LOGPROB_ATOL, rtol=0)


def check_fresh_and_cached(refs: FamilyRefs, **engine_options: Any) -> list[dict]:
    """Greedy and prompt logprobs against HF; then the same prompts again, served from the
    prefix cache (its whole pages but the last token's), give the same tokens. Returns the
    second round's outputs."""
    with Engine(str(refs.folder), kv_cache_tokens=4096, **engine_options) as engine:
        outs = engine.generate(input_ids=refs.prompts, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
        check_outputs(engine, outs, refs.greedy)
        check_logprobs(outs, refs)
        # (prompt logprobs from position 0 recompute the prompt: this round asks for none)
        again = engine.generate(input_ids=refs.prompts, sampling_params=GREEDY)
        check_outputs(engine, again, refs.greedy)
        hits = [o["meta_info"]["cached_tokens"] for o in again]
        ps = engine.config.page_size
        assert all(h >= (len(p) - 1) // ps * ps for h, p in zip(hits, refs.prompts)), hits
        assert any(hits), hits
        return again


def check_retracted(refs: FamilyRefs, **engine_options: Any) -> None:
    """A KV pool (page size 4) that holds the retraction prompts and 4 pages more: their
    decodes retract some of them, and the greedy tokens stay the same."""
    with Engine(str(refs.folder), kv_cache_tokens=RETRACT_PROMPTS * RETRACT_LEN + 16, page_size=4,
                init_new_token_ratio=0.0, min_new_token_ratio=0.0, **engine_options) as engine:
        reqs = [engine.add_request(p, GREEDY)[0] for p in retraction_prompts()]
        while not all(r.finished for r in reqs):
            engine.step()
            engine.check_invariants()
        assert engine.scheduler.num_retractions > 0
        check_outputs(engine, [engine.result(r) for r in reqs], refs.retract_greedy)
