"""``SandboxPlugin()`` with its defaults, where bubblewrap is missing: the process backend as it comes.

The worker's ``PATH`` hides bwrap (an empty dir), so ``backend="auto"`` falls back to the process
backend for real. As root, that backend runs the code as uid 65534, which needs a sandbox root it
can pass through (Dask makes a worker's local directory 0700) and an interpreter it can run (a
venv under /root is closed to it): the defaults must give both, and keep what docs/sandbox.md
promises (no sandbox reaches another's files; the root goes with the pool).
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask import SandboxError
from tangram_dask.sandbox import PoolOptions, SandboxPlugin, SandboxPool
from tangram_dask.sandbox.backends import SYSTEM_PYTHONS, _unreadable_by, namespaces_available, resolve_python
from tangram_dask.sandbox.options import MiB
from tangram_dask.sandbox.pool import _unsafe_parent, default_root

ROOT = os.geteuid() == 0


def _pool_facts(dask_worker=None) -> dict:
    pool = dask_worker.plugins["tangram-sandbox"].pool
    st = os.stat(pool.root)
    return {"backend": pool.backend.name, "root": str(pool.root), "mode": stat.S_IMODE(st.st_mode),
            "owner": st.st_uid, "python": pool.options.python, "local": dask_worker.local_directory,
            "boxes": sorted(os.listdir(pool.root / "boxes")),
            "trajectories_mode": stat.S_IMODE(os.stat(pool.root / "trajectories").st_mode)
            if (pool.root / "trajectories").exists() else None}


def _sandboxed(code: str) -> tuple[str, str, str]:
    r = tangram_dask.run_code(code, timeout=10)
    return r.reason, r.stdout, r.stderr


PROBE = """
import os, sys
root = {root!r}
print(os.getuid(), os.getcwd())
for what, path in [("list root", root), ("list boxes", root + "/boxes"),
                   ("list trajectories", root + "/trajectories"),
                   ("read other", root + "/trajectories/t-secret/secret.txt")]:
    try:
        got = sorted(os.listdir(path)) if what.startswith("list") else open(path).read()
        print(what, "OPEN", *got)
    except OSError as e:
        print(what, "refused", type(e).__name__)
"""


@pytest.fixture(scope="module")
def no_bwrap_cluster(tmp_path_factory):
    empty = tmp_path_factory.mktemp("no-bwrap-path")
    old = os.environ.get("PATH")
    os.environ["PATH"] = str(empty)  # the worker processes inherit it: shutil.which("bwrap") finds nothing
    try:
        plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
        with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, resources={"slots": 2},
                          dashboard_address=":0", worker_dashboard_address=None,
                          scheduler_kwargs={"plugins": [plugin]}) as cluster, Client(cluster) as client:
            client.register_plugin(SandboxPlugin(memory_bytes=256 * MiB))  # the defaults: no root, no python
            yield client
    finally:
        if old is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = old


def test_the_default_plugin_runs_code_without_bubblewrap(no_bwrap_cluster):
    client = no_bwrap_cluster
    facts = next(iter(client.run(_pool_facts).values()))
    assert facts["backend"] == "process"
    root = Path(facts["root"])
    # a 0711 dir of its own under /tmp, named after the worker, not in the worker's 0700 local directory
    assert root.parent == Path("/tmp") and root.name.startswith("tangram-sandbox-0-")
    assert (facts["mode"], facts["owner"]) == (0o711, os.geteuid())
    assert not str(root).startswith(facts["local"])
    with tangram_dask.action(kind="exec", resource="cpu", units=1, hint_s=0.1):
        fut = client.submit(_sandboxed, "import os, sys; print(os.getuid(), sys.executable)", pure=False)
    reason, out, err = fut.result(timeout=60)
    assert reason == "ok", err
    uid, python = out.split()
    assert python == facts["python"]
    if ROOT:
        assert int(uid) == 65534
        assert not _unreadable_by(python, 65534)  # an interpreter that uid can run
        if _unreadable_by(sys.executable, 65534):  # this venv (under /root) is closed to it: a system one
            assert python in SYSTEM_PYTHONS


def test_a_default_root_keeps_sandboxes_out_of_each_others_files(no_bwrap_cluster):
    client = no_bwrap_cluster
    root = next(iter(client.run(_pool_facts).values()))["root"]
    with tangram_dask.action(kind="edit", resource="cpu", trajectory="t-secret", affinity="trajectory",
                             hint_s=0.1):
        fut = client.submit(_sandboxed, "open('secret.txt', 'w').write('s3cret'); print('kept')", pure=False)
    assert fut.result(timeout=60)[:2] == ("ok", "kept\n")
    facts = next(iter(client.run(_pool_facts).values()))
    assert facts["trajectories_mode"] == 0o700  # the trajectories' dirs: the worker's alone
    with tangram_dask.action(kind="peek", resource="cpu", trajectory="t-other", affinity="trajectory",
                             hint_s=0.1):
        fut = client.submit(_sandboxed, PROBE.format(root=root), pure=False)
    reason, out, err = fut.result(timeout=60)
    assert reason == "ok", err
    first, *lines = out.splitlines()
    cwd = Path(first.split()[1])  # <root>/boxes/<its box>/mnt/work
    assert cwd.parents[3] == Path(root), out
    assert len(lines) == 4, out
    assert len(facts["boxes"]) >= 2  # another sandbox is there on the host, to be hidden from this one
    assert " refused " in lines[2] and " refused " in lines[3] and "s3cret" not in out, out
    if namespaces_available("process"):
        # a fresh /tmp per action holds only the path to its own area: no other box, no trajectory
        assert lines[0] == "list root OPEN boxes" and lines[1] == f"list boxes OPEN {cwd.parents[1].name}", out
        assert lines[2:] == ["list trajectories refused FileNotFoundError",
                             "read other refused FileNotFoundError"], out
    else:  # no mount namespace: the host's dirs, 0711 and 0700: nothing to list
        assert all(" refused " in line for line in lines), out
    assert tangram_dask.end_trajectory(client, "t-secret") == sorted(client.scheduler_info()["workers"])


def test_the_default_root_goes_with_the_pool():
    with SandboxPool(backend="process", size=1, memory_bytes=256 * MiB) as pool:
        assert pool.wait_ready(30)
        root = pool.root
        assert root is not None and root.parent == Path("/tmp") and stat.S_IMODE(os.stat(root).st_mode) == 0o711
        assert tangram_dask.run_code("print(1)", pool=pool).stdout == "1\n"
    assert not root.exists()


def test_the_default_root_stays_under_tmp_whatever_tmpdir_says(tmp_path, monkeypatch):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr("tempfile.tempdir", None)  # tempfile caches TMPDIR: read it again
    root = default_root(65534 if ROOT else None)
    try:
        assert root.parent == Path("/tmp") and stat.S_IMODE(os.stat(root).st_mode) == 0o711
        assert os.stat(root).st_uid == os.geteuid() and not any(root.iterdir())
    finally:
        root.rmdir()


def test_a_parent_others_could_swap_the_root_in_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by anyone and not sticky: the new dir could be renamed away
    assert "not sticky" in _unsafe_parent(str(shared), None)
    os.chmod(shared, 0o1777)
    assert _unsafe_parent(str(shared), None) == ""  # sticky: only its owner (or root) may move the new dir
    if ROOT:  # as root, tmp_path's 0700 parents (/tmp/pytest-of-root) block the code's uid 65534
        assert "cannot pass" in _unsafe_parent(str(shared), 65534)
    assert _unsafe_parent(str(tmp_path / "missing"), None)
    if ROOT:
        closed = tmp_path / "closed"
        closed.mkdir(mode=0o700)
        assert "cannot pass" in _unsafe_parent(str(closed), 65534)


@pytest.mark.skipif(not ROOT, reason="the code keeps the worker's uid, and its interpreter, when unprivileged")
def test_a_root_worker_picks_an_interpreter_the_code_uid_can_run():
    python = resolve_python(PoolOptions(backend="process"), "process")
    assert not _unreadable_by(python, 65534)
    assert python == sys.executable or python in SYSTEM_PYTHONS
    assert resolve_python(PoolOptions(python="/given/python"), "process") == "/given/python"  # as given
    assert resolve_python(PoolOptions(), "bwrap") == sys.executable  # bwrap mounts the worker's readable
    with pytest.raises(SandboxError, match="no Python interpreter that uid 65534.*tangram_no_such_module.*"
                                           "backend='bwrap'"):
        resolve_python(PoolOptions(preload=("tangram_no_such_module",)), "process")
