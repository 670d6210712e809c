"""oneDNN-packed CPU GEMMs (plait.runtime.models.linear) against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from plait.runtime.config import EngineConfig
from plait.runtime.models.linear import Linear, onednn_gemm_available


@pytest.mark.parametrize("rows", [1, 3, 64, 517])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(rows)
    lin = Linear(96, 160, bias=bias)
    w, b = lin.weight.detach().clone(), None if lin.bias is None else lin.bias.detach().clone()
    x = torch.randn(rows, 200)[:, 7:103]  # a strided view, like a slice of a fused output
    ref = F.linear(x, w, b)
    lin.pack()
    assert lin.weight is None and lin.packed is not None
    with torch.inference_mode():
        got = lin(x)
    assert got.shape == (rows, 160) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)

def test_this_torch_build_has_onednn():
    assert onednn_gemm_available()  # CI installs torch's CPU wheel, which carries it


def test_auto_resolves_to_onednn_only_on_cpu_float32():
    assert EngineConfig(device="cpu").resolved_cpu_gemm() == "onednn"
    assert EngineConfig(device="cpu", cpu_gemm="torch").resolved_cpu_gemm() == "torch"
    assert EngineConfig(device="cpu", dtype="bfloat16").resolved_cpu_gemm() == "torch"
