"""Seeds on CPU: torch's CPU generator keeps only the low 32 bits of a seed, so seeds
that differ by a multiple of 2**32 (0 and 2**32, -2**63 and 0) sampled the same
outputs. The request's generator now takes a 64-bit mix of the seed
(:func:`plait.runtime.sampler.generator_seed`)."""

from __future__ import annotations

import pytest

from plait.runtime.engine import Engine
from plait.runtime.sampler import generator_seed


def test_the_mix_moves_the_low_32_bits_with_every_bit_of_the_seed():
    low = {generator_seed(s) & 0xFFFFFFFF for s in (0, 2**32, 2**40, -2**63, 2**63 - 1, -1, 1)}
    assert len(low) == 7
    assert all(0 <= generator_seed(s) < 2**64 for s in (-2**63, 2**63 - 1, 2**63 + 5))


@pytest.fixture(scope="module")
def engine(tiny_model_factory):
    with Engine(str(tiny_model_factory("llama")), kv_cache_tokens=2048) as e:
        yield e
        e.check_invariants()


def sample(e: Engine, seed: int, n: int = 1) -> list[str]:
    outs = e.generate("Once", {"temperature": 1.5, "seed": seed, "n": n, "max_new_tokens": 12, "ignore_eos": True})
    return [o["text"] for o in (outs if isinstance(outs, list) else [outs])]


def test_seeds_32_bits_apart_sample_differently(engine):
    assert sample(engine, 0) == sample(engine, 0)  # a seed still reproduces its sample
    assert sample(engine, 0) != sample(engine, 2**32)
    assert sample(engine, -2**63) != sample(engine, 0)
    # n > 1 at the top of the range: each sample its own seed, no overflow
    outs = sample(engine, 2**63 - 1, n=3)
    assert len(outs) == 3 and len(set(outs)) == 3


def test_requests_without_a_seed_never_repeat_each_others_samples(engine):
    """Without a seed, each sample's seed came from a counter plus its index, so the
    second sample of one request (counter c+1, index 1) and the first of the request
    after it (counter c+2) had the same seed: the same prompt sent again drew the same
    text. Seeds are now a 64-bit mix of the counter."""
    params = {"temperature": 1.5, "max_new_tokens": 12, "ignore_eos": True}
    texts = []
    for n in (3, 1, 2, 1, 3):
        outs = engine.generate("Once", {**params, "n": n})
        texts += [o["text"] for o in (outs if isinstance(outs, list) else [outs])]
    assert len(texts) == 10 and len(set(texts)) == 10
