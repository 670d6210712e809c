"""Shared Triton plumbing for the kernel modules.

Only the kernel modules import this file (lazily: from the triton attention backend, a
model that uses the fused kernels, or a test), so importing ``plait`` or
``plait.kernels`` never imports Triton.

Interpreter mode. Triton chooses between compiling and interpreting when a function is
*decorated*, reading ``TRITON_INTERPRET`` at that moment; its own standard library
(``tl.cdiv``, ``tl.max``, ...) is decorated when ``triton`` is first imported. Two rules
follow, applied here:

- On a machine without CUDA a compiled Triton kernel cannot run at all, so if Triton is
  not imported yet we default ``TRITON_INTERPRET=1`` before importing it. Tests may set
  the variable themselves first; the effect is the same.
- Our kernels follow whatever Triton's standard library became (interpreted or
  compiled), never the variable's current value, so a process that set the variable too
  late still gets a consistent set of functions. If Triton was imported without the
  interpreter on a CPU-only machine, importing a kernel module raises with the fix.

Compile-only mode. A process that compiles the kernels for a GPU it does not have (and
never runs them: ``benchmarks/gpu_compile_check.py``) sets ``PLAIT_TRITON_COMPILE_ONLY=1``
before importing a kernel module; then neither rule applies: Triton is imported as the
environment says (``TRITON_INTERPRET`` unset or ``0`` gives plain ``triton.jit`` kernels)
and no CUDA device is required.

So kernel modules take ``triton`` and ``tl`` from here (``from plait.kernels._triton
import tl, triton``) instead of importing Triton themselves: an import sorted above
this one would otherwise load Triton before the default is set.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

import torch

# True when this process only compiles kernels, for a GPU it may lack (see module doc).
COMPILE_ONLY: bool = os.environ.get("PLAIT_TRITON_COMPILE_ONLY") == "1"

if "triton" not in sys.modules and not COMPILE_ONLY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

# True when Triton's standard library runs under the interpreter.
INTERPRET: bool = isinstance(tl.standard.cdiv, InterpretedFunction)

if not INTERPRET and not COMPILE_ONLY and not torch.cuda.is_available():
    raise ImportError(
        "plait.kernels: Triton was imported without TRITON_INTERPRET=1 on a machine without "
        "CUDA, so its kernels cannot run; set TRITON_INTERPRET=1 before anything imports triton"
    )


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit``, interpreted exactly when Triton's own library is (see module doc)."""
    return InterpretedFunction(fn) if INTERPRET else triton.jit(fn)


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (Triton block sizes must be powers of two)."""
    return triton.next_power_of_2(n)


def dot_options(dtype: torch.dtype) -> dict[str, Any]:
    """The constexpr arguments of :func:`dot` for operands of ``dtype``, to splat into a
    launch: ``DOT_PRECISION`` is exact ``ieee`` for fp32 (Triton's default would be tf32
    on NVIDIA GPUs, ~1e-3 relative error; half inputs ignore it); ``DOT_UPCAST`` works
    around the interpreter's bf16 ``tl.dot`` (wrong results in Triton 3.7)."""
    return {
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        "DOT_UPCAST": INTERPRET and dtype == torch.bfloat16,
    }


@jit
def dot(a, b, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` with an fp32 accumulator. Under ``DOT_UPCAST`` the (already
    rounded) operands are widened to fp32 first: the products of two bf16 numbers are
    exact in fp32, so the result equals the tensor-core one up to summation order."""
    if DOT_UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION)
    return out
