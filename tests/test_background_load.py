"""Background loads (``Load``, ``background_load=1``): a replica loads with no action waiting inside it.

The pure policy on a hand-made cluster (events in, decisions out), then the
simulator with its audit: the load is charged from the cost model, counted in
``model_loads``, and a start on a replica still loading is an audit error.
"""

from __future__ import annotations

import pytest
from conftest import hand_run, kind, make_cluster, make_workload

from tangram_dask.cluster import GpuNode
from tangram_dask.policy import Load, Start, TangramOptions, TangramPolicy, make_policy
from tangram_dask.policy.types import ReplicaSpec
from tangram_dask.sim import AuditError, Simulator, _Audit
from tangram_dask.spec import ActionSpec

BG = TangramOptions(background_load=1.0, admission=0.0)


def _policy(opt: TangramOptions = BG, gpus: int = 2):
    cl = make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": gpus, "gpu_memory_gb": 80}])
    spec = make_workload([kind("tool")], [kind("rM", "gpu", dur=20.0, model="M")],
                         models={"M": {"gpu_memory_gb": 60, "load_s": 10}})
    node = cl.gpu_nodes[0].name
    pol = TangramPolicy(cl, spec.models, [ReplicaSpec("M", node, (0,))], options=opt)
    return pol, node


def _action(t: str, hint: float = 20.0) -> ActionSpec:
    return ActionSpec("rM", "gpu", 1, 1, model="M", trajectory=t, hint_s=hint)


def test_a_load_holds_its_gpus_and_the_action_that_wanted_it_stays_queued():
    pol, node = _policy()
    pol.submit("a1", _action("t1"), 0.0)
    (d1,) = pol.schedule(0.0)
    assert isinstance(d1, Start) and d1.gpus == (0,) and not d1.load
    pol.submit("a2", _action("t2"), 1.0)
    (d2,) = pol.schedule(1.0)  # 20 s queued on one replica outlasts a 10 s load: a replica more, in the background
    assert isinstance(d2, Load) and (d2.node, d2.gpus, d2.model, d2.evict) == (node, (1,), "M", ())
    rep = pol.gpu.replicas[d2.replica]
    assert rep.loading and rep.busy and pol.gpu.idle == 0 and d2.replica not in pol.gpu.ready["M"]
    assert "a2" in pol.pools["M"].waiting and pol.schedule(2.0) == []  # nothing ready, no second load
    pol.loaded(d2.replica, 11.0)
    (d3,) = pol.schedule(11.0)
    assert isinstance(d3, Start) and d3.action == "a2" and d3.replica == d2.replica and not d3.load
    pol.loaded(d2.replica, 12.0)  # a second report changes nothing
    assert pol.gpu.replicas[d2.replica].busy


def test_a_waiting_action_takes_whichever_replica_is_ready_first():
    pol, _ = _policy()
    pol.submit("a1", _action("t1", hint=5.0), 0.0)
    pol.schedule(0.0)
    pol.submit("a2", _action("t2", hint=40.0), 0.5)
    (load,) = pol.schedule(0.5)
    assert isinstance(load, Load)
    pol.finish("a1", 5.0, 5.0)  # the resident replica frees before the load ends (10.5)
    (d,) = pol.schedule(5.0)
    assert isinstance(d, Start) and d.action == "a2" and d.gpus == (0,)
    pol.loaded(load.replica, 10.5)
    assert pol.schedule(10.5) == [] and load.replica in pol.gpu.ready["M"]


def test_without_background_loads_the_action_waits_inside_its_load():
    pol, _ = _policy(TangramOptions(admission=0.0, background_load=0.0))
    pol.submit("a1", _action("t1"), 0.0)
    pol.schedule(0.0)
    pol.submit("a2", _action("t2"), 1.0)
    (d,) = pol.schedule(1.0)
    assert isinstance(d, Start) and d.load and d.action == "a2"


def _run(opt: TangramOptions):
    # one 80 GB GPU; A (60 GB) resident at t = 0, B (60 GB, 10 s load) needed by the reward
    spec = make_workload([kind("tool", dur=1.0), kind("gA", "gpu", model="A", weight=1.0)],
                         [kind("rB", "gpu", dur=2.0, model="B", weight=0.1)],
                         models={"A": {"gpu_memory_gb": 60, "load_s": 10}, "B": {"gpu_memory_gb": 60, "load_s": 10}})
    gen = hand_run(spec, [[(1.0, "tool", 1.0), (0.0, "rB", 2.0)]])
    cl = make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 1, "gpu_memory_gb": 80}])
    return Simulator(gen, cl, make_policy("tangram", cl, spec, options=opt), audit=True).run()


@pytest.mark.parametrize("bg", [0.0, 1.0])
def test_simulator_charges_a_background_load_from_the_cost_model(bg):
    # the reward is issued at 2; A is evicted and B loaded (10 s): ready at 12, it runs 2 s: ends 14 either way
    res = _run(TangramOptions(background_load=bg, admission=0.0))
    assert res.end.tolist() == pytest.approx([2.0, 14.0])
    assert res.model_loads == 1
    assert res.busy["gpu"] == pytest.approx(12.0)  # 10 s of load + 2 s of work on one GPU


def test_the_audit_refuses_a_start_on_a_replica_still_loading():
    pol, node = _policy()
    cl = pol.cluster
    spec = make_workload([kind("tool")], [kind("rM", "gpu", dur=20.0, model="M")],
                         models={"M": {"gpu_memory_gb": 60, "load_s": 10}})
    audit = _Audit(cl, spec.models, pol)
    rM = next(k for k in spec.kinds if k.kind == "rM")
    audit.load(Load(node, (1,), "M", 7))
    with pytest.raises(AuditError, match="serves two actions|runs two actions"):
        audit.start(0, Start(0, node, 1, (1,), 7), rM, 1.0)
    with pytest.raises(AuditError, match="already resident"):
        audit.load(Load(node, (1,), "M", 7))
    audit.loaded(7)
    audit.start(1, Start(1, node, 1, (1,), 7), rM, 11.0)  # ready now
    with pytest.raises(AuditError, match="GPU memory over-allocated"):
        audit.load(Load(node, (1,), "M", 8))  # 60 + 60 GB on one 80 GB GPU


# -- whole runs: audit clean, every action started once, the same run twice ------------------------------
import copy  # noqa: E402
from pathlib import Path  # noqa: E402

import yaml  # noqa: E402
from hypothesis import given  # noqa: E402
from test_properties import SETTINGS, _feasible, scenarios  # noqa: E402

from tangram_dask.cluster import parse_cluster  # noqa: E402
from tangram_dask.workload import generate, parse_workload  # noqa: E402

VARIANTS = Path(__file__).resolve().parents[1] / "resources" / "variants"
OPTS = [TangramOptions(background_load=1.0),
        TangramOptions(background_load=1.0, load_ahead=1.0, admission_model=0.6, admission_open=16, plan_loads=1),
        TangramOptions(background_load=1.0, grow=1.0)]
IDS = ["background", "background-ahead-gate", "background-grow"]


def _decisions(wl, cl, opt):
    gen = generate(wl)
    pol = make_policy("tangram", cl, wl, options=opt)
    log = []
    schedule = pol.schedule

    def logged(now):
        out = schedule(now)
        log.extend(out)
        return out
    pol.schedule = logged
    res = Simulator(gen, cl, pol, audit=True).run()  # raises on over-allocation, a stuck action or a bad Load
    starts = sorted(d.action for d in log if isinstance(d, Start))
    assert starts == list(range(gen.n_actions))
    loads = [d for d in log if isinstance(d, Load)]
    assert res.model_loads == len(loads)  # with background_load no action loads its replica itself
    assert not any(isinstance(d, Start) and d.load for d in log)
    assert not any(r.loading for r in pol.gpu.replicas.values())  # every load was reported ready
    return log, res


@pytest.mark.parametrize("opt", OPTS, ids=IDS)
@pytest.mark.parametrize("seed, gpus", [(31, None), (103, 8)])
def test_gpu_bound_runs_with_background_loads_audit_clean_and_repeat(opt, seed, gpus):
    wd = yaml.safe_load((VARIANTS / "gpu-bound.yaml").read_text())
    cd = yaml.safe_load((VARIANTS / "cluster-gpu-mixed.yaml").read_text())
    wd.update(seed=seed, trajectories=64)
    if gpus:  # fewer GPUs: more evictions
        cd = copy.deepcopy(cd)
        cd["gpu"]["nodes"] = cd["gpu"]["nodes"][:1]
    wl, cl = parse_workload(wd, "gpu-bound"), parse_cluster(cd, "gpu-mixed")
    log, res = _decisions(wl, cl, opt)
    assert any(isinstance(d, Load) for d in log)
    log2, res2 = _decisions(wl, cl, opt)
    assert log == log2 and res.end.tolist() == res2.end.tolist()


@pytest.mark.parametrize("opt", OPTS, ids=IDS)
@SETTINGS
@given(scenario=scenarios())
def test_random_runs_with_background_loads_audit_clean(opt, scenario):
    wd, cd = scenario
    wl, cl = parse_workload(wd, "<prop workload>"), parse_cluster(cd, "<prop cluster>")
    _feasible(wl, cl)
    _decisions(wl, cl, opt)


def test_a_node_that_leaves_mid_load_takes_its_loading_replica_and_the_action_loads_again():
    pol, node = _policy()
    pol.submit("a1", _action("t1"), 0.0)
    pol.schedule(0.0)
    pol.submit("a2", _action("t2"), 1.0)
    (load,) = pol.schedule(1.0)
    assert isinstance(load, Load) and pol._loading == {load.replica: "M"}
    lost = pol.remove_node(node)  # a1 was running there; the replicas are gone with the node
    assert lost == ["a1"] and pol._loading == {} and not pol.gpu.replicas
    pol.loaded(load.replica, 11.0)  # a late report of the gone replica changes nothing
    assert pol.schedule(11.0) == [] and "a2" in pol.unplaceable  # no GPU node left: it waits for one
    pol.add_gpu_node(GpuNode("gpu-new", 1, 80.0, (1,)))
    (again,) = pol.schedule(12.0)
    assert isinstance(again, Load) and again.node == "gpu-new" and again.replica != load.replica


def test_a_background_load_that_did_not_fit_leaves_the_ledger_and_its_action_gets_a_new_load():
    """The worker measured the replica bigger than its GPU's free memory and holds nothing
    (``load_failed``): the replica leaves the ledger, its GPU is free again, and the action that wanted
    it is not lost: the next pass loads again, with the model's measured size."""
    from tangram_dask.cluster import ModelSpec

    cl = make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 1, "gpu_memory_gb": 80}])
    spec = make_workload([kind("tool")], [kind("rA", "gpu", model="A"), kind("rB", "gpu", model="B")],
                         models={"A": {"gpu_memory_gb": 10, "load_s": 10}, "B": {"gpu_memory_gb": 10, "load_s": 10}})
    node = cl.gpu_nodes[0].name
    pol = TangramPolicy(cl, spec.models, [ReplicaSpec("A", node, (0,))], options=BG)
    pol.submit("b", ActionSpec("rB", "gpu", 1, 1, 0.0, 5.0, None, "B"), 0.0)
    first = [d for d in pol.schedule(0.0) if isinstance(d, Load)]
    assert len(first) == 1 and first[0].evict == ()  # declared 10 GB: it goes beside A's replica
    pol.set_model(ModelSpec("B", 75.0, 10.0))  # the worker measured 75 GB: it did not fit beside A's 10
    pol.load_failed(first[0].replica, 1.0)
    assert first[0].replica not in pol.gpu.replicas and pol.gpu.idle == 1
    assert pol.gpu.nodes[node].gpus[0].mem_free == pytest.approx(70.0) and not pol._loading
    again = [d for d in pol.schedule(1.0) if isinstance(d, (Load, Start))]
    assert len(again) == 1 and again[0].evict != ()  # now it evicts A's replica to make room
    def state():
        gp = pol.gpu
        return ({rid: repr(r) for rid, r in gp.replicas.items()}, gp.idle, [g.mem_free for g in gp.nodes[node].gpus],
                dict(pol._loading), {m: dict(r) for m, r in gp.ready.items()})

    before = state()
    pol.load_failed(12345, 1.0)  # an unknown replica: nothing happens
    assert state() == before and not pol.schedule(1.5)


def test_an_inline_load_that_failed_leaves_the_ledger_when_its_action_ends():
    """fifo loads inside the action: the failure is reported while the action holds the replica (and gets
    the error), so the replica leaves the ledger when that action ends, not before."""
    from tangram_dask.policy import FifoPolicy

    cl = make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 1, "gpu_memory_gb": 80}])
    spec = make_workload([kind("tool")], [kind("rB", "gpu", model="B")], models={"B": {"gpu_memory_gb": 10,
                                                                                       "load_s": 10}})
    pol = FifoPolicy(cl, spec.models, [])
    pol.submit("b", ActionSpec("rB", "gpu", 1, 1, 0.0, 5.0, None, "B"), 0.0)
    (d,) = pol.schedule(0.0)
    assert isinstance(d, Start) and d.load
    pol.load_failed(d.replica, 0.5)
    assert d.replica in pol.gpu.replicas  # held by the action, which errs on its worker
    pol.finish("b", 0.6)
    assert d.replica not in pol.gpu.replicas and pol.gpu.idle == 1


def test_grow_loads_larger_replicas_on_idle_gpus_beside_no_other_model():
    """``grow`` (opt-in): on the standard files the 16 GB judge (units 1..2) is deployed on six 1-GPU replicas
    and most GPUs idle; grown 2-GPU replicas run its calls on two GPUs (ideal ACT is measured at units.max).
    Each grown replica (the 140 GB judge's too, on 4 GPUs) sits only beside replicas of its own model, and
    the run stays audit-clean."""
    root = Path(__file__).resolve().parents[1] / "resources" / "bench"
    from tangram_dask.cluster import load_cluster
    from tangram_dask.workload import load_workload
    wl, cl = load_workload(root / "standard.yaml"), load_cluster(root / "cluster-standard.yaml")
    gen = generate(wl)
    small = [i for i, k in enumerate(wl.kinds) if k.kind == "judge_small"][0]
    act = {}
    for g in (0.0, 1.0):
        pol = make_policy("tangram", cl, wl, options=TangramOptions(grow=g))
        res = Simulator(gen, cl, pol, audit=True).run()
        act[g] = float((res.end - res.issue)[gen.kind == small].mean())
        if g:
            assert pol.grows >= 1 and res.model_loads == pol.grows  # nothing else loads on this cluster
            gp = pol.gpu
            deployed = {"rm-small": 1, "rm-large": 2}  # GPUs per replica in the static split
            grown = [r for r in gp.replicas.values() if len(r.gpus) > deployed[r.model]]
            assert len(grown) == pol.grows and {r.model for r in grown} >= {"rm-small"}
            for r in grown:
                beside = {gp.replicas[o].model for i in r.gpus for o in gp.nodes[r.node].gpus[i].replicas}
                assert beside == {r.model}
        else:
            assert pol.grows == 0
    assert act[1.0] < 0.85 * act[0.0]  # measured 1.30 s against 1.71 s
