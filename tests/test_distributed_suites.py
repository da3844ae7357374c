"""distributed's own tests still pass with the tangram scheduler plugin preloaded into every scheduler.

A subprocess pytest runs verbatim copies of distributed's resource, scheduler-plugin and
worker-plugin tests (tests/distributed_suites/, README there) with
``DASK_DISTRIBUTED__SCHEDULER__PRELOAD=["scheduler_plugin"]``. distributed's harness resets dask's
config before every test to a snapshot taken before tangram_dask was imported, so this also checks
that the preload starts on the shipped defaults alone (it used to fail with ``KeyError: 'tangram'``,
which distributed only logs, leaving actions to run as plain tasks).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES = ROOT / "tests" / "distributed_suites"
MODULES = ["upstream_resources.py", "upstream_scheduler_plugin.py", "upstream_worker_plugin.py"]


def test_distributed_suites_pass_with_the_tangram_preload(tmp_path):
    try:
        import distributed.utils_test  # noqa: F401
    except ImportError as e:  # pragma: no cover - it ships with distributed
        pytest.skip(f"distributed.utils_test does not import here: {e}")
    report = tmp_path / "report.json"
    env = dict(os.environ)
    env.update({
        "DASK_DISTRIBUTED__SCHEDULER__PRELOAD": '["scheduler_plugin"]',
        "TANGRAM_SUITE_REPORT": str(report),
        "PYTHONPATH": os.pathsep.join([str(SUITES), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tangram_preload",
           "--rootdir", str(SUITES), "-c", os.devnull, "-o", "python_files=upstream_*.py",
           "-W", "ignore::DeprecationWarning", *MODULES]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", "120"]
    out = subprocess.run(cmd, cwd=SUITES, env=env, capture_output=True, text=True, timeout=540)
    tail = "\n".join(out.stdout.splitlines()[-40:])
    assert out.returncode == 0, f"distributed's tests failed with the tangram preload:\n{tail}\n{out.stderr[-3000:]}"
    summary = re.search(r"(\d+) passed", out.stdout)
    assert summary and int(summary.group(1)) >= 70, tail  # 79 passed, 4 skipped when written
    counts = json.loads(report.read_text())
    assert counts["snapshot_had_tangram"] is False  # the harness's snapshot lacks tangram's defaults...
    assert counts["preload_failures"] == 0  # ...and the preload started anyway,
    assert counts["starts"] >= 40, counts  # in the schedulers of most tests (52 starts when written)
