"""The worker plugin's GPU declaration on a real LocalCluster (worker processes, abstract GPUs: no GPU here).

- ``--resources gpus=2`` with ``tangram.worker.gpu-memory-gb`` and no
  ``tangram.worker.gpus`` declares 2 GPUs, and a GPU action runs on them
  (before: 0 GPUs declared and the action waited for ever);
- ``--resources gpus=2`` with no memory anywhere: the worker's log says which
  key to set (before: ``float(None)`` in the plugin's setup), and the worker
  declares nothing rather than something wrong.
"""

from __future__ import annotations

import time

from distributed import Client, LocalCluster, Nanny

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.models import register_model, rm_small
from tangram_dask.scheduler import TangramSchedulerPlugin


def worker(name: str, cfg: dict) -> dict:
    return {"cls": Nanny, "options": {"name": name, "nthreads": 2, "resources": {"gpus": 2},
                                      "config": {"tangram": {"worker": cfg}}, "memory_limit": 0,
                                      "dashboard_address": None}}


def judge() -> tuple[float, tuple[int, ...]]:
    rm = tangram_dask.reward_model("rm-small")
    return rm.score([("x y", "x y")])[0], tangram_dask.current_allocation().gpus


def test_resources_gpus_declare_gpus_and_missing_memory_is_named_in_the_log():
    plugin = TangramSchedulerPlugin("tangram", models={"rm-small": ModelSpec("rm-small", 0.001, 0.1)}, pipeline=0)
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]})
    cluster.worker_spec["ok"] = worker("ok", {"nvml": False, "gpu-memory-gb": 0.01})
    cluster.worker_spec["bad"] = worker("bad", {"nvml": False})
    cluster.sync(cluster._correct_state)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        deadline = time.monotonic() + 30
        while not plugin.nodes:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        names = {a: ws.name for a, ws in cluster.scheduler.workers.items()}
        declared = {names[a]: d for a, d in plugin.nodes.items()}
        assert set(declared) == {"ok"}
        assert (declared["ok"].gpus, declared["ok"].source, declared["ok"].gpu_memory_gb) == (2, "resources", 0.01)
        register_model(client, "rm-small", rm_small(), memory_gb=0.001, load_s=0.1)
        with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
            score, gpus = client.submit(judge, pure=False).result(timeout=30)
        assert score > 0.99 and len(gpus) == 1
        bad = next(a for a, n in names.items() if n == "bad")
        log = "\n".join(msg for _, msg in client.get_worker_logs(workers=[bad])[bad])
        assert "Worker plugin tangram failed to setup" in log
        assert "tangram.worker.gpu-memory-gb" in log and "--resources gpus = 2" in log


def test_a_worker_declaring_slots_and_gpus_is_a_gpu_node_and_the_log_says_its_slots_go_unused(caplog):
    """A worker is one kind of node: one that declares both (here by ``--resources``) joins as a GPU node, and the
    scheduler's log says its sandbox slots are not used, rather than code actions waiting in silence."""
    import logging

    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]})
    both = worker("both", {"nvml": False, "gpu-memory-gb": 0.01})
    both["options"]["resources"] = {"slots": 2, "gpus": 2}
    cluster.worker_spec["both"] = both
    with caplog.at_level(logging.WARNING, logger="tangram_dask.scheduler"):
        cluster.sync(cluster._correct_state)
        with cluster, Client(cluster) as client:
            client.wait_for_workers(1)
            deadline = time.monotonic() + 30
            while not plugin.nodes:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            (decl,) = plugin.nodes.values()
            assert (decl.slots, decl.gpus) == (2, 2)
            pools = {p.resource: p.capacity for p in plugin.policy.snapshot().pools}
            assert pools["gpu"] == 2 and pools["cpu"] == 0
    assert "declares 2 sandbox slots and 2 GPUs" in caplog.text and "its slots are not used" in caplog.text


def test_actions_no_worker_can_hold_are_named_in_the_log_once_they_have_waited(caplog):
    """No CPU worker has joined (the one connected declares no slots, as a LocalCluster made without
    ``resources``): the code action waits (one may be starting), and after ``warn_unplaceable_s`` the scheduler's
    log says which actions wait and why, that the connected worker declares no slots, and the LocalCluster fix,
    once; a CPU worker joining then runs it."""
    import logging

    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    plugin.warn_unplaceable_s, plugin._watch_every_s = 1.0, 0.2
    cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"plugins": [plugin]})
    with caplog.at_level(logging.WARNING, logger="tangram_dask.scheduler"), cluster, Client(cluster) as client:
        deadline = time.monotonic() + 30
        while not plugin.nodes:  # the worker without resources has joined (and declared nothing to place on)
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with tangram_dask.action(kind="code_exec", resource="cpu", units=1):
            fut = client.submit(sum, [1, 2], pure=False)
        deadline = time.monotonic() + 30
        while "waited over 1 s" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.1)
        time.sleep(1.0)  # five more checks: still one warning
        (line,) = [r.getMessage() for r in caplog.records if "waited over" in r.getMessage()]
        assert "1 action (code_exec) has waited over 1 s for a worker that can hold it" in line
        assert "no CPU worker (sandbox slots) has joined" in line
        assert "1 connected worker declares no sandbox slots" in line
        assert "--resources slots=N (a LocalCluster: resources={'slots': N}) and no GPUs joins as a CPU worker" in line
        cluster.worker_spec["cpu"] = {"cls": Nanny, "options": {"nthreads": 1, "resources": {"slots": 1},
                                                                "memory_limit": 0, "dashboard_address": None}}
        cluster.sync(cluster._correct_state)
        assert fut.result(timeout=60) == 3
