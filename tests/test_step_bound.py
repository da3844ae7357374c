"""benchmarks/step_bound.py's lower bound holds: no policy's simulated step is ever below it."""

from __future__ import annotations

import pytest

from benchmarks.step_bound import bound, critical_path, per_action
from tangram_dask.bench import simulate
from tangram_dask.cluster import load_cluster
from tangram_dask.errors import FileFormatError
from tangram_dask.workload import generate, load_workload

FILES = [("resources/bench/small.yaml", "resources/bench/cluster-laptop.yaml"),
         ("resources/bench/standard.yaml", "resources/bench/cluster-tight.yaml"),
         ("resources/variants/gpu-bound.yaml", "resources/variants/cluster-gpu-mixed.yaml")]


@pytest.mark.parametrize("workload, cluster", FILES, ids=[w.split("/")[-1] for w, _ in FILES])
def test_no_policys_step_is_below_the_bound(workload, cluster):
    gen = generate(load_workload(workload))
    cl = load_cluster(cluster)
    res, work, rel, tail = per_action(gen, cl)
    critical = critical_path(gen, cl, rel)
    assert critical == pytest.approx(simulate(gen, cl, "fifo")["ideal_step_s"])  # the simulator's ideal step
    worked = False
    for f in (0.2, 0.3, 0.5, 1.0):
        c = cl.scaled(f)
        b, why = bound(res, work, rel, tail, c.capacity(), critical)
        worked |= why != "critical path"
        for policy in ("tangram", "fifo", "static"):
            try:
                step = simulate(gen, c, policy)["step_s"]
            except FileFormatError:  # an action no node of the scaled cluster can hold
                continue
            assert b <= step + 1e-6, (f, policy, b, why, step)
    assert worked  # on a small enough fraction, the work term, not the critical path, sets the bound
