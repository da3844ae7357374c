"""Stateful trajectory working dirs: kept, isolated, moved between nodes, ended, expired."""

from __future__ import annotations

import pytest
from conftest import bwrap_or_skip

from tangram_dask import SandboxError
from tangram_dask.sandbox import SandboxPool, end_trajectory, run_code, snapshot_trajectory
from tangram_dask.sandbox.workspace import Workspaces


@pytest.fixture(scope="module")
def pools():
    with SandboxPool(backend=bwrap_or_skip(), size=1) as a, SandboxPool(backend=bwrap_or_skip(), size=1) as b:
        yield a, b


def test_a_trajectory_keeps_its_dir_between_actions_and_no_one_else_sees_it(pools):
    a, _ = pools
    r = run_code("import subprocess\nopen('repo.txt', 'w').write('v1')\n", trajectory="traj-1", pool=a)
    assert r.ok, r
    r = run_code("import os\nprint(os.listdir('.'))", pool=a)  # same sandbox, no trajectory
    assert r.stdout == "[]\n"
    r = run_code("import os\nprint(os.listdir('.'))", trajectory="traj-2", pool=a)
    assert r.stdout == "[]\n"
    r = run_code("print(open('repo.txt').read())", trajectory="traj-1", pool=a)
    assert r.stdout == "v1\n"
    assert end_trajectory("traj-2", pool=a)


def test_snapshot_on_one_node_restore_on_another(pools):
    a, b = pools
    files = {"src/app.py": "X = 1\n"}
    run_code("import os\nos.makedirs('build')\nopen('build/out', 'w').write('built')", files=files,
             trajectory="moving", pool=a)
    data = snapshot_trajectory("moving", pool=a)
    assert isinstance(data, bytes) and data[:2] == b"\x1f\x8b"  # gzip
    b.restore_trajectory("moving", data)
    assert a.end_trajectory("moving")
    r = run_code("print(open('src/app.py').read().strip(), open('build/out').read())", trajectory="moving", pool=b)
    assert r.stdout == "X = 1 built\n", r
    assert b.end_trajectory("moving") and not b.end_trajectory("moving")  # twice is safe
    r = run_code("import os\nprint(os.listdir('.'))", trajectory="moving", pool=b)
    assert r.stdout == "[]\n"  # ended: a new one starts empty
    b.end_trajectory("moving")


def test_a_bad_snapshot_is_refused_with_the_fix(pools):
    a, _ = pools
    with pytest.raises(SandboxError, match="snapshot_trajectory"):
        a.restore_trajectory("t", b"not a tarball")


def test_trajectories_unused_past_the_ttl_are_swept(tmp_path):
    now = [0.0]
    ws = Workspaces(tmp_path, uid=None, ttl_s=60, clock=lambda: now[0])
    for t in ("old", "fresh"):
        slot = tmp_path / f"slot-{t}"
        ws.checkout(t, slot, timeout_s=1)
        (slot / "f").write_text(t)
        ws.checkin(t, slot)
        now[0] += 45
    assert ws.sweep() == ["old"]  # 90 s idle > 60; "fresh" is 45 s idle
    assert not ws.path("old").exists() and ws.path("fresh").exists()
    assert ws.trajectories() == ["fresh"]


def test_odd_trajectory_ids_map_to_safe_names(tmp_path):
    ws = Workspaces(tmp_path, uid=None, ttl_s=60)
    assert ws.path("../../etc").parent == tmp_path
    assert ws.path("a/b").parent == tmp_path
    with pytest.raises(SandboxError):
        ws.path("")
