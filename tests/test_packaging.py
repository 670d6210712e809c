"""`import plait` stays light; the three source folders form one namespace."""

from __future__ import annotations

import subprocess
import sys


def test_import_plait_does_not_import_torch():
    code = "import sys, plait, plait.kernels; assert 'torch' not in sys.modules, 'torch imported'; print(plait.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()


def test_runtime_and_kernels_live_under_plait():
    import plait.kernels
    import plait.runtime

    assert plait.runtime.__name__ == "plait.runtime"
    assert plait.kernels.__name__ == "plait.kernels"
    from plait.runtime import Engine, EngineConfig

    assert Engine.__module__ == "plait.runtime.engine"
    assert EngineConfig().page_size == 16
