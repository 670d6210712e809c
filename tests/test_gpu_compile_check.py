"""benchmarks/gpu_compile_check.py compiles every Triton kernel of plait.kernels for
sm_80 and sm_90a on a machine without a GPU: Triton's NVIDIA backend and its ptxas are
all it needs. Run in a subprocess, so this process never imports Triton uninterpreted."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_compile_check.py"
TARGETS = ["sm_80", "sm_90a"]
TIMEOUT_S = 300  # 30-100 s on two CPU cores with a cold Triton cache, as busy as they are


def nvidia_backend_missing() -> str | None:
    """Why the check cannot run here, or None. Looks at files only: importing triton
    here would fix this process's interpreter mode before the kernel tests do."""
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return "triton is not installed"
    nvidia = Path(spec.submodule_search_locations[0]) / "backends" / "nvidia"
    if not (nvidia / "compiler.py").is_file():
        return f"Triton's NVIDIA backend is absent ({nvidia})"
    # as Triton looks: TRITON_PTXAS_PATH, then the bundled binary
    candidates = [p for p in (os.environ.get("TRITON_PTXAS_PATH"), str(nvidia / "bin" / "ptxas")) if p]
    if not any(os.access(p, os.X_OK) for p in candidates):
        return f"no ptxas binary at {' or '.join(candidates)}"
    return None


def kernels_in_source() -> set[str]:
    """Every ``@jit`` / ``@triton.jit`` function of kernels/, read from the files (the
    ``dot`` helper of _triton.py is a device function, not a kernel)."""
    names = set()
    for path in (REPO / "kernels").glob("*.py"):
        if path.name != "_triton.py":
            names |= set(re.findall(r"^@(?:triton\.)?jit\b.*\n(?:@.*\n)*def (\w+)", path.read_text(), re.M))
    return names


def test_every_kernel_compiles_for_sm80_and_sm90a(tmp_path):
    reason = nvidia_backend_missing()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, not from a cache
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--report-only", "--targets", ",".join(TARGETS), "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "triton " in proc.stdout and "ptxas " in proc.stdout  # the machine/version line
    report = json.loads(out.read_text())
    assert report["failures"] == []
    check_settings(report, proc.stdout)

    expected = kernels_in_source()
    assert len(expected) >= 7 and set(report["kernels"]) == expected
    rows = report["rows"]
    for target in TARGETS:
        assert {r["kernel"] for r in rows if r["target"] == target} == expected, target
    for r in rows:
        assert r["registers"] > 0, r
        assert r["num_warps"] > 0 and r["mma"] in ("wgmma", "mma.sync", "fma", "-"), r
    # the attention and KV kernels at both head dims and both dtypes, on both targets
    for kernel in ("_store_kv_kernel", "_extend_kernel", "_decode_split_kernel", "_decode_merge_kernel"):
        got = {(r["target"], r["dtype"], r["head_dim"]) for r in rows if r["kernel"] == kernel}
        assert got == {(t, d, h) for t in TARGETS for d in ("bfloat16", "float32") for h in (64, 128)}, kernel
    # bf16 dots run on tensor cores; extend reaches Hopper's wgmma at its sm_90a tiles
    assert all(r["mma"] in ("wgmma", "mma.sync") for r in rows
               if r["kernel"] in ("_extend_kernel", "_decode_split_kernel") and r["dtype"] == "bfloat16")
    hopper_extend = [r for r in rows if r["kernel"] == "_extend_kernel" and r["target"] == "sm_90a"
                     and r["dtype"] == "bfloat16"]
    assert hopper_extend and all(r["mma"] == "wgmma" and "BLOCK_M=64" in r["constexprs"] for r in hopper_extend)
    # the bitmask kernel, with and without a row index, over bf16 and fp32 logits
    got = {(r["target"], r["dtype"], "HAS_ROWS=True" in r["constexprs"]) for r in rows if r["kernel"] == "_bitmask_kernel"}
    assert got == {(t, d, has) for t in TARGETS for d in ("bfloat16", "float32") for has in (False, True)}


def check_settings(report: dict, stdout: str) -> None:
    """The launch settings are printed and reported, and the kernels were compiled at them."""
    settings, rows = report["settings"], report["rows"]
    assert "launch settings the launchers choose:" in stdout
    extend = {(e["target"], e["dtype"], e["head_dim"]): e for e in settings["extend"]}
    assert set(extend) == {(t, d, h) for t in TARGETS for d in ("bfloat16", "float32") for h in (64, 128)}
    for r in rows:
        if r["kernel"] == "_extend_kernel":
            e = extend[(r["target"], r["dtype"], r["head_dim"])]
            assert f"BLOCK_M={e['block_m']} BLOCK_N={e['block_n']}" in r["constexprs"] and r["num_warps"] == e["num_warps"]
    assert {e["block_m"] for e in settings["extend"] if e["target"] == "sm_90a" and e["dtype"] == "bfloat16"} == {64}
    for d in settings["decode"]:
        splits = d["splits"]
        assert all(n & (n - 1) == 0 for n in splits) and splits == sorted(splits, reverse=True), d
        assert splits[0] > 1 and splits[-1] == 1, d  # many splits at batch 1, none at 256
        assert f"decode splits {d['target']} ({d['sm_count']} SMs) {d['model']}" in stdout
        # the decode-only step compiled the split count of graph bucket 1
        assert any(r["kernel"] == "_decode_split_kernel" and r["target"] == d["target"]
                   and f"NUM_SPLITS={splits[0]} " in r["constexprs"] + " " for r in rows), d
