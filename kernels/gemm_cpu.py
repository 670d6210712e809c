"""Native float32 GEMM for CPUs that overlaps the weight read with the arithmetic, built on
first use (``gemm_cpu.c``; why and how in its header).

The engine uses it for every projection and the LM head when ``EngineConfig.cpu_gemm``
resolves to ``native`` (``auto`` on an x86-64 CPU with AVX-512F or AVX2+FMA, where the
library builds and a start-up probe does not find oneDNN much faster:
:func:`native_preferred`). Weights are packed once by :func:`pack`; :func:`linear` runs
``x @ weight.T + bias``. It is compiled and cached like the decode attention kernel
(:mod:`plait.kernels.cpu_attention`); :func:`load` raises ``RuntimeError`` saying why
when it cannot be built.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import torch

from plait.kernels import cpu_attention

SOURCE = Path(__file__).with_name("gemm_cpu.c")
ISAS = {"avx2": 1, "avx512": 2}  # the C file's ISA_* codes
PANEL, GROUP = 16, 2  # the C file's packed layout: panels of 16 columns, padded to groups of 2
# Rows from which the next group's weights are software-prefetched, per path. Measured over
# SmolLM2-135M's 30 layers of projections (README, benchmarks/bench_gemm.py): AVX-512 at 8
# rows 19 ms without, 21 with, from 16 rows faster with (M=40: 32 against 39 ms); AVX2,
# whose tiles are half as wide, gains from one row on.
PREFETCH_MIN_ROWS = {"avx512": 16, "avx2": 1}
_FLAG_SETS = (["-O3", "-fopenmp", "-fPIC", "-shared"], ["-O3", "-fPIC", "-shared"])



_MISSING = object()
_local_isa = _MISSING


def choose_isa(flags_line: str | None = None) -> str | None:
    """``avx512`` (avx512f), ``avx2`` (avx2 and fma) or None (no native path) for the CPU
    whose ``/proc/cpuinfo`` flags line is given (None: this machine's, read once)."""
    global _local_isa
    if flags_line is None:
        if _local_isa is _MISSING:
            _local_isa = choose_isa(cpu_attention._cpu_flags())
        return _local_isa
    flags = set(flags_line.split())
    if "avx512f" in flags:
        return "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.plait_gemm_f32.restype = i32
    lib.plait_gemm_f32.argtypes = [i32, i64, i64, i64, p, i64, p, p, i64, i32, i32]


_native = cpu_attention.NativeLibrary(SOURCE, _FLAG_SETS, "the native float32 GEMM kernel", _declare)
load = _native.load  # the compiled kernel, built on the first call (RuntimeError saying why not)


def build_error() -> str | None:
    """Why the kernel could not be built or loaded (None: it was not tried, or it loaded)."""
    return _native.error


def available() -> bool:
    """Whether this CPU has a native path and the kernel builds and loads."""
    if choose_isa() is None:
        return False
    try:
        load()
    except RuntimeError:
        return False
    return True


class Packed:
    """A weight [out, in] re-laid out for :func:`linear`: panels of 16 output columns,
    each contiguous over the input dimension, zero-padded to groups of two panels."""

    __slots__ = ("data", "out_features", "in_features")

    def __init__(self, data: torch.Tensor, out_features: int, in_features: int):
        self.data, self.out_features, self.in_features = data, out_features, in_features


def pack(weight: torch.Tensor) -> Packed:
    """Pack ``weight`` [out, in] (float32, CPU)."""
    w = weight.detach().float()
    n, k = w.shape
    per_group = PANEL * GROUP
    padded = -(-n // per_group) * per_group
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    data = w.reshape(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()
    if data.data_ptr() % 64:  # the kernel's aligned loads (torch's CPU allocator aligns to 64)
        raw = torch.empty(data.numel() + 16, dtype=torch.float32)
        off = (-raw.data_ptr() % 64) // 4
        raw[off : off + data.numel()].copy_(data.reshape(-1))
        data = raw[off : off + data.numel()].view(data.shape)
    return Packed(data, n, k)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None, isa: str | None = None,
           prefetch: bool | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` [..., in] float32 on CPU. ``isa``: ``avx512`` or
    ``avx2`` (None: this CPU's); ``prefetch`` None: from :data:`PREFETCH_MIN_ROWS`."""
    isa = isa or choose_isa()
    if isa not in ISAS:
        raise RuntimeError(f"no native GEMM path for this CPU (isa {isa!r})")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        raise TypeError(f"the native GEMM takes float32 activations, not {x2.dtype}")
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    m, k = x2.shape
    if k != packed.in_features:
        raise ValueError(f"input has {k} features, the weight {packed.in_features}")
    n = packed.out_features
    out = torch.empty((m, n), dtype=torch.float32)
    if prefetch is None:
        prefetch = m >= PREFETCH_MIN_ROWS[isa]
    rc = load().plait_gemm_f32(
        ISAS[isa], m, n, k, x2.data_ptr(), x2.stride(0) if m > 1 else k, packed.data.data_ptr(),
        out.data_ptr(), n, torch.get_num_threads(), int(prefetch),
    )
    if rc != 0:
        raise ValueError(f"native GEMM rejected M={m} N={n} K={k} isa={isa} (rc {rc})")
    if bias is not None:
        out.add_(bias)
    return out.view(*lead, n)


_preferred: bool | None = None


def native_preferred() -> bool:
    """Whether ``cpu_gemm=auto`` takes this kernel: it builds for this CPU and
    :func:`probe` does not find oneDNN far faster. Decided once per process."""
    global _preferred
    if _preferred is None:  # (two threads racing here both probe; either answer stands)
        _preferred = available() and probe()[0]
    return _preferred


def probe(rows: int = 64, repeats: int = 15, shape: tuple[int, int] = (1536, 576)) -> tuple[bool, float, float]:
    """Start-up probe: time this kernel and oneDNN's packed GEMM on a random ``shape``
    weight (SmolLM2's MLP) at ``rows`` rows, the weight in cache (the arithmetic alone:
    where the native kernel's prefetch gains nothing). Returns (native at most 25 %
    slower, native ms, oneDNN ms). A guard against a CPU whose vector units this kernel
    uses badly, not a tuner: out of cache the native kernel gains its overlap on top
    (measured: AVX-512 and AVX2 paths both at least on par in cache, README)."""
    from plait.runtime.models.linear import onednn_gemm_available, pack_weight, packed_linear

    if not onednn_gemm_available():
        return True, 0.0, 0.0
    weight = torch.randn(*shape)
    x = torch.randn(rows, weight.shape[1])
    native, one = pack(weight), pack_weight(weight)

    # the two interleaved, the best of each: on a busy machine a load spike during one
    # kernel's turn made identical starts choose differently (probe of 2026-12-04: 7.7
    # against 5.6 ms in one call, the other way in the next, five runs of each in turn)
    runs = {"native": lambda: linear(x, native), "onednn": lambda: packed_linear(x, one, None)}
    best = dict.fromkeys(runs, float("inf"))
    for fn in runs.values():
        fn()
    for _ in range(repeats):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    t_native, t_one = best["native"] * 1e3, best["onednn"] * 1e3
    return t_native <= 1.25 * t_one, t_native, t_one
