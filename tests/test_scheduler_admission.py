"""Trajectory admission through the live scheduler: begin_trajectory returns once admitted."""

from __future__ import annotations

import threading
import time

from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.policy import TangramOptions


def _cluster(plugin) -> LocalCluster:
    return LocalCluster(n_workers=2, threads_per_worker=1, resources={"slots": 1}, processes=True,
                        dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]})


def test_admission_holds_a_trajectory_until_capacity_frees():
    """Admission on, nothing learned yet: one trajectory per slot (2). The third waits until one ends."""
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        tangram_dask.begin_trajectory(client, "t1")
        tangram_dask.begin_trajectory(client, "t2")
        admitted = threading.Event()
        waiter = threading.Thread(target=lambda: (tangram_dask.begin_trajectory(client, "t3"), admitted.set()))
        waiter.start()
        time.sleep(0.5)
        assert not admitted.is_set()  # held: the pool is full of active trajectories
        tangram_dask.begin_trajectory(client, "t2")  # asking again for an admitted one returns at once
        tangram_dask.end_trajectory(client, "t1")
        assert admitted.wait(10)
        waiter.join(5)
        for t in ("t2", "t3"):
            tangram_dask.end_trajectory(client, t)


def test_without_admission_every_trajectory_begins_at_once():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for i in range(20):  # no gate: each is admitted by the next scheduling pass
            assert tangram_dask.begin_trajectory(client, f"t{i}") == {"status": "OK"}
        assert plugin.policy.admission_queue == {} and len(plugin._admitted) == 20
        assert tangram_dask.end_trajectory(client, "t0") == []  # no sandboxes here: nothing to remove
        assert "t0" not in plugin._admitted
