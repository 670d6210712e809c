"""One decoder for the Llama family and Qwen2/Qwen3.

Parameter names follow Hugging Face checkpoints; :meth:`CausalLM.load_weights` takes
HF names and fuses q/k/v and gate/up into single projections (one GEMM each).
Architecture differences are flags on :class:`ModelConfig`: q/k/v bias (Qwen2),
per-head q/k RMSNorm (Qwen3), tied embeddings, rope scaling (llama3, linear).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.rotary import apply_rotary_ref, rope_cos_sin_cache
from plait.runtime.attention.base import AttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.config import ModelConfig


class RotaryEmbedding(nn.Module):
    """HF ``rotate_half`` layout; cos/sin cached for every position up to ``max_pos``
    (the cache and the math live in :mod:`plait.kernels.rotary`)."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, rope_scaling: dict | None) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", rope_cos_sin_cache(head_dim, max_pos, theta, rope_scaling), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, heads, dim], k: [T, kv_heads, dim]
        return apply_rotary_ref(q, k, positions, self.cos_sin_cache)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend, fb: ForwardBatch
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        o = attn.forward(q, k, v, self.layer_id, fb)  # [T, heads, dim]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend, fb: ForwardBatch
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, attn, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)


class CausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits`` maps
    the rows that need them to ``[rows, vocab]`` (float32)."""

    def __init__(self, cfg: ModelConfig, max_pos: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_pos or cfg.context_length)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        m = self.model
        x = m.embed_tokens(fb.input_ids)
        for layer in m.layers:
            x = layer(x, fb.positions, m.rotary, attn, fb)
        return m.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, w).float()

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
