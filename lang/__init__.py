"""plait: a structured-generation language for LLM programs.

This package is the language; it stays light and never imports torch. The serving
runtime lives in :mod:`plait.runtime` and is imported only when used (by
``Runtime`` to launch a sidecar, or by ``EngineBackend`` to run in-process).

Programs written for SGLang's frontend run unchanged after ``import plait as sgl``.
"""

from __future__ import annotations

from typing import Any

from plait.api import (
    CompiledFunction, Function, assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int, gen_string,
    get_default_backend, get_server_info, image, select, separate_reasoning, set_default_backend, system,
    system_begin, system_end, user, user_begin, user_end, video,
)
from plait.backend import BaseBackend, TokenUsage
from plait.choices import (
    ChoicesDecision, ChoicesSamplingMethod, greedy_token_selection, token_length_normalized,
    unconditional_likelihood_normalized,
)
from plait.errors import (
    BackendError, PlaitError, ProgramCancelled, ProgramError, RuntimeUnavailableError, UnknownVariableError,
)
from plait.global_config import GlobalConfig, global_config
from plait.interpreter import ProgramState, ProgramStateGroup
from plait.tracer import BatchPlan, ProgramGraph

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "function", "Function", "CompiledFunction", "gen", "gen_int", "gen_string", "select", "separate_reasoning",
    "image", "video",
    "system", "user", "assistant", "system_begin", "system_end", "user_begin", "user_end",
    "assistant_begin", "assistant_end",
    "set_default_backend", "get_default_backend", "flush_cache", "get_server_info", "global_config", "GlobalConfig",
    "Runtime", "RuntimeEndpoint", "Engine", "EngineBackend", "BaseBackend", "TokenUsage",
    "ChoicesDecision", "ChoicesSamplingMethod", "token_length_normalized", "greedy_token_selection",
    "unconditional_likelihood_normalized",
    "ProgramState", "ProgramStateGroup", "ProgramGraph", "BatchPlan",
    "PlaitError", "BackendError", "RuntimeUnavailableError", "ProgramCancelled", "ProgramError",
    "UnknownVariableError",
]


def __getattr__(name: str) -> Any:
    # backends that pull in zmq or the runtime load on first use
    if name in ("Runtime", "RuntimeEndpoint"):
        from plait import runtime_endpoint

        return getattr(runtime_endpoint, name)
    if name in ("EngineBackend", "Engine"):
        from plait import engine_backend

        return engine_backend.EngineBackend if name == "EngineBackend" else engine_backend.OfflineEngine
    if name in _HOSTED_API_BACKENDS:
        raise AttributeError(f"plait has no {name} backend: SGLang's {name} calls a hosted API, plait programs run "
                             "on plait's runtime (plait.Runtime(), plait.RuntimeEndpoint(url) or plait.Engine())")
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


# SGLang's backends for hosted APIs, which plait does not have
_HOSTED_API_BACKENDS = ("OpenAI", "Anthropic", "LiteLLM", "VertexAI")
