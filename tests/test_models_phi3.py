"""Phi-3 / Phi-3.5 against Hugging Face transformers on tiny random models: checkpoints
with fused qkv_proj and gate_up_proj, plain rope and longrope ("su") scaling with
short/long factors. Greedy tokens identical and prompt logprobs within 1e-4 (fp32),
fresh and from the prefix cache with small prefill chunks, and under retraction.

Longrope: positions below original_max_position_embeddings rotate with the short
factors, later ones with the long factors (plait.runtime.models.llama.cos_sin_cache; the
cache checked against transformers' rotary embedding on both sides of the limit). The
engine runs keep sequences below the limit, where that is exactly transformers: once a
sequence grows past it, transformers' Phi-3 drops its KV cache and recomputes the whole
sequence with the long factors, which plait does not (NOTE: not exact there)."""

from __future__ import annotations

import pytest
import torch
from families import COMMON, build_refs, check_fresh_and_cached, check_retracted

from plait.runtime.model_loader import resolve_model

ORIGINAL = 96  # every prompt + its 8 new tokens stays below


def _longrope() -> dict:
    half = 16 // 2  # head_dim 16
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.9 * i for i in range(half)],
        "original_max_position_embeddings": ORIGINAL,
    }


@pytest.fixture(scope="module", params=["rope", "longrope"])
def phi3(request, tmp_path_factory, tokenizer_dir):
    from transformers import Phi3Config

    scaling = dict(rope_scaling=_longrope(), original_max_position_embeddings=ORIGINAL,
                   max_position_embeddings=256) if request.param == "longrope" else {}
    config = Phi3Config(**{**COMMON, **scaling}, rope_theta=10000.0, architectures=["Phi3ForCausalLM"])
    refs = build_refs(tmp_path_factory.mktemp(f"tiny-phi3-{request.param}"), tokenizer_dir, config)
    assert max(len(p) for p in refs.prompts) + 8 <= ORIGINAL
    refs.kind = request.param
    return refs


def test_phi3_config(phi3):
    cfg = resolve_model(str(phi3.folder)).load_config()
    assert cfg.architecture == "phi3"
    assert cfg.rope_type == ("longrope" if phi3.kind == "longrope" else "default")


def test_rope_cache_matches_transformers_on_both_sides_of_the_limit(phi3):
    from transformers import AutoModelForCausalLM

    from plait.runtime.models.llama import cos_sin_cache

    rotary = AutoModelForCausalLM.from_pretrained(phi3.folder).model.rotary_emb
    cfg = resolve_model(str(phi3.folder)).load_config()
    cache = cos_sin_cache(cfg.head_dim, 256, cfg.rope_theta, cfg.rope_scaling)
    half = cfg.head_dim // 2
    for pos in (0, 10, ORIGINAL - 1, ORIGINAL, 200):
        # transformers picks short/long by the largest position of the call: one at a time
        cos, sin = rotary(torch.zeros(1), torch.tensor([[pos]]))
        torch.testing.assert_close(cache[pos, :half], cos[0, 0, :half], atol=1e-6, rtol=0)
        torch.testing.assert_close(cache[pos, half:], sin[0, 0, :half], atol=1e-6, rtol=0)
    if phi3.kind == "longrope":  # the long factors do take over at the limit
        short = cos_sin_cache(cfg.head_dim, 256, cfg.rope_theta, {**cfg.rope_scaling, "long_factor": cfg.rope_scaling["short_factor"]})
        assert torch.equal(cache[:ORIGINAL], short[:ORIGINAL])
        assert not torch.allclose(cache[ORIGINAL:], short[ORIGINAL:])


def test_phi3_matches_hf_fresh_and_from_the_prefix_cache(phi3):
    check_fresh_and_cached(phi3, chunked_prefill_size=7, page_size=1)


def test_phi3_under_retraction(phi3):
    check_retracted(phi3)
