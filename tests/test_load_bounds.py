"""benchmarks/load_bounds.py's worlds are what they say (the GPU-bound file, the default options)."""

from __future__ import annotations

import time

import pytest
import yaml

from benchmarks import load_bounds as LB
from tangram_dask.bench import simulate
from tangram_dask.cluster import parse_cluster
from tangram_dask.policy import ledger, make_policy
from tangram_dask.policy.types import Load, Start
from tangram_dask.sim import Simulator
from tangram_dask.workload import generate, parse_workload

W = "resources/variants/gpu-bound.yaml"
C = "resources/variants/cluster-gpu-mixed.yaml"


def _dicts():
    with open(W) as f, open(C) as g:
        return yaml.safe_load(f), yaml.safe_load(g)


def _run(sim_cls=Simulator, **kw):
    """tangram on the GPU-bound file: its decisions with their times, and when each replica was reported loaded."""
    wd, cd = _dicts()
    gen = generate(parse_workload(wd, wd["name"]))
    cl = parse_cluster(cd, cd["name"])
    pol = make_policy("tangram", cl, gen.spec)
    decisions, ready = [], {}
    schedule, loaded = pol.schedule, pol.loaded

    def record(now):
        out = schedule(now)
        decisions.extend((now, d) for d in out)
        return out

    def on_loaded(rid, now):
        ready[rid] = now
        return loaded(rid, now)
    pol.schedule, pol.loaded = record, on_loaded
    sim_cls(gen, cl, pol, timer=time.perf_counter, **kw).run()
    return decisions, ready, pol


def test_the_contract_world_is_the_bench_run():
    wd, cd = _dicts()
    r = simulate(generate(parse_workload(wd, wd["name"])), parse_cluster(cd, cd["name"]), "tangram")
    assert LB.act_ratio(wd, cd, "contract", 60.0) == pytest.approx(r["act_mean_s"] / r["ideal_act_mean_s"])


def test_fast_loads_take_one_second_only_before_the_open():
    """``fast-open``: a background load begun before ``until`` is ready ``FAST_S`` later; one begun after it
    takes its model's ``load_s``, as in WORKLOAD.md."""
    wd, _ = _dicts()
    decisions, ready, _ = _run(LB._FastLoads, until=12.0)
    loads = [(t, d) for t, d in decisions if isinstance(d, Load)]
    early = [(t, d) for t, d in loads if t < 12.0]
    late = [(t, d) for t, d in loads if t >= 12.0]
    assert early and late  # the file's warm-up loads straddle 12 s
    for t, d in early:
        assert ready[d.replica] == pytest.approx(t + LB.FAST_S)
    for t, d in late:
        assert ready[d.replica] == pytest.approx(t + wd["models"][d.model]["load_s"])


def _beside_loads(decisions, ready):
    """GPU starts made on a GPU while a background load held it."""
    loading = [(t, ready[d.replica], d.node, set(d.gpus)) for t, d in decisions if isinstance(d, Load)]
    return [d for t, d in decisions if isinstance(d, Start) and d.replica is not None
            and any(n == d.node and t0 < t < t1 and g & set(d.gpus) for t0, t1, n, g in loading)]


def test_no_block_lets_a_replica_serve_beside_a_load_and_is_undone():
    """``no-block``: some action starts on a GPU while another model's replica loads there, which WORKLOAD.md's
    world never does; and the ledger's own methods are back afterwards."""
    saved = ledger.GpuPool.begin_load, ledger.GpuPool.loaded
    with LB._no_block():
        decisions, ready, _ = _run()
    assert (ledger.GpuPool.begin_load, ledger.GpuPool.loaded) == saved
    assert _beside_loads(decisions, ready)
    decisions, ready, _ = _run()
    assert any(isinstance(d, Load) for _, d in decisions) and not _beside_loads(decisions, ready)
