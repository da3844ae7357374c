"""The elastic pool on a real LocalCluster (worker processes) running the tangram plugin.

- ``/api/v1/adaptive_target``, the ``adaptive_target`` RPC and ``cluster.adapt()``'s own
  target agree, and ``/api/v1/tangram/targets`` breaks the total down per kind;
- GPU actions with no GPU worker ask for a GPU worker, not CPU workers (the issue's repro);
- ``workers_to_close`` moves a trajectory's working dir off the worker it picks before
  offering it, and never offers a worker running an action; ``retire_workers`` refuses one;
- ``cluster.adapt()`` grows while actions wait and shrinks when they drain.
"""

from __future__ import annotations

import json
import time
import urllib.request

import dask
import pytest
from distributed import Client, Event, LocalCluster

import tangram_dask
from tangram_dask.adaptive import EXTENSION_NAME
from tangram_dask.cluster import ModelSpec
from tangram_dask.sandbox import SandboxPlugin

ROUTES = ["distributed.http.scheduler.api", "distributed.http.health"]
KINDS = [{"name": "cpu", "slots": 1}, {"name": "gpu", "gpus": 1, "gpu-memory-gb": 24}]


def hold(name: str) -> str:
    Event(name).wait(60)
    return "done"


def step(code: str) -> dict:  # noqa: D103
    from distributed import get_worker
    res = tangram_dask.run_code(code, timeout=10)
    return {"worker": get_worker().address, "stdout": res.stdout, "reason": res.reason, "stderr": res.stderr}


def has_dir(trajectory: str, dask_worker=None) -> bool:
    return dask_worker.plugins["tangram-sandbox"].pool.has_trajectory(trajectory)


def wait_for(pred, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def http_json(cluster, path):
    port = cluster.scheduler.http_server.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture
def cluster_client():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0, models={"rm": ModelSpec("rm", 16, 0.5)})
    with dask.config.set({"distributed.scheduler.http.routes": ROUTES, "tangram.adaptive.kinds": KINDS}), \
            LocalCluster(n_workers=2, threads_per_worker=1, resources={"slots": 1}, processes=True,
                         dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        client.register_plugin(SandboxPlugin(size=1))
        yield cluster, client


def test_http_rpc_and_adapt_agree_and_gpu_demand_asks_for_gpu_workers(cluster_client):
    cluster, client = cluster_client
    # 2 CPU workers of 1 slot: 2 run (held), 6 wait, 2 s hints each: 12 unit-s / 5 s -> 3 slots for the queue
    with tangram_dask.action(kind="hold", resource="cpu", units=1, hint_s=2.0):
        held = [client.submit(hold, "cpu-hold", pure=False) for _ in range(8)]
    # 20 GPU actions and no GPU worker: they wait for one (the issue: Dask grew 2 CPU workers)
    with tangram_dask.action(kind="score", resource="gpu", units=1, hint_s=1.0, model="rm"):
        gpu = [client.submit(hold, "gpu-hold", pure=False) for _ in range(20)]
    ad = cluster.adapt(minimum=1, maximum=50, interval="1h")  # Adaptive's own target(), not ticking
    sched = cluster.scheduler

    def all_parked():
        snap = sched.plugins["tangram"].policy.snapshot()
        cpu = next(p for p in snap.pools if p.pool == "cpu")
        return cpu.running == 2 and cpu.queued == 6 and len(snap.unplaceable) == 20

    wait_for(all_parked, what="2 running, 6 queued, 20 unplaceable")
    rpc = client.sync(client.scheduler.adaptive_target)
    http = http_json(cluster, "/api/v1/adaptive_target")["workers"]
    adapt = client.sync(ad.target)
    per_kind = http_json(cluster, "/api/v1/tangram/targets")
    rpc_kinds = client.sync(client.scheduler.tangram_targets)
    assert rpc == http == adapt == per_kind["total"] == rpc_kinds["total"] == sched.adaptive_target()
    kinds = per_kind["kinds"]
    assert kinds["cpu"]["target"] == 2 + 3 and kinds["cpu"]["current"] == 2  # busy + queue within 5 s
    assert kinds["gpu"]["target"] == 1 and kinds["gpu"]["current"] == 0  # GPU demand asks for a GPU worker
    assert rpc == 6
    Event("cpu-hold", client=client).set()
    client.gather(held)
    for f in gpu:
        f.cancel()


def test_once_an_autoscaler_reads_a_target_what_no_kind_can_hold_errs_and_the_rest_waits(cluster_client):
    """The kinds are CPU workers of 1 slot and GPU workers of one 24 GB GPU. A GPU action on 2 GPUs waits
    while no GPU worker has joined; once a target is read (an autoscaler watches), no kind could ever hold
    it, so it errs, as does a new 4-slot action; a 1-GPU action waits for the GPU worker the targets ask
    for. Before session 31 all three waited, the targets listing two of them as unservable."""
    cluster, client = cluster_client
    with tangram_dask.action(kind="wide", resource="gpu", units=2, hint_s=1.0, model="rm"):
        wide = client.submit(hold, "never", pure=False)
    policy = cluster.scheduler.plugins["tangram"].policy
    wait_for(lambda: len(policy.snapshot().unplaceable) == 1, what="the 2-GPU action to wait")
    targets = client.sync(client.scheduler.tangram_targets)
    assert targets["kinds"]["gpu"]["target"] == 0  # rejected as the autoscaler came: nothing to grow for it
    with pytest.raises(tangram_dask.PlacementError, match="no worker kind the autoscaler can make would hold it"):
        wide.result(timeout=30)
    with tangram_dask.action(kind="big", resource="cpu", units=4, hint_s=1.0):
        big = client.submit(hold, "never", pure=False)
    with pytest.raises(tangram_dask.PlacementError, match="4 sandbox slots"):
        big.result(timeout=30)
    with tangram_dask.action(kind="score", resource="gpu", units=1, hint_s=1.0, model="rm"):
        score = client.submit(hold, "never", pure=False)
    wait_for(lambda: len(policy.snapshot().unplaceable) == 1, what="the 1-GPU action to wait")
    assert client.sync(client.scheduler.tangram_targets)["kinds"]["gpu"]["target"] == 1
    assert score.status == "pending"
    score.cancel()


def test_retirement_moves_state_first_and_spares_busy_workers(cluster_client):
    cluster, client = cluster_client
    ext = cluster.scheduler.plugins[EXTENSION_NAME]
    ext.move_state = True  # tangram.adaptive.move-state (off by default: homes pin their workers)
    stateful = dict(kind="edit", resource="cpu", units=1, hint_s=0.2, affinity="trajectory", restore_s=5.0)
    firsts = {}
    for t in ("t-1", "t-2"):  # submitted together: one on each worker
        with tangram_dask.action(trajectory=t, **stateful):
            firsts[t] = client.submit(step, f"open('notes', 'w').write('{t} step 1')", pure=False)
    homes = {t: f.result(60)["worker"] for t, f in firsts.items()}
    assert len(set(homes.values())) == 2, homes
    addrs = sorted(client.scheduler_info()["workers"])
    before = ext.stats.moved
    # a running action pins its worker: it is never offered, and retiring it is refused
    with tangram_dask.action(kind="hold", resource="cpu", units=1, hint_s=30):
        busy = client.submit(hold, "pin", pure=False)
    wait_for(lambda: any(cluster.scheduler.workers[a].processing for a in addrs), what="the hold to start")
    pinned = next(a for a in addrs if cluster.scheduler.workers[a].processing)
    assert pinned not in client.sync(client.scheduler.workers_to_close, target=0)
    assert client.retire_workers(workers=[pinned]) == {}
    assert pinned in client.scheduler_info()["workers"]
    Event("pin", client=client).set()
    busy.result(60)
    wait_for(lambda: not any(cluster.scheduler.workers[a].processing for a in addrs), what="idle")
    # nothing waits: one CPU worker is wanted (the trajectories' state needs a place)
    assert client.sync(client.scheduler.tangram_targets)["kinds"]["cpu"]["target"] == 1
    chosen = client.sync(client.scheduler.workers_to_close, target=1)
    assert len(chosen) == 1
    leaving = chosen[0]
    staying = next(a for a in addrs if a != leaving)
    moved = [t for t, w in homes.items() if w == leaving]
    # moved once, by the first workers_to_close call already (the busy worker could receive state)
    assert len(moved) == 1 and ext.stats.moved - before == 1
    policy = cluster.scheduler.plugins["tangram"].policy
    assert policy.homes_on(leaving) == [] and sorted(policy.homes_on(staying)) == ["t-1", "t-2"]
    assert client.run(has_dir, "t-1", workers=[staying]) == {staying: True}
    assert client.run(has_dir, "t-2", workers=[staying]) == {staying: True}
    retired = client.retire_workers(workers=[leaving])
    assert list(retired) == [leaving]
    wait_for(lambda: leaving not in client.scheduler_info()["workers"], what="retirement")
    for t in ("t-1", "t-2"):  # both trajectories' working dirs survived the retirement
        with tangram_dask.action(trajectory=t, **stateful):
            r = client.submit(step, "print(open('notes').read())", pure=False).result(60)
        assert r["worker"] == staying and r["stdout"] == f"{t} step 1\n", (t, homes, leaving, r)


def test_adapt_grows_while_actions_wait_and_shrinks_when_they_drain():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
    with dask.config.set({"tangram.adaptive.kinds": KINDS[:1]}), \
            LocalCluster(n_workers=1, threads_per_worker=1, resources={"slots": 1}, processes=True,
                         dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        cluster.adapt(minimum=1, maximum=3, interval="200ms", wait_count=2, target_duration="1s")
        with tangram_dask.action(kind="hold", resource="cpu", units=1, hint_s=2.0):
            held = [client.submit(hold, "grow", pure=False) for _ in range(6)]
        wait_for(lambda: len(cluster.scheduler.workers) == 3, timeout=60, what="3 workers")
        Event("grow", client=client).set()
        assert client.gather(held) == ["done"] * 6
        wait_for(lambda: len(cluster.scheduler.workers) == 1, timeout=60, what="back to 1 worker")


def test_adapt_down_to_no_worker_grows_again():
    """Without configured kinds, the kinds were the shapes of the current workers only: ``cluster.adapt()``
    (minimum 0, Dask's default) shrank an idle cluster to no worker, then knew no kind, asked for 0 workers
    and an action submitted next waited for ever. A shape seen stays a kind while no worker has its role."""
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
    with LocalCluster(n_workers=1, threads_per_worker=1, resources={"slots": 1}, processes=False,
                      dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        cluster.adapt(minimum=0, maximum=2, interval="200ms", wait_count=2)
        wait_for(lambda: not cluster.scheduler.workers, timeout=60, what="no worker")
        with tangram_dask.action(kind="after", resource="cpu", units=1, hint_s=0.1):
            fut = client.submit(str, "back", pure=False)
        assert fut.result(timeout=60) == "back"


def test_by_default_a_trajectorys_home_pins_its_worker(cluster_client):
    cluster, client = cluster_client
    ext = cluster.scheduler.plugins[EXTENSION_NAME]
    assert ext.move_state is False
    stateful = dict(kind="edit", resource="cpu", units=1, hint_s=0.2, affinity="trajectory", restore_s=5.0)
    with tangram_dask.action(trajectory="t-9", **stateful):
        home = client.submit(step, "open('notes', 'w').write('kept')", pure=False).result(60)["worker"]
    addrs = sorted(client.scheduler_info()["workers"])
    other = next(a for a in addrs if a != home)
    # nothing waits: 1 CPU worker is wanted; only the worker without the trajectory's state is offered
    assert client.sync(client.scheduler.tangram_targets)["kinds"]["cpu"]["target"] == 1
    assert list(client.sync(client.scheduler.workers_to_close, target=0)) == [other]
    assert ext.stats.moved == 0
    assert client.retire_workers(workers=[home]) == {}  # refused: its state has not moved
    assert list(client.retire_workers(workers=[other])) == [other]
    with tangram_dask.action(trajectory="t-9", **stateful):
        r = client.submit(step, "print(open('notes').read())", pure=False).result(60)
    assert (r["worker"], r["stdout"]) == (home, "kept\n")
    tangram_dask.end_trajectory(client, "t-9")  # the trajectory ends: its worker may go
    wait_for(lambda: list(client.sync(client.scheduler.workers_to_close, target=0)) == [home], what="home freed")
