"""Worker death mid-action, and the ``dask scheduler --preload scheduler_plugin`` install path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed import Client, KilledWorker

import tangram_dask
from tangram_dask.scheduler import TangramSchedulerPlugin, snapshot

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
            while len(snapshot(client)["nodes"]) < 2:
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
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _granted() -> tuple[int, str]:
    a = tangram_dask.current_allocation()
    return a.units, a.node
