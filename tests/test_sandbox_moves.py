"""When the scheduler moves a stateful trajectory to another worker, its working dir follows.

A real LocalCluster (two worker processes, one sandbox slot each) with the
tangram scheduler plugin and the sandbox plugin: trajectory t-1 writes a
file on its home worker; that worker is then kept busy, so the policy sends
t-1's next stateful action elsewhere (restore_s is tiny, so waiting for home
never pays); that action reads the file: the grant named where the state was,
and the sandbox took it from there.
"""

from __future__ import annotations

import time

import pytest
from distributed import Client, Event, LocalCluster

import tangram_dask
from tangram_dask.sandbox import SandboxPlugin


def step(code: str) -> dict:
    from distributed import get_worker
    alloc = tangram_dask.current_allocation()
    res = tangram_dask.run_code(code, timeout=10)
    return {"worker": get_worker().address, "restore": alloc.restore, "restore_from": alloc.restore_from,
            "stdout": res.stdout, "reason": res.reason}


def hold(name: str) -> str:
    from distributed import get_worker
    Event(name).wait(30)
    return get_worker().address


def has_dir(trajectory: str, dask_worker=None) -> bool:
    return dask_worker.plugins["tangram-sandbox"].pool.has_trajectory(trajectory)


@pytest.fixture(scope="module")
def client():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
    with LocalCluster(n_workers=2, threads_per_worker=2, resources={"slots": 1}, processes=True,
                      dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as c:
        c.register_plugin(SandboxPlugin(size=1))
        yield c


def _keep_busy(client, home: str, tag: str) -> dict:
    """Fill both workers, then free the other one: home stays busy. Returns the blockers by event name."""
    with tangram_dask.action(kind="block", resource="cpu", units=1, hint_s=30):
        blockers = {name: client.submit(hold, name, pure=False) for name in (f"{tag}-0", f"{tag}-1")}
    deadline = time.monotonic() + 30
    where: dict[str, str] = {}
    while len(where) < 2:
        assert time.monotonic() < deadline, client.processing()
        where = {k: w for w, keys in client.processing().items() for k in keys
                 if k in {f.key for f in blockers.values()}}
        time.sleep(0.05)
    on_other = next(name for name, f in blockers.items() if where[f.key] != home)
    Event(on_other, client=client).set()
    blockers[on_other].result(timeout=30)
    return blockers


def test_a_moved_trajectory_finds_its_working_dir(client):
    stateful = dict(kind="edit", resource="cpu", units=1, hint_s=0.5, trajectory="t-1", affinity="trajectory",
                    restore_s=0.001)
    with tangram_dask.action(**stateful):
        first = client.submit(step, "open('notes', 'w').write('step 1')", pure=False).result(timeout=60)
    home = first["worker"]
    assert first["reason"] == "ok" and not first["restore"]
    blockers = _keep_busy(client, home, "b")
    with tangram_dask.action(**stateful):
        moved = client.submit(step, "print(open('notes').read())", pure=False).result(timeout=60)
    assert moved["worker"] != home and moved["restore"] and moved["restore_from"] == home
    assert moved["stdout"] == "step 1\n", moved
    assert client.run(has_dir, "t-1") == {home: False, moved["worker"]: True}  # taken, not copied
    for name in blockers:
        Event(name, client=client).set()
    tangram_dask.end_trajectory(client, "t-1")
    assert client.run(has_dir, "t-1") == {home: False, moved["worker"]: False}


def checked_out(trajectory: str, dask_worker=None) -> bool:
    """An action of the trajectory runs here with its dir (renamed into its sandbox)."""
    ws = dask_worker.plugins["tangram-sandbox"].pool.workspaces
    lock = ws._locks.get(trajectory) if ws is not None else None
    return lock is not None and lock.locked() and not ws.path(trajectory).exists()


def _held_at_home(client, trajectory: str, hold_s: float):
    """The trajectory writes 'a' at home, then a second action of it writes 'b' and holds the dir there for
    ``hold_s`` (its code sleeps): returns its action annotations, home, and that second action's future, once
    the dir is checked out."""
    stateful = dict(kind="edit", resource="cpu", units=1, hint_s=0.5, trajectory=trajectory, affinity="trajectory",
                    restore_s=0.001)
    with tangram_dask.action(**stateful):
        home = client.submit(step, "open('log', 'a').write('a')", pure=False).result(timeout=60)["worker"]
    with tangram_dask.action(**stateful):
        busy = client.submit(step, f"import time; open('log', 'a').write('b'); time.sleep({hold_s})", pure=False)
    deadline = time.monotonic() + 30
    while not client.run(checked_out, trajectory, workers=[home])[home]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return stateful, home, busy


def test_an_action_moved_while_another_of_its_trajectory_runs_at_home_waits_for_the_dir(client):
    """Two actions of one trajectory overlap: the first runs at home with the dir (its code sleeps 3 s), the
    second is moved to the other worker. Its restore waits for the first to give the dir back and then takes
    what it wrote. Before session 34 the home answered "nothing here" while the dir was checked out, and the
    moved action began with an empty dir, in silence, forking the trajectory (a helper's review found it)."""
    stateful, home, busy = _held_at_home(client, "t-3", hold_s=3)
    with tangram_dask.action(**stateful):
        moved = client.submit(step, "open('log', 'a').write('c'); print(open('log').read())", pure=False)
    out = moved.result(timeout=60)
    assert busy.result(timeout=60)["worker"] == home
    assert out["worker"] != home and out["restore_from"] == home, out
    assert out["stdout"] == "abc\n", out
    assert client.run(has_dir, "t-3") == {home: False, out["worker"]: True}
    tangram_dask.end_trajectory(client, "t-3")


def test_a_move_that_cannot_be_restored_loses_nothing(client):
    """A working dir with a link out of it cannot move: the moved action fails saying so, before the
    home worker removes anything; the trajectory's files are still there."""
    stateful = dict(kind="edit", resource="cpu", units=1, hint_s=0.5, trajectory="t-2", affinity="trajectory",
                    restore_s=0.001)
    with tangram_dask.action(**stateful):
        first = client.submit(step, "import os\nopen('notes', 'w').write('mine')\nos.symlink('/etc/passwd', 'out')",
                              pure=False).result(timeout=60)
    home = first["worker"]
    assert first["reason"] == "ok"
    blockers = _keep_busy(client, home, "c")
    with tangram_dask.action(**stateful):
        moved = client.submit(step, "print(open('notes').read())", pure=False)
        with pytest.raises(tangram_dask.SandboxError, match="could not be moved here.*points out of the dir.*stays"):
            moved.result(timeout=60)
    assert client.run(has_dir, "t-2")[home] is True  # the home worker still holds it
    for name in blockers:
        Event(name, client=client).set()
    tangram_dask.end_trajectory(client, "t-2")


def test_a_move_that_times_out_waiting_for_the_dir_leaves_the_trajectory_at_home():
    """As above, but the action at home outlasts the pool's ``start_timeout_s`` (2 s here): the moved action fails
    saying the dir cannot move yet, and the trajectory's home is the source again, so its next action finds its
    files. Before, the policy kept the destination as home and the next action ran there on an empty dir, the
    files left at the source (a helper's review of the first version)."""
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
    with LocalCluster(n_workers=2, threads_per_worker=2, resources={"slots": 1}, processes=True,
                      dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        client.register_plugin(SandboxPlugin(size=1, start_timeout_s=2))
        stateful, home, busy = _held_at_home(client, "t-4", hold_s=6)
        with tangram_dask.action(**stateful):
            moved = client.submit(step, "print(open('log').read())", pure=False)
            with pytest.raises(tangram_dask.SandboxError, match="could not be moved here.*cannot move yet"):
                moved.result(timeout=60)
        assert plugin.policy.home["t-4"] == home
        busy.result(timeout=60)
        with tangram_dask.action(**stateful):
            after = client.submit(step, "print(open('log').read())", pure=False).result(timeout=60)
        assert after["stdout"] == "ab\n", after
        assert sum(client.run(has_dir, "t-4").values()) == 1  # one copy of its files
