"""Native paged decode attention for CPUs (float32), built on first use.

The torch backend gathers each decode request's pages into a contiguous copy and runs
SDPA over it: the K/V cross memory twice, and SDPA's CPU kernel is slow with one query
row per head. ``paged_decode_cpu.c`` reads every K/V row once, in place, through the
page table, with an AVX-512 path where the CPU has it (see its header): on the 2-core
development machine decode attention in the offline benchmark took 4.0 s instead of
12.5 s. It is compiled with the system's C compiler on first use into a per-user cache
(``$PLAIT_CACHE_DIR``, else ``~/.cache/plait``; a folder under the temp dir where that
cannot be written), keyed by the source, the flags, the compiler and the CPU's feature
flags, and loaded with ctypes.
Importing plait never needs a compiler; :func:`load` raises ``RuntimeError`` saying why
when the kernel cannot be built, and the engine then keeps the torch backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Callable

import torch

SOURCE = Path(__file__).with_name("paged_decode_cpu.c")
MAX_GROUP = 16  # query heads per KV head, as compiled into the kernel
MAX_DIM = 256  # head dim
# $PLAIT_MAX_ISA=avx2 runs this CPU as an AVX2-only one would (tests, benchmarks: the
# "machines differ" stand-in): every native kernel chooses its path from the CPU's flags
# without AVX-512 and AMX (:func:`_cpu_flags`), and this kernel is built without AVX-512.
# With torch held alike: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# MKL_ENABLE_INSTRUCTIONS=AVX2.
MAX_ISA = (os.environ.get("PLAIT_MAX_ISA") or "").strip().lower()
if MAX_ISA not in ("", "avx2", "avx512"):
    raise ValueError(f"PLAIT_MAX_ISA={MAX_ISA!r}: expected avx2 or avx512 (or unset)")
# -march=native: AVX-512 where the CPU has it; the cache key includes the CPU's flags.
# $PLAIT_NATIVE_MARCH (e.g. haswell: AVX2 and FMA) builds it for another target. Without
# OpenMP (a compiler lacking it) the kernel still builds and runs on one thread.
_MARCH = ["-march=" + (os.environ.get("PLAIT_NATIVE_MARCH") or "native")]
if MAX_ISA == "avx2":
    _MARCH.append("-mno-avx512f")  # and every AVX-512 extension with it
_FLAG_SETS = (
    ["-O3", *_MARCH, "-fopenmp", "-fPIC", "-shared"],
    ["-O3", *_MARCH, "-fPIC", "-shared"],
)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def cache_dir() -> Path:
    base = os.environ.get("PLAIT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "plait"
    )
    return Path(base)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_flags() -> str:
    """The CPU's flags line from /proc/cpuinfo ("" where there is none), without the
    AVX-512 and AMX flags under ``PLAIT_MAX_ISA=avx2``."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
    if MAX_ISA == "avx2":
        line = " ".join(f for f in line.split() if not f.startswith(("avx512", "amx")))
    return line


def _writable_cache_dir() -> Path:
    """:func:`cache_dir`, or a per-user folder under the temp dir where it cannot be
    created (a read-only home)."""
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"plait-cache-{os.getuid()}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise RuntimeError(f"no writable folder for the compiled kernel (tried {cache_dir()} and the temp dir)")


def _local_headers(path: Path) -> bytes:
    """The text of the headers beside ``path`` that it includes (``#include "name.h"``):
    part of the cache key, so a changed header rebuilds every library that uses it."""
    names = re.findall(rb'^\s*#\s*include\s+"([^"]+)"', path.read_bytes(), flags=re.MULTILINE)
    return b"".join(b"\0" + name + b"\0" + (path.parent / name.decode()).read_bytes()
                    for name in sorted(set(names)) if (path.parent / name.decode()).is_file())


def _build(
    cc: str | None, path: Path | None = None, flag_sets: tuple[list[str], ...] = _FLAG_SETS,
    what: str = "the CPU decode kernel"
) -> Path:
    """The shared library of the C file ``path`` (None: this module's kernel), built with
    the first of ``flag_sets`` that compiles, or found in the cache. Its name keys the
    source (with its headers), flags and CPU flags, then the compiler: with ``cc`` None
    (no compiler on PATH, as in an image that built its kernels and then dropped the
    compiler) a library any compiler built from the same source for the same flags is
    taken (the newest); before, none was, and the engine fell back to torch's paths."""
    path = path or SOURCE
    source = path.read_bytes() + _local_headers(path)
    folder = _writable_cache_dir()
    if cc is None:
        for flags in flag_sets:
            stem = f"{path.stem}-{_source_key(source, flags)}-"
            built = sorted((p for p in folder.glob(f"{stem}*.so") if p.name.startswith(stem)),
                           key=lambda p: p.stat().st_mtime)
            if built:
                return built[-1]
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang), and no library built earlier for "
                           f"this source, these flags and this CPU in {folder}")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    ckey = hashlib.sha256(version.encode()).hexdigest()[:8]
    errors = []
    for flags in flag_sets:
        target = folder / f"{path.stem}-{_source_key(source, flags)}-{ckey}.so"
        if target.exists():
            return target
        # build beside the target and rename: concurrent builders never see half a file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            proc = subprocess.run([cc, *flags, str(path), "-o", tmp], capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                os.replace(tmp, target)
                return target
            errors.append(f"{' '.join(flags)}: {proc.stderr.strip()[-500:]}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError(f"compiling {what} failed: " + " | ".join(errors))


def _source_key(source: bytes, flags: list[str]) -> str:
    """A library's key before its compiler: the source, the flags, the CPU's flags."""
    return hashlib.sha256(source + "\0".join([*flags, _cpu_flags()]).encode()).hexdigest()[:16]


class NativeLibrary:
    """A C file compiled on first use by :func:`_build` and loaded with ctypes, once per
    process: :meth:`load` returns the library (``setup`` declared its functions), or
    raises RuntimeError saying why it cannot be built; the failure is remembered."""

    def __init__(self, source: Path, flag_sets: tuple[list[str], ...], what: str,
                 setup: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.flag_sets, self.what, self.setup = source, flag_sets, what, setup
        self.lib: ctypes.CDLL | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    def load(self) -> ctypes.CDLL:
        if self.lib is not None:  # called per GEMM: no lock once loaded
            return self.lib
        with self._lock:
            if self.lib is not None:
                return self.lib
            if self.error is not None:
                raise RuntimeError(self.error)
            try:
                lib = ctypes.CDLL(str(_build(_compiler(), self.source, self.flag_sets, self.what)))
                self.setup(lib)
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                self.error = f"{self.what} is unavailable: {e}"
                raise RuntimeError(self.error) from e
            self.lib = lib
            return lib


def load() -> ctypes.CDLL:
    """The compiled kernel (built on the first call). Raises RuntimeError saying why it
    cannot be built or loaded; the failure is remembered for the process."""
    global _lib, _error
    if _lib is not None:  # every decode layer calls this: no lock once loaded
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise RuntimeError(_error)
        try:
            lib = ctypes.CDLL(str(_build(_compiler())))
            for fn in (lib.plait_paged_decode_f32, lib.plait_paged_extend_f32):  # one signature
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                               ctypes.c_int]
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _error = f"the native CPU decode kernel is unavailable: {e}"
            raise RuntimeError(_error) from e
        _lib = lib
        return lib


def supports(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the compiled kernel handles this attention shape and dtype."""
    return (
        dtype == torch.float32 and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP and head_dim <= MAX_DIM
    )


def paged_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    starts: torch.Tensor | None = None,
    tiled: bool = False,
) -> torch.Tensor:
    """Decode attention, the same contract as :func:`plait.kernels.decode_attention.decode_attention_ref`:
    q [B, H, D] (rows may be strided; heads and dims contiguous), k/v buffers
    [slots, KVH, D], req_to_token int32 [rows, context], req_rows / seq_lens int64 [B];
    ``starts`` int64 [B]: first position each request attends to (a sliding window),
    None: 0. Returns [B, H, D].

    ``tiled``: the rows are tokens of prompt chunks and decodes (a chunk's tokens
    consecutive, each with its own ``seq_lens``: position + 1), run by
    ``plait_paged_extend_f32``, which reads a chunk's context once per tile of its
    tokens (the fused forward's attention); the same result."""
    B, H, D = q.shape
    kvh = k_buffer.shape[1]
    if not supports(H, kvh, D, q.dtype):
        raise ValueError(f"native decode kernel: unsupported heads={H}, kv_heads={kvh}, head_dim={D}, dtype={q.dtype}")
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    for name, t in (("k_buffer", k_buffer), ("v_buffer", v_buffer), ("req_to_token", req_to_token)):
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"native decode kernel: {name} must be a contiguous CPU tensor")
    if k_buffer.dtype != torch.float32 or v_buffer.dtype != torch.float32 or req_to_token.dtype != torch.int32:
        raise ValueError("native decode kernel: float32 K/V buffers and an int32 page table are required")
    req_rows = req_rows.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if starts is not None:
        starts = starts.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty((B, H, D), dtype=q.dtype)
    if B == 0:
        return out
    lib = load()
    rc = (lib.plait_paged_extend_f32 if tiled else lib.plait_paged_decode_f32)(
        q.data_ptr(), q.stride(0), k_buffer.data_ptr(), v_buffer.data_ptr(), req_to_token.data_ptr(),
        req_to_token.stride(0), req_rows.data_ptr(), seq_lens.data_ptr(),
        starts.data_ptr() if starts is not None else None, out.data_ptr(),
        B, H, kvh, D, scale, torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError(f"native decode kernel rejected heads={H}, kv_heads={kvh}, head_dim={D}")
    return out
