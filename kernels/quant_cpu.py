"""Native weight-only quantized GEMM for CPUs (float32 activations; 16-bit blocks for one
row on AVX-512 VNNI and AVX2), built on first use.

``quant_linear_cpu.c`` multiplies float32 rows by weights stored in blocks of 32 (Q8:
int8 + a float32 scale; Q4: 4-bit + a float32 scale and minimum, GGUF Q4_1's math), the
formats of :mod:`plait.runtime.models.quant`. It carries an AVX-512F, an AVX2+FMA and a
portable C path in one library (per-function target attributes, no ``-march``);
:func:`choose_isa` picks one from the CPU's flags in ``/proc/cpuinfo``. It is compiled
and cached like the decode attention kernel (:mod:`plait.kernels.cpu_attention`);
:func:`load` raises ``RuntimeError`` saying why when it cannot be built.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from plait.kernels import cpu_attention

SOURCE = Path(__file__).with_name("quant_linear_cpu.c")
BLOCK = 32  # weights per quantization block (the C file's QBLOCK)
ISAS = ("portable", "avx2", "avx512", "avx512vnni")  # the C file's ISA_* codes, in this order
# what the VNNI level needs beyond avx512f (its one-row path: AVX512-BW/VL byte ops, vpdpbusd)
_VNNI_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
KINDS = ("q8", "q4")  # the C file's KIND_* codes
_FLAG_SETS = (["-O3", "-fopenmp", "-fPIC", "-shared"], ["-O3", "-fPIC", "-shared"])



def cpu_flags() -> str:
    """This machine's /proc/cpuinfo flags line (empty where there is none)."""
    return cpu_attention._cpu_flags()


def choose_isa(flags_line: str | None = None) -> str:
    """The fastest path the CPU runs: ``avx512vnni`` (avx512f/bw/vl and avx512_vnni:
    the AVX-512 paths, and one-row steps on 16-bit activations with integer dot
    products), ``avx512`` (avx512f), ``avx2`` (avx2 and fma) or ``portable``.
    ``flags_line``: a ``/proc/cpuinfo`` flags line (None: this machine's)."""
    flags = set((cpu_flags() if flags_line is None else flags_line).split())
    if _VNNI_FLAGS <= flags:
        return "avx512vnni"
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return "portable"


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.plait_quant_linear_f32.restype = i32
    lib.plait_quant_linear_f32.argtypes = [i32, i32, p, i64, i64, p, p, p, i64, p, p, i32]
    lib.plait_quant_dequant_f32.restype = i32
    lib.plait_quant_dequant_f32.argtypes = [i32, i32, p, p, p, i64, i64, p, i32]


_native = cpu_attention.NativeLibrary(SOURCE, _FLAG_SETS, "the native quantized GEMM kernel", _declare)
load = _native.load  # the compiled kernel, built on the first call (RuntimeError saying why not)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def quant_linear(
    x: torch.Tensor,
    kind: str,
    qs: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    isa: str,
) -> torch.Tensor:
    """``x`` [M, K] float32 (contiguous) times the blocked weight [N, K]: qs int8 [N, K]
    (q8) or uint8 [N, K/2] (q4), scales / mins float32 [N, K/32]. Returns [M, N]."""
    M, K = x.shape
    N = scales.shape[0]
    out = torch.empty((M, N), dtype=torch.float32)
    rc = load().plait_quant_linear_f32(
        KINDS.index(kind), ISAS.index(isa), x.data_ptr(), M, K, qs.data_ptr(), scales.data_ptr(), _ptr(mins), N,
        _ptr(bias), out.data_ptr(), torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"quantized GEMM kernel rejected kind={kind} isa={isa} K={K} (rc {rc})")
    return out


def dequantize(
    kind: str, qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, K: int, isa: str
) -> torch.Tensor:
    """The float32 weight [N, K] the blocks stand for (threaded, in C)."""
    N = scales.shape[0]
    w = torch.empty((N, K), dtype=torch.float32)
    rc = load().plait_quant_dequant_f32(
        KINDS.index(kind), ISAS.index(isa), qs.data_ptr(), scales.data_ptr(), _ptr(mins), N, K, w.data_ptr(), torch.get_num_threads()
    )
    if rc != 0:
        raise ValueError(f"quantized dequantize kernel rejected kind={kind} K={K} (rc {rc})")
    return w
