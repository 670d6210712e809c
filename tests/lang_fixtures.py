"""The language tests' shared module fixtures: a tiny random Llama folder, an
``EngineBackend`` on it and a reference ``Engine`` on the same weights (greedy outputs
of a program are checked against the engine's own). Import the fixtures by name; a
module's own ``ENGINE_OPTS`` replaces the default options."""

from __future__ import annotations

import pytest

import plait as sgl
from plait.runtime import Engine

ENGINE_OPTS = {"kv_cache_tokens": 8192, "num_threads": 1, "max_running_requests": 16, "attention_backend": "torch"}


@pytest.fixture(scope="module")
def folder(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def _opts(request: pytest.FixtureRequest) -> dict:
    return getattr(request.module, "ENGINE_OPTS", ENGINE_OPTS)


@pytest.fixture(scope="module")
def backend(folder, request):
    b = sgl.EngineBackend(folder, **_opts(request))
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def ref(folder, request):
    with Engine(folder, **_opts(request)) as e:
        yield e
