"""One decoder for the Llama family and Qwen2/Qwen3.

Parameter names follow Hugging Face checkpoints; :meth:`CausalLM.load_weights` takes
HF names and fuses q/k/v and gate/up into single projections (one GEMM each).
Architecture differences are flags on :class:`ModelConfig`: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), tied embeddings, rope scaling (llama3, linear).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.rotary import rope_cos_sin_cache, rotate_ref
from plait.runtime.attention.base import AttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.linear import Linear, pack_weight, packed_linear


class RotaryEmbedding(nn.Module):
    """HF ``rotate_half`` layout; cos/sin cached for every position up to ``max_pos``
    (the cache and the math live in :mod:`plait.kernels.rotary`)."""

    def __init__(
        self, head_dim: int, max_pos: int, theta: float, rope_scaling: dict | None, triton_ops: bool = False
    ) -> None:
        super().__init__()
        self._args = (head_dim, max_pos, theta, rope_scaling)
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(*self._args), persistent=False)
        self.triton_ops = triton_ops
        self._positions: torch.Tensor | None = None  # the step whose cos/sin are cached
        self._cos = self._sin = None

    def recompute_cache(self) -> None:
        """Fill the cos/sin cache again (float32) where the buffer now lives: a module
        built on the meta device and materialised with ``to_empty`` has no values."""
        device = self.cos_sin_cache.device
        self.cos_sin_cache = rope_cos_sin_cache(*self._args).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, heads, dim], k: [T, kv_heads, dim]
        if self.triton_ops:
            from plait.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos_sin_cache)
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Torch path: ``x`` [T, heads, dim] (q, k, or both side by side), with cos/sin
        looked up once per step: every layer passes the same ``positions``."""
        if positions is not self._positions:
            half = x.shape[-1] // 2
            cs = self.cos_sin_cache[positions.long()].float()
            self._positions, self._cos, self._sin = positions, cs[:, None, :half], cs[:, None, half:]
        return rotate_ref(x, self._cos, self._sin)


class RMSNorm(nn.Module):
    """HF RMSNorm. With ``residual``: ``residual = x + residual`` first, and returns
    ``(norm(residual), residual)`` (fused into one kernel on the triton path)."""

    def __init__(self, dim: int, eps: float, triton_ops: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.triton_ops = triton_ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if self.triton_ops:
            from plait.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm

            if residual is None:
                return rmsnorm(x, self.weight, self.eps)
            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, triton_ops: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, triton_ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, triton_ops)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend, fb: ForwardBatch
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.qk_norm or rope.triton_ops:
            q, k = rope(positions, q, k)
        else:  # q and k are adjacent in the fused output: rotate them as one tensor
            qk = rope.rotate(positions, qkv[:, : self.q_size + self.kv_size].view(T, -1, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = attn.forward(q, k, v, self.layer_id, fb)  # [T, heads, dim]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, triton_ops: bool = False) -> None:
        super().__init__()
        self.triton_ops = triton_ops
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.triton_ops:
            from plait.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        # in place, in the GEMM's output: no fresh [tokens, intermediate] buffers
        gate = F.silu(gate_up[:, : self.inter], inplace=True)
        return self.down_proj(gate.mul_(gate_up[:, self.inter :]))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, triton_ops: bool = False) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, triton_ops)
        self.mlp = MLP(cfg, triton_ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton_ops)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionBackend,
        fb: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous sublayer's output (the embeddings for layer 0, with no
        residual yet). Residual adds are fused into the norms that follow them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, attn, fb)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int, triton_ops: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, triton_ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton_ops)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, triton_ops)


class CausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits`` maps
    the rows that need them to ``[rows, vocab]`` (float32).

    ``triton_ops`` swaps RMSNorm (+ fused residual add), rotary and SiLU-and-mul for the
    kernels in :mod:`plait.kernels` (the default with the triton backend on CUDA).
    """

    def __init__(self, cfg: ModelConfig, max_pos: int | None = None, triton_ops: bool = False) -> None:
        super().__init__()
        self.config = cfg
        self.triton_ops = triton_ops
        self.model = DecoderModel(cfg, max_pos or cfg.context_length, triton_ops)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_lm_head: torch.Tensor | None = None  # tied embeddings, packed for oneDNN

    def materialize(self, device: torch.device, dtype: torch.dtype) -> CausalLM:
        """Allocate a model built on the meta device on ``device`` in ``dtype``
        (parameters uninitialised until :meth:`load_weights`; buffers recomputed)."""
        # cast on the meta device first: materialising float32 and casting after would
        # need the weights in both dtypes at once (3x the bf16 size at the peak)
        self.to(dtype).to_empty(device=device)
        self.model.rotary.recompute_cache()
        return self

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        m = self.model
        x, residual = m.embed_tokens(fb.input_ids), None
        for layer in m.layers:
            x, residual = layer(x, residual, fb.positions, m.rotary, attn, fb)
        return m.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.config.tie_word_embeddings:
            return self.lm_head(hidden).float()
        if self.packed_lm_head is not None:
            return packed_linear(hidden, self.packed_lm_head, None).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    def pack_for_cpu(self) -> None:
        """Run every projection and the LM head on oneDNN with weights packed now
        (:mod:`plait.runtime.models.linear`); call after :meth:`load_weights`. The
        embedding table stays as it is for the lookup, so tied embeddings are held twice."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()
        if self.config.tie_word_embeddings:
            self.packed_lm_head = pack_weight(self.model.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load from Hugging Face names; q/k/v and gate/up are fused on the way in.
        Raises if a parameter is missing or a name is unknown."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        fused = {  # hf shard -> (fused name, row offset, rows)
            "self_attn.q_proj": ("self_attn.qkv_proj", 0, q),
            "self_attn.k_proj": ("self_attn.qkv_proj", q, kv),
            "self_attn.v_proj": ("self_attn.qkv_proj", q + kv, kv),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
            "mlp.up_proj": ("mlp.gate_up_proj", inter, inter),
        }
        with torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                target, rows = name, None
                for shard, (fused_name, off, n) in fused.items():
                    if f".{shard}." in name:
                        target, rows = name.replace(shard, fused_name), (off, n)
                        break
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {cfg.architecture} model")
                p = params[target]
                if rows is None:
                    if p.shape != tensor.shape:
                        raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
                    p.copy_(tensor)
                    loaded.add(target)
                else:
                    off, n = rows
                    p[off : off + n].copy_(tensor)
                    loaded.add(f"{target}#{off}")
        expected = set()
        for pname in params:
            shards = [(off) for (fname, off, _n) in fused.values() if pname.endswith(fname + ".weight") or pname.endswith(fname + ".bias")]
            if shards:
                expected.update(f"{pname}#{off}" for off in shards)
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")
