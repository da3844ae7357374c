"""Per-sandbox cgroup v2 limits, on a FAKE cgroup tree.

This machine's cgroups are v1 and not writable, so a delegated cgroup v2 dir cannot be had here:
a plain directory with ``cgroup.controllers`` and ``cgroup.subtree_control`` stands in for it.
What is real: the pool, the sandboxes (bubblewrap and process), the files the host writes, and
the zygote writing ``0`` (itself) into the ``cgroup.procs`` it was handed, before it forks anything.
What the fake cannot show: the kernel moving the zygote and enforcing the limits.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from conftest import bwrap_or_skip

from tangram_dask import SandboxError
from tangram_dask.sandbox import PoolOptions, SandboxPool, run_code
from tangram_dask.sandbox.options import MiB


def fake_cgroup_root(path: Path, controllers: str = "cpuset cpu io memory pids") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "cgroup.controllers").write_text(controllers + "\n")
    (path / "cgroup.subtree_control").write_text("")
    return path


@pytest.mark.parametrize("backend", ["bwrap", "process"])
def test_each_sandbox_gets_its_own_cgroup_with_the_limits(backend, tmp_path):
    if backend == "bwrap":
        bwrap_or_skip()
    python = "/usr/bin/python3" if backend == "process" and os.geteuid() == 0 else sys.executable
    root = fake_cgroup_root(tmp_path / "cg")
    with SandboxPool(backend=backend, size=1, cgroup=str(root), python=python, memory_bytes=256 * MiB,
                     work_bytes=32 * MiB, procs=20) as pool:
        assert pool.wait_ready(30)
        assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
        r = run_code("print('in')", units=2, pool=pool)
        assert r.ok and r.stdout == "in\n", r
        [cg] = [d for d in root.iterdir() if d.is_dir()]
        assert cg.name.startswith("tangram-b1-")
        assert (cg / "memory.max").read_text() == str(256 * MiB + 32 * MiB)  # address space + its tmpfs
        assert (cg / "pids.max").read_text() == "28"                          # procs + the zygote's own
        assert (cg / "cpu.max").read_text() == "200000 100000"                # the action's 2 units
        assert (cg / "cgroup.procs").read_text() == "0"                       # written by the zygote itself
        run_code("pass", units=1, pool=pool)
        assert (cg / "cpu.max").read_text() == "100000 100000"
    assert not cg.exists()  # removed with its sandbox


def test_a_cgroup_without_the_controllers_is_refused_naming_them(tmp_path):
    root = fake_cgroup_root(tmp_path / "cg", controllers="cpu io")
    with SandboxPool(backend=bwrap_or_skip(), size=1, cgroup=str(root)) as pool:
        with pytest.raises(SandboxError, match="memory, pids controller"):
            pool.acquire(timeout=20)


def test_the_cgroup_option_is_checked_where_written():
    with pytest.raises(SandboxError, match="cgroup"):
        PoolOptions(cgroup="relative/dir")
