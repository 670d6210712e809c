"""Fused mixture-of-experts: the routed experts of a sparse MLP in two grouped GEMMs.

Inputs: ``x`` [T, H]; the stacked expert weights ``w_gate_up`` [E, 2 * I, H] (gate rows
first, then up, as :class:`plait.runtime.models.moe.Experts` holds them) and
``w_down`` [E, H, I]; the router's choice ``topk_ids`` [T, k] and ``topk_weights`` [T, k].
Output: ``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` [T, H], the
contract of :func:`plait.runtime.models.moe.Experts.forward` (the torch reference).

Layout. Pair ``p = t * k + j`` is token ``t`` routed to its ``j``-th expert. The pairs
are sorted by expert and each expert's run is padded to a multiple of ``BLOCK_M``
(:func:`align_pairs`), so every block of ``BLOCK_M`` sorted entries belongs to one
expert: a program multiplies one block's rows by one expert's weight tile, a grouped
GEMM in a single launch. Padding entries hold ``P = T * k`` (no pair) and are masked.

Two launches:

1. ``gate_up``: per block, ``act(x @ W_gate[e].T) * (x @ W_up[e].T)`` with two fp32
   accumulators over the same ``x`` tile; the activation (SiLU, or GELU-tanh) runs on
   the accumulators and only the product [P, I] is written, indexed by pair.
2. ``down``: per block, ``h @ W_down[e].T`` scaled by the pair's router weight, written
   to [T, k, H]; the top-k sum over ``k`` is one torch reduction after it (a fixed
   order, so results are deterministic, unlike atomic adds).

Rounding follows the torch path: the GEMM outputs are rounded to the input dtype before
the activation and before the router weight is applied, the activation's product once.

No host synchronisation: the alignment is torch ops on the device whose output sizes
depend only on ``T``, ``k`` and ``E`` (the number of real blocks stays on the device and
surplus programs exit at once), so a decode step using it can be recorded in a CUDA
graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# triton comes through _triton, which sets up interpreter mode before importing it
from plait.kernels._triton import INTERPRET, dot, dot_options, jit, tl, triton


class MoeLaunch(NamedTuple):
    """Tile sizes of :func:`fused_experts`: sorted rows per block, output columns and
    reduction depth per program, and warps."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


def moe_launch_settings(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeLaunch:
    """Tiles for ``num_pairs`` (token, expert) pairs over ``num_experts`` experts in ``dtype``.

    Each used expert pads its rows up to a multiple of ``block_m``; when experts get few
    rows each (decode: ``num_pairs`` around ``num_experts`` or less) the 16-row tile,
    the smallest ``tl.dot`` takes, wastes least, else 64 rows reuse each weight tile
    more (wgmma on sm_90 in 16-bit). From ptxas (benchmarks/gpu_compile_check.py): no
    spills at 4 warps, except gate_up's two fp32 [64, 64] accumulators beside fp32
    operand tiles (at 4 and at 8 warps on sm_80), so fp32 halves BLOCK_N. Under
    the interpreter the smallest tiles are the fastest. Not yet tuned on a GPU.
    """
    if INTERPRET:
        return MoeLaunch(16, 32, 32, 4)
    if num_pairs <= 4 * num_experts:
        return MoeLaunch(16, 64, 64, 4)
    return MoeLaunch(64, 32 if dtype == torch.float32 else 64, 64, 4)


class AlignedPairs(NamedTuple):
    """(token, expert) pairs sorted by expert, each expert's run padded to ``block_m``.

    ``sorted_pairs`` [capacity]: pair ids ``t * k + j``; padding entries hold ``P``.
    ``block_expert`` [capacity // block_m]: the expert of each block (blocks past the
    real ones: clamped to the last expert, never computed).
    ``num_padded`` [1]: how many leading entries of ``sorted_pairs`` are real blocks.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """Sort the pairs of ``topk_ids`` [T, k] by expert (stable: pairs of one expert keep
    their order) and pad each expert's run to a multiple of ``block_m``.

    Capacity: at most ``min(P, E)`` experts have pairs, each wasting under ``block_m``
    entries, so ``P + min(P, E) * (block_m - 1)`` entries (rounded up to whole blocks)
    always suffice; the sizes depend on the shapes only, never on the routing.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [P]
    num_pairs = flat.numel()
    capacity = triton.cdiv(num_pairs + min(num_pairs, num_experts) * (block_m - 1), block_m) * block_m
    sorted_experts, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=device)
    starts = torch.searchsorted(sorted_experts, experts)  # [E] first sorted index of each expert
    counts = torch.searchsorted(sorted_experts, experts, right=True) - starts
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    # sorted entry i (expert e, its rank i - starts[e] among e's pairs) -> its padded slot
    dest = padded_start[sorted_experts] + torch.arange(num_pairs, device=device) - starts[sorted_experts]
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return AlignedPairs(sorted_pairs, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32))


@jit
def _moe_gate_up_kernel(
    X, W, Out, SortedPairs, BlockExpert, NumPadded,
    stride_xt, stride_we, stride_wn, stride_ot,
    num_pairs, top_k, hidden, inter,
    GELU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # grid: (capacity // BLOCK_M, cdiv(I, BLOCK_N)); X [T, H]; W [E, 2I, H]; Out [P, I]
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    real = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    dtype = X.dtype.element_ty
    w_rows = W + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BLOCK_N] gate rows
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        x = tl.load(X + tokens[:, None] * stride_xt + offs_k[None, :], mask=real[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        w_gate = tl.load(w_rows + offs_k[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        w_up = tl.load(w_rows + inter * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        acc_gate += dot(x, w_gate, DOT_PRECISION, DOT_UPCAST)
        acc_up += dot(x, w_up, DOT_PRECISION, DOT_UPCAST)
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    if GELU:  # tanh approximation; tanh(z) = 2 * sigmoid(2z) - 1
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * z)))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    h = act.to(dtype).to(tl.float32) * up
    out = Out + pairs.to(tl.int64)[:, None] * stride_ot + offs_n[None, :]
    tl.store(out, h.to(Out.dtype.element_ty), mask=real[:, None] & n_mask[None, :])


@jit
def _moe_down_kernel(
    Hid, W, PairWeights, Out, SortedPairs, BlockExpert, NumPadded,
    stride_ht, stride_we, stride_wn, stride_ot,
    num_pairs, inter, hidden,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    # grid: (capacity // BLOCK_M, cdiv(H, BLOCK_N)); Hid [P, I]; W [E, H, I]; Out [P, H]
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(NumPadded):
        return
    pairs = tl.load(SortedPairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    rows = pairs.to(tl.int64)
    expert = tl.load(BlockExpert + pid_m).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    dtype = Hid.dtype.element_ty
    w_rows = W + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        h = tl.load(Hid + rows[:, None] * stride_ht + offs_k[None, :], mask=real[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += dot(h, w, DOT_PRECISION, DOT_UPCAST)
    weight = tl.load(PairWeights + rows, mask=real, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * weight[:, None]
    tl.store(Out + rows[:, None] * stride_ot + offs_n[None, :], y.to(Out.dtype.element_ty),
             mask=real[:, None] & n_mask[None, :])


def fused_experts(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gelu: bool = False,
    launch: MoeLaunch | None = None,
) -> torch.Tensor:
    """Triton routed experts; the contract of the module docstring. ``gelu``: GELU-tanh
    instead of SiLU on the gate. ``launch``: tiles (default :func:`moe_launch_settings`)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w_gate_up.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    out = torch.empty((num_tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    if num_pairs == 0:
        return out.sum(dim=1)
    launch = launch or moe_launch_settings(num_pairs, num_experts, x.dtype)
    aligned = align_pairs(topk_ids, num_experts, launch.block_m)
    x = x.contiguous()
    w_gate_up, w_down = w_gate_up.contiguous(), w_down.contiguous()
    pair_weights = topk_weights.reshape(-1).contiguous()  # [P], in pair order
    blocks = aligned.block_expert.numel()
    tiles = dict(BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                 num_warps=launch.num_warps, **dot_options(x.dtype))
    hid = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)  # [P, I], by pair
    _moe_gate_up_kernel[(blocks, triton.cdiv(inter, launch.block_n))](
        x, w_gate_up, hid, aligned.sorted_pairs, aligned.block_expert, aligned.num_padded,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), hid.stride(0),
        num_pairs, top_k, hidden, inter,
        GELU=gelu, **tiles,
    )
    out_pairs = out.view(num_pairs, hidden)
    _moe_down_kernel[(blocks, triton.cdiv(hidden, launch.block_n))](
        hid, w_down, pair_weights, out_pairs, aligned.sorted_pairs, aligned.block_expert, aligned.num_padded,
        hid.stride(0), w_down.stride(0), w_down.stride(1), out_pairs.stride(0),
        num_pairs, inter, hidden,
        **tiles,
    )
    return out.sum(dim=1)
