"""The language tests' shared module fixtures: a tiny random Llama folder, an
``EngineBackend`` on it and a reference ``Engine`` on the same weights (greedy outputs
of a program are checked against the engine's own). Import the fixtures by name."""

from __future__ import annotations

import pytest

import plait as sgl
from plait.runtime import Engine

ENGINE_OPTS = {"kv_cache_tokens": 8192, "num_threads": 1, "max_running_requests": 16, "attention_backend": "torch"}


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


@pytest.fixture(scope="module")
def backend(folder):
    b = sgl.EngineBackend(folder, **ENGINE_OPTS)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def ref(folder):
    with Engine(folder, **ENGINE_OPTS) as e:
        yield e
