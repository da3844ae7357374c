"""Per-kind growth on the local path: a SpecCluster whose new workers are of the kind that is short.

Real: worker processes, the tangram scheduler plugin, Dask's Adaptive (the tangram subclass).
The GPU worker has no GPU: it declares one GPU of 24 GB through the ``tangram.worker`` config
(``nvml: false``), the project's own path for GPUs NVML cannot see; the GPU actions only sleep.
"""

from __future__ import annotations

import time

import dask
from distributed import Client

import tangram_dask
from tangram_dask.adaptive import WorkerKind, adaptive_class, kinds_cluster
from tangram_dask.cluster import ModelSpec

CPU = WorkerKind("cpu", slots=1)
GPU = WorkerKind("gpu", gpus=1, gpu_memory_gb=24)


def score(x: int) -> int:
    time.sleep(0.3)
    return x


def test_gpu_demand_grows_a_gpu_worker_and_never_a_cpu_one():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0, models={"rm": ModelSpec("rm", 16, 0.1)})
    kinds = [{"name": k.name, "slots": k.slots, "gpus": k.gpus, "gpu-memory-gb": k.gpu_memory_gb} for k in (CPU, GPU)]
    with dask.config.set({"tangram.adaptive.kinds": kinds}):
        cluster = kinds_cluster([CPU, GPU], n_workers={"cpu": 1}, scheduler_kwargs={"plugins": [plugin]})
        with cluster, Client(cluster) as client:
            cluster.adapt(Adaptive=adaptive_class(), minimum=1, maximum=3, interval="300ms", wait_count=2)
            with tangram_dask.action(kind="score", resource="gpu", units=1, hint_s=0.3, model="rm"):
                futs = [client.submit(score, i, pure=False) for i in range(4)]
            seen: list[dict[str, int]] = []
            deadline = time.monotonic() + 60
            done = False
            while time.monotonic() < deadline:
                seen.append(dict(cluster.counts()))
                if not done and all(f.done() for f in futs):
                    done = True
                if done and sum(cluster.counts().values()) == 1:
                    break
                time.sleep(0.2)
            assert [f.result(timeout=30) for f in futs] == [0, 1, 2, 3]
            assert any(c.get("gpu", 0) >= 1 for c in seen), seen  # a GPU worker came for the GPU demand
            assert max(c.get("cpu", 0) for c in seen) == 1, seen  # and no CPU worker did
            assert sum(cluster.counts().values()) == 1, seen  # back to the minimum when the demand drained


def test_a_cluster_scaled_up_and_down_for_many_steps_keeps_the_kinds_of_its_current_workers_only():
    """Each scale-up names a new worker and notes its kind; one scaled down leaves worker_spec, and its note goes
    at the next scale-up. Before, every worker ever made kept its note for as long as the cluster ran (one more
    per scale-up: 100 after 50 steps of one up and one down each). The specs alone: no worker starts."""
    cluster = kinds_cluster([CPU, GPU], scheduler_kwargs={"dashboard_address": ":0"})
    with cluster:
        for step in range(50):  # each step, a GPU-bound phase then a CPU-bound one: a worker up, then down
            for _ in range(2):
                cluster.worker_spec.update(cluster.new_worker_spec())
            for name in list(cluster.worker_spec)[:2]:
                del cluster.worker_spec[name]
        assert len(cluster.worker_spec) == 0
        spec = cluster.new_worker_spec()
        assert set(cluster._kind_of) == set(spec)  # only the worker just named
        cluster.worker_spec.update(spec)
        assert sum(cluster.counts().values()) == 1
