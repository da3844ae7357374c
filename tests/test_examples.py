"""The examples a new user copies from still run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_actions_and_a_sandbox():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].startswith("repo-a: 4 slots on tcp://127.0.0.1:")  # an idle pool grants units.max
    assert lines[1] == "ok: '45'"
