"""End to end: the engine with the triton attention backend (under the Triton
interpreter on CPU) gives the same greedy tokens as the torch backend."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from plait.runtime import Engine  # noqa: E402


def test_triton_backend_matches_torch_backend(tiny_model_factory):
    folder = str(tiny_model_factory("qwen2"))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (3, 17, 33)]
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    outs = {}
    for backend in ("torch", "triton"):
        # chunk 16 forces chunked prefill over a cached prefix; page 4 exercises paging
        with Engine(folder, kv_cache_tokens=512, page_size=4, chunked_prefill_size=16,
                    attention_backend=backend) as engine:
            first = engine.generate(input_ids=prompts, sampling_params=params)
            again = engine.generate(input_ids=prompts[1], sampling_params=params)  # prefix hit
            assert again["meta_info"]["cached_tokens"] > 0
            outs[backend] = [o["output_ids"] for o in first] + [again["output_ids"]]
            engine.check_invariants()
    assert outs["triton"] == outs["torch"]
