"""Stateful trajectory working dirs: kept, isolated, moved between nodes, ended, expired."""

from __future__ import annotations

import os
from pathlib import Path

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


def test_trajectories_never_ended_leave_nothing_behind_once_swept(tmp_path):
    """A trajectory never ended (an abandoned rollout) is swept past the TTL, its lock too: before, each one left
    a lock in the workspace's books for as long as the worker ran (8 per step: 400 after 50 steps)."""
    now = [0.0]
    ws = Workspaces(tmp_path / "trajectories", uid=None, ttl_s=60, clock=lambda: now[0])
    slot = tmp_path / "slot"
    for step in range(50):
        for i in range(8):
            ws.checkout(f"s{step}-t{i}", slot, timeout_s=1)
            ws.checkin(f"s{step}-t{i}", slot)
        now[0] += 90
        assert len(ws.sweep()) == 8
        assert len(ws._locks) == 0 and ws.trajectories() == []
    ws.checkout("s0-t0", slot, timeout_s=1)  # an id swept comes back: a fresh dir, and its lock works as before
    assert ws.holds("s0-t0") and not ws.sweep()
    ws.checkin("s0-t0", slot)
    assert ws.path("s0-t0").is_dir() and len(ws._locks) == 1


def test_a_dir_checked_out_by_a_running_action_is_held_and_its_snapshot_waits_for_it(tmp_path):
    """While an action has the dir (renamed into its sandbox), the node still holds the trajectory, and a
    snapshot (a move to another node) waits for the action to give it back, then packs what it wrote; past its
    timeout it refuses, naming why. Before session 34 the node answered "nothing here" and the move began empty."""
    import threading
    import time

    ws = Workspaces(tmp_path / "ws", uid=None, ttl_s=60)
    slot = tmp_path / "slot"
    ws.checkout("t", slot, timeout_s=1)
    (slot / "f").write_text("first")
    ws.checkin("t", slot)
    ws.checkout("t", slot, timeout_s=1)  # a second action runs with the dir
    assert not ws.path("t").exists() and ws.holds("t") and not ws.holds("other")
    with pytest.raises(SandboxError, match="still holds its working dir here after 0.1 s, so it cannot move yet"):
        ws.snapshot("t", timeout_s=0.1)

    def finish():
        time.sleep(0.3)
        (slot / "f").write_text("second")
        ws.checkin("t", slot)

    threading.Thread(target=finish).start()
    data = ws.snapshot("t", timeout_s=10)
    dst = Workspaces(tmp_path / "dst", uid=None, ttl_s=60)
    dst.restore("t", data)
    assert (dst.path("t") / "f").read_text() == "second"


def test_odd_trajectory_ids_map_to_safe_names(tmp_path):
    ws = Workspaces(tmp_path, uid=None, ttl_s=60)
    assert ws.path("../../etc").parent == tmp_path
    assert ws.path("a/b").parent == tmp_path
    with pytest.raises(SandboxError):
        ws.path("")


def test_restore_refuses_bad_snapshots_before_touching_the_dir(tmp_path):
    import io
    import tarfile

    ws = Workspaces(tmp_path / "a", uid=None, ttl_s=60)
    slot = tmp_path / "slot"
    ws.checkout("t", slot, timeout_s=1)
    (slot / "keep").write_text("mine")
    ws.checkin("t", slot)
    for name, linkname, kind in [("abs", "/etc/passwd", tarfile.SYMTYPE), ("up", "../../x", tarfile.SYMTYPE),
                                 ("hard", "/etc/shadow", tarfile.LNKTYPE), ("dev", "", tarfile.CHRTYPE)]:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            m = tarfile.TarInfo(name)
            m.type, m.linkname = kind, linkname
            tar.addfile(m)
        with pytest.raises(SandboxError, match="cannot be restored"):
            ws.restore("t", buf.getvalue())
        assert (ws.path("t") / "keep").read_text() == "mine", name
    with pytest.raises(SandboxError, match="no working dir on this node"):
        ws.snapshot("never-ran-here")


def test_snapshot_and_restore_work_on_python_3_11_2_without_tarfile_filters(tmp_path):
    """requires-python allows 3.11.0: tarfile's extraction filters came in 3.11.4. /usr/bin/python3 here
    is 3.11.2: the round trip (files, a relative symlink, a hard link, modes) runs there."""
    import subprocess

    py = "/usr/bin/python3"
    if not os.access(py, os.X_OK):
        pytest.skip("no system python here")
    script = (
        "import os, sys, tarfile\n"
        "from pathlib import Path\n"
        "from tangram_dask.sandbox.workspace import Workspaces\n"
        "print(sys.version.split()[0], hasattr(tarfile, 'data_filter'))\n"
        "root = Path(sys.argv[1])\n"
        "a = Workspaces(root / 'a', uid=None, ttl_s=60); b = Workspaces(root / 'b', uid=None, ttl_s=60)\n"
        "slot = root / 'slot'\n"
        "a.checkout('t', slot, timeout_s=1)\n"
        "(slot / 'src').mkdir(); (slot / 'src' / 'app.py').write_text('X = 1')\n"
        "os.symlink('src/app.py', slot / 'link'); os.link(slot / 'src' / 'app.py', slot / 'hard')\n"
        "(slot / 'run.sh').write_text('#!/bin/sh'); os.chmod(slot / 'run.sh', 0o755)\n"
        "a.checkin('t', slot)\n"
        "b.restore('t', a.snapshot('t'))\n"
        "d = b.path('t')\n"
        "print(os.readlink(d / 'link'), (d / 'link').read_text(), (d / 'hard').read_text(),"
        " oct(os.stat(d / 'run.sh').st_mode & 0o777))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    p = subprocess.run([py, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stderr
    version, rest = p.stdout.splitlines()
    assert rest == "src/app.py X = 1 X = 1 0o755", p.stdout


def test_a_restore_that_fails_on_the_destination_leaves_the_source_whole(tmp_path):
    """The source's snapshot removes nothing; a destination that cannot write says so, naming the source."""
    src = Workspaces(tmp_path / "src", uid=None, ttl_s=60)
    slot = tmp_path / "slot"
    src.checkout("t", slot, timeout_s=1)
    (slot / "notes").write_text("mine")
    src.checkin("t", slot)
    data = src.snapshot("t")
    (tmp_path / "dst").write_text("not a dir")  # the destination's trajectory root cannot be made
    dst = Workspaces(tmp_path / "dst", uid=None, ttl_s=60)
    with pytest.raises(SandboxError, match="could not be restored here.*still holds the dir"):
        dst.restore("t", data)
    assert (src.path("t") / "notes").read_text() == "mine"


def test_restoring_a_trajectory_leaves_one_named_like_its_temporary_dir(tmp_path):
    """Restoring "t" built its dir in "t.restore" first, which is also trajectory "t.restore"'s own dir: that one was
    removed, without its lock (helper-48's review). The temporary dir now has a name no trajectory's can have."""
    ws = Workspaces(tmp_path / "ws", uid=None, ttl_s=60)
    for t, text in (("t", "mine"), ("t.restore", "theirs")):
        slot = tmp_path / f"slot-{t}"
        ws.checkout(t, slot, timeout_s=1)
        (slot / "notes").write_text(text)
        ws.checkin(t, slot)
    ws.restore("t", ws.snapshot("t"))
    assert (ws.path("t") / "notes").read_text() == "mine"
    assert (ws.path("t.restore") / "notes").read_text() == "theirs"
    assert sorted(p.name for p in ws.root.iterdir()) == ["t", "t.restore"]  # no temporary dir left


def test_an_action_waiting_while_its_trajectory_is_swept_keeps_it_to_itself(tmp_path, monkeypatch):
    """A trajectory idle past the TTL gets its next action while the sweep removes its dir: the action waits on the
    lock the sweep holds, and the sweep drops that lock from the books. Once the action has the dir, a second action
    of it must still wait, and the node must still hold it. Before, the action held a lock no longer in the books: the
    second action took a new one at once (two actions in one dir), and holds() said the node had no dir for it."""
    import shutil
    import threading
    import time

    from tangram_dask.sandbox import workspace

    now = [0.0]
    ws = Workspaces(tmp_path / "trajectories", uid=None, ttl_s=60, clock=lambda: now[0])
    ws.checkout("t", tmp_path / "s0", timeout_s=1)
    ws.checkin("t", tmp_path / "s0")
    now[0] = 100.0
    in_rmtree, go = threading.Event(), threading.Event()
    real = shutil.rmtree

    def gated(path, *a, **kw):
        if Path(path) == ws.path("t") and not go.is_set():
            in_rmtree.set()
            go.wait(10)
        return real(path, *a, **kw)

    monkeypatch.setattr(workspace.shutil, "rmtree", gated)
    sweep = threading.Thread(target=ws.sweep)
    sweep.start()
    assert in_rmtree.wait(10)
    first = threading.Thread(target=ws.checkout, args=("t", tmp_path / "s1", 10))
    first.start()
    time.sleep(0.2)  # the action waits on the lock the sweep holds
    go.set()
    sweep.join(10)
    first.join(10)
    assert (tmp_path / "s1").is_dir()  # the first action has the dir
    assert ws.holds("t")
    with pytest.raises(SandboxError, match="previous action still holds"):
        ws.checkout("t", tmp_path / "s2", timeout_s=0.2)
    ws.checkin("t", tmp_path / "s1")
    ws.checkout("t", tmp_path / "s2", timeout_s=1)  # and once it gave it back, the next one goes
    ws.checkin("t", tmp_path / "s2")


def test_a_trajectory_used_again_while_the_sweep_removes_others_keeps_its_dir(tmp_path, monkeypatch):
    """The sweep lists the trajectories idle past the TTL, then removes them one by one. One of them whose next action
    ran (and checked in) while the sweep was still removing another is no longer idle: its dir must stay. Before, the
    sweep went by its list, removed the dir the action had just written to and forgot the trajectory."""
    import shutil
    import threading

    from tangram_dask.sandbox import workspace

    now = [0.0]
    ws = Workspaces(tmp_path / "trajectories", uid=None, ttl_s=60, clock=lambda: now[0])
    for t in ("a", "b"):
        ws.checkout(t, tmp_path / "s", timeout_s=1)
        ws.checkin(t, tmp_path / "s")
    now[0] = 100.0
    in_rmtree, go = threading.Event(), threading.Event()
    real = shutil.rmtree
    first = sorted(ws.trajectories())[0]  # the sweep goes in _last_used's order: "a" then "b"
    other = "b" if first == "a" else "a"

    def gated(path, *a, **kw):
        if Path(path) == ws.path(first) and not go.is_set():
            in_rmtree.set()
            go.wait(10)
        return real(path, *a, **kw)

    monkeypatch.setattr(workspace.shutil, "rmtree", gated)
    gone: list[str] = []
    sweep = threading.Thread(target=lambda: gone.extend(ws.sweep()))
    sweep.start()
    try:
        assert in_rmtree.wait(10)
        ws.checkout(other, tmp_path / "s", timeout_s=1)  # its next action, while the sweep removes the first
        (tmp_path / "s" / "work").write_text("fresh")
        ws.checkin(other, tmp_path / "s")
    finally:
        go.set()
        sweep.join(10)
    assert not sweep.is_alive()
    assert gone == [first]
    assert (ws.path(other) / "work").read_text() == "fresh"
    assert other in ws.trajectories()
