"""Cached KV is dropped exactly when what it depends on changes: new weights."""

from __future__ import annotations

import shutil

import pytest

from conftest import build_tiny_model
from plait.errors import RequestError
from plait.runtime import Engine

PARAMS = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
PROMPT = list(range(60, 90))


def test_new_weights_drop_the_cache_and_the_same_weights_keep_it(tmp_path, tokenizer_dir, tiny_model_factory):
    first = tiny_model_factory("llama")
    tuned = build_tiny_model(tmp_path / "tuned", tokenizer_dir, "llama", seed=1)  # same shape, other weights
    copy = tmp_path / "copy"
    shutil.copytree(first, copy, copy_function=shutil.copy2)  # same files: same fingerprint
    with Engine(str(tuned), kv_cache_tokens=512, page_size=4) as ref:
        expected = ref.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
    with Engine(str(first), kv_cache_tokens=512, page_size=4) as e:
        before = e.generate(input_ids=PROMPT, sampling_params=PARAMS)
        fp = e.server_info()["weights_fingerprint"]
        assert e.update_weights_from_disk(str(copy)) is True
        assert e.server_info()["weights_fingerprint"] == fp
        kept = e.generate(input_ids=PROMPT, sampling_params=PARAMS)
        assert kept["meta_info"]["cached_tokens"] > 0 and kept["output_ids"] == before["output_ids"]

        running = e.add_request(PROMPT, PARAMS)[0]
        e.step()
        assert e.update_weights_from_disk(str(tuned)) is False  # refused while requests run
        while e.has_work():
            e.step()
        e.pop_result(running)

        assert e.update_weights_from_disk(str(tuned)) is True
        assert e.server_info()["weights_fingerprint"] != fp
        after = e.generate(input_ids=PROMPT, sampling_params=PARAMS)
        assert after["meta_info"]["cached_tokens"] == 0  # the old weights' KV is gone
        assert after["output_ids"] == expected  # the new weights, exactly
        e.check_invariants()


def test_weights_of_another_shape_or_a_missing_path_are_refused(tmp_path, tokenizer_dir, tiny_model_factory):
    other = build_tiny_model(tmp_path / "wide", tokenizer_dir, "llama", hidden_size=96)
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=256, page_size=4) as e:
        before = e.generate(input_ids=PROMPT[:8], sampling_params=PARAMS)["output_ids"]
        with pytest.raises(RequestError, match="different model") as err:
            e.update_weights_from_disk(str(other))
        assert err.value.param == "model_path"
        with pytest.raises(RequestError, match="cannot be loaded"):
            e.update_weights_from_disk(str(tmp_path / "nowhere"))
        assert e.generate(input_ids=PROMPT[:8], sampling_params=PARAMS)["output_ids"] == before
