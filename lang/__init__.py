"""plait: a structured-generation language for LLM programs.

This package is the language; it stays light and never imports torch. The serving
runtime lives in :mod:`plait.runtime` and is imported only when used.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
