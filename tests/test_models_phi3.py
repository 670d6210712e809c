"""Phi-3 / Phi-3.5 against Hugging Face transformers on tiny random models: checkpoints
with fused qkv_proj and gate_up_proj, plain rope and longrope ("su") scaling with
short/long factors. Greedy tokens identical and prompt logprobs within 1e-4 (fp32),
fresh and from the prefix cache with small prefill chunks, and under retraction.

Longrope: a sequence of at most original_max_position_embeddings tokens is computed
with the short factors, a longer one with the long factors throughout -- transformers'
rule: its Phi-3 drops its KV cache and recomputes the whole sequence when generation
crosses the limit, and so does the scheduler (plait.runtime.models.llama.cos_sin_cache
holds both; checked against transformers' rotary embedding on both sides of the limit).
Engine runs below, across and beyond the limit, with prefix-cache reuse kept apart by
factor (a short-factor prefix never serves a long-factor request).

GGUF: the same models written as llama.cpp's converter writes a ``phi3`` file (fused
``attn_qkv`` and ``ffn_up`` = gate | up, longrope as ``rope_factors_long/short`` tensors with
``rope.scaling.original_context_length`` and ``rope.scaling.attn_factor``, F32 tensors,
SmolLM2's tokenizer metadata): the same config and weights as the folder, and the
engine on the GGUF against transformers on the folder."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import smollm2_gguf_path
from families import COMMON, FamilyRefs, build_refs, check_fresh_and_cached, check_retracted

from plait.runtime.model_loader import resolve_model

ORIGINAL = 96  # every prompt + its 8 new tokens stays below


def _longrope() -> dict:
    half = 16 // 2  # head_dim 16
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.0 + 0.9 * i for i in range(half)],
        "original_max_position_embeddings": ORIGINAL,
    }


@pytest.fixture(scope="module", params=["rope", "longrope"])
def phi3(request, tmp_path_factory, tokenizer_dir):
    from transformers import Phi3Config

    scaling = dict(rope_scaling=_longrope(), original_max_position_embeddings=ORIGINAL,
                   max_position_embeddings=256) if request.param == "longrope" else {}
    config = Phi3Config(**{**COMMON, **scaling}, rope_theta=10000.0, architectures=["Phi3ForCausalLM"])
    refs = build_refs(tmp_path_factory.mktemp(f"tiny-phi3-{request.param}"), tokenizer_dir, config)
    assert max(len(p) for p in refs.prompts) + 8 <= ORIGINAL
    refs.kind = request.param
    return refs


def test_phi3_config(phi3):
    cfg = resolve_model(str(phi3.folder)).load_config()
    assert cfg.architecture == "phi3"
    assert cfg.rope_type == ("longrope" if phi3.kind == "longrope" else "default")


def test_rope_cache_matches_transformers_on_both_sides_of_the_limit(phi3):
    from transformers import AutoModelForCausalLM

    from plait.runtime.models.llama import cos_sin_cache, long_rope_offset

    rotary = AutoModelForCausalLM.from_pretrained(phi3.folder).model.rotary_emb
    cfg = resolve_model(str(phi3.folder)).load_config()
    cache = cos_sin_cache(cfg.head_dim, 256, cfg.rope_theta, cfg.rope_scaling)
    offset = long_rope_offset(256, cfg.rope_scaling)
    assert cache.shape[0] == 256 + offset and offset == (256 if phi3.kind == "longrope" else 0)
    half = cfg.head_dim // 2
    for pos in (0, 10, ORIGINAL - 1, ORIGINAL, 200):
        # transformers picks short/long by the largest position of the call: one at a time
        cos, sin = rotary(torch.zeros(1), torch.tensor([[pos]]))
        row = pos + (offset if pos >= ORIGINAL else 0)  # a sequence that long: the long rows
        torch.testing.assert_close(cache[row, :half], cos[0, 0, :half], atol=1e-6, rtol=0)
        torch.testing.assert_close(cache[row, half:], sin[0, 0, :half], atol=1e-6, rtol=0)
    if phi3.kind == "longrope":  # the long rows differ from the short ones at every position
        cos, _ = rotary(torch.zeros(1), torch.tensor([[0, ORIGINAL]]))  # a call past the limit: long
        torch.testing.assert_close(cache[offset, :half], cos[0, 0, :half], atol=1e-6, rtol=0)
        assert not torch.allclose(cache[offset + 1 : 2 * offset], cache[1:offset])


def test_phi3_matches_hf_fresh_and_from_the_prefix_cache(phi3):
    check_fresh_and_cached(phi3, chunked_prefill_size=7, page_size=1)


def test_phi3_under_retraction(phi3):
    check_retracted(phi3)


@pytest.mark.parametrize("phi3", ["longrope"], indirect=True)
def test_longrope_across_and_beyond_the_original_context_matches_hf(phi3):
    """Prompts below the limit whose generation crosses it (recomputed with the long
    factors there), prompts longer than it (long factors from the start), together and
    one after another, with prefix-cache reuse only within one kind of factors."""
    from conftest import hf_greedy, hf_prompt_logprobs
    from transformers import AutoModelForCausalLM

    from test_engine_exactness import LOGPROB_ATOL, check_outputs

    from plait.errors import RequestError
    from plait.runtime import Engine
    from plait.runtime.request import long_rope_namespace

    hf = AutoModelForCausalLM.from_pretrained(phi3.folder, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 40000, (130,), generator=g).tolist()
    crossing, beyond, short = base[:92], base[:120], base[:80]  # + 8 new: 100, 128, 88 tokens
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    with Engine(str(phi3.folder), kv_cache_tokens=2048, page_size=4, chunked_prefill_size=32) as engine:
        first = engine.generate(input_ids=[crossing, beyond], sampling_params=params, return_logprob=True,
                                logprob_start_len=0)
        rounds = [first, engine.generate(input_ids=[short, crossing, beyond], sampling_params=params)]
        prompts = [[crossing, beyond], [short, crossing, beyond]]
        for outs, ps in zip(rounds, prompts):
            check_outputs(engine, outs, [hf_greedy(hf, p, 8) for p in ps])
        for o, p in zip(first, prompts[0]):
            got = torch.tensor([lp for lp, _ in o["meta_info"]["input_token_logprobs"][1:]])
            torch.testing.assert_close(got, hf_prompt_logprobs(hf, p), atol=LOGPROB_ATOL, rtol=0)
        hits = [o["meta_info"]["cached_tokens"] for o in rounds[1]]
        # the second round reused the first's KV, each request within its own factors
        assert hits[0] >= 76 and hits[1] >= 88 and hits[2] >= 116, hits
        # a tenant's flush drops its long-factor namespace with it; salts cannot name it
        engine.generate(input_ids=[beyond], sampling_params=params, cache_salt="t")
        assert engine.cache.match_prefix(beyond, long_rope_namespace("t")).length >= 116
        assert engine.flush_cache(cache_salt="t")
        assert engine.cache.match_prefix(beyond, long_rope_namespace("t")).length == 0
        assert engine.cache.match_prefix(beyond, long_rope_namespace(None)).length >= 116
        with pytest.raises(RequestError, match="cache_salt must not contain NUL"):
            engine.generate(input_ids=[short], sampling_params=params, cache_salt="\x00long-rope\x00t")
        # "" is a salt of its own for long factors too (its namespace was the unsalted one's)
        assert engine.generate(input_ids=beyond, sampling_params=params, cache_salt="")["meta_info"]["cached_tokens"] == 0
        assert engine.flush_cache(cache_salt="")
        assert engine.cache.match_prefix(beyond, long_rope_namespace(None)).length >= 116
        # a per-salt flush is refused, before anything changes, only while that salt's requests
        # of either factors run (an unsalted long-factor request does not block salt "")
        (req,) = engine.add_request(beyond, {**params, "max_new_tokens": 64}, cache_salt="t")
        engine.step()
        assert req in engine.scheduler.running and req.long_rope
        assert engine.flush_cache(cache_salt="t") is False
        assert engine.abort(req.rid)
        (req,) = engine.add_request(beyond, {**params, "max_new_tokens": 64})
        engine.step()
        assert req in engine.scheduler.running
        assert engine.flush_cache(cache_salt="") is True and engine.flush_cache() is False
        engine.abort(req.rid)
        while engine.scheduler.has_work():
            engine.step()


# ----------------------------------------------------------------------------- GGUF

# HF module name -> llama.cpp tensor name for Phi-3 (its converter's mapping)
_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def _folder_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@functools.cache
def _tokenizer_fields() -> list[tuple[str, Any, Any, Any]]:
    """The SmolLM2 GGUF's ``tokenizer.*`` metadata: (key, value, type, array item type)."""
    import gguf

    return [(f.name, f.contents(), f.types[0], f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
            for f in gguf.GGUFReader(smollm2_gguf_path()).fields.values() if f.name.startswith("tokenizer.")]


def write_phi3_gguf(folder: Path, path: Path, tokenizer: bool = False, rope_dims: int | None = None,
                    sliding_window: int | None = None) -> Path:
    """What llama.cpp's convert_hf_to_gguf writes for the Phi-3 model in ``folder``
    (F32); ``tokenizer``: with the SmolLM2 GGUF's tokenizer metadata (the engine needs
    it; the config and weights do not)."""
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(rope_dims or head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_sliding_window(sliding_window or cfg.sliding_window or 0)  # 0: none
    scaling = cfg.rope_parameters
    if scaling.get("rope_type") == "longrope":
        scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
        orig = cfg.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)))
        writer.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], dtype=np.float32))
    for key, value, vtype, sub in _tokenizer_fields() if tokenizer else ():
        writer.add_key_value(key, value, vtype, sub_type=sub)
    for name, tensor in _folder_state(folder).items():
        if name in _GGUF_TOP:
            gguf_name = _GGUF_TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{_GGUF_NAMES[module]}.{suffix}"
        writer.add_tensor(gguf_name, tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_phi3_gguf_config_and_weights_equal_the_folder(phi3, tmp_path):
    source = resolve_model(str(write_phi3_gguf(phi3.folder, tmp_path / "phi3.gguf")))
    assert source.kind == "gguf"
    got, want = source.load_config(), resolve_model(str(phi3.folder)).load_config()
    assert got.architecture == "phi3" and got.sliding_window is None
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "rope_theta", "max_position_embeddings", "tie_word_embeddings", "qkv_bias", "o_bias", "qk_norm",
              "hidden_act", "rope_type")
    assert {f: getattr(got, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert got.rms_norm_eps == pytest.approx(want.rms_norm_eps)
    if phi3.kind == "longrope":
        for key in ("short_factor", "long_factor", "original_max_position_embeddings", "max_position_embeddings"):
            np.testing.assert_allclose(got.rope_scaling[key], want.rope_scaling[key], rtol=1e-7)
        from plait.runtime.models.llama import cos_sin_cache, long_rope_offset

        torch.testing.assert_close(cos_sin_cache(got.head_dim, 256, got.rope_theta, got.rope_scaling),
                                   cos_sin_cache(want.head_dim, 256, want.rope_theta, want.rope_scaling),
                                   atol=1e-6, rtol=0)
    weights = dict(source.iter_weights())
    state = _folder_state(phi3.folder)
    assert weights.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("phi3", ["rope"], indirect=True)
def test_phi3_gguf_metadata_window_and_partial_rotary(phi3, tmp_path):
    windowed = write_phi3_gguf(phi3.folder, tmp_path / "window.gguf", sliding_window=47)
    assert resolve_model(str(windowed)).load_config().sliding_window == 47
    partial = write_phi3_gguf(phi3.folder, tmp_path / "partial.gguf", rope_dims=12)
    with pytest.raises(ValueError, match="rope.dimension_count=12"):
        resolve_model(str(partial)).load_config()


@pytest.mark.parametrize("phi3", ["longrope"], indirect=True)
def test_phi3_gguf_matches_hf(phi3, tmp_path):
    """The engine on the GGUF against transformers on the folder, fresh and cached; the
    longrope model only (it has all the GGUF mapping: fused tensors and rope metadata;
    the engine's GGUF tokenizer costs seconds to build)."""
    path = write_phi3_gguf(phi3.folder, tmp_path / "phi3.gguf", tokenizer=True)
    refs = FamilyRefs(path, phi3.prompts, phi3.greedy, phi3.logprobs, phi3.retract_greedy)
    check_fresh_and_cached(refs, chunked_prefill_size=7, page_size=1)


def test_fused_q4_decode_reads_the_rotary_rows_of_either_factors(phi3):
    """q4 decode steps on the fused path (plait.runtime.models.fused_decode) look up the
    rotary rows the module path does: short factors, long factors past the original
    context (``positions`` carry the long-rope offset), and across the recompute."""
    from plait.runtime import Engine

    g = torch.Generator().manual_seed(5)
    base = torch.randint(3, 40000, (130,), generator=g).tolist()
    prompts = [base[:92], base[:120], base[:40]]  # crossing, beyond, short
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for fused in (False, True):
        with Engine(str(phi3.folder), kv_cache_tokens=2048, page_size=4, quantization="q4",
                    fused_decode=fused) as engine:
            assert (engine.runner.fused is not None) == fused
            outs[fused] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    assert outs[True] == outs[False]
