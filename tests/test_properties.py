"""Properties of every policy on random small workloads and clusters (hypothesis).

Each example is written as the dicts of a workload and a cluster file and read
through ``parse_workload`` / ``parse_cluster``; it is simulated with the
independent audit ledger, which raises ``AuditError`` on any over-allocated
slot, GPU, GPU memory or token (and the simulator raises if an action never
completes).

The suite draws 40 examples per property (``SETTINGS``, also used by
test_background_load.py). A longer search, outside the suite's time budget:
``TANGRAM_PROPERTY_EXAMPLES=1500 .venv/bin/python -m pytest tests/test_properties.py
tests/test_background_load.py`` (about 80 s here); at 1500 it found a model declared
to load in 2e-311 s raising OverflowError, which 40 had not.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from conftest import kind, make_cluster, make_workload, record, simulate
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from tangram_dask import FileFormatError
from tangram_dask.cluster import load_cluster, parse_cluster
from tangram_dask.policy import initial_replicas, make_policy
from tangram_dask.sim import Simulator
from tangram_dask.workload import generate, load_workload, parse_workload

POLICIES = ("tangram", "fifo", "static")
SETTINGS = settings(max_examples=int(os.environ.get("TANGRAM_PROPERTY_EXAMPLES", "40")), deadline=None,
                    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])


def _dist(draw, lo: float = 0.0, hi: float = 5.0) -> dict:
    shape = draw(st.sampled_from(["constant", "lognormal", "uniform"]))
    if shape == "constant":
        return {"dist": "constant", "value": draw(st.floats(lo, hi))}
    if shape == "lognormal":
        return {"dist": "lognormal", "median": draw(st.floats(max(lo, 0.05), hi)), "sigma": draw(st.floats(0, 1.5))}
    low = draw(st.floats(lo, hi))
    return {"dist": "uniform", "low": low, "high": low + draw(st.floats(0, 3))}


def _groups(draw, gpus: int) -> list[int]:
    cuts = sorted(draw(st.sets(st.integers(1, gpus - 1), max_size=3)))
    bounds = [0, *cuts, gpus]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@st.composite
def scenarios(draw):
    """A (workload dict, cluster dict) pair small enough to simulate in milliseconds."""
    cpu = [{"slots": draw(st.integers(1, 8))} for _ in range(draw(st.integers(1, 3)))]
    max_slots = max(n["slots"] for n in cpu)
    gpu = []
    for _ in range(draw(st.integers(0, 2))):
        gpus = draw(st.integers(2, 8))
        gpu.append({"gpus": gpus, "gpu_memory_gb": draw(st.sampled_from([24, 40, 80])), "groups": _groups(draw, gpus)})
    tokens = draw(st.integers(0, 4))
    resources = ["cpu"] + (["gpu"] if gpu else []) + (["api"] if tokens else [])
    models = {}
    if gpu:
        for i in range(draw(st.integers(1, 2))):
            models[f"m{i}"] = {"gpu_memory_gb": draw(st.sampled_from([8, 16, 40, 70])),
                               "load_s": draw(st.floats(0, 20))}

    def action_kind(name: str) -> dict:
        res = draw(st.sampled_from(resources))
        cap = {"cpu": max_slots, "api": tokens, "gpu": 2}[res]
        lo = draw(st.integers(1, cap))
        hi = draw(st.integers(lo, cap + 2))
        d = kind(name, res, units=(lo, hi), weight=draw(st.floats(0.1, 3)), duration_s=_dist(draw))
        if hi > lo and draw(st.booleans()):
            d["speedup"] = {"model": "amdahl", "parallel_fraction": draw(st.floats(0, 1))}
        if res == "gpu":
            d["model"] = draw(st.sampled_from(sorted(models)))
        if res == "cpu" and draw(st.booleans()):
            d["affinity"] = "trajectory"
            d["restore_s"] = draw(st.floats(0, 5))
        return d

    tools = [action_kind(f"tool{i}") for i in range(draw(st.integers(1, 3)))]
    rewards = [action_kind(f"reward{i}") for i in range(draw(st.integers(1, 2)))]
    used = {k["model"] for k in tools + rewards if "model" in k}
    if draw(st.booleans()):
        turns = {"dist": "constant", "value": draw(st.integers(1, 3))}
    else:
        turns = {"dist": "geometric", "mean": draw(st.floats(1, 4)), "max": draw(st.integers(1, 6))}
    wl = {
        "name": "prop", "seed": draw(st.integers(0, 2**16)), "trajectories": draw(st.integers(1, 12)),
        "steps": draw(st.integers(1, 2)), "train_time_s": draw(st.floats(0, 5)),
        "turns": turns, "llm_time_s": _dist(draw, 0.0, 3.0), "hint_sigma": draw(st.floats(0, 2)),
        "static": {"sandbox_units": draw(st.integers(1, max_slots))},
        "tools": tools, "rewards": rewards, "models": {m: models[m] for m in sorted(used)},
    }
    cl = {"name": "prop", "cpu": {"nodes": cpu},
          "sandbox": {"cold_start_s": draw(st.floats(0, 5)), "warm_start_s": draw(st.floats(0, 1))}}
    if gpu:
        cl["gpu"] = {"nodes": gpu, "cross_group_slowdown": draw(st.floats(1, 3))}
    if tokens:
        cl["api"] = {"tokens": tokens}
    return wl, cl


def _feasible(wl, cl) -> None:
    """Skip examples the contract cannot serve: every model needs a replica of the static split
    (which lies in one topology group), since every policy starts from it and static keeps it."""
    placed = {r.model for r in initial_replicas(cl, wl)}
    assume(set(wl.models) <= placed)


def _check_run(policy: str, wl, cl) -> tuple:
    gen = generate(wl)
    pol = make_policy(policy, cl, wl)
    log = record(pol)
    res = Simulator(gen, cl, pol, audit=True).run()  # raises on over-allocation or a stuck action
    act = res.end - res.issue
    assert (res.end >= res.issue).all()
    # ACT >= its ideal (units.max, warm sandbox, resident model, no queue). static runs CPU actions
    # in the trajectory's own sandbox, paid for at admission: they skip the warm start of the ideal.
    slack = np.zeros(len(act))
    if policy == "static":
        cpu_kind = np.array([k.resource == "cpu" for k in wl.kinds])
        slack = np.where(cpu_kind[gen.kind], cl.warm_start_s, 0.0)
    tol = 1e-9 * np.maximum(1.0, res.ideal)
    bad = np.flatnonzero(act < res.ideal - slack - tol)
    assert bad.size == 0, f"{policy}: action {bad[0]} ACT {act[bad[0]]} below its ideal {res.ideal[bad[0]]}"
    if policy != "static":
        steps = np.subtract(res.step_end, res.step_start)
        assert (steps >= np.asarray(res.ideal_step) - 1e-9 * np.maximum(1.0, res.ideal_step)).all()
    assert len(res.step_end) == wl.steps
    starts = [d for _, d in log if d.__class__.__name__ == "Start"]
    assert sorted(d.action for d in starts) == list(range(gen.n_actions))  # each action started exactly once
    if policy == "static":
        assert not any(d.cross_group for d in starts), "static spanned topology groups"
    if policy == "tangram":  # only a replica too large for every group of its node spans groups
        nodes = {n.name: n for n in cl.gpu_nodes}
        for d in starts:
            if d.cross_group:
                assert len(d.gpus) > max(nodes[d.node].groups), f"tangram spanned groups with {d.gpus} on {d.node}"
    if policy == "static":
        assert res.model_loads == 0 and not any(d.evict for d in starts)
        assert res.restores == 0
        assert res.cold_starts == gen.n_trajectories  # one per admitted trajectory, whatever cold_start_s is
    else:
        assert res.cold_starts == 0  # warm pools never run dry in tangram and fifo
    for d in starts:
        k = wl.kinds[gen.kind[d.action]]
        assert d.units >= k.units_min
        if k.resource != "gpu":
            assert d.units <= k.units_max
    return res, log


@pytest.mark.parametrize("policy", POLICIES)
@SETTINGS
@given(scenario=scenarios())
def test_random_runs_audit_clean_complete_and_respect_the_ideal(policy, scenario):
    wd, cd = scenario
    wl, cl = parse_workload(wd, "<prop workload>"), parse_cluster(cd, "<prop cluster>")
    _feasible(wl, cl)
    res, log = _check_run(policy, wl, cl)
    # the same seed gives the same run twice
    res2, log2 = _check_run(policy, wl, cl)
    assert log == log2
    np.testing.assert_array_equal(res.issue, res2.issue)
    np.testing.assert_array_equal(res.end, res2.end)
    assert (res.model_loads, res.cold_starts, res.restores) == (res2.model_loads, res2.cold_starts, res2.restores)


@SETTINGS
@given(scenario=scenarios())
def test_same_seed_same_metrics_through_the_bench(scenario):
    from tangram_dask.bench import simulate as bench_simulate

    wd, cd = scenario
    wl, cl = parse_workload(wd), parse_cluster(cd)
    _feasible(wl, cl)
    gen = generate(wl)
    for policy in POLICIES:
        a = bench_simulate(gen, cl, policy, audit=True)
        b = bench_simulate(generate(wl), cl, policy, audit=True)
        a.pop("sim_wall_s"), b.pop("sim_wall_s")
        assert a == b


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("workload, cluster", [("standard", "standard"), ("standard", "tight"), ("small", "laptop")])
def test_shipped_files_audit_clean(policy, workload, cluster):
    wl = load_workload(f"resources/bench/{workload}.yaml")
    cl = load_cluster(f"resources/bench/cluster-{cluster}.yaml")
    res, _ = _check_run(policy, wl, cl)
    assert len(res.end) > 1000 or workload == "small"


# -- a cluster that can never serve an action: a clear error, not a stuck run --------------------
UNSERVABLE = [
    ("cpu-units-above-every-node", dict(tools=[kind("big", units=(4, 8))]), dict(cpu=[{"count": 2, "slots": 3}]),
     "tools[0].units.min", "the largest CPU worker has 3 slots"),
    ("api-units-above-the-quota", dict(tools=[kind("search", "api", units=(3, 3))]), dict(cpu=[{"slots": 2}], tokens=2),
     "tools[0].units.min", "API tokens"),
    ("api-without-any-quota", dict(tools=[kind("search", "api")]), dict(cpu=[{"slots": 2}]),
     "tools[0].units.min", "API tokens"),
    ("gpu-model-larger-than-any-node",
     dict(rewards=[kind("judge", "gpu", model="big")], models={"big": {"gpu_memory_gb": 200, "load_s": 1}}),
     dict(cpu=[{"slots": 2}], gpu=[{"gpus": 2, "gpu_memory_gb": 80}]), "rewards[0].model",
     "the GPU workers have 2 x 80 GB"),
    ("gpu-action-without-gpus",
     dict(rewards=[kind("judge", "gpu", model="m")], models={"m": {"gpu_memory_gb": 8, "load_s": 1}}),
     dict(cpu=[{"slots": 2}]), "rewards[0].model", "no GPU worker has joined"),
]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("wl_kw, cl_kw, key, words", [c[1:] for c in UNSERVABLE], ids=[c[0] for c in UNSERVABLE])
def test_unservable_kind_is_a_clear_error(policy, wl_kw, cl_kw, key, words):
    wl = make_workload(**wl_kw)
    cl = make_cluster(**cl_kw)
    with pytest.raises(FileFormatError) as info:
        simulate(wl, cl, policy)
    assert (info.value.path, info.value.key) == ("<test workload>", key)
    assert words in info.value.problem


# -- the audit can fail: a policy that ignores capacity is caught -----------------------------------
class _OverbookingFifo:
    """fifo that starts every waiting action at once, slots and tokens be damned (bypassing its ledger)."""

    @staticmethod
    def make(cluster, wl):
        from tangram_dask.policy.fifo import FifoPolicy
        from tangram_dask.policy.types import Start

        class Overbooking(FifoPolicy):
            def _schedule(self, now, out):
                for res in ("cpu", "api"):
                    for aid, spec in list(self.waiting[res].items()):
                        del self.waiting[res][aid]
                        self.running[aid] = None  # never released through the ledger
                        out.append(Start(aid, "cpu-0" if res == "cpu" else "api", spec.units_min))

            def _release(self, r, now):
                pass

        return Overbooking(cluster, wl.models, initial_replicas(cluster, wl))


@pytest.mark.parametrize("resource", ["cpu", "api"])
def test_audit_catches_over_allocation(resource):
    from tangram_dask.sim import AuditError

    wl = make_workload([kind("tool", resource)], [kind("reward", resource)], trajectories=3)
    cl = make_cluster(cpu=[{"slots": 2}], tokens=2)
    gen = generate(wl)
    with pytest.raises(AuditError,
                       match="CPU slots over-allocated" if resource == "cpu" else "API tokens over-allocated"):
        Simulator(gen, cl, _OverbookingFifo.make(cl, wl), audit=True).run()
    # without the audit the same run goes through: the audit is what catches it
    Simulator(gen, cl, _OverbookingFifo.make(cl, wl), audit=False).run()


def _erlang_wq_naive(c: int, a: float, s: float) -> float:
    """Erlang C's mean wait as the residency rules first computed it: the whole recursion for each call."""
    if c <= 0 or a >= c:
        return float("inf")
    b = 1.0
    for k in range(1, c + 1):
        b = a * b / (k + a * b)
    pw = c * b / (c - a * (1.0 - b))
    return pw * s / (c - a)


def _servers_naive(a: float, c: int, most: int, wait: float) -> int:
    """The fewest servers from ``c`` up as the residency rules first searched them: Erlang C anew for each count."""
    while a > 0 and c < most and _erlang_wq_naive(c, a, 1.0) > wait:
        c += 1
    return c


@settings(max_examples=400, deadline=None)
@given(a=st.one_of(st.just(0.0), st.floats(0.0, 3.0), st.floats(0.0, 400.0), st.integers(1, 40).map(float)),
       c=st.integers(0, 300), extra=st.integers(0, 400),
       wait=st.one_of(st.sampled_from([0.0, 0.1, 0.25, 0.5, 1.0]), st.floats(0.0, 2.0)))
def test_servers_carried_erlang_b_is_the_naive_search(a, c, extra, wait):
    """``_servers`` carries Erlang B from one server count to the next (O(servers), not O(servers^2)); its
    answer is the naive search's, to the server."""
    from tangram_dask.policy.residency import _servers
    assert _servers(a, c, c + extra, wait) == _servers_naive(a, c, c + extra, wait)


@settings(max_examples=400, deadline=None)
@given(a=st.one_of(st.just(0.0), st.floats(0.0, 3.0), st.floats(0.0, 400.0), st.integers(1, 40).map(float)),
       c=st.integers(-1, 300), s=st.floats(0.01, 100.0))
def test_erlang_pair_is_two_erlang_waits(a, c, s):
    """``_erlang_wq_pair`` (one recursion for the waits on ``c`` and ``c + 1`` servers, as ``_plan_ahead`` asks) and
    ``_erlang_wq`` (read from it) give the first computation's floats, bit for bit (it stops once Erlang B
    underflows to 0.0, after which every step gave 0.0)."""
    from tangram_dask.policy.residency import _erlang_wq, _erlang_wq_pair
    w = (_erlang_wq_naive(c, a, s), _erlang_wq_naive(c + 1, a, s))
    assert _erlang_wq_pair(c, a, s) == w
    assert (_erlang_wq(c, a, s), _erlang_wq(c + 1, a, s)) == w


@settings(max_examples=1000, deadline=None)
@given(a=st.one_of(st.floats(1e-6, 3.0), st.floats(0.0, 2000.0), st.integers(1, 40).map(float)),
       c=st.integers(0, 3000), s=st.floats(0.01, 100.0))
def test_erlang_bound_is_an_upper_bound(a, c, s):
    """``_erlang_wq_bound`` (O(1), from the Poisson median) never reads below the wait the recursion gives, so
    ``_plan_ahead`` skips only loads the recursion would refuse."""
    from tangram_dask.policy.residency import _erlang_wq, _erlang_wq_bound
    assert _erlang_wq_bound(c, a, s) >= _erlang_wq(c, a, s)


def test_erlang_bound_decides_the_common_case():
    """Where a model's replicas are mostly idle the bound is far below a load's cost (it skips the recursion),
    and near saturation it gives no bound."""
    from tangram_dask.policy.residency import _erlang_wq, _erlang_wq_bound
    assert _erlang_wq_bound(478, 277.0, 1.0) < 1e-20
    assert 0 < _erlang_wq(478, 277.0, 1.0) <= _erlang_wq_bound(478, 277.0, 1.0)
    assert _erlang_wq_bound(10, 9.5, 1.0) == float("inf")


def _ready_replica_naive(pol, model, spec):
    """``_ready_replica`` as first written: every ready replica of the model looked at (no early end)."""
    gp = pol.gpu
    best, best_k, best_c = None, 0, 0.0
    for rid in gp.ready.get(model, ()):
        r = gp.replicas[rid]
        k = len(r.gpus)
        if k < spec.units_min:
            continue
        key = k if k <= spec.units_max else -k
        if best is not None and (key < best_k or (key == best_k and best_c <= 0.0)):
            continue
        c = pol._shared_need(r) if pol.opt.spare_shared else 0.0
        if best is None or key > best_k or c < best_c:
            best, best_k, best_c = rid, key, c
    return best


def _serve(pol, busy) -> None:
    """The replicas of ``pol`` indexed by ``busy`` (in placement order) serve, where their GPUs are idle."""
    rids = list(pol.gpu.replicas)
    for i in sorted(busy):
        if i < len(rids):
            r = pol.gpu.replicas[rids[i]]
            st_ = pol.gpu.nodes[r.node]
            if not r.busy and not any(st_.gpus[g].busy for g in r.gpus):
                pol.gpu.acquire(rids[i], 0.0)


@settings(max_examples=300, deadline=None)
@given(replicas=st.lists(st.tuples(st.sampled_from(["prm", "judge"]), st.integers(0, 7), st.integers(1, 3)),
                         min_size=1, max_size=14),
       busy=st.sets(st.integers(0, 13)), lo=st.integers(1, 3), extra=st.integers(0, 2), spare=st.booleans())
@example(replicas=[("prm", 0, 1), ("judge", 0, 1), ("prm", 1, 1)], busy=set(), lo=1, extra=0, spare=True)  # GPU 1
def test_ready_replica_ends_early_with_the_same_choice(replicas, busy, lo, extra, spare):
    """``_ready_replica`` stops at a replica of the largest size (``GpuPool.widest``) alone on its GPUs; it picks
    what looking at every ready replica picks (prm replicas of 1-3 GPUs, beside deployed judge replicas not
    called yet, which count as busy; some replicas serving)."""
    from tangram_dask.cluster import ClusterSpec, GpuNode, ModelSpec
    from tangram_dask.policy import TangramOptions, TangramPolicy
    from tangram_dask.policy.types import ReplicaSpec
    from tangram_dask.spec import ActionSpec

    specs = [ReplicaSpec(m, "gpu-0", tuple(range(i, min(i + k, 8)))) for m, i, k in replicas]
    cluster = ClusterSpec("g", (), (GpuNode("gpu-0", 8, 80.0, (4, 4)),), 2.0, 0)
    pol = TangramPolicy(cluster, {"prm": ModelSpec("prm", 6.0, 10.0), "judge": ModelSpec("judge", 6.0, 10.0)},
                        specs, options=TangramOptions(spare_shared=float(spare)))
    _serve(pol, busy)
    spec = ActionSpec("prm_call", "gpu", lo, lo + extra, 0.8, 1.0, "t0", "prm")
    assert pol._ready_replica("prm", spec) == _ready_replica_naive(pol, "prm", spec)


def _load_site_policy(replicas, busy, nodes: int, scan: float):
    """A tangram policy on ``nodes`` nodes of 4 GPUs of 80 GB in two 2-GPU groups, with ``replicas``
    ((model, node, first GPU, GPUs)) resident and those indexed by ``busy`` serving."""
    from tangram_dask.cluster import ClusterSpec, GpuNode, ModelSpec
    from tangram_dask.policy import TangramOptions, TangramPolicy
    from tangram_dask.policy.types import ReplicaSpec

    gpu_nodes = tuple(GpuNode(f"gpu-{n}", 4, 80.0, (2, 2)) for n in range(nodes))
    models = {"prm": ModelSpec("prm", 30.0, 10.0), "judge": ModelSpec("judge", 50.0, 10.0),
              "big": ModelSpec("big", 140.0, 30.0), "aux": ModelSpec("aux", 30.0, 10.0)}
    specs, free = [], {}
    for m, n, i, k in replicas:  # those that fit, in the order given
        gpus = tuple(range(i, min(i + k, 4)))
        share = models[m].gpu_memory_gb / len(gpus)
        if all(free.get((n % nodes, g), 80.0) >= share for g in gpus):
            for g in gpus:
                free[(n % nodes, g)] = free.get((n % nodes, g), 80.0) - share
            specs.append(ReplicaSpec(m, f"gpu-{n % nodes}", gpus))
    pol = TangramPolicy(ClusterSpec("g", (), gpu_nodes, 2.0, 0), models, specs,
                        options=TangramOptions(site_scan=scan))
    _serve(pol, busy)
    return pol


@settings(max_examples=200, deadline=None)
@given(replicas=st.lists(st.tuples(st.sampled_from(["prm", "judge"]), st.integers(0, 19), st.integers(0, 3),
                                   st.integers(1, 2)), max_size=40),
       open_=st.sets(st.integers(0, 19), max_size=2), busy=st.sets(st.integers(0, 99)),
       model=st.sampled_from(["prm", "judge", "big"]))
def test_load_site_over_the_idle_node_index_is_the_full_scan(replicas, open_, busy, model):
    """Where few nodes have an idle GPU (of 20 nodes, at most 2: every GPU of the others serves a 30 GB
    model), ``_load_site`` visits those from the ledger's index (``GpuPool.idle_nodes``), in node order; it
    picks what visiting every node picks."""
    from tangram_dask.spec import ActionSpec

    fill = [("aux", n, i, 1) for n in range(20) if n not in open_ for i in range(4)]
    pol = _load_site_policy(fill + replicas, set(range(len(fill))) | {len(fill) + i for i in busy}, 20, 0.0)
    gp = pol.gpu
    assert set(gp.idle_nodes) == {n for n, s in gp.nodes.items() if any(not g.busy for g in s.gpus)}
    assert len(gp.idle_nodes) * 8 < len(gp.nodes)  # the index's path
    spec = ActionSpec("call", "gpu", 1, 2, 0.8, 1.0, "t0", model)
    fast = pol._load_site(model, spec)
    gp.idle_nodes = dict.fromkeys(gp.nodes)  # every node: the full scan
    assert pol._load_site(model, spec) == fast


def test_a_load_ranks_site_scan_sites_and_no_more():
    """``site_scan``: a load ranks at most that many sites that can take it, in node order. Three nodes of
    four GPUs, a 50 GB judge on each; beside it a 30 GB model on the first two nodes' GPUs, none on the
    last's: with every site ranked the 30 GB prm goes onto the last node, evicting nothing; with 2 ranked,
    onto the first, evicting one replica."""
    from tangram_dask.spec import ActionSpec

    full = [("judge", n, i, 1) for n in range(3) for i in range(4)]
    full += [("aux", n, i, 1) for n in range(2) for i in range(4)]  # 30 GB more: the GPUs of nodes 0 and 1 full
    spec = ActionSpec("call", "gpu", 1, 1, 0.8, 1.0, "t0", "prm")
    every = _load_site_policy(full, set(), 3, 0.0)._load_site("prm", spec)
    two = _load_site_policy(full, set(), 3, 2.0)._load_site("prm", spec)
    assert every[0] == "gpu-2" and every[2] == []
    assert two[0] == "gpu-0" and len(two[2]) == 1
