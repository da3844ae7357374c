"""The per-kind target computation, retirement choice and state moves: pure functions, tables of named cases."""

from __future__ import annotations

import pytest

from tangram_dask.adaptive import (KindTarget, Targets, WorkerKind, choose_to_close, classify, compute_targets,
                                   kinds_from_shapes, next_kind, plan_moves)
from tangram_dask.cluster import ModelSpec
from tangram_dask.policy.types import NodeStats, PoolStats, Shortfall

CPU4 = WorkerKind("cpu", slots=4)
CPU16 = WorkerKind("cpu-big", slots=16)
GPU1 = WorkerKind("gpu-1x24", gpus=1, gpu_memory_gb=24)
GPU4 = WorkerKind("gpu-4x80", gpus=4, gpu_memory_gb=80)
KINDS = (CPU4, GPU1, GPU4)
MODELS = {"rm-small": ModelSpec("rm-small", 16, 5.0), "rm-70b": ModelSpec("rm-70b", 140, 30.0)}
T = 5.0


def pools(cpu=(0, 0, 0, 0.0), api=(0, 0), **models):
    """cpu=(queued, running, queued_units, queued_work_s); api=(queued, running);
    model=(queued, running, units, work)."""
    out = [PoolStats("cpu", 0, 0, cpu[0], cpu[1], pool="cpu", queued_units=cpu[2], queued_work_s=cpu[3]),
           PoolStats("gpu", 0, 0, sum(m[0] for m in models.values()), 0, pool="gpu"),
           PoolStats("api", 8, 8, api[0], api[1], pool="api")]
    for name, (q, r, u, w) in models.items():
        out.append(PoolStats("gpu", 0, 0, q, r, pool=name.replace("_", "-"), queued_units=u, queued_work_s=w))
    return tuple(out)


def cpu_node(name, slots=4, free=4, running=0, homes=0):
    return NodeStats(name, "cpu", slots, free, running, homes)


def gpu_node(name, gpus=1, free=1, running=0, replicas=0, needed=0):
    return NodeStats(name, "gpu", gpus, free, running, 0, replicas, needed)


def never(resource, requested, pool="", kind="k"):
    return Shortfall(resource, requested, 0, f"{kind} cannot fit", pool, 0, True, kind)


# name, pools, unplaceable, nodes, workers (addr -> kind), expected {kind: target}, expected unservable count
CASES = [
    ("idle cluster shrinks to nothing",
     pools(), (), (cpu_node("c1"), cpu_node("c2")), {"c1": "cpu", "c2": "cpu"},
     {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 0}, 0),
    ("cpu queue sized by work within the target duration",
     # 40 actions of 1 slot, 1 s each: 40 unit-s / 5 s = 8 slots -> 2 workers of 4
     pools(cpu=(40, 0, 40, 40.0)), (), (cpu_node("c1", free=0, running=4),), {"c1": "cpu"},
     {"cpu": 3, "gpu-1x24": 0, "gpu-4x80": 0}, 0),  # 4 busy + 8 = 12 slots
    ("a few long cpu actions ask no more than their units",
     pools(cpu=(2, 0, 2, 200.0)), (), (), {},
     {"cpu": 1, "gpu-1x24": 0, "gpu-4x80": 0}, 0),
    ("busy slots are kept even with no queue",
     pools(cpu=(0, 6, 0, 0.0)), (), (cpu_node("c1", free=0, running=4), cpu_node("c2", free=2, running=2)),
     {"c1": "cpu", "c2": "cpu"}, {"cpu": 2, "gpu-1x24": 0, "gpu-4x80": 0}, 0),
    ("gpu demand never grows cpu workers",
     # 100 waiting actions of a 16 GB model, 1 GPU, 1 s each: 100 s / 5 s = 20 replicas on 1-GPU workers
     pools(rm_small=(100, 0, 100, 100.0)), (), (cpu_node("c1"),), {"c1": "cpu"},
     {"cpu": 0, "gpu-1x24": 20, "gpu-4x80": 0}, 0),
    ("a model too large for the small gpus goes to the large kind",
     # 140 GB on 80 GB GPUs: 2 GPUs a replica, 2 replicas per 4-GPU worker; 10 waiting x 2 GPU x 1 s = 20 unit-s
     pools(rm_70b=(10, 0, 20, 20.0)), (), (), {},
     {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 1}, 0),
    ("replicas busy are kept and packed per worker",
     pools(rm_70b=(0, 3, 0, 0.0)), (), (gpu_node("g1", 4, 0, 2, 2), gpu_node("g2", 4, 2, 1, 1)),
     {"g1": "gpu-4x80", "g2": "gpu-4x80"}, {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 2}, 0),
    ("an action no worker can hold asks for a worker that can",
     pools(), (never("gpu", 2, "rm-70b"),), (cpu_node("c1"),), {"c1": "cpu"},
     {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 1}, 0),
    ("a cpu action larger than any cpu kind is unservable",
     pools(), (never("cpu", 32),), (), {}, {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 0}, 1),
    ("an api action beyond the quota is unservable: no worker adds tokens",
     pools(), (never("api", 100),), (), {}, {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 0}, 1),
    ("api actions need one cpu worker to run on",
     pools(api=(3, 0)), (), (), {}, {"cpu": 1, "gpu-1x24": 0, "gpu-4x80": 0}, 0),
    ("trajectory state keeps one cpu worker",
     pools(), (), (cpu_node("c1", homes=3), cpu_node("c2")), {"c1": "cpu", "c2": "cpu"},
     {"cpu": 1, "gpu-1x24": 0, "gpu-4x80": 0}, 0),
    # two actions of 0.1 s of work ask for one worker; the two whose replicas they need are both kept
    ("a replica that waiting actions need pins its worker",
     pools(rm_small=(2, 0, 2, 0.2)), (),
     (gpu_node("g1", needed=1, replicas=1), gpu_node("g2", needed=1, replicas=1), gpu_node("g3")),
     {"g1": "gpu-1x24", "g2": "gpu-1x24", "g3": "gpu-1x24"}, {"cpu": 0, "gpu-1x24": 2, "gpu-4x80": 0}, 0),
    ("unknown model demand is reported, not guessed",
     pools(rm_unknown=(5, 0, 5, 5.0)), (), (), {}, {"cpu": 0, "gpu-1x24": 0, "gpu-4x80": 0}, 1),
    ("no estimate yet: one unit per waiting unit",
     pools(cpu=(6, 0, 6, 0.0)), (), (), {}, {"cpu": 2, "gpu-1x24": 0, "gpu-4x80": 0}, 0),
]


@pytest.mark.parametrize("name,pools_,unplaceable,nodes,workers,expected,unservable", CASES,
                         ids=[c[0] for c in CASES])
def test_targets(name, pools_, unplaceable, nodes, workers, expected, unservable):
    t = compute_targets(pools_, unplaceable, nodes, workers, KINDS, MODELS, T)
    assert {k.kind: k.target for k in t.kinds} == expected, t
    assert len(t.unservable) == unservable, t.unservable
    assert t.total == sum(expected.values()) + t.unmanaged
    for k in t.kinds:
        assert k.current == sum(1 for v in workers.values() if v == k.kind)


def test_unmanaged_workers_are_kept_in_the_total():
    t = compute_targets(pools(), (), (), {"a": None, "b": None, "c1": "cpu"}, KINDS, MODELS, T)
    assert t.unmanaged == 2 and t.total == 2


def test_the_first_cpu_kind_grows_and_others_keep_what_is_pinned():
    nodes = (cpu_node("big", 16, 0, 16),)
    t = compute_targets(pools(cpu=(20, 16, 20, 20.0)), (), nodes, {"big": "cpu-big"}, (CPU4, CPU16), MODELS, T)
    # 16 busy + 4 for the queue = 20 slots; 16 are held by the pinned big worker: 1 small worker more
    assert (t.of("cpu").target, t.of("cpu-big").target) == (1, 1)


def test_a_longer_target_duration_asks_for_fewer_workers():
    p = pools(cpu=(100, 0, 100, 100.0))
    short = compute_targets(p, (), (), {}, KINDS, MODELS, 2.0).of("cpu").target
    long = compute_targets(p, (), (), {}, KINDS, MODELS, 20.0).of("cpu").target
    assert (short, long) == (13, 2)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="target duration"):
        compute_targets(pools(), (), (), {}, KINDS, MODELS, 0)
    with pytest.raises(ValueError, match="slots .* or gpus"):
        WorkerKind("x")
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        WorkerKind("x", gpus=2)


CLASSIFY = [
    ("cpu by slots", (4, 0, 0.0), "cpu"),
    ("gpu by count and memory", (0, 4, 80.0), "gpu-4x80"),
    ("gpu memory within rounding", (0, 1, 23.7), "gpu-1x24"),
    ("an unknown shape is no kind", (8, 0, 0.0), None),
    ("a gpu worker with slots is still a gpu", (2, 1, 24.0), "gpu-1x24"),
]


@pytest.mark.parametrize("name,shape,kind", CLASSIFY, ids=[c[0] for c in CLASSIFY])
def test_classify(name, shape, kind):
    assert classify(*shape, KINDS) == kind


def test_kinds_from_shapes():
    ks = kinds_from_shapes([(0, 2, 24.0), (4, 0, 0.0), (4, 0, 0.0), (16, 0, 0.0), (0, 0, 0.0)])
    assert [k.name for k in ks] == ["cpu-16", "cpu-4", "gpu-2x24"]


def targets(**kinds):
    return Targets(tuple(KindTarget(k, "cpu", cur, tgt) for k, (cur, tgt) in kinds.items()))


CLOSE = [
    ("no surplus, nothing closes", targets(cpu=(2, 2)), (cpu_node("a"), cpu_node("b")), (), []),
    ("a running action keeps its worker", targets(cpu=(2, 0)),
     (cpu_node("a", free=3, running=1), cpu_node("b")), (), ["b"]),
    ("busy in dask keeps it too", targets(cpu=(2, 0)), (cpu_node("a"), cpu_node("b")), ("b",), ["a"]),
    ("fewest homes first, only the surplus", targets(cpu=(3, 1)),
     (cpu_node("a", homes=2), cpu_node("b", homes=0), cpu_node("c", homes=1)), (), ["b", "c"]),
    ("a replica waiting actions need is kept", targets(gpu=(2, 0)),
     (gpu_node("a", needed=1, replicas=1), gpu_node("b", replicas=1)), (), ["b"]),
]


@pytest.mark.parametrize("name,t,nodes,busy,expected", CLOSE, ids=[c[0] for c in CLOSE])
def test_choose_to_close(name, t, nodes, busy, expected):
    kind = t.kinds[0].kind
    workers = {n.node: kind for n in nodes}
    assert choose_to_close(t, nodes, workers, busy) == expected


def test_only_kinds_with_a_surplus_lose_workers():
    t = Targets((KindTarget("cpu", "cpu", 1, 1), KindTarget("gpu", "gpu", 2, 1)))
    nodes = (cpu_node("c"), gpu_node("g1"), gpu_node("g2"))
    assert choose_to_close(t, nodes, {"c": "cpu", "g1": "gpu", "g2": "gpu"}) == ["g1"]


MOVES = [
    ("homes go to the staying node with the fewest per slot",
     {"a": ["t1", "t2"]}, ["a"], (cpu_node("a", homes=2), cpu_node("b", 4, homes=2), cpu_node("c", 4, homes=0)),
     [("t1", "a", "c"), ("t2", "a", "c")], []),
    ("spread evenly", {"a": ["t1", "t2", "t3"]}, ["a"],
     (cpu_node("a", homes=3), cpu_node("b", homes=0), cpu_node("c", homes=0)),
     [("t1", "a", "b"), ("t2", "a", "c"), ("t3", "a", "b")], []),
    ("nowhere to go", {"a": ["t1"]}, ["a", "b"], (cpu_node("a", homes=1), cpu_node("b")), [], ["a"]),
    ("gpu nodes receive no sandbox state", {"a": ["t1"]}, ["a"], (cpu_node("a", homes=1), gpu_node("g")), [], ["a"]),
    ("no homes, no moves", {}, ["a"], (cpu_node("a"), cpu_node("b")), [], []),
]


@pytest.mark.parametrize("name,homes,leaving,nodes,moves,stuck", MOVES, ids=[c[0] for c in MOVES])
def test_plan_moves(name, homes, leaving, nodes, moves, stuck):
    assert plan_moves(homes, leaving, nodes) == (moves, stuck)


NEXT = [
    ("the kind furthest below its target", {"cpu": (1, 3), "gpu": (0, 1)}, {"cpu": 1, "gpu": 0}, "cpu"),
    ("counts include workers on their way", {"cpu": (1, 3), "gpu": (0, 1)}, {"cpu": 3, "gpu": 0}, "gpu"),
    ("every kind at target", {"cpu": (2, 2)}, {"cpu": 2}, None),
]


@pytest.mark.parametrize("name,kinds,counts,expected", NEXT, ids=[c[0] for c in NEXT])
def test_next_kind(name, kinds, counts, expected):
    assert next_kind(targets(**kinds), counts) == expected


def test_module_level_imports_no_dask():
    """The pure half needs no Dask: the glue imports distributed inside its functions only."""
    import ast
    import tangram_dask.adaptive as mod
    tree = ast.parse(open(mod.__file__).read())
    roots = set()
    for node in tree.body:  # module level only
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    assert not roots & {"dask", "distributed", "tornado"}, roots


def test_a_cpu_only_pool_is_not_grown_by_gpu_demand():
    """The issue's repro on a plain LocalCluster (one CPU kind): 100 waiting GPU actions and GPU actions
    no worker can hold grow nothing; they are reported as unservable."""
    p = pools(cpu=(0, 0, 0, 0.0), rm_small=(100, 0, 100, 100.0))
    t = compute_targets(p, (never("gpu", 1, "rm-small"),), (cpu_node("c1"),), {"c1": "cpu"}, (CPU4,), MODELS, T)
    assert t.of("cpu").target == 0 and t.total == 0
    assert len(t.unservable) == 2, t.unservable
