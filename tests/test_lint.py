"""Lint: ``ruff check`` (settings in pyproject.toml [tool.ruff]) finds nothing in the project's code.

setup.cfg's [flake8] mirrors the same settings for tools that read it; a test holds the two together.
"""

from __future__ import annotations

import configparser
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["tangram_dask", "tests", "benchmarks", "examples", "scheduler_plugin"]

# Findings a file may keep for now, by file and rule (every other finding fails the test).
KNOWN: dict[str, set[str]] = {}  # file -> rules it may break for now; empty: the tree is clean


def _ruff() -> list[str]:
    exe = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if exe is None:
        try:
            import ruff  # noqa: F401
        except ImportError:
            pytest.skip("ruff is not installed (pip install -e '.[test]')")
        return [sys.executable, "-m", "ruff"]
    return [exe]


def test_ruff_finds_nothing_new():
    out = subprocess.run([*_ruff(), "check", "--output-format", "json", "--no-cache", *PATHS],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr  # 1: findings; 2: ruff itself failed (bad config)
    findings = json.loads(out.stdout or "[]")
    new = []
    for f in findings:
        path = Path(f["filename"]).resolve().relative_to(ROOT).as_posix()
        if f["code"] not in KNOWN.get(path, ()):
            new.append(f"{path}:{f['location']['row']}:{f['location']['column']}: {f['code']} {f['message']}")
    assert not new, "ruff check found:\n" + "\n".join(sorted(new))


def test_flake8_settings_mirror_ruff():
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    flake8 = cfg["flake8"]
    assert int(flake8["max-line-length"]) == ruff["line-length"] == 120
    selected = {c.strip() for c in flake8["select"].split(",")}
    assert {"E", "F", "W"} <= {c[0] for c in selected} and set(ruff["lint"]["select"]) >= {"E", "F", "W"}
    excluded = {c.strip().rstrip("/") for c in flake8["exclude"].split(",")}
    assert {".venv", "build", "dist"} <= excluded
