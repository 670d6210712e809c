"""Model family -> the class that runs it (the families come from
:data:`plait.runtime.models.config.HF_ARCHITECTURES` / ``GGUF_ARCHITECTURES``)."""

from __future__ import annotations

from plait.runtime.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, unsupported
from plait.runtime.models.llama import CausalLM

# Every supported family runs on the shared decoder; its flags come from ModelConfig.
MODEL_CLASSES: dict[str, type[CausalLM]] = {family: CausalLM for family in SUPPORTED_ARCHITECTURES}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The model class for ``cfg.architecture``; an unknown family lists the supported ones."""
    if cfg.architecture not in MODEL_CLASSES:
        raise unsupported("model architecture", cfg.architecture, MODEL_CLASSES)
    return MODEL_CLASSES[cfg.architecture]
