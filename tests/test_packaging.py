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


def test_every_subpackage_is_listed_in_pyproject():
    """A normal (non-editable) install ships only the listed packages; a forgotten
    subpackage would work in the editable checkout and break for users."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for pkg, folder in tool["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            found.add(".".join([pkg, *rel.parts]) if rel.parts else pkg)
    assert found <= listed, f"subpackages missing from pyproject.toml packages: {sorted(found - listed)}"


def test_non_python_files_ship_as_package_data():
    """kernels/paged_decode_cpu.c is compiled from the installed package at run time; a
    file missing from package-data would exist in the checkout only."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    data = tool.get("package-data", {})
    shipped = []
    for pkg, folder in tool["package-dir"].items():
        for f in (root / folder).rglob("*"):
            rel = f.relative_to(root / folder)
            if f.is_dir() or f.suffix in (".py", ".pyc") or "__pycache__" in rel.parts:
                continue
            owner = ".".join([pkg, *rel.parent.parts])
            assert any(fnmatch.fnmatch(f.name, p) for p in data.get(owner, [])), f"{f} is not in package-data"
            shipped.append(f.name)
    assert "paged_decode_cpu.c" in shipped
