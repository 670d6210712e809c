"""Megatron-style tensor parallelism for the shared decoder (:mod:`plait.runtime.models.llama`).

Each of the ``size`` ranks holds one shard of every projection:

- q/k/v and gate/up are *column-parallel*: a rank computes its heads (and its slice of the
  intermediate features) from the full hidden state, with no communication;
- o_proj and down_proj are *row-parallel*: a rank multiplies its slice of the input
  features, and the partial sums are all-reduced (:class:`RowParallelLinear`);
- the embedding and the LM head are *vocab-parallel*: a rank holds ``ceil(V / size)`` rows;
  the lookup is masked to its rows and all-reduced (:class:`VocabParallelEmbedding`), the
  logits of the shards are all-gathered (:meth:`TPGroup.gather_vocab`).

KV heads are split like the q heads when ``size`` divides them; when ``size`` exceeds
them (``size`` a multiple of ``num_kv_heads``) each rank keeps the one KV head its q heads
read, so KV heads are replicated ``size / num_kv_heads`` times.

A rank's model is built from :func:`shard_config` (the per-rank head, intermediate and
vocabulary counts), so the decoder code is the same at every size, and is loaded from
:func:`shard_weights`, which slices each checkpoint tensor as it streams past: no rank
ever holds more than one full tensor at a time.
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

# families whose layers are all dense attention + MLP with unfused checkpoints
TP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


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


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Raise ``ValueError`` naming ``tp_size`` when ``cfg`` cannot be split ``size`` ways."""
    if size == 1:
        return
    why = None
    if cfg.architecture not in TP_FAMILIES:
        why = f"the {cfg.architecture} family is not supported with tensor parallelism; supported: {', '.join(TP_FAMILIES)}"
    elif cfg.o_bias:
        why = "models with an o_proj bias are not supported with tensor parallelism"
    elif cfg.num_heads % size:
        why = f"it must divide the model's {cfg.num_heads} attention heads"
    elif cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        why = f"it must divide the model's {cfg.num_kv_heads} KV heads or be a multiple of them"
    elif cfg.intermediate_size % size:
        why = f"it must divide the model's intermediate size {cfg.intermediate_size}"
    if why:
        raise ValueError(f"tp_size={size} is invalid for this model: {why}")


def local_kv_heads(cfg: ModelConfig, size: int) -> int:
    """KV heads each rank holds (1 when they are replicated)."""
    return max(cfg.num_kv_heads // size, 1)


def vocab_shard(cfg: ModelConfig, size: int) -> int:
    """Rows of the embedding / LM head on each rank (the last rank's tail is zero padding)."""
    return -(-cfg.vocab_size // size)


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one rank's model is built from: its heads, intermediate features and
    vocabulary rows (the rest unchanged)."""
    if size == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // size, num_kv_heads=local_kv_heads(cfg, size),
        intermediate_size=cfg.intermediate_size // size, vocab_size=vocab_shard(cfg, size),
    )


class RowParallelLinear(Linear):
    """A projection over this rank's slice of the input features; the partial outputs
    are summed over the group (no bias: :func:`check_tp` refuses one)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows ``[rank * n, (rank + 1) * n)`` of the embedding table; tokens
    outside them look up zeros, and the group's sum is the full lookup."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup) -> None:
        super().__init__(num_embeddings, embedding_dim)
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
    it is sliced."""
    if size == 1:
        yield from weights
        return
    hd = cfg.head_dim
    q_rows = cfg.num_heads // size * hd
    kv_rows = local_kv_heads(cfg, size) * hd
    # the first KV head of this rank (with replication: the one its q heads read)
    kv_start = (rank * cfg.num_kv_heads // size if cfg.num_kv_heads < size else rank * (cfg.num_kv_heads // size)) * hd
    inter = cfg.intermediate_size // size
    vocab = vocab_shard(cfg, size)
    for name, t in weights:
        proj = name.rsplit(".", 2)[-2] if name.count(".") >= 2 else ""
        if proj in ("qkv_proj", "gate_up_proj"):
            raise ValueError(f"checkpoint tensor {name!r} is fused; tensor parallelism needs unfused q/k/v and gate/up")
        if proj == "q_proj":
            t = t[rank * q_rows : (rank + 1) * q_rows]
        elif proj in ("k_proj", "v_proj"):
            t = t[kv_start : kv_start + kv_rows]
        elif proj in ("gate_proj", "up_proj"):
            t = t[rank * inter : (rank + 1) * inter]
        elif proj == "o_proj":
            t = t[:, rank * q_rows : (rank + 1) * q_rows]
        elif proj == "down_proj":
            t = t[:, rank * inter : (rank + 1) * inter]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            part = t[rank * vocab : (rank + 1) * vocab]
            t = torch.zeros(vocab, t.shape[1], dtype=t.dtype)
            t[: part.shape[0]] = part
        yield name, t.contiguous()
