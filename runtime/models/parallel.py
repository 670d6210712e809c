"""Megatron-style tensor parallelism for the shared decoder (:mod:`plait.runtime.models.llama`).

Each of the ``size`` ranks holds one shard of every projection:

- q/k/v and gate/up are *column-parallel*: a rank computes its heads (and its slice of the
  intermediate features) from the full hidden state, with no communication;
- o_proj and down_proj are *row-parallel*: a rank multiplies its slice of the input
  features, and the partial sums are all-reduced (:class:`RowParallelLinear`);
- the embedding and the LM head are *vocab-parallel*: a rank holds ``ceil(V / size)`` rows;
  the lookup is masked to its rows and all-reduced (:class:`VocabParallelEmbedding`), the
  logits of the shards are all-gathered (:meth:`TPGroup.gather_vocab`).

Heads are split by whole GQA groups (a KV head and the q heads that read it), as
evenly as they go: with ``size`` not dividing the KV heads the first ranks take one
group more (SmolLM2-135M's 3 KV heads over 2 ranks: 6 q heads and 2 KV heads on rank 0,
3 and 1 on rank 1), so ``tp_size=2`` runs on models whose head counts are odd. When
``size`` exceeds the KV heads (``size`` a multiple of ``num_kv_heads``) each rank keeps
the one KV head its q heads read (replicated ``size / num_kv_heads`` times) and a share
of that group's q heads. The intermediate features are split as evenly (the first ranks
one more), the vocabulary in equal padded shards. Uneven shards cost balance, not
correctness: the row-parallel all-reduces sum whatever each rank holds. vLLM and SGLang
require ``size`` to divide the head counts; plait's CPU machines have 2 cores, and the
default model 9 q / 3 KV heads.

A rank's model is built from :func:`shard_config` (the per-rank head, intermediate and
vocabulary counts), so the decoder code is the same at every size, and is loaded from
:func:`shard_weights`, which slices each checkpoint tensor as it streams past (fused
q/k/v and gate/up tensors, as Phi-3 ships them, part by part): no rank ever holds more
than one full tensor at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.runtime.models.config import ModelConfig
from plait.runtime.models.linear import Linear

TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3_moe", "qwen2_moe", "mixtral")


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, and the
    c10d process group (gloo or NCCL) the collectives run on."""

    rank: int
    size: int
    pg: Any  # torch.distributed ProcessGroup{Gloo,NCCL}

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (every rank gets the same values)."""
        self.pg.allreduce([x]).wait()
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place."""
        self.pg.broadcast(x, 0).wait()
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``[rows, V / size]`` logits of each rank's vocabulary shard -> ``[rows, V]``."""
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self.pg.allgather([parts], [logits.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def split(n: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, count)`` of rank ``rank``'s part of ``n`` items over ``size`` ranks:
    contiguous, the first ``n % size`` ranks one item more."""
    base, extra = divmod(n, size)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``size`` holds: q heads ``[q_start, q_start + q_heads)``, KV
    heads ``[kv_start, kv_start + kv_heads)`` and intermediate features ``[inter_start,
    inter_start + inter)`` of the full model."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int
    inter_start: int
    inter: int
    moe: tuple[int, int] = (0, 0)  # (start, count) of every routed expert's intermediate features
    shared: tuple[int, int] = (0, 0)  # the same of the shared expert's (Qwen2-MoE)


def shard_of(cfg: ModelConfig, rank: int, size: int) -> Shard:
    """Rank ``rank``'s heads and intermediate features (:func:`check_tp` has passed)."""
    group = cfg.num_heads // cfg.num_kv_heads  # q heads per KV head
    if cfg.num_kv_heads >= size:  # whole GQA groups per rank
        kv_start, kv_heads = split(cfg.num_kv_heads, size, rank)
        q_start, q_heads = kv_start * group, kv_heads * group
    else:  # each KV head on size / num_kv_heads ranks, its q heads split among them
        per_kv = size // cfg.num_kv_heads
        kv_start, kv_heads = rank // per_kv, 1
        start, q_heads = split(group, per_kv, rank % per_kv)
        q_start = kv_start * group + start
    inter_start, inter = split(cfg.intermediate_size, size, rank)
    return Shard(q_start, q_heads, kv_start, kv_heads, inter_start, inter,
                 split(cfg.moe_intermediate_size, size, rank), split(cfg.shared_expert_intermediate_size, size, rank))


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming ``tp_size`` when ``cfg`` cannot be split ``size`` ways."""
    if size == 1:
        return
    why = None
    if cfg.architecture not in TP_FAMILIES:
        why = f"the {cfg.architecture} family is not supported with tensor parallelism; supported: {', '.join(TP_FAMILIES)}"
    elif cfg.o_bias:
        why = "models with an o_proj bias are not supported with tensor parallelism"
    elif cfg.num_kv_heads < size and size % cfg.num_kv_heads:
        why = (f"the model has {cfg.num_kv_heads} KV heads: a larger tp_size must be a multiple of them "
               f"(each rank holds at least one whole KV head)")
    elif cfg.num_kv_heads < size and cfg.num_heads // cfg.num_kv_heads < size // cfg.num_kv_heads:
        why = (f"the model's {cfg.num_heads} attention heads are too few: each of the {size} ranks needs "
               f"at least one (at most {cfg.num_heads})")
    elif min(cfg.intermediate_size, cfg.moe_intermediate_size or size, cfg.shared_expert_intermediate_size or size) < size:
        why = "the model's MLP or expert intermediate size is smaller than it"
    if why:
        raise ValueError(f"tp_size={size} is invalid for this model: {why}")


def vocab_shard(cfg: ModelConfig, size: int) -> int:
    """Rows of the embedding / LM head on each rank (the last rank's tail is zero padding)."""
    return -(-cfg.vocab_size // size)


def shard_config(cfg: ModelConfig, rank: int, size: int) -> ModelConfig:
    """The config rank ``rank``'s model is built from: its heads, intermediate features
    and vocabulary rows (the rest unchanged)."""
    if size == 1:
        return cfg
    s = shard_of(cfg, rank, size)
    return dataclasses.replace(cfg, num_heads=s.q_heads, num_kv_heads=s.kv_heads, intermediate_size=s.inter,
                               moe_intermediate_size=s.moe[1], shared_expert_intermediate_size=s.shared[1],
                               vocab_size=vocab_shard(cfg, size))


class RowParallelLinear(Linear):
    """A projection over this rank's slice of the input features; the partial outputs
    are summed over the group (no bias: :func:`check_tp` refuses one)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def on_meta_device() -> bool:
    """Whether tensors are being created on the meta device (``with torch.device("meta")``)."""
    return torch.empty(0).is_meta


def meta_weight(*shape: int) -> torch.Tensor | None:
    """An empty weight on the meta device for a module whose initialisation would draw
    random values (``nn.Embedding``'s ``normal_``): on meta, torch runs that op's Python
    reference, whose first use imports ``torch._dynamo`` (~0.7 s of an engine's start-up).
    ``None`` elsewhere: the module initialises itself as usual."""
    return torch.empty(*shape) if on_meta_device() else None


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows ``[rank * n, (rank + 1) * n)`` of the embedding table; tokens
    outside them look up zeros, and the group's sum is the full lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup) -> None:
        super().__init__(num_embeddings, embedding_dim, _weight=meta_weight(num_embeddings, embedding_dim))
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.tp.rank * self.num_embeddings
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, rank: int, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank ``rank``'s part of each HF-named checkpoint tensor of the full model ``cfg``,
    in the shapes :func:`shard_config`'s model expects; every full tensor is dropped once
    it is sliced. Fused ``qkv_proj`` / ``gate_up_proj`` tensors (Phi-3) are sliced part by
    part and come out as the unfused ``q/k/v_proj`` / ``gate/up_proj`` names. Experts
    (per-expert tensors or stacked ``experts.gate_up_proj`` [E, 2I, H] / ``down_proj``
    [E, H, I]) keep every expert, with this rank's share of its intermediate features;
    the router is whole on every rank."""
    if size == 1:
        yield from weights
        return
    from plait.runtime.models.llama import EXPERT_WEIGHT  # (llama imports this module)

    hd, s = cfg.head_dim, shard_of(cfg, rank, size)
    q = slice(s.q_start * hd, (s.q_start + s.q_heads) * hd)
    kv = slice(s.kv_start * hd, (s.kv_start + s.kv_heads) * hd)
    inter = slice(s.inter_start, s.inter_start + s.inter)
    moe, shared = slice(s.moe[0], s.moe[0] + s.moe[1]), slice(s.shared[0], s.shared[0] + s.shared[1])
    vocab = vocab_shard(cfg, size)
    q_rows, kv_rows = cfg.num_heads * hd, cfg.num_kv_heads * hd
    for name, t in weights:
        base, _, suffix = name.rpartition(".")
        module, _, proj = base.rpartition(".")
        if EXPERT_WEIGHT.match(name.replace(".block_sparse_moe.", ".mlp.")):  # [I, H] gate / up rows, [H, I] down
            yield name, (t[:, moe] if proj in ("down_proj", "w2") else t[moe]).contiguous()
            continue
        if name.endswith(".experts.gate_up_proj"):  # stacked [E, 2I, H]
            half = cfg.moe_intermediate_size
            yield name, torch.cat([t[:, :half][:, moe], t[:, half:][:, moe]], dim=1)
            continue
        if name.endswith(".experts.down_proj"):  # stacked [E, H, I]
            yield name, t[:, :, moe].contiguous()
            continue
        mlp = shared if module.endswith("shared_expert") else inter
        if proj == "qkv_proj":  # [q | k | v] rows
            parts = {"q_proj": t[:q_rows], "k_proj": t[q_rows : q_rows + kv_rows], "v_proj": t[q_rows + kv_rows :]}
            for part, rows in parts.items():
                yield f"{module}.{part}.{suffix}", rows[q if part == "q_proj" else kv].contiguous()
            continue
        if proj == "gate_up_proj":  # [gate | up] rows
            half = cfg.intermediate_size
            yield f"{module}.gate_proj.{suffix}", t[:half][inter].contiguous()
            yield f"{module}.up_proj.{suffix}", t[half:][inter].contiguous()
            continue
        if proj == "q_proj":
            t = t[q]
        elif proj in ("k_proj", "v_proj"):
            t = t[kv]
        elif proj in ("gate_proj", "up_proj"):
            t = t[mlp]
        elif proj == "o_proj":
            t = t[:, q]
        elif proj == "down_proj":
            t = t[:, mlp]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = t[rank * vocab : (rank + 1) * vocab]
            t = torch.zeros(vocab, t.shape[1], dtype=t.dtype)
            t[: part.shape[0]] = part
        yield name, t.contiguous()
