"""The Triton fused-MoE kernel (plait.kernels.fused_moe) against the grouped torch path
of plait.runtime.models.moe, which tests/test_models_moe.py checks against a per-token
loop and transformers.

Runs on CPU under the Triton interpreter (tiny shapes: it is slow), on CUDA compiled
(benchmarks/gpu_check.py runs this file). NOTE: ``TRITON_INTERPRET`` is set before
``plait.kernels`` (and so triton) is imported; see tests/test_kernels_attention.py.

Tolerances: fp32, atol/rtol 1e-5 (the kernel sums the top-k contributions in fp32 in
router order, the torch path adds them in ascending expert order); bf16, atol/rtol 2e-2
(the torch path rounds every expert's contribution and each partial sum to bf16), 5e-2
under the interpreter, which truncates at each of the kernel's fp32 -> bf16 roundings
(GEMM outputs, activation, product, router scaling) where GPUs and torch round to nearest.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: F401  (pinned in the test extra; a missing triton must fail, not skip)

from plait.kernels._triton import INTERPRET  # noqa: E402
from plait.kernels.fused_moe import MoeLaunch, align_pairs, fused_experts  # noqa: E402
from plait.runtime.models.config import ModelConfig  # noqa: E402
from plait.runtime.models.moe import Experts, SparseMoeBlock  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = 5e-2 if INTERPRET else 2e-2
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=BF16, rtol=BF16)}


def _cfg(num_experts: int, top_k: int, hidden: int = 40, inter: int = 24, shared: int = 0,
         act: str = "silu") -> ModelConfig:
    return ModelConfig(
        architecture="qwen2_moe" if shared else "qwen3_moe", vocab_size=10, hidden_size=hidden,
        intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=hidden // 2,
        num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=True,
        shared_expert_intermediate_size=shared, hidden_act=act,
    )


def _randomize(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights scaled so that every intermediate is O(1) (bf16 ulps ~1e-2)."""
    torch.manual_seed(0)
    for p in module.parameters():
        p.data.normal_(0, 0.15)
    return module.to(DEVICE, dtype)


def _routing(num_tokens: int, num_experts: int, top_k: int, unused: int | None, seed: int):
    """Distinct experts per token, drawn from all experts but ``unused``; weights > 0."""
    g = torch.Generator().manual_seed(seed)
    pool = [e for e in range(num_experts) if e != unused]
    ids = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g) + 0.1
    return ids.to(DEVICE), weights.to(DEVICE)


# (tokens, experts, top-k, expert left without tokens): one token (decode), token counts
# below, at and past a 16-row block, top-k 1 to all experts
CASES = [(1, 4, 1, None), (1, 8, 2, 3), (16, 4, 4, None), (19, 5, 2, 4), (37, 6, 3, 0)]


@pytest.mark.parametrize("num_tokens,num_experts,top_k,unused", CASES)
def test_fused_experts_match_the_grouped_torch_path(num_tokens, num_experts, top_k, unused):
    experts = _randomize(Experts(_cfg(num_experts, top_k)), torch.float32)
    ids, weights = _routing(num_tokens, num_experts, top_k, unused, seed=num_tokens)
    x = torch.randn(num_tokens, 40, device=DEVICE)
    with torch.no_grad():
        got = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
        want = experts(x, weights, ids)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [MoeLaunch(16, 16, 16, 4), MoeLaunch(32, 32, 16, 4)])
def test_fused_experts_tiles_and_dtypes(block: MoeLaunch, dtype: torch.dtype):
    """Hidden and intermediate sizes that no tile divides (masked columns and K tails)."""
    experts = _randomize(Experts(_cfg(5, 2, hidden=40, inter=24)), dtype)
    ids, weights = _routing(21, 5, 2, unused=2, seed=1)
    x = torch.randn(21, 40, device=DEVICE).to(dtype)
    weights = weights.to(dtype)
    with torch.no_grad():
        got = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, launch=block)
        want = experts(x, weights, ids)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_fused_experts_gelu():
    experts = _randomize(Experts(_cfg(4, 2, act="gelu_pytorch_tanh")), torch.float32)
    assert experts.gelu
    ids, weights = _routing(9, 4, 2, unused=None, seed=2)
    x = torch.randn(9, 40, device=DEVICE)
    with torch.no_grad():
        got = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids, gelu=True)
        want = experts(x, weights, ids)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


@pytest.mark.parametrize("shared", [0, 24])
def test_sparse_moe_block_with_triton_ops_matches_the_torch_path(shared):
    """The whole sparse MLP (router, experts, the sigmoid-gated shared expert): with
    ``triton_ops`` the experts go through the fused kernel, the same weights."""
    cfg = _cfg(6, 2, shared=shared)
    torch_block = _randomize(SparseMoeBlock(cfg), torch.float32)
    triton_block = SparseMoeBlock(cfg, triton_ops=True).to(DEVICE)
    triton_block.load_state_dict(torch_block.state_dict())
    assert triton_block.experts.fused and not torch_block.experts.fused
    x = torch.randn(13, 40, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(triton_block(x), torch_block(x), **TOL[torch.float32])


@pytest.mark.parametrize("block_m", [16, 32])
def test_align_pairs_layout(block_m):
    """Every pair once, grouped by expert in pair order; each block one expert; each
    expert's run padded to the block; sizes fixed by the shapes alone (CUDA graphs)."""
    num_experts, top_k = 6, 2
    sizes = set()
    for seed, unused in ((0, None), (1, 5), (2, 0)):
        ids, _ = _routing(23, num_experts, top_k, unused, seed)
        a = align_pairs(ids, num_experts, block_m)
        sizes.add((a.sorted_pairs.shape, a.block_expert.shape))
        num_pairs, n = ids.numel(), int(a.num_padded)
        pairs, blocks = a.sorted_pairs.cpu(), a.block_expert.cpu()
        assert n % block_m == 0 and n <= pairs.numel() and (pairs[n:] == num_pairs).all()
        real = pairs[pairs < num_pairs]
        assert sorted(real.tolist()) == list(range(num_pairs))
        flat = ids.reshape(-1).cpu()
        for b in range(n // block_m):
            rows = pairs[b * block_m : (b + 1) * block_m]
            rows = rows[rows < num_pairs]
            assert (flat[rows.long()] == blocks[b]).all()
        for e in range(num_experts):
            mine = [int(p) for b in range(n // block_m) if blocks[b] == e
                    for p in pairs[b * block_m : (b + 1) * block_m]]
            count = int((flat == e).sum())
            assert len(mine) == -(-count // block_m) * block_m
            assert [p for p in mine if p < num_pairs] == (flat == e).nonzero().flatten().tolist()
    assert len(sizes) == 1


def test_gpu_check_moe_engine_comparison_on_cpu(tmp_path, tokenizer_dir):
    """benchmarks/gpu_check.py's fused-MoE engine check on a tiny random MoE model: the
    torch backend (grouped torch experts) and the triton backend (the fused kernel, here
    interpreted) give the same greedy tokens."""
    from test_gpu_check import load_script

    gpu_check = load_script()
    folder = gpu_check.tiny_moe_model(tmp_path, tokenizer_dir)
    cmp = gpu_check.compare_moe_backends(folder, ["The capital of France is", "1, 2, 3,"], max_new_tokens=3)
    assert cmp["match"] and cmp["num_prompts"] == 2 and cmp["mismatches"] == []
