"""The scheduler plugin on a real LocalCluster with worker processes.

One module-scoped cluster: two CPU workers (2 slots, 3 threads each, so that
only the grant can hold an action back), one abstract GPU worker (4 GPUs in
groups [2, 2], declared by config) and 2 API tokens held by the scheduler.
Its plugin dispatches exactly (``pipeline=0``); dispatch-ahead, the default,
has its own cluster below.
"""

from __future__ import annotations

import os
import threading
import time

import dask
import pytest
from distributed import Client, Event, LocalCluster, Nanny, wait

import tangram_dask
from tangram_dask import PlacementError
from tangram_dask.cluster import ModelSpec
from tangram_dask.scheduler import PARK, TangramSchedulerPlugin, snapshot

from conftest import wait_on_scheduler

MODELS = {"rm-one": ModelSpec("rm-one", 16, 0.0), "rm-two": ModelSpec("rm-two", 120, 0.0)}
SLOTS = 2


def _gpu_worker(name: str, groups: list[int]) -> dict:
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": sum(groups), "gpu-groups": groups, "gpu-memory-gb": 80}}}
    return {"cls": Nanny, "options": {"name": name, "nthreads": sum(groups), "resources": {"gpus": sum(groups)},
                                      "config": cfg, "memory_limit": 0, "dashboard_address": None}}


def _cpu_worker(name: str, slots: int, nthreads: int) -> dict:
    return {"cls": Nanny, "options": {"name": name, "nthreads": nthreads, "resources": {"slots": slots},
                                      "memory_limit": 0, "dashboard_address": None}}


def start_cluster(plugin: TangramSchedulerPlugin, workers: dict[str, dict], **kw) -> LocalCluster:
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"plugins": [plugin], **kw})
    cluster.worker_spec.update(workers)
    cluster.sync(cluster._correct_state)
    return cluster


def wait_nodes(plugin: TangramSchedulerPlugin, n: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while len(plugin.nodes) < n:
        assert time.monotonic() < deadline, f"only {plugin.nodes} declared"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def env():
    plugin = TangramSchedulerPlugin("tangram", models=MODELS, api_tokens=2, pipeline=0)
    workers = {"cpu-0": _cpu_worker("cpu-0", SLOTS, 3), "cpu-1": _cpu_worker("cpu-1", SLOTS, 3),
               "gpu-0": _gpu_worker("gpu-0", [2, 2])}
    with start_cluster(plugin, workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(3)
        wait_nodes(plugin, 3)
        yield client, plugin, cluster


# -- what actions run -------------------------------------------------------------------------
def _units_meter(dask_worker=None):
    from distributed import get_worker
    w = dask_worker or get_worker()
    if not hasattr(w, "_tg_meter"):
        w._tg_meter = [threading.Lock(), 0, 0]  # lock, units running now, most units at once
    return w._tg_meter


def metered(hold_s: float) -> dict:
    """Hold the granted units for hold_s and record the most units this worker ever ran at once."""
    from distributed import get_worker
    alloc = tangram_dask.current_allocation()
    m = _units_meter()
    with m[0]:
        m[1] += alloc.units
        m[2] = max(m[2], m[1])
    time.sleep(hold_s)
    with m[0]:
        m[1] -= alloc.units
    return {"units": alloc.units, "node": alloc.node, "worker": get_worker().address, "gpus": alloc.gpus,
            "cuda": alloc.cuda_visible_devices, "env": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cross": alloc.cross_group}


def most_units(dask_worker) -> int:
    return _units_meter(dask_worker)[2]


def inc(x: int) -> int:
    return x + 1


def add(x: int, y: int) -> int:
    return x + y


def test_actions_obey_the_grant_on_each_worker(env):
    client, plugin, _ = env
    with tangram_dask.action(kind="elastic", resource="cpu", units=(1, 2), speedup=0.9, hint_s=0.2):
        futs = [client.submit(metered, 0.15, pure=False) for _ in range(16)]
    res = client.gather(futs)
    cpu = {addr for addr, d in plugin.nodes.items() if d.role == "cpu"}
    for r in res:
        assert r["node"] == r["worker"] and r["worker"] in cpu
        assert 1 <= r["units"] <= SLOTS
    most = client.run(most_units, workers=sorted(cpu))
    assert all(0 < m <= SLOTS for m in most.values()), most
    snap = snapshot(client)
    cpu_pool = next(p for p in snap["pools"] if p["resource"] == "cpu")
    assert cpu_pool["free"] == cpu_pool["capacity"] == 2 * SLOTS


def test_dispatch_ahead_never_runs_more_units_than_a_worker_has():
    """pipeline=2 (the default): each worker may be sent actions ahead, which wait
    on the worker; no worker ever runs more units at once than its slots, and no
    action is granted more than its node's slots."""
    plugin = TangramSchedulerPlugin("tangram")
    assert plugin.options.pipeline == 2
    workers = {"cpu-0": _cpu_worker("cpu-0", SLOTS, 3), "cpu-1": _cpu_worker("cpu-1", SLOTS, 3)}
    with start_cluster(plugin, workers) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        with tangram_dask.action(kind="elastic", resource="cpu", units=(1, 4), speedup=0.9, hint_s=0.1):
            futs = [client.submit(metered, 0.05, pure=False) for _ in range(24)]
        res = client.gather(futs)
        assert all(1 <= r["units"] <= SLOTS for r in res)
        most = client.run(most_units)
        assert all(0 < m <= SLOTS for m in most.values()), most
        snap = snapshot(client)
        cpu_pool = next(p for p in snap["pools"] if p["resource"] == "cpu")
        assert cpu_pool["capacity"] == 2 * SLOTS and cpu_pool["free"] == 2 * SLOTS


def test_gpu_actions_stay_inside_one_topology_group(env):
    client, plugin, _ = env
    gpu = next(addr for addr, d in plugin.nodes.items() if d.role == "gpu")
    with tangram_dask.action(kind="judge_two", resource="gpu", model="rm-two", units=2, hint_s=0.1):
        two = [client.submit(metered, 0.1, pure=False) for _ in range(4)]
    with tangram_dask.action(kind="judge_one", resource="gpu", model="rm-one", units=1, hint_s=0.1):
        one = [client.submit(metered, 0.05, pure=False) for _ in range(4)]
    for r in client.gather(two):
        assert r["worker"] == gpu and len(r["gpus"]) == 2
        assert set(r["gpus"]) in ({0, 1}, {2, 3}), r["gpus"]  # groups [2, 2]
        assert not r["cross"]
        assert r["cuda"] == ",".join(map(str, r["gpus"]))
        # process-wide, set as each GPU action starts: another action's value when two overlap
        assert r["env"] in ("0,1", "2,3", "0", "1", "2", "3")
    for r in client.gather(one):
        assert r["worker"] == gpu and len(r["gpus"]) == 1


def test_api_actions_hold_tokens_and_run_on_a_worker(env):
    client, _, _ = env
    with tangram_dask.action(kind="search", resource="api", units=1, hint_s=0.05):
        futs = [client.submit(metered, 0.05, pure=False) for _ in range(5)]
    res = client.gather(futs)
    assert all(r["node"] == "api" and r["units"] == 1 for r in res)


def test_mixed_graphs_of_actions_and_ordinary_tasks(env):
    client, plugin, _ = env
    a = client.submit(inc, 1)                                    # ordinary
    with tangram_dask.action(kind="step", resource="cpu", units=1, hint_s=0.01):
        b = client.submit(inc, a)                               # action on an ordinary task
        c = client.submit(add, a, b)                            # action on both
    d = client.submit(add, b, c)                                 # ordinary on actions
    assert d.result() == 2 + (2 + 3) + 3 - 2  # b = 3, c = 5, d = 8
    assert (a.result(), b.result(), c.result(), d.result()) == (2, 3, 5, 8)
    assert a.key not in plugin.actions and d.key not in plugin.actions
    # ordinary tasks keep Dask's own scheduling: no restriction was put on them
    restrictions = client.run_on_scheduler(lambda dask_scheduler, k=a.key: dask_scheduler.tasks[k].worker_restrictions)
    assert restrictions is None


def test_plain_dask_collections_pass_through(env):
    client, _, _ = env
    import dask.bag as db
    assert db.from_sequence(range(10), npartitions=4).map(inc).sum().compute() == 55


def test_cancel_frees_units_so_a_waiting_action_starts(env):
    client, plugin, cluster = env
    gate = Event("tangram-gate")
    gate.clear()
    try:
        _cancel_frees_units(client, cluster, gate)
    finally:
        gate.set()  # a failure here must not leave every slot held for the tests after it


def _cancel_frees_units(client, cluster, gate) -> None:

    def hold(name: str) -> str:
        """Wait for the gate; stop early when cancelled (cooperative, as a sandbox kill would be)."""
        from distributed import get_worker
        from distributed.worker import thread_state
        w, key, ev = get_worker(), thread_state.key, Event(name)
        while not ev.wait(0.05):
            if w.state.tasks[key].state == "cancelled":
                return "cancelled"
        return "held"

    with tangram_dask.action(kind="blocker", resource="cpu", units=SLOTS, hint_s=5):
        blockers = [client.submit(hold, "tangram-gate", pure=False) for _ in range(2)]  # fills every slot
    deadline = time.monotonic() + 10
    tasks = cluster.scheduler.tasks
    # both blockers granted and sent (this test's own actions: the plugin's counters also hold the actions
    # earlier tests made, some of which erred before they started)
    while sum(getattr(tasks.get(f.key), "state", None) == "processing" for f in blockers) < 2:
        assert time.monotonic() < deadline, [getattr(tasks.get(f.key), "state", None) for f in blockers]
        time.sleep(0.02)
    with tangram_dask.action(kind="waiter", resource="cpu", units=1, hint_s=0.01):
        waiter = client.submit(inc, 41, pure=False)
    # the client sends its submissions in batches: under load the waiter can take longer than the 0.3 s
    # below to reach the scheduler, and reading tasks[waiter.key] there raised KeyError
    wait_on_scheduler(client, [waiter.key], what="the waiter to reach the scheduler")
    time.sleep(0.3)  # time for the plugin to start the waiter, were it (wrongly) to: it must stay parked
    assert client.run_on_scheduler(lambda dask_scheduler, k=waiter.key: dask_scheduler.tasks[k].state) == "no-worker"
    blockers[0].cancel()
    assert waiter.result(timeout=10) == 42  # the policy gave the cancelled action's units to the waiter
    gate.set()
    assert blockers[1].result(timeout=10) == "held"


def test_a_malformed_annotation_errs_only_that_action(env):
    client, _, _ = env
    with dask.annotate(tangram={"kind": "bad", "resource": "cpu", "units_min": 0}):
        bad = client.submit(inc, 1, pure=False)
    with dask.annotate(tangram={"kind": "typo", "resource": "cpu", "unitz": 2}):
        typo = client.submit(inc, 1, pure=False)
    with tangram_dask.action(kind="good", resource="cpu", units=1):
        good = client.submit(inc, 1, pure=False)
    wait([bad, typo, good])
    with pytest.raises(PlacementError, match="units.min"):
        bad.result()
    with pytest.raises(PlacementError, match="unitz"):
        typo.result()
    assert good.result() == 2


def test_an_unknown_model_errs_with_the_fix(env):
    client, _, _ = env
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-nope", units=1):
        fut = client.submit(inc, 1, pure=False)
    with pytest.raises(PlacementError, match="rm-nope.*models="):
        fut.result()


def test_an_exception_in_the_plugin_errs_the_action_and_the_scheduler_serves_on(env):
    client, plugin, _ = env
    original = plugin._setup_s

    def broken(d, spec):
        if spec.kind == "boom":
            raise RuntimeError("injected fault")
        return original(d, spec)

    plugin._setup_s = broken
    try:
        with tangram_dask.action(kind="boom", resource="cpu", units=1):
            boom = client.submit(inc, 1, pure=False)
        with pytest.raises(PlacementError, match="injected fault"):
            boom.result(timeout=10)
    finally:
        plugin._setup_s = original
    with tangram_dask.action(kind="after", resource="cpu", units=1):
        assert client.submit(inc, 2, pure=False).result(timeout=10) == 3
    cpu_pool = next(p for p in snapshot(client)["pools"] if p["resource"] == "cpu")
    assert cpu_pool["free"] == cpu_pool["capacity"]  # the failed grant was given back


def test_an_action_that_raises_errs_like_any_task(env):
    client, _, _ = env

    def fail():
        raise ValueError("tool crashed")

    with tangram_dask.action(kind="crash", resource="cpu", units=1):
        fut = client.submit(fail, pure=False)
    with pytest.raises(ValueError, match="tool crashed"):
        fut.result()
    cpu_pool = next(p for p in snapshot(client)["pools"] if p["resource"] == "cpu")
    assert cpu_pool["free"] == cpu_pool["capacity"]


def test_installing_again_is_harmless(env):
    client, plugin, cluster = env
    client.register_plugin(TangramSchedulerPlugin("fifo"))  # same name: a no-op
    assert cluster.scheduler.plugins["tangram"] is plugin
    with tangram_dask.action(kind="again", resource="cpu", units=1):
        assert client.submit(inc, 5, pure=False).result() == 6


def held_until(name: str) -> int:
    Event(name).wait(30)
    return 1


def test_actions_with_one_grant_share_one_granted_annotations_dict(env):
    """Dask keeps recent compute-task messages with each task's annotations: actions of one annotate
    block granted alike (same worker, same units) hold one granted dict, not a copy each; the user's
    own annotations come back once they finish."""
    from tangram_dask.messages import GRANT_KEY
    client, plugin, cluster = env
    Event("hold-shared", client=client).clear()
    with tangram_dask.action(kind="shared", resource="cpu", units=1, hint_s=0.1):
        futs = [client.submit(held_until, "hold-shared", pure=False) for _ in range(2 * SLOTS)]
    tasks = cluster.scheduler.tasks
    deadline = time.monotonic() + 30
    while sum(getattr(tasks.get(f.key), "state", None) == "processing" for f in futs) < 2 * SLOTS:
        assert time.monotonic() < deadline, [getattr(tasks.get(f.key), "state", None) for f in futs]
        time.sleep(0.02)
    by_grant: dict[tuple, set[int]] = {}
    for f in futs:
        ann = tasks[f.key].annotations
        by_grant.setdefault(ann[GRANT_KEY], set()).add(id(ann))
    assert len(by_grant) == 2  # one grant per CPU worker (both hold SLOTS one-unit actions)
    assert all(len(ids) == 1 for ids in by_grant.values()), by_grant
    Event("hold-shared", client=client).set()
    assert client.gather(futs) == [1] * len(futs)
    deadline = time.monotonic() + 10
    while any(GRANT_KEY in (tasks[f.key].annotations or {}) for f in futs):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert all(tasks[f.key].annotations["tangram"]["kind"] == "shared" for f in futs)


def test_parked_actions_are_restricted_to_an_address_that_never_joins(env):
    """An action that waits for units is parked: restricted to PARK, which no worker has, so Dask holds
    it in no-worker; it runs once its grant arrives. (The test used to read the count of failed
    actions, which only earlier tests had made: run alone, it failed.)"""
    client, plugin, cluster = env
    assert PARK not in cluster.scheduler.workers
    Event("hold-park", client=client).clear()
    with tangram_dask.action(kind="park", resource="cpu", units=1, hint_s=0.1):
        busy = [client.submit(held_until, "hold-park", pure=False) for _ in range(2 * SLOTS)]
        extra = client.submit(held_until, "hold-park", pure=False)
    tasks = cluster.scheduler.tasks
    deadline = time.monotonic() + 30
    while sum(getattr(tasks.get(f.key), "state", None) == "processing" for f in busy) < 2 * SLOTS:
        assert time.monotonic() < deadline, [getattr(tasks.get(f.key), "state", None) for f in busy + [extra]]
        time.sleep(0.02)
    # the client sends its submissions in batches: the extra one may reach the scheduler after the others run.
    # Waited for on the scheduler's loop: from this thread it could be seen in tasks before its update-graph
    # had parked it (state 'released' or 'waiting')
    wait_on_scheduler(client, [extra.key], what="the extra action to reach the scheduler")
    ts = tasks[extra.key]
    assert ts.state == "no-worker" and ts.worker_restrictions == {PARK}
    Event("hold-park", client=client).set()
    assert client.gather(busy + [extra]) == [1] * (2 * SLOTS + 1)


# -- install paths -------------------------------------------------------------------------------
def test_install_with_client_register_plugin():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"slots": 1},
                      dashboard_address=":0", worker_dashboard_address=None) as cluster, Client(cluster) as client:
        client.register_plugin(TangramSchedulerPlugin())
        client.register_plugin(TangramSchedulerPlugin())  # twice: harmless
        plugin = cluster.scheduler.plugins["tangram"]
        wait_nodes(plugin, 2)
        with tangram_dask.action(kind="x", resource="cpu", units=1):
            futs = [client.submit(metered, 0.02, pure=False) for _ in range(6)]
        assert {r["units"] for r in client.gather(futs)} == {1}
        assert plugin.stats.finished == 6
        assert max(client.run(most_units).values()) == 1
