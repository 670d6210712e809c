"""The model facts the runtime needs, read from a Hugging Face config or GGUF metadata.

The architecture registry lives here: :data:`HF_ARCHITECTURES` maps the class names in a
``config.json``'s ``architectures`` and :data:`GGUF_ARCHITECTURES` the GGUF
``general.architecture`` values to a *family*; :mod:`plait.runtime.models.registry` maps a
family to the model class that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# rope scaling types plait.kernels.rotary computes (defined here, torch-free: the server's
# front reads model configs without importing torch)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Hugging Face architecture class -> family.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # the text model of the multimodal checkpoint
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# GGUF general.architecture -> family (llama.cpp names Mistral and Mixtral "llama").
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "qwen3moe": "qwen3_moe",
    "qwen2moe": "qwen2_moe",
}
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(HF_ARCHITECTURES.values()))  # families
# HF model_type -> family, for a config.json without ``architectures``.
_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3",
    "gemma3_text": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3_moe", "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
}
SUPPORTED_ROPE_TYPES = (*ROPE_TYPES, "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


def unsupported(what: str, value: Any, supported: Any) -> ValueError:
    return ValueError(f"{what} {value!r} is not supported; supported: {', '.join(supported)}")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model of one of the supported families.

    One decoder implementation (:mod:`plait.runtime.models.llama`) serves all of them; the
    differences are flags: ``qkv_bias``/``o_bias`` (Qwen2 has q/k/v bias only), ``qk_norm``
    (per-head RMSNorm on q and k: Qwen3, Gemma 3), ``tie_word_embeddings``, ``rope_scaling``
    (llama3 / linear / yarn / longrope), and for Gemma 3 ``norm_unit_offset`` (RMSNorm scales by
    ``1 + w``), ``sandwich_norms`` (norms after attention and after the MLP too),
    ``scale_embeddings`` (by sqrt(hidden)), ``query_pre_attn_scalar``, soft-capping and
    per-layer sliding windows with their own rope base (``rope_local_theta``). Mixture-of-
    experts layers (``num_experts > 0``) replace the MLP of the layers :attr:`sparse_layers`
    names with a routed block (:mod:`plait.runtime.models.moe`).
    """

    architecture: str  # the family, one of SUPPORTED_ARCHITECTURES
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
    # Attention window (keys within the last ``sliding_window`` positions, the query's
    # own included), on every layer unless ``layer_types`` names the windowed ones.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # rope base of sliding layers; None: rope_theta
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power; None: head_dim
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: one always-on expert, sigmoid-gated

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise unsupported("model architecture", self.architecture, SUPPORTED_ARCHITECTURES)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise unsupported("hidden_act", self.hidden_act, SUPPORTED_ACTIVATIONS)
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise unsupported("rope_scaling type", self.rope_type, SUPPORTED_ROPE_TYPES)
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                raise unsupported("layer type", t, LAYER_TYPES)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be None or >= 1, got {self.sliding_window}")
        if self.attn_logit_softcapping is not None:
            raise ValueError(
                f"attn_logit_softcapping={self.attn_logit_softcapping} is not supported (the attention "
                "kernels have no soft-capping); supported: None (Gemma 3 configs leave it unset)"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.num_experts_per_tok}"
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def long_rope_limit(self) -> int | None:
        """Longrope (Phi-3): sequences longer than this are computed with the long
        factors throughout (``original_max_position_embeddings``); None otherwise."""
        if self.rope_type != "longrope":
            return None
        return int(self.rope_scaling["original_max_position_embeddings"])

    @property
    def attention_scale(self) -> float:
        """The factor on q.k scores: ``query_pre_attn_scalar ** -0.5`` (Gemma) or ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer, its attention window (``None``: full attention)."""
        if not self.sliding_window:
            return (None,) * self.num_layers
        if not self.layer_types:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is a mixture of experts (transformers' rule)."""
        return tuple(
            self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_layers)
        )

    @property
    def context_length(self) -> int:
        """Longest sequence served (windowed layers attend to their window at any length)."""
        return self.max_position_embeddings

    @classmethod
    def from_hf(cls, cfg: Any) -> "ModelConfig":
        """Build from a ``transformers.PretrainedConfig`` or its ``to_dict()``. The family
        comes from ``architectures`` (else ``model_type``); an unknown one is an error
        that lists the supported architectures."""
        d = cfg if isinstance(cfg, dict) else cfg.to_dict()
        archs = d.get("architectures") or []
        if archs:
            if archs[0] not in HF_ARCHITECTURES:
                raise unsupported("model architecture", archs[0], HF_ARCHITECTURES)
            family = HF_ARCHITECTURES[archs[0]]
        else:
            model_type = d.get("model_type", "llama")
            if model_type not in _MODEL_TYPES:
                raise unsupported("model architecture", model_type, HF_ARCHITECTURES)
            family = _MODEL_TYPES[model_type]
        if "text_config" in d:  # Gemma3ForConditionalGeneration: the language model's config
            d = {**d["text_config"], "tie_word_embeddings": d.get("tie_word_embeddings", True)}
        num_heads = d["num_attention_heads"]
        hidden = d["hidden_size"]
        head_dim = d.get("head_dim") or hidden // num_heads
        rope_theta, rope_scaling = _hf_rope(d, "full_attention" if family == "gemma3" else None)
        rope_local_theta = None
        if family == "gemma3":
            rope_local_theta, local_scaling = _hf_rope(d, "sliding_attention")
            if local_scaling is not None:
                raise unsupported("rope type of sliding layers", local_scaling.get("rope_type"), ["default"])
        if rope_scaling is not None and _is_longrope(rope_scaling):
            rope_scaling = {
                **rope_scaling, "rope_type": "longrope",
                "original_max_position_embeddings": rope_scaling.get("original_max_position_embeddings")
                or d["original_max_position_embeddings"],
                "max_position_embeddings": d["max_position_embeddings"],
            }
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) == "yarn":
            # transformers: the pretraining context from the config's own field first, then
            # the dict's, then max_position_embeddings; a missing factor is their ratio
            original = (d.get("original_max_position_embeddings") or rope_scaling.get("original_max_position_embeddings")
                        or d["max_position_embeddings"])
            rope_scaling = {**rope_scaling, "rope_type": "yarn", "original_max_position_embeddings": original}
            if rope_scaling.get("factor") is None:
                rope_scaling["factor"] = d["max_position_embeddings"] / original
        if float(d.get("partial_rotary_factor") or 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor={d['partial_rotary_factor']} is not supported; supported: 1.0")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        gemma = family == "gemma3"
        moe = family in ("qwen3_moe", "qwen2_moe", "mixtral")
        return cls(
            architecture=family,
            vocab_size=d["vocab_size"],
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size") or 0,
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2(-MoE) always has q/k/v bias and no o_proj bias; Llama and Qwen3 put
            # attention_bias on all four projections.
            qkv_bias=family in ("qwen2", "qwen2_moe") or bool(d.get("attention_bias", False)),
            o_bias=family not in ("qwen2", "qwen2_moe") and bool(d.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
            hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            # transformers' configs already drop the window where use_sliding_window is off
            # (Qwen) and list the windowed layers in layer_types where only some are.
            sliding_window=d.get("sliding_window") or None,
            layer_types=tuple(d.get("layer_types") or ()),
            rope_local_theta=rope_local_theta,
            query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
            norm_unit_offset=gemma,
            sandwich_norms=gemma,
            scale_embeddings=gemma,
            final_logit_softcapping=d.get("final_logit_softcapping"),
            attn_logit_softcapping=d.get("attn_logit_softcapping"),
            num_experts=(d.get("num_local_experts") or d.get("num_experts") or 0) if moe else 0,
            num_experts_per_tok=(d.get("num_experts_per_tok") or 0) if moe else 0,
            # Mixtral's experts have intermediate_size; the Qwen MoEs their own size
            moe_intermediate_size=(d.get("moe_intermediate_size") or d.get("intermediate_size") or 0) if moe else 0,
            # Mixtral always renormalises the top-k weights; Qwen MoEs when norm_topk_prob
            norm_topk_prob=family == "mixtral" or bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
        )


def _is_longrope(scaling: dict[str, Any]) -> bool:
    return scaling.get("rope_type", scaling.get("type")) in ("longrope", "su")


def _hf_rope(d: dict[str, Any], layer_type: str | None) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)``; transformers >= 5 keeps them in ``rope_parameters``
    (per layer type for Gemma 3), older versions in ``rope_theta`` / ``rope_scaling``."""
    params = d.get("rope_parameters") or {}
    if layer_type is not None:
        params = params.get(layer_type) or {}
    if layer_type == "sliding_attention":
        theta = params.get("rope_theta") or d.get("rope_local_base_freq") or 10000.0
        scaling = None
    else:
        theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
        scaling = d.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    return float(theta), scaling
