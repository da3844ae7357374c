"""benchmarks/act_bound.py's floor holds: no policy's simulated action completes faster than its floor."""

from __future__ import annotations

import time

import numpy as np
import pytest

from benchmarks.act_bound import floors
from tangram_dask.cluster import load_cluster
from tangram_dask.policy import make_policy
from tangram_dask.sim import Simulator
from tangram_dask.workload import generate, load_workload

FILES = [("resources/bench/small.yaml", "resources/bench/cluster-laptop.yaml"),
         ("resources/bench/standard.yaml", "resources/bench/cluster-tight.yaml"),
         ("resources/variants/gpu-bound.yaml", "resources/variants/cluster-gpu-mixed.yaml")]


@pytest.mark.parametrize("workload, cluster", FILES, ids=[w.split("/")[-1] for w, _ in FILES])
def test_no_action_completes_under_its_floor(workload, cluster):
    wl = load_workload(workload)
    gen = generate(wl)
    cl = load_cluster(cluster)
    floor, ideal = floors(gen, cl)
    assert floor.shape == ideal.shape == (gen.n_actions,)
    gpu = np.array([wl.kinds[k].resource == "gpu" for k in gen.kind])
    specs = [k.spec(None, "t") for k in wl.kinds]
    want = np.array([d * specs[k].scale(specs[k].units_max) + (cl.warm_start_s if specs[k].resource == "cpu" else 0.0)
                     for k, d in zip(gen.kind.tolist(), gen.duration.tolist())])
    for policy in ("tangram", "fifo", "static"):
        res = Simulator(gen, cl, make_policy(policy, cl, wl), timer=time.perf_counter).run()
        assert np.allclose(res.ideal, want)  # WORKLOAD.md's ideal: alone on units.max, warm sandbox for CPU
        act = res.end - res.issue
        assert (act >= floor - 1e-9).all(), (policy, int(np.argmin(act - floor)))
    # the floor is above the ideal where replicas are smaller than units.max, and never below it elsewhere
    # but by the warm start (a sandbox bound to its trajectory pays none after its first)
    assert (floor[gpu] >= ideal[gpu] - 1e-9).all()
    assert (floor[~gpu] >= ideal[~gpu] - cl.warm_start_s - 1e-9).all()
    if workload.endswith("gpu-bound.yaml"):
        # its reward models' contract replicas are narrower than their units.max: the floor is well above the ideal
        assert floor.mean() > 1.2 * ideal.mean()


def test_bench_reports_the_floor_beside_the_ideal():
    """Every bench run carries the floor's mean (``floor_act_mean_s``, overall and per kind) and the table
    shows it ("floor ACT"). On the GPU-bound file the reward models' contract replicas are narrower than
    their units.max, so the floor is above the ideal, and the process reward model's with it."""
    from tangram_dask.bench import run
    from tangram_dask.cli import format_table

    wl = load_workload("resources/variants/gpu-bound.yaml")
    cl = load_cluster("resources/variants/cluster-gpu-mixed.yaml")
    results = run(wl, cl, ("static",))
    r = results[0]
    floor, ideal = floors(generate(wl), cl)
    assert r["floor_act_mean_s"] == pytest.approx(floor.mean())
    assert r["ideal_act_mean_s"] == pytest.approx(ideal.mean())
    prm = r["by_kind"]["prm_score"]
    assert prm["floor_act_mean_s"] > prm["ideal_act_mean_s"] and r["floor_act_mean_s"] > r["ideal_act_mean_s"]
    assert r["act_mean_s"] >= r["floor_act_mean_s"]
    head = format_table(results).splitlines()[1]
    assert "floor ACT" in head and head.index("ideal ACT") < head.index("floor ACT") < head.index("step")
