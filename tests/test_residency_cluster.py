"""Residency on a real LocalCluster with worker processes: memory, evictions under actions, dying workers.

GPUs are abstract (``tangram.worker.nvml: false``; this machine has none) and
small: each holds exactly one of the models below, so every change of model
on a GPU is an eviction. The models are numpy weights files written to a
temporary directory and loaded from disk by the built-in loader.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.models import models_snapshot, register_model
from tangram_dask.models.builtin import NumpyLoader
from tangram_dask.scheduler import TangramSchedulerPlugin

DIM = 32
ROWS = {"m-a": 3000, "m-b": 3200, "m-c": 3400}  # 384 KB .. 435 KB each
GPU_GB = 0.0006  # 600 KB: one model per GPU


def param_bytes(rows: int) -> int:
    return (rows + 1) * DIM * 4


def write_models(tmp: Path) -> dict[str, str]:
    out = {}
    for name, rows in ROWS.items():
        p = tmp / f"{name}.npz"
        rng = np.random.default_rng(rows)
        np.savez(p, embed=rng.standard_normal((rows, DIM)).astype(np.float32), bias=np.zeros(DIM, np.float32))
        out[name] = str(p)
    return out


def gpu_worker(name: str, gpus: int) -> dict:
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": gpus, "gpu-memory-gb": GPU_GB}}}
    return {"cls": Nanny, "options": {"name": name, "nthreads": gpus, "resources": {"gpus": gpus}, "config": cfg,
                                      "memory_limit": 0, "dashboard_address": None}}


def wait_until(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Cluster:
    def __init__(self, policy: str, workers: dict, paths: dict, loader=NumpyLoader, tangram=None):
        declared = {m: ModelSpec(m, param_bytes(r) / 1e9, 0.2) for m, r in ROWS.items()}
        self.plugin = TangramSchedulerPlugin(policy, models=declared, pipeline=0, tangram=tangram)
        self.cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0",
                                    scheduler_kwargs={"plugins": [self.plugin]})
        self.cluster.worker_spec.update(workers)
        self.cluster.sync(self.cluster._correct_state)
        self.client = Client(self.cluster)
        wait_until(lambda: len(self.plugin.nodes) == len(workers), what="declarations")
        for m, p in paths.items():
            register_model(self.client, m, loader(p), memory_gb=param_bytes(ROWS[m]) / 1e9, load_s=0.2)

    def close(self) -> None:
        self.client.close()
        self.cluster.close()

    def residency(self) -> dict:
        return self.client.run(lambda dask_worker: dask_worker.plugins["tangram"].residency.snapshot())


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return write_models(tmp_path_factory.mktemp("weights"))


def hold(model: str, seconds: float, log: str = "") -> dict:
    """Score, hold the replica for ``seconds``, score again; append what happened to ``log``."""
    rm = tangram_dask.reward_model(model)
    t0 = time.time()
    first = rm.score([("a b c", "a b c")])[0]
    time.sleep(seconds)
    second = rm.score([("a b c", "a b c")])[0]
    out = {"model": model, "got": t0, "end": time.time(), "first": first, "second": second,
           "replica": rm.info()["replica"]}
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(out) + "\n")
    return out


# -- memory never over-committed: random sequences on a real cluster (fifo churns replicas the most) -------
@pytest.fixture(scope="module")
def churn(paths):
    c = Cluster("fifo", {"gpu-0": gpu_worker("gpu-0", 2)}, paths)
    yield c
    c.close()


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seq=st.lists(st.tuples(st.sampled_from(sorted(ROWS)), st.sampled_from([0.0, 0.02, 0.08])),
                    min_size=3, max_size=12))
def test_random_sequences_never_overcommit_a_gpu(churn, seq):
    c = churn
    futs = []
    for model, secs in seq:
        with tangram_dask.action(kind="score", resource="gpu", model=model, hint_s=max(secs, 0.01)):
            futs.append(c.client.submit(hold, model, secs, pure=False))
    results = c.client.gather(futs)
    assert [r["model"] for r in results] == [m for m, _ in seq]
    assert all(r["first"] == pytest.approx(1.0, abs=1e-5) and r["second"] == r["first"] for r in results)
    (snap,) = c.residency().values()
    cap = int(GPU_GB * 1e9)
    assert snap["capacity"] == [cap, cap]
    assert all(p <= cap for p in snap["peak_used"]), snap
    assert all(u <= cap for u in snap["used"])
    assert sum(r["bytes_per_gpu"] for r in snap["replicas"].values() if r["state"] == "resident") == sum(snap["used"])


# -- never evicted under a running action (also after the client cancelled it) --------------------------
@pytest.fixture(scope="module")
def single(paths):
    c = Cluster("tangram", {"gpu-0": gpu_worker("gpu-0", 1)}, paths)
    yield c
    c.close()


def test_a_replica_is_not_evicted_under_a_cancelled_action_still_running(single, tmp_path):
    c = single
    log = str(tmp_path / "log.jsonl")
    with tangram_dask.action(kind="score", resource="gpu", model="m-a", hint_s=0.1):
        x = c.client.submit(hold, "m-a", 2.0, log, pure=False)
    wait_until(lambda: any(r["state"] == "resident" and r["pins"] for s in c.residency().values()
                           for r in s["replicas"].values()), what="m-a to serve")
    x.cancel()  # the policy frees the GPU at once; the thread runs on, holding the replica
    with tangram_dask.action(kind="score", resource="gpu", model="m-b", hint_s=0.1):
        y = c.client.submit(hold, "m-b", 0.0, log, pure=False)
    y_out = y.result(timeout=60)
    wait_until(lambda: os.path.exists(log) and len(open(log).read().splitlines()) == 2, what="both actions")
    rows = {r["model"]: r for r in map(json.loads, open(log).read().splitlines())}
    a = rows["m-a"]
    assert a["second"] == pytest.approx(1.0, abs=1e-5)  # its replica was still resident at its end
    assert y_out["got"] >= a["end"]  # m-b's load (which evicts m-a) waited for the cancelled action's thread
    (snap,) = c.residency().values()
    assert snap["evictions"] >= 1 and all(p <= int(GPU_GB * 1e9) for p in snap["peak_used"])


def test_an_evict_request_for_a_serving_replica_is_refused(single):
    from distributed.core import rpc

    from tangram_dask.messages import WORKER_EVICT_HANDLER
    c = single
    with tangram_dask.action(kind="score", resource="gpu", model="m-c", hint_s=0.1):
        x = c.client.submit(hold, "m-c", 1.5, pure=False)
    wait_until(lambda: any(r["model"] == "m-c" and r["state"] == "resident" and r["pins"]
                           for s in c.residency().values() for r in s["replicas"].values()), what="m-c to serve")
    (addr, snap), = c.residency().items()
    rid = next(int(k) for k, r in snap["replicas"].items() if r["model"] == "m-c")

    async def ask(timeout):
        async with rpc(addr) as w:
            return await getattr(w, WORKER_EVICT_HANDLER)(replica=rid, timeout=timeout)

    reply = c.client.sync(ask, 0.3)
    assert reply["status"] == "busy" and "still serving an action" in reply["error"]
    assert x.result(timeout=30)["second"] == pytest.approx(1.0, abs=1e-5)
    assert c.client.sync(ask, 5.0)["status"] == "OK"  # idle now: evicted
    assert c.client.sync(ask, 5.0)["status"] == "absent"


def test_a_replica_the_policy_does_not_hold_is_evicted_from_its_worker(single):
    """Load one ahead under an id the policy never placed: the scheduler's reconciliation evicts it."""
    from distributed.core import rpc

    from tangram_dask.messages import WORKER_LOAD_HANDLER
    c = single
    (addr, snap), = c.residency().items()
    idle = [int(k) for k, r in snap["replicas"].items() if not r["pins"]]

    async def load():
        async with rpc(addr) as w:
            return await getattr(w, WORKER_LOAD_HANDLER)(replica=900, model="m-b", gpus=[0], evict=idle, wait=True)

    assert 900 not in c.plugin.policy.gpu.replicas
    # Reconciliation runs on every residency report as well as each second: held off while the load's reply
    # travels, or the stale replica's eviction can reach the worker first and the reply reads 'evicted'
    # (seen in about 1 run in 4 on a loaded 2-core machine). It runs again at the next tick.
    res = c.plugin.residency
    res.reconcile = lambda: None
    try:
        assert c.client.sync(load) == {"status": "resident"}  # the worker obeys a load-ahead request
    finally:
        del res.reconcile
    wait_until(lambda: 900 not in next(iter(c.residency().values()))["replicas"], timeout=10,
               what="the stale replica's eviction")
    assert models_snapshot(c.client)["counts"]["stale"] >= 1
    assert next(iter(c.residency().values()))["used"] == [0]


# -- a worker killed while loading loses no action ---------------------------------------------------------
class SlowLoader:
    """The numpy loader, after a pause (a large model's load); picklable, importable by the workers."""

    def __init__(self, path: str, pause_s: float = 2.5):
        self.inner = NumpyLoader(path)
        self.pause_s = pause_s

    def __call__(self, devices):
        time.sleep(self.pause_s)
        return self.inner(devices)


def test_a_worker_killed_while_loading_loses_no_action(paths):
    c = Cluster("tangram", {"gpu-0": gpu_worker("gpu-0", 1), "gpu-1": gpu_worker("gpu-1", 1)}, paths,
                loader=SlowLoader)
    try:
        with tangram_dask.action(kind="score", resource="gpu", model="m-a", hint_s=0.1):
            fut = c.client.submit(hold, "m-a", 0.0, pure=False)
        st_ = c.plugin.residency

        def loading_on():
            for w, reps in list(st_.replicas.items()):
                if any(r.state == "loading" for r in reps.values()):
                    return w
            return None

        wait_until(lambda: loading_on() is not None, what="a load to start")
        victim = loading_on()
        pid = c.client.run(os.getpid, workers=[victim])[victim]
        os.kill(pid, signal.SIGKILL)  # the worker process we started, mid-load
        out = fut.result(timeout=90)
        assert out["first"] == pytest.approx(1.0, abs=1e-5)
        # The action lost with its worker and placed again (a load inside the action), or, with background
        # loads (the default), never sent there: the replica lost mid-load is loaded again elsewhere
        assert c.plugin.stats.cancelled >= 1 or c.plugin.stats.loads_ahead >= 2
        served = [w for w, reps in st_.replicas.items() if any(r.state == "resident" for r in reps.values())]
        assert served and victim not in served
        assert models_snapshot(c.client)["counts"]["loads"] >= 1
    finally:
        c.close()


# -- background loads (Load decisions): the worker loads, no action waits inside the load -------------------
def test_a_background_load_is_loaded_by_its_worker_before_the_action_is_granted(paths):
    from tangram_dask.policy import TangramOptions
    c = Cluster("tangram", {"gpu-0": gpu_worker("gpu-0", 1)}, paths, loader=SlowLoader,
                tangram=TangramOptions(background_load=1.0))
    c.plugin.grants = {}
    try:
        with tangram_dask.action(kind="score", resource="gpu", model="m-a", hint_s=0.1):
            fut = c.client.submit(hold, "m-a", 0.0, pure=False)
        pol = c.plugin.policy
        wait_until(lambda: any(r.loading for r in pol.gpu.replicas.values()), what="a background load")
        (rid,) = [k for k, r in pol.gpu.replicas.items() if r.loading]
        time.sleep(0.5)  # the loader takes 2.5 s: the action waits in its queue meanwhile, granted nothing
        assert not c.plugin.grants and fut.key in pol.pools["m-a"].waiting
        out = fut.result(timeout=60)
        assert out["first"] == pytest.approx(1.0, abs=1e-5)
        (grant,) = c.plugin.grants.values()
        assert (grant.replica, grant.load, grant.evict, grant.setup_s) == (rid, False, (), 0.0)
        assert out["replica"] == rid and not pol.gpu.replicas[rid].loading
        assert c.plugin.stats.loads_ahead == 1
        assert models_snapshot(c.client)["counts"]["loads"] == 1
    finally:
        c.close()
