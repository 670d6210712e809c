"""Mixture-of-experts families against Hugging Face transformers on tiny random models:
Qwen3-MoE (top-k renormalised, a dense layer from mlp_only_layers), Mixtral (per-expert
w1/w2/w3 checkpoint names, softmax top-k renormalised) and Qwen2-MoE (top-k not
renormalised, a sigmoid-gated shared expert, decoder_sparse_step 2). Greedy
tokens identical and prompt logprobs within 1e-4 (fp32), fresh and from the prefix cache
with small prefill chunks, and under retraction; the grouped expert path against a
per-token loop."""

from __future__ import annotations

import pytest
import torch
from families import COMMON, build_refs, check_fresh_and_cached, check_retracted

from plait.runtime.model_loader import resolve_model
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.moe import SparseMoeBlock

MOE = dict(num_experts_per_tok=2)


def _config(kind: str):
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    common = {**COMMON, "num_hidden_layers": 3}
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**common, **MOE, num_experts=4, moe_intermediate_size=32, norm_topk_prob=True,
                              mlp_only_layers=[2], head_dim=16, architectures=["Qwen3MoeForCausalLM"])
    if kind == "mixtral":
        return MixtralConfig(**common, **MOE, num_local_experts=4, architectures=["MixtralForCausalLM"])
    if kind == "qwen2_moe":
        return Qwen2MoeConfig(**common, **MOE, num_experts=4, moe_intermediate_size=32,
                              shared_expert_intermediate_size=48, decoder_sparse_step=2,
                              architectures=["Qwen2MoeForCausalLM"])
    raise ValueError(kind)


KINDS = ["qwen3_moe", "mixtral", "qwen2_moe"]


@pytest.fixture(scope="module", params=KINDS)
def moe(request, tmp_path_factory, tokenizer_dir):
    refs = build_refs(tmp_path_factory.mktemp(f"tiny-{request.param}"), tokenizer_dir, _config(request.param))
    refs.kind = request.param
    return refs


def test_moe_config(moe):
    cfg = resolve_model(str(moe.folder)).load_config()
    assert cfg.architecture == moe.kind
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    # qwen3_moe: layer 2 in mlp_only_layers; qwen2_moe: decoder_sparse_step 2
    expected = {"qwen3_moe": (True, True, False), "qwen2_moe": (False, True, False), "mixtral": (True, True, True)}
    assert cfg.sparse_layers == expected[moe.kind]
    assert cfg.norm_topk_prob == (moe.kind != "qwen2_moe")
    assert bool(cfg.shared_expert_intermediate_size) == (moe.kind == "qwen2_moe")


def test_moe_matches_hf_fresh_and_from_the_prefix_cache(moe):
    check_fresh_and_cached(moe, chunked_prefill_size=7, page_size=1)


def test_moe_under_retraction(moe):
    check_retracted(moe)


@pytest.mark.parametrize("shared", [0, 24])
def test_grouped_experts_equal_a_per_token_loop(shared):
    """The grouped path (sort by expert, one GEMM pair per expert, index_add) against the
    definition, token by token, on more tokens than experts times k."""
    cfg = ModelConfig(
        architecture="qwen2_moe", vocab_size=10, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
        num_kv_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=16,
        norm_topk_prob=True, shared_expert_intermediate_size=shared,
    )
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    for p in block.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(40, 32)
    with torch.no_grad():
        got = block(x)
        expected = torch.zeros_like(x)
        for t in range(x.shape[0]):
            probs = torch.softmax(x[t] @ block.gate.weight.T, -1)
            w, ids = torch.topk(probs, 3)
            w = w / w.sum()
            for weight, e in zip(w, ids.tolist()):
                gate, up = (block.experts.gate_up_proj[e] @ x[t]).split(16)
                expected[t] += weight * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
            if shared:
                expected[t] += torch.sigmoid(block.shared_expert_gate(x[t])) * block.shared_expert(x[t : t + 1])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
