"""The static split of GPUs across reward models, against replica lists worked out by hand."""

from __future__ import annotations

import pytest
from conftest import make_cluster

from tangram_dask.cluster import ModelSpec, load_cluster
from tangram_dask.policy import initial_replicas, static_split
from tangram_dask.policy.types import ReplicaSpec
from tangram_dask.workload import load_workload

BENCH = "resources/bench"


def R(model: str, node: str, *gpus: int) -> ReplicaSpec:
    return ReplicaSpec(model, node, tuple(gpus))


def test_standard_cluster_split_by_hand():
    """standard.yaml on cluster-standard.yaml.

    demand: rm-small 0.6 x 1.5 = 0.9, rm-large 0.4 x 4.0 = 1.6; shares of 16 GPUs:
    small 5.76, large 10.24. Replica sizes: small 1 (16 GB fits 80), large
    max(units.min 2, ceil(140 / 80) = 2) = 2. First large (more demand), then
    small, then the model furthest below its share, each into the group with
    the fewest free GPUs that still fits it:
      large gpu-0 0,1 | small gpu-0 2 | large gpu-0 4,5 (g0 has 1 free) | large gpu-0 6,7
      | small gpu-0 3 | large gpu-1 0,1 | small gpu-1 2 | small gpu-1 3 | large gpu-1 4,5
      | small gpu-1 6 | small gpu-1 7: rm-large 10 GPUs in 2-GPU replicas, rm-small 6.
    """
    wl = load_workload(f"{BENCH}/standard.yaml")
    cl = load_cluster(f"{BENCH}/cluster-standard.yaml")
    reps = initial_replicas(cl, wl)
    assert reps == [
        R("rm-large", "gpu-0", 0, 1), R("rm-small", "gpu-0", 2), R("rm-large", "gpu-0", 4, 5),
        R("rm-large", "gpu-0", 6, 7), R("rm-small", "gpu-0", 3), R("rm-large", "gpu-1", 0, 1),
        R("rm-small", "gpu-1", 2), R("rm-small", "gpu-1", 3), R("rm-large", "gpu-1", 4, 5),
        R("rm-small", "gpu-1", 6), R("rm-small", "gpu-1", 7),
    ]
    per_model = {m: sum(len(r.gpus) for r in reps if r.model == m) for m in ("rm-large", "rm-small")}
    assert per_model == {"rm-large": 10, "rm-small": 6}


def _models(**gb: float) -> dict[str, ModelSpec]:
    return {m: ModelSpec(m, g, 10.0) for m, g in gb.items()}


CASES = [
    ("one-model-fills-every-gpu",
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 80}]), _models(a=16), [("a", 1.0, 1.0, 1)],
     [R("a", "gpu-0", 0), R("a", "gpu-0", 1), R("a", "gpu-0", 2), R("a", "gpu-0", 3)]),
    ("replica-grown-until-its-share-fits",  # 140 GB on 80 GB GPUs: 2 GPUs even though units.min is 1
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 80}]), _models(a=140), [("a", 1.0, 1.0, 1)],
     [R("a", "gpu-0", 0, 1), R("a", "gpu-0", 2, 3)]),
    ("size-is-largest-units-min-of-the-models-kinds",
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 80}]), _models(a=10), [("a", 1.0, 1.0, 1), ("a", 1.0, 1.0, 2)],
     [R("a", "gpu-0", 0, 1), R("a", "gpu-0", 2, 3)]),
    ("replica-never-spans-groups",  # 3 GPUs wanted, groups of 2: nothing fits
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]}]), _models(a=10), [("a", 1.0, 1.0, 3)],
     []),
    ("model-too-big-for-any-group",
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 24, "groups": [2, 2]}]), _models(a=70), [("a", 1.0, 1.0, 1)],
     []),
    ("smallest-group-that-fits-first",  # groups [3, 1]: a 1-GPU replica goes to the 1-GPU group first
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 80, "groups": [3, 1]}]), _models(a=10), [("a", 1.0, 1.0, 1)],
     [R("a", "gpu-0", 3), R("a", "gpu-0", 0), R("a", "gpu-0", 1), R("a", "gpu-0", 2)]),
    ("one-each-in-descending-demand-then-furthest-below-share",
     # demand a = 1 x 1 = 1, b = 3 x 1 = 3; 4 GPUs: shares a 1, b 3. b first, then a, then b, b.
     dict(gpu=[{"gpus": 4, "gpu_memory_gb": 80}]), _models(a=10, b=10), [("a", 1.0, 1.0, 1), ("b", 3.0, 1.0, 1)],
     [R("b", "gpu-0", 0), R("a", "gpu-0", 1), R("b", "gpu-0", 2), R("b", "gpu-0", 3)]),
    ("demand-is-weight-times-median",
     # a: 0.2 x 10 = 2 beats b: 0.8 x 1 = 0.8 although b is drawn more often; shares of 3: a 2.14, b 0.86
     dict(gpu=[{"gpus": 3, "gpu_memory_gb": 80}]), _models(a=10, b=10), [("a", 0.2, 10.0, 1), ("b", 0.8, 1.0, 1)],
     [R("a", "gpu-0", 0), R("b", "gpu-0", 1), R("a", "gpu-0", 2)]),
    ("every-model-gets-one-even-below-its-share",
     # b's share of 2 GPUs is 0.02, but every model first gets one replica
     dict(gpu=[{"gpus": 2, "gpu_memory_gb": 80}]), _models(a=10, b=10), [("a", 99.0, 1.0, 1), ("b", 1.0, 1.0, 1)],
     [R("a", "gpu-0", 0), R("b", "gpu-0", 1)]),
    ("replica-size-grown-per-node",
     # 60 GB needs 3 GPUs of 24 GB (more than the small node has) but only 1 of 80 GB
     dict(gpu=[{"gpus": 2, "gpu_memory_gb": 24}, {"gpus": 2, "gpu_memory_gb": 80}]), _models(a=60),
     [("a", 1.0, 1.0, 1)],
     [R("a", "gpu-1", 0), R("a", "gpu-1", 1)]),
    ("mixed-nodes-each-get-their-own-size",
     # 40 GB: 2 GPUs on the 24 GB node, 1 on the 80 GB node
     dict(gpu=[{"gpus": 2, "gpu_memory_gb": 24}, {"gpus": 1, "gpu_memory_gb": 80}]), _models(a=40),
     [("a", 1.0, 1.0, 1)],
     [R("a", "gpu-1", 0), R("a", "gpu-0", 0, 1)]),
    ("zero-demand-shares-equally",  # every median 0 (constant 0 s durations): equal shares of 3 GPUs
     dict(gpu=[{"gpus": 3, "gpu_memory_gb": 80}]), _models(a=10, b=10), [("a", 1.0, 0.0, 1), ("b", 1.0, 0.0, 1)],
     [R("a", "gpu-0", 0), R("b", "gpu-0", 1), R("a", "gpu-0", 2)]),
    ("no-gpu-kinds", dict(gpu=[{"gpus": 2, "gpu_memory_gb": 80}]), _models(a=10), [], []),
    ("no-gpu-nodes", dict(cpu=[{"slots": 2}]), _models(a=10), [("a", 1.0, 1.0, 1)], []),
]


@pytest.mark.parametrize("cluster, models, kinds, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_static_split_cases(cluster, models, kinds, expected):
    assert static_split(make_cluster(**cluster), models, kinds) == expected


def test_split_across_nodes_uses_both():
    cl = make_cluster(gpu=[{"count": 2, "gpus": 2, "gpu_memory_gb": 80}])
    reps = static_split(cl, _models(a=100), [("a", 1.0, 1.0, 1)])
    assert reps == [R("a", "gpu-0", 0, 1), R("a", "gpu-1", 0, 1)]
