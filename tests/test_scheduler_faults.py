"""Worker death mid-action, and the ``dask scheduler --preload scheduler_plugin`` install path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import pytest
from distributed import Client, KilledWorker

import tangram_dask
from tangram_dask.scheduler import TangramSchedulerPlugin, snapshot

from conftest import stop_workers_then_scheduler
from test_scheduler_plugin import _cpu_worker, start_cluster, wait_nodes


def record_then_sleep(log: str, hold_s: float) -> int:
    """Append this attempt's pid to ``log``, sleep, then append 'done'."""
    with open(log, "a") as f:
        f.write(f"start {os.getpid()}\n")
    time.sleep(hold_s)
    with open(log, "a") as f:
        f.write("done\n")
    return os.getpid()


def kill_own_worker() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_for_line(path: Path, prefix: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith(prefix):
                    return line
        time.sleep(0.02)
    raise AssertionError(f"no {prefix!r} line in {path}")


def test_worker_killed_mid_action_the_action_completes_once_elsewhere(tmp_path):
    plugin = TangramSchedulerPlugin("tangram")
    workers = {"cpu-0": _cpu_worker("cpu-0", 1, 1), "cpu-1": _cpu_worker("cpu-1", 1, 1)}
    with start_cluster(plugin, workers, allowed_failures=1) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        log = tmp_path / "attempts.log"
        with tangram_dask.action(kind="long", resource="cpu", units=1, hint_s=1.0):
            fut = client.submit(record_then_sleep, str(log), 1.0, pure=False)
        first = int(_wait_for_line(log, "start").split()[1])
        os.kill(first, signal.SIGKILL)  # the worker process dies mid-action
        pid = fut.result(timeout=30)
        assert pid != first
        lines = log.read_text().splitlines()
        assert lines.count("done") == 1 and len([x for x in lines if x.startswith("start")]) == 2
        assert plugin.stats.finished == 1
        # the dashboard counts one action, submitted once, whose ACT spans both attempts (the record was
        # kept while the task waited again: the monitor keeps nothing per action of its own)
        k = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["tangram-monitor"]
                                    .stats.totals()["long"])
        assert (k["submitted"], k["finished"], k["failed"]) == (1, 1, 0)
        assert k["act_sum_s"] >= 1.0  # at least the second attempt's 1 s sleep, plus the first one's start
        # the policy lost the dead node and holds nothing
        deadline = time.monotonic() + 20
        while len(plugin.nodes) < 2:  # the nanny restarts the worker under a new address
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert not plugin.policy.running

        # a task that kills every worker it runs on errs with Dask's KilledWorker
        with tangram_dask.action(kind="poison", resource="cpu", units=1):
            poison = client.submit(kill_own_worker, pure=False)
        with pytest.raises(KilledWorker):
            poison.result(timeout=60)
        assert not plugin.policy.running
        cpu = next(p for p in snapshot(client)["pools"] if p["resource"] == "cpu")
        assert cpu["free"] == cpu["capacity"]


def test_install_with_dask_scheduler_preload(tmp_path):
    here = Path(__file__).resolve().parent  # the processes import this module for _granted
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), str(here)]),
           "DASK_TANGRAM__SCHEDULER__API_TOKENS": "1"}
    bindir = Path(sys.executable).parent
    sched_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([str(bindir / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                               "--no-dashboard", "--scheduler-file", str(sched_file),
                               "--preload", "scheduler_plugin", "--preload", "scheduler_plugin"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        deadline = time.monotonic() + 30
        while not sched_file.exists():
            assert time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.1)
        for _ in range(2):
            procs.append(subprocess.Popen([str(bindir / "dask"), "worker", "--scheduler-file", str(sched_file),
                                           "--host", "127.0.0.1", "--nthreads", "2", "--resources", "slots=2",
                                           "--no-dashboard", "--no-nanny"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        with Client(scheduler_file=str(sched_file), timeout=30) as client:
            client.wait_for_workers(2, timeout=30)
            deadline = time.monotonic() + 20
            while len(snapshot(client)["workers"]) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            client.register_plugin(TangramSchedulerPlugin())  # a third install: harmless
            with tangram_dask.action(kind="x", resource="cpu", units=(1, 2), speedup=0.5):
                futs = [client.submit(_granted, pure=False) for _ in range(6)]
            with tangram_dask.action(kind="search", resource="api", units=1):
                api = client.submit(_granted, pure=False)
            res = client.gather(futs)
            assert all(1 <= units <= 2 and node.startswith("tcp://127.0.0.1") for units, node in res)
            assert api.result() == (1, "api")
            snap = snapshot(client)
            assert snap["policy"] == "tangram" and snap["plugin"]["finished"] == 7
            api_pool = next(p for p in snap["pools"] if p["resource"] == "api")
            assert api_pool["capacity"] == 1  # DASK_TANGRAM__SCHEDULER__API_TOKENS reached the preload
    finally:
        stop_workers_then_scheduler(procs[0], procs[1:], timeout=10)


def _granted() -> tuple[int, str]:
    a = tangram_dask.current_allocation()
    return a.units, a.node


# -- bad and oversized input on a live cluster, at the shipped defaults (dispatch-ahead 2) --------------
def _units_of_this_action() -> int:
    return tangram_dask.current_allocation().units


def _sleep(s: float) -> int:
    time.sleep(s)
    return 1


@pytest.fixture(scope="module")
def two_small_workers():
    plugin = TangramSchedulerPlugin("tangram")  # every option as shipped
    assert plugin.options.pipeline == 2
    workers = {"cpu-0": _cpu_worker("cpu-0", 2, 2), "cpu-1": _cpu_worker("cpu-1", 2, 2)}
    with start_cluster(plugin, workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        yield client, plugin


def _elastic_units(client) -> int:
    with tangram_dask.action(kind="elastic", resource="cpu", units=(1, 2), speedup=1.0, hint_s=0.01):
        return client.submit(_units_of_this_action, pure=False).result(timeout=30)


@pytest.mark.parametrize("need", [3, 4, 10**6], ids=["slots+1", "slots+ahead", "a million"])
def test_an_oversized_action_errs_at_once_and_the_others_run(two_small_workers, need):
    client, plugin = two_small_workers
    before = _elastic_units(client)
    with tangram_dask.action(kind="busy", resource="cpu", units=1, hint_s=0.3):
        busy = [client.submit(_sleep, 0.3, pure=False) for _ in range(4)]
    with tangram_dask.action(kind="ok", resource="cpu", units=1, hint_s=0.01):
        first = [client.submit(_sleep, 0.01, pure=False) for _ in range(3)]
    with tangram_dask.action(kind="wide", resource="cpu", units=need):
        big = client.submit(_sleep, 0.01, pure=False)
    with tangram_dask.action(kind="ok", resource="cpu", units=1, hint_s=0.01):
        later = [client.submit(_sleep, 0.01, pure=False) for _ in range(3)]
    with pytest.raises(tangram_dask.PlacementError, match=f"asks for {need} sandbox slots on one worker; "
                                                          "the largest CPU worker has 2 slots"):
        big.result(timeout=30)
    assert client.gather(busy + first + later) == [1] * 10
    assert _elastic_units(client) == before == 2  # elastic sizing as it was
    assert not plugin.policy.running and plugin.policy.cpu.slots_free == 4


def _until(path: str, limit: float = 60.0) -> int:
    """An action that runs until ``path`` exists (or ``limit`` seconds)."""
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return 1


def test_timeout_s_errs_the_action_and_frees_its_units(two_small_workers, tmp_path):
    """The action runs until the test lets it go, after the error: the error can only be the timeout's
    (without it ``result`` would raise its own TimeoutError after 30 s), and its units are free while its
    function still runs on the worker."""
    client, plugin = two_small_workers
    go = tmp_path / "go"
    try:
        with tangram_dask.action(kind="stuck", resource="cpu", units=2, timeout_s=0.5):
            stuck = client.submit(_until, str(go), pure=False)
        with pytest.raises(tangram_dask.PlacementError, match="ran past its timeout_s = 0.5 s"):
            stuck.result(timeout=30)
        assert not go.exists()  # still running on its worker
        assert not any(r.spec.kind == "stuck" for r in plugin.policy.running.values())
        assert plugin.policy.cpu.slots_free == 4
    finally:
        go.touch()  # the worker's thread ends


def _stamp(path: str) -> int:
    with open(path, "a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(0.3)
    return 1


def test_timeout_s_counts_from_the_start_of_an_action_dispatched_ahead(two_small_workers, tmp_path):
    """Dispatch-ahead (the default, pipeline 2): with one worker's 2 slots held by a 6 s action (hinted 0.5 s, so
    the policy expects it to end soon and sends ahead to it, ahead_wait), of four 0.3 s
    actions with timeout_s = 2 one is sent ahead to that worker and waits there for its slots. Its timeout counts
    from when it starts, so all four end well. Before session 31 it counted from the grant: the waiting one
    erred as "ran past its timeout_s" before it had started, and then ran anyway."""
    client, plugin = two_small_workers
    log = tmp_path / "starts"
    log.touch()
    with tangram_dask.action(kind="long", resource="cpu", units=2, hint_s=0.5):  # mis-hinted: sent ahead to
        long = client.submit(_sleep, 6.0, pure=False)
    deadline = time.monotonic() + 20
    while not any(r.spec.kind == "long" for r in plugin.policy.running.values()):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    t0 = time.time()
    with tangram_dask.action(kind="short", resource="cpu", units=1, hint_s=0.3, timeout_s=2.0):
        shorts = [client.submit(_stamp, str(log), pure=False) for _ in range(4)]
    assert client.gather(shorts) == [1] * 4
    starts = sorted(float(x) - t0 for x in log.read_text().split())
    assert starts[-1] > 2.0, starts  # one did wait past its timeout on its worker: the case is the one described
    assert long.result(timeout=30) == 1


def test_a_timed_action_behind_a_thread_that_outlived_its_timeout_counts_from_its_own_start(two_small_workers):
    """Both workers' 2 slots are taken: one by a 6 s action, one by a 3 s action with timeout_s = 0.5. That one
    errs at 0.5 s and its units are freed in the ledger, but its thread holds the worker's slots until it
    returns. The next 2-slot action (timeout_s = 2, 0.3 s of work) goes there, waits ~2.5 s for the thread,
    and ends well: its timeout counts from its start, which the worker reports (it has said it would, when it
    declared). Before, it counted from the grant, and the runaway thread made it err unstarted."""
    client, plugin = two_small_workers
    assert client.run(lambda dask_worker: dask_worker.plugins["tangram"].report_starts) == dict.fromkeys(
        client.scheduler_info()["workers"], True)
    with tangram_dask.action(kind="long", resource="cpu", units=2, hint_s=6.0):
        long = client.submit(_sleep, 6.0, pure=False)
    with tangram_dask.action(kind="runaway", resource="cpu", units=2, hint_s=0.1, timeout_s=0.5):
        runaway = client.submit(_sleep, 3.0, pure=False)
    with pytest.raises(tangram_dask.PlacementError, match="ran past its timeout_s = 0.5 s"):
        runaway.result(timeout=30)
    t0 = time.monotonic()
    with tangram_dask.action(kind="next", resource="cpu", units=2, hint_s=0.3, timeout_s=2.0):
        nxt = client.submit(_sleep, 0.3, pure=False)
    assert nxt.result(timeout=30) == 1
    assert time.monotonic() - t0 > 2.0  # it did wait past its own timeout for the runaway thread: the case described
    assert long.result(timeout=30) == 1


def test_a_finished_action_keeps_no_grant_and_no_record(two_small_workers):
    client, plugin = two_small_workers
    with tangram_dask.action(kind="small", resource="cpu", units=1):
        futs = [client.submit(_sleep, 0.0, pure=False) for _ in range(5)]
    client.gather(futs)

    def leftovers(dask_scheduler, keys):
        p = dask_scheduler.plugins["tangram"]
        return ([k for k in keys if "tangram-grant" in dask_scheduler.tasks[k].annotations],
                [k for k in keys if k in p.actions],
                [k for k in keys if k in p._grant_worker or any(k in on for on in p._granted_on.values())])

    grants, records, indexed = client.run_on_scheduler(leftovers, keys=[f.key for f in futs])
    assert grants == [] and records == [] and indexed == []  # nor in the index of grants by worker


def test_the_actions_of_one_annotate_block_share_one_spec():
    """Dask gives every task of one ``dask.annotate`` block the same annotation object; the plugin parses it
    once (one frozen ActionSpec for them all, not ~120 bytes per queued action), shares the queued records
    of what arrived together, and a malformed one errs every task of its block, naming the field."""
    plugin = TangramSchedulerPlugin("tangram")
    with start_cluster(plugin, {}) as cluster, Client(cluster) as client:  # no worker: every action waits
        with tangram_dask.action(kind="shared", resource="cpu", units=1):
            futs = client.map(_sleep, [0.0] * 20, pure=False)
        with dask.annotate(tangram={"kind": "bad", "resource": "cpu", "units_min": 0}):
            bad = client.map(_sleep, [0.0] * 3, pure=False)

        def specs(dask_scheduler, keys):
            p = dask_scheduler.plugins["tangram"]
            present = [dask_scheduler.tasks[k] for k in keys if k in dask_scheduler.tasks]
            return (len({id(p.actions[k].spec) for k in keys if k in p.actions}),
                    len({id(ts.annotations) for ts in present}), len(present),
                    len({id(p.actions[k]) for k in keys if k in p.actions}),
                    {p.actions[k].state.value for k in keys if k in p.actions})

        deadline = time.monotonic() + 20
        while client.run_on_scheduler(specs, keys=[f.key for f in futs])[:3] != (1, 1, 20):
            assert time.monotonic() < deadline, client.run_on_scheduler(specs, keys=[f.key for f in futs])
            time.sleep(0.05)
        # queued records are shared too: one per millisecond of arrivals, not one per task (64 bytes each)
        _, _, _, records, states = client.run_on_scheduler(specs, keys=[f.key for f in futs])
        assert states == {"pending"} and records < 20, (records, states)
        for f in bad:
            with pytest.raises(Exception, match="units.min"):
                f.result(timeout=20)
        # granting one writes its grant on a copy: the others' shared annotations stay the user's
        cluster.worker_spec.update({"cpu-0": _cpu_worker("cpu-0", 2, 2)})
        cluster.sync(cluster._correct_state)
        assert client.gather(futs, errors="raise") == [1] * 20

        def grants(dask_scheduler, keys):
            return [dict(dask_scheduler.tasks[k].annotations) for k in keys]

        anns = client.run_on_scheduler(grants, keys=[f.key for f in futs])
        assert all(set(a) == {"tangram"} and a["tangram"]["kind"] == "shared" for a in anns)


def _pid_and_units() -> tuple[int, int]:
    return os.getpid(), tangram_dask.current_allocation().units


def test_a_lost_result_runs_again_through_the_policy():
    """The record of a finished action is dropped; if its result is lost with its worker, the task
    comes back to no-worker and is placed again from its annotation."""
    plugin = TangramSchedulerPlugin("tangram")
    workers = {"cpu-0": _cpu_worker("cpu-0", 2, 2), "cpu-1": _cpu_worker("cpu-1", 2, 2)}
    with start_cluster(plugin, workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        with tangram_dask.action(kind="once", resource="cpu", units=(1, 2), speedup=1.0):
            fut = client.submit(_pid_and_units, pure=False)
        pid, units = fut.result(timeout=30)
        assert fut.key not in plugin.actions
        os.kill(pid, signal.SIGKILL)  # the worker holding the result dies
        deadline = time.monotonic() + 30
        while True:
            new_pid, new_units = client.submit(lambda x: x, fut, pure=False).result(timeout=30)
            if new_pid != pid:
                break
            assert time.monotonic() < deadline
        assert new_units >= 1 and plugin.stats.started == 2


def test_a_worker_declaring_absurd_slots_is_left_out_and_the_scheduler_goes_on(caplog):
    """A worker started with --resources slots=1e9 (a typo): the ledger's index by free count would have held
    70 GB for it, stalling and then killing the scheduler (40 million slots: a 10 s stall, 2.9 GB). It is
    left out of placement with an error naming it; a sane worker beside it serves."""
    import logging

    plugin = TangramSchedulerPlugin("tangram")
    workers = {"sane": _cpu_worker("sane", 2, 2), "typo": _cpu_worker("typo", 10**9, 1)}
    with caplog.at_level(logging.ERROR, logger="tangram_dask.scheduler"), \
            start_cluster(plugin, workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 1)
        typo = next(a for a, ws in cluster.scheduler.workers.items() if ws.name == "typo")
        deadline = time.monotonic() + 20
        while not any(typo in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
        assert typo not in plugin.nodes and typo not in plugin.policy.cpu.capacity
        assert "1000000000 sandbox slots" in next(r.getMessage() for r in caplog.records if typo in r.getMessage())
        with tangram_dask.action(kind="small", resource="cpu", units=1):
            assert client.gather([client.submit(_sleep, 0.0, pure=False) for _ in range(4)]) == [1] * 4
