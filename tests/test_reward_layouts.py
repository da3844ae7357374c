"""benchmarks/reward_layouts.py: the layouts it tries are every maximal split of the contract's replicas, and a run
from the contract's split is the bench's own tangram run."""

from __future__ import annotations

import sys

import pytest

from benchmarks.reward_layouts import counts_of, gpu_models, layouts, main, place, run
from tangram_dask.bench import simulate
from tangram_dask.cluster import load_cluster
from tangram_dask.policy import initial_replicas
from tangram_dask.workload import generate, load_workload

STANDARD = ("resources/bench/standard.yaml", "resources/bench/cluster-standard.yaml")
GPU_BOUND = ("resources/variants/gpu-bound.yaml", "resources/variants/cluster-gpu-mixed.yaml")


def _load(files):
    return generate(load_workload(files[0])), load_cluster(files[1])


def test_the_standard_cluster_splits_its_16_gpus_seven_ways():
    gen, cl = _load(STANDARD)
    got = sorted((c["rm-large"], c["rm-small"]) for c in layouts(cl, gen))
    # 2-GPU replicas of the 140 GB judge and 1-GPU ones of the 16 GB judge fill 16 GPUs exactly
    assert got == [(n, 16 - 2 * n) for n in range(1, 8)]
    assert counts_of(initial_replicas(cl, gen.spec)) == {"rm-large": 5, "rm-small": 6}  # the contract's is one


@pytest.mark.parametrize("files", [STANDARD, GPU_BOUND], ids=["standard", "gpu-bound"])
def test_each_layout_fits_and_leaves_no_room_for_one_more(files):
    gen, cl = _load(files)
    found = layouts(cl, gen)
    assert found
    groups = {n.name: [set(g) for g in n.group_gpus()] for n in cl.gpu_nodes}
    for c in found:
        reps = place(cl, gen, c)
        assert counts_of(reps) == c
        used = [(r.node, g) for r in reps for g in r.gpus]
        assert len(used) == len(set(used))  # no GPU holds two replicas
        for r in reps:
            assert any(set(r.gpus) <= g for g in groups[r.node])  # each within one topology group
        for m in gpu_models(gen):
            assert place(cl, gen, {**c, m: c[m] + 1}) is None


@pytest.mark.parametrize("cluster", ["cluster-standard", "cluster-tight"])
def test_on_the_standard_files_where_a_split_goes_does_not_change_the_run(cluster):
    """place's arrangement of the contract's counts is not the static split's (it places larger models first), but
    where nodes are alike, no replicas share a GPU and nothing loads, the runs are the same to the bit."""
    gen, cl = _load(("resources/bench/standard.yaml", f"resources/bench/{cluster}.yaml"))
    deployed = initial_replicas(cl, gen.spec)
    mine = place(cl, gen, counts_of(deployed))
    assert set(mine) != set(deployed)
    assert run(gen, cl, mine) == run(gen, cl, deployed)


@pytest.mark.parametrize("files", [STANDARD, GPU_BOUND], ids=["standard", "gpu-bound"])
def test_the_contracts_row_is_the_benchs_own_run(files, capsys, monkeypatch):
    gen, cl = _load(files)
    bench = simulate(gen, cl, "tangram")
    static = simulate(gen, cl, "static")
    mine = run(gen, cl, initial_replicas(cl, gen.spec))
    assert mine["act"] == pytest.approx(bench["act_mean_s"])
    assert mine["step"] == pytest.approx(bench["step_s"])
    for kind in gpu_kinds(gen):
        assert mine[kind] == pytest.approx(bench["by_kind"][kind]["act_mean_s"])
        assert run(gen, cl, None)[kind] == pytest.approx(static["by_kind"][kind]["act_mean_s"])
    # and the script prints that run on the contract's row (marked *), not another arrangement of its counts
    monkeypatch.setattr(sys, "argv", ["reward_layouts.py", *files])
    main()
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if "*" in line and "tangram" in line]
    assert len(rows) == 1
    n = len(gpu_kinds(gen))  # layout, policy, one column per GPU kind, then ACT and step
    assert float(rows[0][2 + n]) == pytest.approx(bench["act_mean_s"], abs=5e-4)
    assert float(rows[0][3 + n]) == pytest.approx(bench["step_s"], abs=0.05)


def gpu_kinds(gen):
    return [k.kind for k in gen.spec.kinds if k.resource == "gpu"]
