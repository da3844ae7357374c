"""The scheduling core is pure: no Dask, no event loop, no clock (STYLE.md, "How that could look" 1 and 9)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tangram_dask"
PURE_FILES = sorted(PKG.joinpath("policy").glob("*.py")) + [PKG / "sim.py"]
PURE_MODULES = ["tangram_dask.policy", "tangram_dask.sim", "tangram_dask.bench", "tangram_dask.workload",
                "tangram_dask.cluster", "tangram_dask.metrics", "tangram_dask.formats", "tangram_dask.spec"]


def _imported_roots(path: Path) -> set[str]:
    """Top-level names of every module the file imports (absolute imports; relative ones stay inside)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                "__import__", "import_module"):
            roots.update(a.value.split(".")[0] for a in node.args
                         if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return roots


def test_importing_the_core_loads_no_dask():
    code = (
        "import json, sys\n"
        + "".join(f"import {m}\n" for m in PURE_MODULES)
        + "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('dask', 'distributed'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_subprocess_check_would_see_dask():
    """The check above can fail: importing the Dask side in the same way does load dask."""
    code = "import json, sys, tangram_dask\ntangram_dask.action\nprint(json.dumps('dask' in sys.modules))\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) is True


@pytest.mark.parametrize("path", PURE_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dask_distributed_or_asyncio_import(path):
    assert _imported_roots(path) & {"dask", "distributed", "asyncio"} == set()


_TIME_CASES = [pytest.param(p, id=str(p.relative_to(ROOT))) for p in PURE_FILES]


@pytest.mark.parametrize("path", _TIME_CASES)
def test_no_clock_import(path):
    assert "time" not in _imported_roots(path)


def test_the_static_check_sees_imports():
    """The AST check can fail: it finds the imports of modules that do use Dask and a clock."""
    assert {"dask"} <= _imported_roots(PKG / "annotate.py")
    assert {"time"} <= _imported_roots(PKG / "bench.py")
    assert {"numpy"} <= _imported_roots(PKG / "sim.py")


def test_pure_files_exist():
    names = {p.name for p in PURE_FILES}
    assert {"base.py", "fifo.py", "static.py", "tangram.py", "ledger.py", "split.py", "sim.py"} <= names
