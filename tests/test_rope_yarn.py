"""YaRN rope scaling (``rope_type: yarn``, as Qwen2.5 / Qwen3 long-context configs and
DeepSeek use it) against transformers: the inverse frequencies and attention factor
equal ``_compute_yarn_parameters``' for given, inferred and mscale-derived factors; a
tiny Qwen3 and a tiny Llama with YaRN (prompts past the original context) give HF's
greedy tokens and prompt logprobs, fresh and from the prefix cache, with the torch and
cpu attention backends."""

from __future__ import annotations

import pytest
import torch
from families import COMMON, build_refs, check_fresh_and_cached

from plait.kernels.rotary import attention_factor, compute_inv_freq
from plait.runtime.model_loader import resolve_model

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}


@pytest.mark.parametrize("params", [
    YARN,
    {**YARN, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    {**YARN, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707},
    {**YARN, "attention_factor": 1.25},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256},  # factor = 1024 / 256
])
def test_frequencies_and_attention_factor_are_transformers(params):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = Qwen3Config(**COMMON, head_dim=32, rope_parameters={**params, "rope_theta": 1_000_000.0})
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    folder_config = {**params, "factor": params["factor"] or 1024 / 256}
    assert torch.equal(compute_inv_freq(32, 1_000_000.0, folder_config), want_freq)
    assert attention_factor(folder_config) == pytest.approx(want_scale, rel=1e-12)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def yarn(request, tmp_path_factory, tokenizer_dir):
    from transformers import LlamaConfig, Qwen3Config

    if request.param == "qwen3":
        config = Qwen3Config(**COMMON, head_dim=32, rope_parameters={**YARN, "rope_theta": 1_000_000.0},
                             architectures=["Qwen3ForCausalLM"])
    else:
        config = LlamaConfig(**COMMON, rope_parameters={**YARN, "factor": 8.0, "beta_fast": 8, "rope_theta": 10000.0,
                                                        "mscale": 0.9, "mscale_all_dim": 0.5})
    return build_refs(tmp_path_factory.mktemp(f"tiny-yarn-{request.param}"), tokenizer_dir, config)


def test_yarn_config_is_read(yarn):
    cfg = resolve_model(str(yarn.folder)).load_config()
    assert cfg.rope_type == "yarn" and cfg.rope_scaling["original_max_position_embeddings"] == 16
    assert max(len(p) for p in yarn.prompts) > 16  # past the original context


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_yarn_matches_hf_fresh_and_from_the_prefix_cache(yarn, backend):
    check_fresh_and_cached(yarn, attention_backend=backend, chunked_prefill_size=7)
