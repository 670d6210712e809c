"""The model facts the runtime needs, read from a Hugging Face config or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.kernels.rotary import ROPE_TYPES as SUPPORTED_ROPE_TYPES

# model_type -> the flags that distinguish it inside the shared decoder.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Mistral, SmolLM, Qwen2/2.5, Qwen3).

    One decoder implementation serves all of them; the differences are flags:
    ``qkv_bias``/``o_bias`` (Qwen2 has q/k/v bias only), ``qk_norm`` (Qwen3's per-head RMSNorm on q
    and k), ``tie_word_embeddings`` and ``rope_scaling`` (llama3 / linear).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def context_length(self) -> int:
        """Longest sequence served exactly. NOTE: sliding-window attention is not
        implemented, so a windowed model (Mistral v0.1) is capped at its window, where
        full attention and windowed attention agree."""
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        """Build from a ``transformers.PretrainedConfig`` or its ``to_dict()``."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        model_type = d.get("model_type", "llama")
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        # transformers >= 5 keeps rope settings in rope_parameters; older versions in
        # rope_theta / rope_scaling.
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta") or rope_params.get("rope_theta") or 10000.0
        rope_scaling = d.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        use_sliding = d.get("use_sliding_window", model_type == "mistral")
        return cls(
            architecture=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no o_proj bias; Llama and Qwen3 put
            # attention_bias on all four projections.
            qkv_bias=model_type == "qwen2" or bool(d.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(d.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=d.get("sliding_window") if use_sliding else None,
        )
