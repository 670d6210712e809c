"""plait.runtime: the serving engine (scheduler, paged KV cache, radix prefix cache,
models) and, later, the server processes. Importing it imports torch."""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "EngineConfig", "launch"]


def __getattr__(name: str) -> Any:
    # Lazy so that `python -m plait.runtime.<module>` and partial imports stay cheap.
    if name == "Engine":
        from plait.runtime.engine import Engine

        return Engine
    if name == "launch":
        from plait.runtime.server import launch

        return launch
    if name == "EngineConfig":
        from plait.runtime.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'plait.runtime' has no attribute {name!r}")
