"""The fused path (plait.runtime.models.fused_decode) of quantized models and of float32
models on the native GEMM: the same tokens and logprobs as the module path, for decode
steps and for steps with prompt chunks beside them, the K/V it writes reusable by later
prompts, and used only where it applies."""

from __future__ import annotations

import pytest

from plait.runtime import Engine
from plait.runtime.models.fused_decode import why_not

GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _run(folder, mode, fused, prompts, **kw):
    if mode == "none":
        kw.setdefault("cpu_gemm", "native")
    with Engine(str(folder) if folder else None, kv_cache_tokens=2048, quantization=mode, fused_decode=fused,
                **kw) as engine:
        calls = []  # the steps the fused path ran: (prompt-chunk tokens, decodes)
        if engine.runner.fused is not None:
            forward = engine.runner.fused.forward
            engine.runner.fused.forward = lambda fb: calls.append((sum(fb.extend_seq_lens), fb.num_decodes)) or forward(fb)
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)
        return outs, calls, engine


def _logprobs(out):
    return [lp for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]


@pytest.mark.parametrize("arch, mode", [("llama", "q4"), ("qwen2", "q4"), ("llama3", "int8"), ("llama", "none"),
                                        ("qwen2", "none")])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fused_decode_gives_the_module_paths_tokens(tiny_model_factory, arch, mode, page_size):
    """Prompts of 3 to 70 tokens in chunks of at most 24 tokens a step: the longer ones'
    chunks run beside the shorter ones' decodes (mixed steps, tiles of a chunk's tokens
    in the attention), then decode-only steps."""
    folder = tiny_model_factory(arch)  # qwen2: q/k/v biases; llama3: its rope scaling, tied head
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40)] + [[9, 4, 33, 7] * 5] + [[3 + i % 50 for i in range(70)]]
    kw = {"chunked_prefill_size": 24, "page_size": page_size}
    ref, ref_calls, _ = _run(folder, mode, False, prompts, **kw)
    outs, calls, engine = _run(folder, mode, True, prompts, **kw)
    assert ref_calls == [] and calls
    assert max(d for _, d in calls) == len(prompts)  # batches of 5 decodes took the path
    # and chunks beside decodes, where the attention's tiles are vectorized (x86: always)
    assert any(e >= 2 and d >= 1 for e, d in calls) == (engine.runner.fused.max_extend > 0)
    for a, b in zip(ref, outs):
        assert a["output_ids"] == b["output_ids"]
        for x, y in zip(_logprobs(a), _logprobs(b)):
            assert abs(x - y) < 1e-3


@pytest.mark.parametrize("mode", ["none", "q4"])
def test_whole_prompts_take_the_fused_path(tiny_model_factory, mode):
    """Prompts prefilled in one step each (no chunking), many tiles of 16 tokens: float32
    models take them on the fused path, quantized ones while the step has fewer rows than
    PACK_MIN_ROWS (from there the module path packs the weights for oneDNN); the module
    path's tokens and prompt logprobs either way."""
    from plait.runtime.models.quant import KERNEL_MAX_ROWS, PACK_MIN_ROWS

    folder = tiny_model_factory("llama")
    # distinct from their first token on (a shared prefix would hold the second back for the cache)
    prompts = [[3 + (i * 7 + 13 * k) % 90 for i in range(n)] for k, n in enumerate((150, 300, 610, 620))]
    kw = {"chunked_prefill_size": 4096, "kv_cache_tokens": 4096, "cpu_gemm": "native"}

    def run(fused):
        with Engine(str(folder), quantization=mode, fused_decode=fused, **kw) as engine:
            calls = []
            if engine.runner.fused is not None:
                forward = engine.runner.fused.forward
                engine.runner.fused.forward = lambda fb: calls.append(sum(fb.extend_seq_lens)) or forward(fb)
            outs = [engine.generate(input_ids=prompts[:2], sampling_params=GREEDY, return_logprob=True,
                                    logprob_start_len=0)]
            outs.append(engine.generate(input_ids=prompts[2:], sampling_params=GREEDY, return_logprob=True,
                                        logprob_start_len=0))
            return [o for batch in outs for o in batch], calls, engine

    ref, ref_calls, _ = run(False)
    outs, calls, engine = run(True)
    assert ref_calls == [] and engine.runner.fused is not None
    if engine.runner.fused.max_extend:
        # the first two prompts' step (450 rows): quantized weights take it only where the
        # kernel multiplies that many rows itself (AVX-512; AVX2's q4 kernel stops at 32:
        # the test assumed an AVX-512 machine and failed under PLAIT_MAX_ISA=avx2)
        assert (450 in calls) == (mode == "none" or KERNEL_MAX_ROWS[engine.runner.fused.isa_name] is None)
        # the last two (1230 rows) on the fused path only for float32 weights
        assert (1230 in calls) == (mode == "none") and 1230 >= PACK_MIN_ROWS
    for a, b in zip(ref, outs):
        assert a["output_ids"] == b["output_ids"]
        for x, y in zip(_logprobs(a), _logprobs(b)):
            assert abs(x - y) < 1e-3
        prompt_a = [lp for lp, *_ in a["meta_info"]["input_token_logprobs"][1:]]
        prompt_b = [lp for lp, *_ in b["meta_info"]["input_token_logprobs"][1:]]
        assert len(prompt_a) == len(prompt_b) > 100
        assert max(abs(x - y) for x, y in zip(prompt_a, prompt_b)) < 1e-3


def test_a_step_too_large_for_the_fused_buffers_takes_the_module_path(tiny_model_factory, monkeypatch):
    """The fused step holds every row's activations at once: a step with more rows than
    MAX_STEP_BUFFER_BYTES allows runs on the torch modules (same tokens)."""
    from plait.runtime.models import fused_decode

    cfg = tiny_model_factory("llama")
    monkeypatch.setattr(fused_decode, "MAX_STEP_BUFFER_BYTES", 100 * 4 * (4 * 64 + 2 * (4 + 2) * 16 + 3 * 128))
    prompts = [[3 + (i * 7) % 90 for i in range(150)]]
    kw = {"chunked_prefill_size": 4096, "cpu_gemm": "native"}
    ref, _, _ = _run(cfg, "none", False, prompts, **kw)
    outs, calls, engine = _run(cfg, "none", True, prompts, **kw)
    assert engine.runner.fused.max_extend in (0, 100)
    assert calls and max(e for e, _ in calls) == 0  # the prompt's step on the modules, decodes fused
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_float32_fused_per_token_work_on_each_isa(tiny_model_factory, monkeypatch, isa):
    """A float32 model's per-token work in C (the SiLU's vector exp) on the AVX2 and the
    portable paths, as on CPUs without AVX-512: the module path's tokens and logprobs.
    (The AVX-512 path: the test above.)"""
    from plait.kernels import quant_cpu

    if isa == "avx2" and "avx2" not in quant_cpu.cpu_flags().split():
        pytest.skip("needs an AVX2 CPU")
    folder = tiny_model_factory("llama")
    prompts = [[5 + i for i in range(n)] for n in (3, 17, 40)]
    kw = {"chunked_prefill_size": 24}
    ref, _, _ = _run(folder, "none", False, prompts, **kw)
    monkeypatch.setattr(quant_cpu, "choose_isa", lambda flags_line=None: isa)
    outs, calls, engine = _run(folder, "none", True, prompts, **kw)
    assert calls and engine.runner.fused.isa == quant_cpu.ISAS.index(isa)
    for a, b in zip(ref, outs):
        assert a["output_ids"] == b["output_ids"]
        for x, y in zip(_logprobs(a), _logprobs(b)):
            assert abs(x - y) < 1e-3


def test_kv_written_by_the_fused_path_is_reused(tiny_model_factory):
    """A prompt made of an earlier prompt and its output reuses the KV the fused decode
    steps wrote (prefix cache) and continues as the first request did."""
    folder = tiny_model_factory("llama")
    prompt = [7, 3, 11, 19, 23, 5, 8]
    with Engine(str(folder), kv_cache_tokens=2048, quantization="q4", page_size=1) as engine:
        assert engine.runner.fused is not None
        first = engine.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"]
        cont = engine.generate(input_ids=prompt + first[:6], sampling_params={**GREEDY, "max_new_tokens": 6})
        # the first five outputs' KV came from decode steps (the sixth is recomputed: the
        # last prompt token is always computed for its logits)
        assert cont["meta_info"]["cached_tokens"] == len(prompt) + 5
        assert cont["output_ids"] == first[6:]


def test_default_model_q4_fused_gives_the_same_greedy_tokens():
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1977, 8104, 28, 33, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    ref, _, _ = _run(None, "q4", False, prompts)
    outs, calls, _ = _run(None, "q4", True, prompts)
    assert calls
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]


def test_used_only_where_it_applies(tiny_model_factory):
    llama = tiny_model_factory("llama")
    with Engine(str(llama), kv_cache_tokens=512, quantization="none", cpu_gemm="onednn") as engine:
        assert engine.runner.fused is None  # float32 on oneDNN's GEMM: the module path
        assert "native GEMM" in why_not(engine.model, engine.runner.attn)
    with Engine(str(llama), kv_cache_tokens=512, quantization="none", cpu_gemm="native", fused_decode=False) as engine:
        assert engine.runner.fused is None  # the option turns it off
    with Engine(str(llama), kv_cache_tokens=512, quantization="q4", attention_backend="torch") as engine:
        assert engine.runner.fused is None
        assert "attention backend" in why_not(engine.model, engine.runner.attn)
    with Engine(str(tiny_model_factory("qwen3")), kv_cache_tokens=512, quantization="q4") as engine:
        assert engine.runner.fused is None  # q/k norms
        assert "norm" in why_not(engine.model, engine.runner.attn)
        assert len(engine.generate(input_ids=[4, 5, 6], sampling_params=GREEDY)["output_ids"]) == 12


def test_option_is_validated():
    from plait.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="fused_decode"):
        EngineConfig(fused_decode="yes").validate()


def test_speculative_steps_beside_fused_decode_steps(tiny_model_factory):
    """n-gram drafts are verified on the module path, plain decode steps on the fused one:
    greedy output as without speculation."""
    folder = tiny_model_factory("llama")
    prompts = [[5, 6, 7, 8] * 6, [9, 4, 33, 7, 12] * 4]
    ref, _, _ = _run(folder, "q4", True, prompts)
    outs, calls, _ = _run(folder, "q4", True, prompts, speculative="ngram")
    assert calls
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in ref]
