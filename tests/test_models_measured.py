"""Models declared smaller than they are, on a real LocalCluster: the load that did not fit teaches their size.

One module-scoped cluster: the tangram scheduler plugin and one GPU worker
with one abstract GPU of 0.1 GB (``tangram.worker.nvml: false``: this
machine has no GPU; memory is accounted from parameter bytes). The models are
the built-in numpy reward model (``rm_small``) loaded from real weights files
of 60 MB and 150 MB written here, each registered as 1 MB.

Before, the policy's ledger kept the declared shares: it placed a second
60 MB model beside the first on the 0.1 GB GPU, the worker refused the load
(it never over-commits), the replica stayed in the ledger as if resident, and
every later action of that model erred.
"""

from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, Nanny

import tangram_dask
from tangram_dask.errors import PlacementError
from tangram_dask.models import models_snapshot, register_model, rm_small
from tangram_dask.scheduler import TangramSchedulerPlugin

from test_models import start, wait_until

GPU_GB = 0.1


def weights(tmp, name: str, mb: int) -> str:
    """A weights file of the built-in model's layout holding ``mb`` MB of parameters (rows x 32 float32)."""
    path = tmp / f"{name}.npz"
    rows = mb * 1_000_000 // 128
    rng = np.random.default_rng(mb)
    np.savez(path, embed=rng.standard_normal((rows, 32)).astype(np.float32), bias=np.zeros(32, np.float32))
    return str(path)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weights")
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": 1, "gpu-memory-gb": GPU_GB}}}
    worker = {"cls": Nanny, "options": {"name": "gpu-0", "nthreads": 1, "resources": {"gpus": 1}, "config": cfg,
                                        "memory_limit": 0, "dashboard_address": None}}
    with start(plugin, {"gpu-0": worker}) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_until(lambda: len(plugin.nodes) == 1, what="the GPU worker's declaration")
        for name, mb in (("rm-a", 60), ("rm-b", 60), ("rm-huge", 150)):
            register_model(client, name, rm_small(weights(tmp, name, mb)), memory_gb=0.001, load_s=0.1)
        yield client, plugin


def judge(model: str) -> float:
    return tangram_dask.reward_model(model).score([("the same words", "the same words")])[0]


def score(client, model: str):
    with tangram_dask.action(kind=f"judge:{model}", resource="gpu", model=model, hint_s=0.05):
        return client.submit(judge, model, pure=False)


def test_two_models_declared_too_small_take_turns_on_a_gpu_that_holds_one(env):
    client, plugin = env
    results = [score(client, m).result(timeout=60) for m in ("rm-a", "rm-b", "rm-a", "rm-b", "rm-a", "rm-b")]
    assert results == pytest.approx([1.0] * 6, abs=1e-5)  # every action scored: none erred for the ledger's error
    snap = models_snapshot(client)
    assert snap["counts"].get("failures", 0) >= 1  # the second model's first load did not fit beside the first
    for m in ("rm-a", "rm-b"):  # the policy plans with the measured 60 MB, not the declared 1 MB
        assert plugin.policy.models[m].gpu_memory_gb == pytest.approx(0.06, rel=1e-3)
        assert snap["measured"][m]["memory_gb"] == pytest.approx(0.06, rel=1e-3)
    reps = list(plugin.policy.gpu.replicas.values())
    assert len(reps) == 1 and reps[0].share_gb == pytest.approx(0.06, rel=1e-3)  # what the worker holds, no more
    gpu = plugin.policy.gpu.nodes[reps[0].node].gpus[0]
    assert gpu.mem_free == pytest.approx(GPU_GB - 0.06, rel=1e-3)


def test_a_model_declared_small_that_fits_no_gpu_errs_its_own_actions_clearly_and_only_them(env):
    client, plugin = env
    huge = score(client, "rm-huge")
    fine = score(client, "rm-a")
    with pytest.raises(PlacementError, match=r"needs a replica of rm-huge \(0\.15\d* GB\).*1 x 0\.1 GB"):
        huge.result(timeout=60)
    assert fine.result(timeout=60) == pytest.approx(1.0, abs=1e-5)
    assert plugin.policy.models["rm-huge"].gpu_memory_gb == pytest.approx(0.15, rel=1e-3)
    assert all(r.model != "rm-huge" for r in plugin.policy.gpu.replicas.values())  # nothing left of its load
    later = score(client, "rm-huge")  # known now: refused at once, with the same error
    with pytest.raises(PlacementError, match="needs a replica of rm-huge"):
        later.result(timeout=30)
