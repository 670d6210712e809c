"""One decoder for every supported family: Llama, Mistral, Qwen2/Qwen3, Gemma 3, Phi-3
and the mixture-of-experts models (Qwen3-MoE, Qwen2-MoE, Mixtral).

Parameter names follow Hugging Face checkpoints; :meth:`CausalLM.load_weights` takes
HF names and fuses q/k/v and gate/up into single projections (one GEMM each; Phi-3
checkpoints arrive fused). Architecture differences are flags on :class:`ModelConfig`:
q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3, Gemma 3), tied embeddings, rope
scaling (llama3, linear, yarn, longrope), Gemma 3's ``(1 + w)`` norms, sandwich norms,
embedding scale, GELU-tanh, soft-capped logits and sliding-window layers with their own
rope base, and routed experts in place of the MLP (:mod:`plait.runtime.models.moe`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.rotary import rope_cos_sin_cache
from plait.runtime.attention.base import AttentionBackend
from plait.runtime.forward_batch import ForwardBatch
from plait.runtime.models.config import ModelConfig
from plait.runtime.models.linear import Linear, pack_for, packed_linear
from plait.runtime.models.quant import QuantLinear, QuantWeight, quantized_lm_head
from plait.runtime.models.parallel import (
    RowParallelLinear, TPGroup, VocabParallelEmbedding, meta_weight, on_meta_device, shard_config, shard_weights,
)


class RotaryEmbedding(nn.Module):
    """HF ``rotate_half`` layout; cos/sin cached for every position up to ``max_pos``
    (the cache and the math live in :mod:`plait.kernels.rotary`)."""

    def __init__(
        self, head_dim: int, max_pos: int, theta: float, rope_scaling: dict | None, triton_ops: bool = False
    ) -> None:
        super().__init__()
        self._args = (head_dim, max_pos, theta, rope_scaling)
        if on_meta_device():  # values come with recompute_cache where the model is materialised
            cache = torch.empty(max_pos * (2 if long_rope_offset(max_pos, rope_scaling) else 1), head_dim)
        else:
            cache = cos_sin_cache(*self._args)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.triton_ops = triton_ops
        self._positions: torch.Tensor | None = None  # the step whose cos/sin are cached
        self._cos = self._sin = None

    def recompute_cache(self) -> None:
        """Fill the cos/sin cache again (float32) where the buffer now lives: a module
        built on the meta device and materialised with ``to_empty`` has no values."""
        device = self.cos_sin_cache.device
        self.cos_sin_cache = cos_sin_cache(*self._args).to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, heads, dim], k: [T, kv_heads, dim]
        if self.triton_ops:
            from plait.kernels.rotary import apply_rotary

            return apply_rotary(q, k, positions, self.cos_sin_cache)
        return self.rotate(positions, q), self.rotate(positions, k)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Torch path: ``x`` [T, heads, dim] (q, k, or both side by side), with cos/sin
        looked up once per step: every layer passes the same ``positions``.

        :func:`~plait.kernels.rotary.rotate_ref` bit for bit in fewer ops (per layer; at
        decode the ops' count is the cost): ``x * [cos | cos] + roll(x) * [-sin | sin]``,
        the same products summed in the same order (``a - b`` is ``a + (-b)`` exactly)."""
        if positions is not self._positions:
            half = x.shape[-1] // 2
            cs = self.cos_sin_cache[positions.long()].float()
            cos, sin = cs[:, None, :half], cs[:, None, half:]
            self._positions = positions
            self._cos, self._sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)  # [T, 1, dim]
        xf = x.float()
        return (xf * self._cos + xf.roll(x.shape[-1] // 2, -1) * self._sin).to(x.dtype)


def cos_sin_cache(head_dim: int, max_pos: int, theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """``[max_pos, head_dim]`` cos | sin, fp32 (:func:`plait.kernels.rotary.rope_cos_sin_cache`),
    and longrope (Phi-3) here: ``[2 * max_pos, head_dim]``, the short factors' rows then
    the long factors' (a position rotated with the long factors is looked up at
    ``max_pos + position``: :func:`long_rope_offset`).

    transformers computes a sequence of at most ``original_max_position_embeddings``
    tokens with the short factors and a longer one with the long factors throughout (its
    Phi-3 recomputes the whole sequence when generation crosses the limit); the
    scheduler does the same (``Req.long_rope``).
    """
    if not rope_scaling or rope_scaling.get("rope_type") != "longrope":
        return rope_cos_sin_cache(head_dim, max_pos, theta, rope_scaling)
    orig = int(rope_scaling["original_max_position_embeddings"])
    factor = rope_scaling.get("factor") or rope_scaling["max_position_embeddings"] / orig
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos = torch.arange(max_pos, dtype=torch.float32)
    rows = []
    for ext in (rope_scaling["short_factor"], rope_scaling["long_factor"]):
        inv_freq = 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta**exponents)
        freqs = torch.outer(pos, inv_freq)
        rows.append(torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1))
    return torch.cat(rows)


def long_rope_offset(max_pos: int, rope_scaling: dict | None) -> int:
    """Where :func:`cos_sin_cache`'s long-factor rows start (0: the model has none)."""
    return max_pos if rope_scaling and rope_scaling.get("rope_type") == "longrope" else 0


class RMSNorm(nn.Module):
    """HF RMSNorm. With ``residual``: ``residual = x + residual`` first, and returns
    ``(norm(residual), residual)`` (fused into one kernel on the triton path).
    ``unit_offset`` (Gemma): scales by ``1 + w`` in fp32 before rounding, as HF's Gemma
    norm does (on the torch path: the triton kernel takes ``w`` as it is)."""

    def __init__(self, dim: int, eps: float, triton_ops: bool = False, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.triton_ops = triton_ops and not unit_offset

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
        w = self.weight
        if x.dtype == torch.float32 and w.dtype == torch.float32 and x.is_cpu and not self.unit_offset:
            # torch's one-call RMSNorm: on CPU the same ops as the lines below, bit for bit
            # in float32 (tests/test_decode_fast_paths.py), with one Python dispatch
            # instead of seven (two norms per layer per step). Not on CUDA: a fused kernel there.
            return torch.rms_norm(x, w.shape, w, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + w.float())).to(x.dtype)
        return w * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, triton_ops: bool = False, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.sliding_window = cfg.layer_windows[layer_id]  # None: full attention
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        if tp is not None:  # this rank's heads in, partial sums all-reduced
            self.o_proj: Linear = RowParallelLinear(self.q_size, cfg.hidden_size, tp)
        else:
            self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, triton_ops, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, triton_ops, cfg.norm_unit_offset)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, attn: AttentionBackend, fb: ForwardBatch
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_size = self.q_size + self.kv_size
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm or rope.triton_ops:
            q = qkv[:, : self.q_size].view(T, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : qk_size].view(T, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope(positions, q, k)
        else:  # q and k are adjacent in the fused output: rotate them as one tensor
            qk = rope.rotate(positions, qkv[:, :qk_size].view(T, -1, self.head_dim))
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        o = attn.forward(q, k, v, self.layer_id, fb, self.sliding_window)  # [T, heads, dim]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, triton_ops: bool = False, intermediate_size: int = 0,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.triton_ops = triton_ops and cfg.hidden_act == "silu"
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.inter, bias=False)
        if tp is not None:  # this rank's intermediate features in, partial sums all-reduced
            self.down_proj: Linear = RowParallelLinear(self.inter, cfg.hidden_size, tp)
        else:
            self.down_proj = Linear(self.inter, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.triton_ops:
            from plait.kernels.activation import silu_and_mul

            return self.down_proj(silu_and_mul(gate_up))
        return self.down_proj(act_and_mul(gate_up, self.inter, self.gelu))


def act_and_mul(gate_up: torch.Tensor, inter: int, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for ``gate_up`` [T, 2 * inter] (SiLU, or GELU-tanh for Gemma);
    in place, in the GEMM's output: no fresh [tokens, intermediate] buffers."""
    gate = gate_up[:, :inter]
    gate = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate, inplace=True)
    return gate.mul_(gate_up[:, inter:])


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, triton_ops: bool = False, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, triton_ops, tp)
        if cfg.sparse_layers[layer_id]:
            from plait.runtime.models.moe import SparseMoeBlock

            self.mlp: nn.Module = SparseMoeBlock(cfg, triton_ops, tp)
        else:
            self.mlp = MLP(cfg, triton_ops, tp=tp)
        self.rope_local = cfg.rope_local_theta is not None and self.self_attn.sliding_window is not None
        norm = (cfg.hidden_size, cfg.rms_norm_eps, triton_ops, cfg.norm_unit_offset)
        self.input_layernorm = RMSNorm(*norm)
        self.post_attention_layernorm = RMSNorm(*norm)
        self.sandwich_norms = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(*norm)
            self.post_feedforward_layernorm = RMSNorm(*norm)

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
        residual yet). Residual adds are fused into the norms that follow them; with
        sandwich norms (Gemma) each sublayer's output is normalised before its add."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rope, attn, fb)
        if not self.sandwich_norms:
            h, residual = self.post_attention_layernorm(h, residual)
            return self.mlp(h), residual
        h, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(h), residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int, triton_ops: bool = False, tp: TPGroup | None = None) -> None:
        super().__init__()
        if tp is not None:
            self.embed_tokens: nn.Embedding = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        else:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=meta_weight(cfg.vocab_size,
                                                                                                 cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, triton_ops, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, triton_ops, cfg.norm_unit_offset)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling, triton_ops)
        self.rotary_local: RotaryEmbedding | None = None  # Gemma 3's sliding layers
        if any(layer.rope_local for layer in self.layers):
            self.rotary_local = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_local_theta, None, triton_ops)

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary, self.rotary_local) if r is not None]


class CausalLM(nn.Module):
    """``forward`` returns final hidden states ``[T, hidden]``; ``compute_logits`` maps
    the rows that need them to ``[rows, vocab]`` (float32).

    ``triton_ops`` swaps RMSNorm (+ fused residual add), rotary and SiLU-and-mul for the
    kernels in :mod:`plait.kernels` (the default with the triton backend on CUDA).

    ``tp``: this rank of a tensor-parallel group (:mod:`plait.runtime.models.parallel`);
    ``config`` is then the rank's shard of ``full_config`` (the checkpoint's shapes),
    :meth:`load_weights` takes the full checkpoint and keeps this rank's slices, and
    :meth:`compute_logits` returns the whole vocabulary on every rank.
    """

    def __init__(
        self, cfg: ModelConfig, max_pos: int | None = None, triton_ops: bool = False, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        self.full_config = cfg
        self.tp = tp
        self.config = cfg = shard_config(cfg, tp.rank, tp.size) if tp is not None else cfg
        self.triton_ops = triton_ops
        self.model = DecoderModel(cfg, max_pos or cfg.context_length, triton_ops, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_lm_head: torch.Tensor | None = None  # tied embeddings, packed for oneDNN
        self.quant_lm_head: QuantLinear | None = None  # tied embeddings in q8 blocks (quantization)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> CausalLM:
        """Allocate a model built on the meta device on ``device`` in ``dtype``
        (parameters uninitialised until :meth:`load_weights`; buffers recomputed)."""
        # cast on the meta device first: materialising float32 and casting after would
        # need the weights in both dtypes at once (3x the bf16 size at the peak)
        self.to(dtype).to_empty(device=device)
        for m in self.modules():
            if isinstance(m, QuantLinear):
                m.keep_float32_blocks()
        for rotary in self.model.rotary_embeddings():
            rotary.recompute_cache()
        return self

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        m = self.model
        x, residual = m.embed_tokens(fb.input_ids), None
        if self.config.scale_embeddings:
            # by sqrt(hidden) rounded to the model dtype, as HF's Gemma does
            x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype).item()
        for layer in m.layers:
            rope = m.rotary_local if layer.rope_local else m.rotary
            x, residual = layer(x, residual, fb.positions, rope, attn, fb)
        return m.norm(x, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.config.tie_word_embeddings:
            logits = self.lm_head(hidden).float()
        elif self.packed_lm_head is not None:
            logits = packed_linear(hidden, self.packed_lm_head, None).float()
        elif self.quant_lm_head is not None:
            logits = self.quant_lm_head(hidden).float()
        else:
            logits = F.linear(hidden, self.model.embed_tokens.weight).float()
        if self.tp is not None:  # [rows, V / size] per rank -> [rows, V]
            logits = self.tp.gather_vocab(logits, self.full_config.vocab_size)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def pack_for_cpu(self, kind: str = "onednn") -> None:
        """Run every projection and the LM head on packed weights (``kind``: ``onednn`` or
        ``native``, :mod:`plait.runtime.models.linear`); call after :meth:`load_weights`.
        The embedding table stays as it is for the lookup, so tied embeddings are held twice."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(kind)
        if self.config.tie_word_embeddings:
            self.packed_lm_head = pack_for(self.model.embed_tokens.weight, kind)

    def quantize_tied_lm_head(self) -> None:
        """With tied embeddings and ``quantization`` on: the LM head in q8 blocks from the
        loaded embedding table (:mod:`plait.runtime.models.quant`); call after
        :meth:`load_weights`."""
        if self.config.tie_word_embeddings:
            self.quant_lm_head = quantized_lm_head(self.model.embed_tokens.weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load from Hugging Face names; q/k/v, gate/up and per-expert weights are fused on
        the way in (:func:`weight_target`). Raises if a parameter is missing or a name is
        unknown, misshapen or given twice."""
        params = dict(self.named_parameters())
        # projections kept in 4-bit blocks: filled row range by row range, from blocks or floats
        quantized = {f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, QuantLinear)}
        cfg = self.config
        if self.tp is not None:
            weights = shard_weights(weights, self.full_config, self.tp.rank, self.tp.size)
        filled: dict[str, int] = dict.fromkeys([*params, *quantized], 0)  # elements written per parameter
        seen: set[tuple[str, tuple]] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb.inv_freq" in name:
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                target, region = weight_target(name, cfg)
                if target not in params and target not in quantized:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {cfg.architecture} model")
                if (target, region) in seen:
                    raise ValueError(f"checkpoint tensor {name!r} is given twice")
                seen.add((target, region))
                if target in quantized:
                    quantized[target].load_rows(tensor, *(region[1:] if region else (0, 0)))
                    filled[target] += tensor.numel()
                    continue
                if isinstance(tensor, QuantWeight):  # blocks for a float parameter
                    tensor = tensor.dequantize()
                dest = params[target]
                if region:
                    index, off, n = region
                    dest = dest[index] if index is not None else dest
                    dest = dest[off : off + n] if n else dest
                if dest.shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
                dest.copy_(tensor)
                filled[target] += tensor.numel()
        missing = sorted(n for n, p in [*params.items(), *quantized.items()] if filled[n] != p.numel())
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:3]}")


# HF shard -> (fused parameter, which half: 0 first rows, 1 the rows after). q/k/v go
# through _QKV (three parts of different sizes).
_GATE_UP = {"gate_proj": 0, "up_proj": 1, "w1": 0, "w3": 1}  # Mixtral's experts: w1 gate, w3 up, w2 down
_QKV = ("q_proj", "k_proj", "v_proj")
EXPERT_WEIGHT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def weight_target(name: str, cfg: ModelConfig) -> tuple[str, tuple]:
    """Where an HF checkpoint tensor goes: ``(parameter name, region)``, region ``()`` for
    the whole parameter or ``(expert index | None, row offset, rows)`` (rows 0: all)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's checkpoint name of the MoE block
    m = EXPERT_WEIGHT.match(name)
    if m:  # one expert's projection -> its slice of the stacked [E, ...] parameters
        block, e, proj = m.group(1), int(m.group(2)), m.group(3)
        inter = cfg.moe_intermediate_size
        if proj in ("down_proj", "w2"):
            return f"{block}.experts.down_proj", (e, 0, 0)
        return f"{block}.experts.gate_up_proj", (e, _GATE_UP[proj] * inter, inter)
    base, _, suffix = name.rpartition(".")
    module, _, proj = base.rpartition(".")
    if proj in _QKV and module.endswith("self_attn"):
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        off = {"q_proj": 0, "k_proj": q, "v_proj": q + kv}[proj]
        return f"{module}.qkv_proj.{suffix}", (None, off, q if proj == "q_proj" else kv)
    if proj in ("gate_proj", "up_proj") and module.endswith(("mlp", "shared_expert")):
        layer_inter = cfg.shared_expert_intermediate_size if module.endswith("shared_expert") else cfg.intermediate_size
        return f"{module}.gate_up_proj.{suffix}", (None, _GATE_UP[proj] * layer_inter, layer_inter)
    return name, ()
