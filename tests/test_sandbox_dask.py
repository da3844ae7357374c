"""The worker plugin through a real LocalCluster with worker processes."""

from __future__ import annotations

import os

import pytest

distributed = pytest.importorskip("distributed")

import tangram_dask  # noqa: E402
from tangram_dask import SandboxError  # noqa: E402
from tangram_dask.sandbox import SandboxPlugin, bwrap_available, end_trajectory_everywhere, move_trajectory, run_code  # noqa: E402
from tangram_dask.sandbox.options import MiB  # noqa: E402


@pytest.fixture(scope="module")
def client():
    ok, why = bwrap_available()
    if not ok:
        pytest.skip(f"bubblewrap unusable here: {why}")
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)  # actions need it (PluginMissingError)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=2, processes=True, resources={"slots": 2},
                                  dashboard_address=":0", worker_dashboard_address=None,
                                  scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            distributed.Client(cluster) as c:
        c.register_plugin(SandboxPlugin(backend="bwrap", timeout_s=2, memory_bytes=256 * MiB))
        yield c


def test_plugin_rejects_bad_options_in_the_client():
    with pytest.raises(SandboxError, match="backend"):
        SandboxPlugin(backend="docker")
    with pytest.raises(SandboxError, match="memory_bytes"):
        SandboxPlugin(memory_bytes=-1)


def _pool_stats(dask_worker):
    s = dask_worker.plugins["tangram-sandbox"].pool.statistics()
    return s.backend, s.size


def test_pool_sized_from_the_workers_slots(client):
    stats = client.run(_pool_stats)
    assert set(stats.values()) == {("bwrap", 2)}


def _check(code: str) -> tuple[str, str, tuple[int, ...]]:
    r = run_code(code)
    return r.reason, r.stdout, r.cpus


def test_run_code_inside_an_action(client):
    with tangram_dask.action(kind="exec", resource="cpu", units=2, hint_s=0.1):
        fut = client.submit(_check, "print(6 * 7)", pure=False)
    reason, stdout, cpus = fut.result(timeout=60)
    assert (reason, stdout, len(cpus)) == ("ok", "42\n", 2)  # 2 units -> 2 CPUs
    fut = client.submit(_check, "print(1)", pure=False)  # not an action: 1 unit
    assert len(fut.result(timeout=60)[2]) == 1


def _pid(dask_worker):
    import os
    return os.getpid()


def test_hostile_actions_leave_the_worker_alive_and_the_next_action_unaffected(client):
    pids = client.run(_pid)
    hostile = {
        "while True:\n    pass\n": "timeout",
        "import os\nos.kill(os.getppid(), 9)\n": "error",   # the zygote is not the code's to kill
        # its PID namespace holds only the zygote (PID 1, root): nothing it may signal (EPERM)
        "import os\nos.kill(-1, 9)\n": "error" if os.geteuid() == 0 else "ok",
        "x = bytearray(10 * 256 * 2**20)\n": "memory",
    }
    futs = {code: client.submit(_check, code, pure=False) for code in hostile}
    for code, want in hostile.items():
        assert futs[code].result(timeout=60)[0] == want, code
    assert client.run(_pid) == pids  # same worker processes, alive
    nxt = client.map(_check, ["print('next')"] * 4, pure=False)
    assert [f.result(timeout=60)[:2] for f in nxt] == [("ok", "next\n")] * 4


def _traj_step(code: str, trajectory: str | None = None) -> tuple[str, str]:
    from distributed import get_worker
    return get_worker().address, run_code(code, trajectory=trajectory).stdout


def test_trajectory_affinity_keeps_state_and_moves_between_workers(client):
    with tangram_dask.action(kind="edit", resource="cpu", affinity="trajectory", trajectory="t-9"):
        first = client.submit(_traj_step, "open('notes', 'w').write('step 1')", pure=False)
        a = first.result(timeout=60)[0]  # the trajectory's home, chosen by the scheduler
        second = client.submit(_traj_step, "print(open('notes').read())", pure=False)
        assert second.result(timeout=60) == (a, "step 1\n")
    b = next(w for w in client.scheduler_info()["workers"] if w != a)
    # by hand, behind the scheduler's back: a plain task (not an action) on b names the trajectory
    moved = move_trajectory(client, "t-9", a, b)
    assert moved > 0
    third = client.submit(_traj_step, "print(open('notes').read())", trajectory="t-9", workers=[b], pure=False)
    assert third.result(timeout=60) == (b, "step 1\n")
    assert end_trajectory_everywhere(client, "t-9") == [b]
