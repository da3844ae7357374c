"""The client calls with an asynchronous client (``Client(asynchronous=True)``), against a real cluster.

``begin_trajectory``, ``end_trajectory``, ``register_model`` and ``models_snapshot`` return
awaitables there, as distributed's own client methods do; with a synchronous client they block
(tests/test_scheduler_admission.py, tests/test_sandbox_moves.py, tests/test_residency_cluster.py).

One module-scoped LocalCluster with worker processes: the tangram scheduler plugin, a CPU
worker with the sandbox plugin (stateful trajectory dirs to remove) and an abstract GPU worker
(``nvml: false``) that loads a registered numpy model from disk. Each test runs its own event loop
and its own asynchronous client.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from distributed import Client, LocalCluster, Nanny

import tangram_dask
from tangram_dask import ModelError, PluginMissingError
from tangram_dask.models.builtin import NumpyLoader
from tangram_dask.sandbox import SandboxPlugin

DIM = 8


def _cpu_worker() -> dict:
    return {"cls": Nanny, "options": {"name": "cpu-0", "nthreads": 1, "resources": {"slots": 1},
                                      "memory_limit": 0, "dashboard_address": None,
                                      "plugins": (SandboxPlugin(size=1),)}}


def _gpu_worker() -> dict:
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": 1, "gpu-memory-gb": 1}}}
    return {"cls": Nanny, "options": {"name": "gpu-0", "nthreads": 1, "resources": {"gpus": 1}, "config": cfg,
                                      "memory_limit": 0, "dashboard_address": None}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights") / "rm-async.npz"
    rng = np.random.default_rng(0)
    np.savez(weights, embed=rng.standard_normal((64, DIM)).astype(np.float32), bias=np.zeros(DIM, np.float32))
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"plugins": [plugin]})
    cluster.worker_spec.update({"cpu-0": _cpu_worker(), "gpu-0": _gpu_worker()})
    cluster.sync(cluster._correct_state)
    deadline = time.monotonic() + 60
    while len(plugin.nodes) < 2:
        assert time.monotonic() < deadline, f"only {plugin.nodes} declared"
        time.sleep(0.05)
    with cluster:
        yield cluster, str(weights)


def run(coro_fn, *args):
    return asyncio.run(asyncio.wait_for(coro_fn(*args), 120))


def write_state(text: str) -> str:
    r = tangram_dask.run_code(f"open('state.txt', 'a').write({text!r}); print(open('state.txt').read())",
                              timeout=10)
    return r.stdout


def judge(model: str) -> float:
    return tangram_dask.reward_model(model).score([("a b c", "a b c")])[0]


def test_trajectory_calls_are_awaitable_on_an_async_client(cluster):
    address = cluster[0].scheduler_address

    async def main():
        async with Client(address, asynchronous=True) as client:
            began = tangram_dask.begin_trajectory(client, "t-async")
            assert asyncio.iscoroutine(began) or asyncio.isfuture(began)
            assert await began == {"status": "OK"}
            with tangram_dask.action(kind="edit", resource="cpu", trajectory="t-async", affinity="trajectory",
                                     hint_s=0.1):
                first = client.submit(write_state, "a", pure=False)
            assert await first == "a\n"
            with tangram_dask.action(kind="edit", resource="cpu", trajectory="t-async", affinity="trajectory",
                                     hint_s=0.1):
                second = client.submit(write_state, "b", pure=False)
            assert await second == "ab\n"  # the trajectory's dir kept its file between actions
            cpu = [w for w, info in (await client.scheduler.identity())["workers"].items() if info["name"] == "cpu-0"]
            assert await tangram_dask.end_trajectory(client, "t-async") == cpu  # the worker that had its dir
            assert await tangram_dask.end_trajectory(client, "t-async") == []   # twice is safe
    run(main)


def test_register_model_is_awaitable_and_the_model_serves(cluster):
    address = cluster[0].scheduler_address
    weights = cluster[1]

    async def main():
        async with Client(address, asynchronous=True) as client:
            with pytest.raises(ModelError, match="memory_gb"):  # a bad argument raises at the call, unawaited
                tangram_dask.register_model(client, "rm-async", NumpyLoader(weights), memory_gb=-1)
            rm = await tangram_dask.register_model(client, "rm-async", NumpyLoader(weights), memory_gb=0.001,
                                                   load_s=0.1)
            assert (rm.name, rm.units) == ("rm-async", (1, 1))
            assert "rm-async" in (await tangram_dask.models_snapshot(client))["models"]
            with rm.action(hint_s=0.05):
                fut = client.submit(judge, "rm-async", pure=False)
            score = await fut
            assert score == pytest.approx(1.0, abs=1e-4)  # the same text scores as identical
    run(main)


def test_the_async_calls_raise_where_the_scheduler_has_no_plugin():
    async def main():
        async with LocalCluster(n_workers=0, processes=False, dashboard_address=":0", asynchronous=True) as plain, \
                Client(plain, asynchronous=True) as client:
            with pytest.raises(PluginMissingError):
                await tangram_dask.begin_trajectory(client, "t")
            with pytest.raises(PluginMissingError):
                await tangram_dask.end_trajectory(client, "t")
            with pytest.raises(ModelError, match="does not run the tangram scheduler plugin"):
                await tangram_dask.register_model(client, "rm", NumpyLoader("/nonexistent.npz"), memory_gb=0.001)
    run(main)
