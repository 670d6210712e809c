"""Gemma 3 (text) against Hugging Face transformers on a tiny random model: sliding-window
layers (window 16, shorter than most prompts) interleaved with a global layer, separate
rope bases, (1 + w) and sandwich norms, GELU-tanh, embedding scale, query_pre_attn_scalar
unlike head_dim, and final logit soft-capping. Greedy tokens identical and prompt
logprobs within 1e-4 (fp32) with the torch and cpu attention backends, under prefix-cache
hits on prompts longer than the window, chunked prefill and retraction; and Mistral's
window on every layer."""

from __future__ import annotations

import pytest
from families import COMMON, build_refs, check_retracted, check_fresh_and_cached

from plait.runtime.model_loader import resolve_model

WINDOW = 16


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        **{**COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=24,
        final_logit_softcapping=30.0, architectures=["Gemma3ForCausalLM"],
    )
    return build_refs(tmp_path_factory.mktemp("tiny-gemma3"), tokenizer_dir, config)


def test_config_is_read_as_gemma3(gemma3):
    cfg = resolve_model(str(gemma3.folder)).load_config()
    assert cfg.architecture == "gemma3"
    assert cfg.layer_windows == (WINDOW, WINDOW, None, WINDOW)
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10_000.0)
    assert cfg.attention_scale == 24**-0.5 and cfg.final_logit_softcapping == 30.0
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.tie_word_embeddings
    assert sum(len(p) > WINDOW for p in gemma3.prompts) >= 4  # the windows matter


@pytest.mark.parametrize(
    "options",
    [dict(attention_backend="cpu"), dict(attention_backend="torch", chunked_prefill_size=7, page_size=1)],
    ids=["cpu", "torch-chunked"],
)
def test_gemma3_matches_hf_fresh_and_from_the_prefix_cache(gemma3, options):
    again = check_fresh_and_cached(gemma3, **options)
    # prompts longer than the window were served from the cache beyond the window
    assert any(o["meta_info"]["cached_tokens"] > WINDOW for o in again)


def test_gemma3_under_retraction(gemma3):
    check_retracted(gemma3)


def test_mistral_sliding_window_on_every_layer_matches_hf(tmp_path, tokenizer_dir):
    """Mistral's window applies to every layer (no layer_types): the same backends'
    window, now past the window instead of capping the context at it."""
    from transformers import MistralConfig

    config = MistralConfig(**COMMON, sliding_window=WINDOW, architectures=["MistralForCausalLM"])
    refs = build_refs(tmp_path, tokenizer_dir, config, n_prompts=6)
    cfg = resolve_model(str(tmp_path)).load_config()
    assert cfg.layer_windows == (WINDOW, WINDOW) and cfg.context_length == 1024
    check_fresh_and_cached(refs, attention_backend="cpu", chunked_prefill_size=7)
