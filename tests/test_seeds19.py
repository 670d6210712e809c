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
