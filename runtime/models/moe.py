"""Mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral), with transformers 5's names.

A router picks ``num_experts_per_tok`` experts per token (softmax over all experts, top-k,
renormalised where the family does it); each expert is a gated MLP. The experts'
weights are stacked: ``experts.gate_up_proj`` [E, 2 * I, H] and ``experts.down_proj``
[E, H, I] (per-expert checkpoint tensors are copied into their slices by
:func:`plait.runtime.models.llama.weight_target`).

Tokens are grouped by expert, not looped over: the (token, expert) pairs are sorted by
expert, each expert with tokens runs two GEMMs over its rows, and the weighted results
are added into the output with ``index_add_`` -- in ascending expert order, the order in
which transformers accumulates them, so fp32 results agree to the last bits. That is the
CPU path and the reference; with ``triton_ops`` (the triton backend, the CUDA default)
the experts run as the fused Triton kernel :func:`plait.kernels.fused_moe.fused_experts`
instead (two grouped-GEMM launches, no host synchronisation, so CUDA graphs can record
it), which agrees with this path to fp32 rounding (tests/test_fused_moe.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.runtime.models.config import ModelConfig
from plait.runtime.models.llama import MLP, act_and_mul  # llama imports this module lazily
from plait.runtime.models.parallel import TPGroup


class Router(nn.Module):
    """``weight`` [E, H]: the linear layer that scores experts (HF ``mlp.gate``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts


class Experts(nn.Module):
    """The routed experts, stacked; ``fused``: run them as the Triton fused-MoE kernel."""

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        e, h, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.inter = inter
        self.fused = fused
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; weights, experts: [T, k] -> sum over k of weight * expert(x): [T, H]."""
        if self.fused:
            from plait.kernels.fused_moe import fused_experts

            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts, gelu=self.gelu)
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [T * k] pair p = (token p // k, its (p % k)-th expert)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()  # one host sync
        tokens = order // k
        pair_weights = weights.reshape(-1)[order].unsqueeze(1)  # [T * k, 1]
        xs = x.index_select(0, tokens)  # [T * k, H], grouped by expert
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            h = act_and_mul(F.linear(xs[rows], self.gate_up_proj[e]), self.inter, self.gelu)
            h = F.linear(h, self.down_proj[e]) * pair_weights[rows]
            out.index_add_(0, tokens[rows], h)
            start += n
        return out


class SparseMoeBlock(nn.Module):
    """HF ``mlp`` of a sparse layer: ``gate`` (router), ``experts``, and for Qwen2-MoE a
    ``shared_expert`` (a dense MLP on every token) scaled by ``sigmoid(shared_expert_gate(x))``.
    With ``tp`` every rank routes alike (the router is whole) and runs its share of each
    expert's features; one all-reduce sums the block's output."""

    def __init__(self, cfg: ModelConfig, triton_ops: bool = False, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp  # each rank holds every expert's share of features: its output is a partial sum
        self.gate = Router(cfg)
        self.experts = Experts(cfg, fused=triton_ops)
        self.shared_expert: nn.Module | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = MLP(cfg, triton_ops, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.experts(x, weights, experts)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)
