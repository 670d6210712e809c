"""Packed CPU GEMMs (plait.runtime.models.linear: oneDNN's and the native kernel,
plait.kernels.gemm_cpu) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.kernels import gemm_cpu
from plait.runtime.config import EngineConfig
from plait.runtime.models.linear import Linear, onednn_gemm_available

# CI's machines are x86-64 with AVX2 or AVX-512 and a C compiler: the native kernel must build
NATIVE_ISAS = [isa for isa in ("avx512", "avx2") if isa == gemm_cpu.choose_isa() or gemm_cpu.choose_isa() == "avx512"]


def test_native_kernel_builds_here():
    assert gemm_cpu.choose_isa() in ("avx512", "avx2")
    assert gemm_cpu.available(), gemm_cpu.build_error()


@pytest.mark.parametrize("isa", NATIVE_ISAS)
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize(
    "rows,out_features,in_features",
    [(1, 32, 8), (5, 33, 64), (12, 47, 96), (13, 64, 100), (6, 17, 7), (7, 31, 576), (25, 160, 96),
     (300, 70, 2048), (40, 1, 3)],  # tails of tiles (12/6 rows), groups (32 columns), k (8); 300 rows x 2048 crosses a row block
)
def test_native_gemm_matches_f_linear(isa, prefetch, rows, out_features, in_features):
    torch.manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features + 9)[:, 4 : 4 + in_features]  # strided rows
    packed = gemm_cpu.pack(w)
    assert packed.data.data_ptr() % 64 == 0
    got = gemm_cpu.linear(x, packed, None, isa=isa, prefetch=prefetch)
    torch.testing.assert_close(got, F.linear(x, w), atol=1e-4, rtol=1e-4)
    b = torch.randn(out_features)
    got3 = gemm_cpu.linear(x.reshape(1, rows, in_features), packed, b, isa=isa, prefetch=prefetch)
    assert got3.shape == (1, rows, out_features)
    torch.testing.assert_close(got3[0], F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_native_gemm_refuses_what_it_cannot_take():
    packed = gemm_cpu.pack(torch.randn(8, 16))
    with pytest.raises(ValueError, match="15 features, the weight 16"):
        gemm_cpu.linear(torch.randn(2, 15), packed)
    with pytest.raises(TypeError, match="float32"):
        gemm_cpu.linear(torch.randn(2, 16, dtype=torch.float64), packed)
    assert gemm_cpu.linear(torch.randn(0, 16), packed).shape == (0, 8)


def test_choose_isa_reads_the_flags():
    assert gemm_cpu.choose_isa("flags : fpu sse2 avx2 fma avx512f") == "avx512"
    assert gemm_cpu.choose_isa("flags : fpu sse2 avx2 fma") == "avx2"
    assert gemm_cpu.choose_isa("flags : fpu sse2 avx2") is None  # AVX2 without FMA
    assert gemm_cpu.choose_isa("Features : fp asimd") is None  # an ARM CPU


@pytest.mark.parametrize("kind", ["onednn", "native"])
@pytest.mark.parametrize("rows", [1, 3, 64, 517])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(kind, rows, bias):
    torch.manual_seed(rows)
    lin = Linear(96, 160, bias=bias)
    w, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    x = torch.randn(rows, 200)[:, 7:103]  # a strided view, like a slice of a fused output
    ref = F.linear(x, w, b)
    lin.pack(kind)
    assert lin.weight is None and lin.packed is not None
    with torch.inference_mode():
        got = lin(x)
    assert got.shape == (rows, 160) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

def test_this_torch_build_has_onednn():
    assert onednn_gemm_available()  # CI installs torch's CPU wheel, which carries it


def test_the_probe_interleaves_so_a_load_spike_does_not_decide(monkeypatch):
    # a spike over the first calls: with each kernel timed in one run of turns it fell on
    # the native kernel's alone and identical starts chose differently
    import time

    from plait.runtime.models import linear as linear_mod

    calls = []

    def timed(name):
        def run(*args, **kwargs):
            calls.append(name)
            time.sleep(0.02 if len(calls) <= 8 else 0.002)  # the spike, then a quiet machine
        return run

    monkeypatch.setattr(gemm_cpu, "linear", timed("native"))
    monkeypatch.setattr(linear_mod, "packed_linear", timed("onednn"))
    ok, native_ms, onednn_ms = gemm_cpu.probe(rows=4, shape=(32, 16))
    assert ok and native_ms < 10 and onednn_ms < 10, (native_ms, onednn_ms)
    assert calls[:4] == ["native", "onednn", "native", "onednn"]


def test_auto_resolves_to_native_then_onednn_only_on_cpu_float32(monkeypatch):
    monkeypatch.setattr(gemm_cpu, "_preferred", True)  # (the probe is timed: not asserted here)
    assert EngineConfig(device="cpu").resolved_cpu_gemm() == "native"
    monkeypatch.setattr(gemm_cpu, "_preferred", False)  # a CPU where the probe found oneDNN far faster
    assert EngineConfig(device="cpu").resolved_cpu_gemm() == "onednn"
    assert EngineConfig(device="cpu", cpu_gemm="native").resolved_cpu_gemm() == "native"
    assert EngineConfig(device="cpu", cpu_gemm="torch").resolved_cpu_gemm() == "torch"
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_cpu_gemm() == "torch"
