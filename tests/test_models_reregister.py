"""A model registered again with a new loader while replicas of the old one are resident, through the real
SchedulerResidency, the plugin's replica hooks, a real policy and real worker Residency ledgers
(tests/residency_harness.py; no Dask). Found by a helper's review (session 35)."""
from __future__ import annotations

import pytest

from residency_harness import Harness, OkLoader, gpu_spec, run_action
from tangram_dask.policy.types import Start


def _free(h, worker):
    """(the policy's ledger's free GB per GPU, the worker's free GB per GPU)"""
    pol, w = h.plugin.policy, h.workers[worker]
    return ([g.mem_free for g in pol.gpu.nodes[worker].gpus],
            [(c - u) / 1e9 for c, u in zip(w.capacity, w.used)])


def test_the_new_loaders_first_measurement_does_not_shrink_the_old_loaders_resident_replicas():
    """rm's old loader has a replica resident at 60 GB; rm is registered again with a loader of a 1 GB model. The
    new loader's first load (a second replica, the old one serving) measures 1 GB. Before, the policy then counted
    every replica of rm at 1 GB, the old one included: its GPU looked 59 GB freer than the worker held it, a model
    placed there was refused by the worker for room, and each of its actions erred, blaming its own memory_gb
    (live: tmp/p9_rereg.py of the review). docs/models.md: while replicas of the old one are resident the policy
    counts the model at least as big as they were measured."""
    h = Harness()
    loaders = {"rm": OkLoader(int(60e9)), "other": OkLoader(int(50e9))}
    h.register("rm", loaders["rm"], memory_gb=60.0, load_s=0.1)
    h.add_gpu_worker("w", gpus=2, gb=100.0, loaders=loaders)
    assert run_action(h, "warm", gpu_spec("rm"), h.plugin.now())[0] == "ok"
    pol = h.plugin.policy
    (old,) = list(pol.gpu.by_model["rm"])
    g_old = pol.gpu.replicas[old].gpus[0]

    loaders["rm"] = OkLoader(int(1e9))  # the worker gets the new loader
    h.register("rm", loaders["rm"], memory_gb=1.0, load_s=0.1)
    now = h.plugin.now()
    pol.submit("long", gpu_spec("rm", hint_s=1000.0), now)  # the old replica serves a long action
    started = [d for d in h.schedule(now) if isinstance(d, Start)]
    assert started and started[0].replica == old
    h.workers["w"].prepare("long", int(old), "rm", started[0].gpus)
    assert run_action(h, "new", gpu_spec("rm"), h.plugin.now())[0] == "ok"  # a second replica: the new loader's
    h.drain()
    assert h.res.measured["rm"].memory_gb == pytest.approx(1.0)  # what the new loader's load measured
    ledger, worker = _free(h, "w")
    print("old replica on GPU", g_old, "ledger free", ledger, "worker free", worker)
    assert ledger[g_old] == pytest.approx(worker[g_old])  # 40 GB: the old replica still counts 60 GB

    h.workers["w"].unpin("long")
    pol.finish("long", h.plugin.now(), None)
    h.register("other", loaders["other"], memory_gb=50.0, load_s=0.1)
    out = run_action(h, "other", gpu_spec("other"), h.plugin.now())
    print("a 50 GB model beside them:", out)
    assert out[0] == "ok"  # before: erred ("... not loaded (the scheduler's memory figures for other are below ...")

    # the 50 GB model's load evicted the old replica (idle, 60 GB): rm is counted at what its new loader measured
    h.drain()
    print("rm's replicas now:", {rid: r.share_gb for rid, r in pol.gpu.replicas.items() if r.model == "rm"})
    assert old not in pol.gpu.replicas and not h.res._old_loader
    assert pol.models["rm"].gpu_memory_gb == pytest.approx(1.0)
    assert all(r.share_gb == pytest.approx(1.0) for r in pol.gpu.replicas.values() if r.model == "rm")


def test_the_old_loaders_size_leaves_the_policy_with_the_worker_that_held_its_replica():
    """rm's old loader (60 GB) has a replica resident on a 100 GB worker; rm is registered again at 1 GB; that worker
    leaves, and the one left has a 24 GB GPU. The policy counts rm at 1 GB as the worker leaves, and its next action
    runs there. Before, the 60 GB floor stayed until the next residency report from any worker: none came (no GPU
    held 60 GB, so nothing loaded), and the action waited for ever."""
    h = Harness()
    loaders = {"rm": OkLoader(int(60e9))}
    h.register("rm", loaders["rm"], memory_gb=60.0, load_s=0.1)
    h.add_gpu_worker("big", gpus=1, gb=100.0, loaders=loaders)
    assert run_action(h, "warm", gpu_spec("rm"), h.plugin.now())[0] == "ok"
    loaders["rm"] = OkLoader(int(1e9))
    h.register("rm", loaders["rm"], memory_gb=1.0, load_s=0.1)
    pol = h.plugin.policy
    assert pol.models["rm"].gpu_memory_gb == pytest.approx(60.0)  # its old replica is resident
    del h.sched.workers["big"]  # it leaves (Dask drops it, then calls the plugins' remove_worker)
    pol.remove_node("big")
    h.plugin.remove_worker(h.sched, "big")
    assert pol.models["rm"].gpu_memory_gb == pytest.approx(1.0) and not h.res._old_loader
    h.add_gpu_worker("small", gpus=1, gb=24.0, loaders=loaders)
    assert run_action(h, "next", gpu_spec("rm"), h.plugin.now())[0] == "ok"
