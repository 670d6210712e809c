"""Linear layers whose CPU GEMM runs on a weight packed once at load: oneDNN's, or plait's
native kernel (:mod:`plait.kernels.gemm_cpu`).

On CPU, ``F.linear`` in float32 calls MKL's sgemm. oneDNN, which every torch CPU build
also carries, JIT-compiles its GEMM for the widest vector unit the CPU has and multiplies
against a weight re-laid out once into its blocked format. Where MKL does not use that
unit (on AMD CPUs it takes its AVX2 path even where AVX-512 exists) the difference is
large: on the 2-core AMD EPYC (Zen 5) the benchmarks run on, MKL reaches ~190 GFLOP/s on
SmolLM2's projections and oneDNN ~450, from 16 rows up. Results are float32 GEMMs with a
different summation order, so they differ from MKL's in the last bits only.

The engine packs every projection and the LM head after loading when
``EngineConfig.cpu_gemm`` resolves to ``onednn`` or ``native`` (``CausalLM.pack_for_cpu``; the
native kernel overlaps the weight read with the arithmetic at serving's row counts, see
``gemm_cpu.c``). Packing replaces each weight: the model is then for inference only, and its
state dict lacks them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels import gemm_cpu

# Row count the packed layout is tuned for. Measured on the benchmark machine, one
# layout packed for 64 rows runs within ~5% of a layout packed for each size from 16 to
# 2048 rows, and at 1-4 rows (where memory bandwidth bounds every GEMM) as fast as MKL.
PACK_BATCH_HINT = 64


def onednn_gemm_available() -> bool:
    """Whether this torch build can pack weights for oneDNN's CPU GEMM."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (float32, CPU) re-laid out for :func:`packed_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [rows, in] with a weight from :func:`pack_weight`
    (oneDNN) or :func:`plait.kernels.gemm_cpu.pack` (native)."""
    if isinstance(packed, gemm_cpu.Packed):
        return gemm_cpu.linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_for(weight: torch.Tensor, kind: str):
    """``weight`` packed for :func:`packed_linear` by ``kind``: ``onednn`` or ``native``."""
    if kind == "native":
        return gemm_cpu.pack(weight)
    if kind == "onednn":
        return pack_weight(weight)
    raise ValueError(f"no packed GEMM named {kind!r} (onednn or native)")


class Linear(nn.Linear):
    """``nn.Linear`` that runs on a packed weight once :meth:`pack` was called."""

    packed = None  # a oneDNN tensor or a gemm_cpu.Packed once packed

    def pack(self, kind: str = "onednn") -> None:
        self.packed = pack_for(self.weight, kind)
        self.weight = None  # the packed copy is the weight from now on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)
