"""``static`` (WORKLOAD.md): trajectories bind a sandbox (and a token) for life; GPUs are split up front."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import approx, hand_run, kind, lru_case, make_cluster, make_workload, simulate

from tangram_dask.policy import StaticPolicy, make_policy
from tangram_dask.policy.types import Admit
from tangram_dask.sim import AuditError
from tangram_dask.workload import generate


def test_admission_cold_start_and_clamped_units():
    """One node of 4 slots, sandbox_units 2, three trajectories of 2 turns (LLM 1 s).

    Tool: units 1..4, p = 1, 4 s on 1 unit: runs on clamp(2, 1, 4) = 2 units: 2 s.
    Reward: units 1..1, 1 s: runs on clamp(2, 1, 1) = 1 unit: 1 s. No warm start.
    t=0 T0 and T1 admitted (2 + 2 slots), T2 waits. Each pays cold start 3 s before
    its first turn: tools 4-6 and 7-9, reward 9-10. At 10 both end and free their
    sandboxes: T2 admitted, tools 14-16, 17-19, reward 19-20.
    """
    wl = make_workload([kind("tool", dur=4.0, units=(1, 4), p=1.0)], [kind("reward", dur=1.0)],
                       trajectories=3, turns=2, static={"sandbox_units": 2})
    cl = make_cluster(cpu=[{"slots": 4}], cold=3.0, warm=0.5)
    run = simulate(wl, cl, "static")
    admits = run.admits()
    assert [(t, a.trajectory, a.node, a.units, a.tokens, a.setup_s) for t, a in admits] == [
        (0.0, "0/0", "cpu-0", 2, 0, 3.0), (0.0, "0/1", "cpu-0", 2, 0, 3.0), (10.0, "0/2", "cpu-0", 2, 0, 3.0)]
    starts = run.starts()
    assert {d.sandbox for _, d in starts.values()} == {"bound"}
    assert [starts[a][1].units for a in range(3)] == [2, 2, 1]
    r = run.result
    assert r.issue.tolist() == [4, 7, 9, 4, 7, 9, 14, 17, 19]
    assert run.act.tolist() == approx([2, 2, 1] * 3)
    m = run.metrics
    assert (m["cold_starts"], m["model_loads"], m["restores"]) == (3, 0, 0)
    assert m["step_s"] == approx(20.0)
    # busy: 3 cold starts x 2 slots x 3 s = 18, plus per trajectory 2 x (2 units x 2 s) + 1 = 9: 45 over 4 x 20
    assert m["utilization"]["cpu"] == approx(45 / 80)
    # the ideal is warm sandboxes on units.max: tool 4 x S(1)/S(4) + 0.5 = 1.5, reward 1.5
    assert m["ideal_act_mean_s"] == approx(1.5)
    # a bound sandbox pays no warm start, so static's reward ACT (1 s) is below that ideal
    assert m["by_kind"]["reward"]["act_mean_s"] < m["by_kind"]["reward"]["ideal_act_mean_s"]


def test_one_api_token_per_trajectory_when_the_workload_has_api_actions():
    """Room for 4 sandboxes but one token: trajectories are admitted one at a time.

    T0 at 0 (cold 3): search 4-6, reward 6-7; T1 admitted at 7: search 11-13, reward 13-14.
    """
    wl = make_workload([kind("search", "api", dur=2.0)], [kind("reward", dur=1.0)], trajectories=2)
    cl = make_cluster(cpu=[{"slots": 8}], tokens=1, cold=3.0)
    run = simulate(wl, cl, "static")
    assert [(t, a.units, a.tokens) for t, a in run.admits()] == [(0.0, 2, 1), (7.0, 2, 1)]
    assert run.result.end.tolist() == [6, 7, 13, 14]
    assert run.metrics["step_s"] == approx(14.0)
    assert run.metrics["utilization"]["api"] == approx(4 / 14)


def test_no_token_is_held_without_api_actions():
    wl = make_workload([kind("tool")], [kind("reward")], trajectories=3)
    run = simulate(wl, make_cluster(cpu=[{"slots": 6}], tokens=1), "static")
    assert [(t, a.tokens) for t, a in run.admits()] == [(0.0, 0)] * 3


def test_sandbox_units_grow_to_the_largest_cpu_units_min():
    """A kind that needs 3 slots cannot run in a 2-slot sandbox: the sandbox is sized 3."""
    wl = make_workload([kind("big", units=(3, 4))], [kind("reward")], static={"sandbox_units": 2})
    pol = make_policy("static", make_cluster(cpu=[{"slots": 4}]), wl)
    assert isinstance(pol, StaticPolicy) and pol.sandbox_units == 3
    run = simulate(wl, make_cluster(cpu=[{"slots": 4}]), "static")
    assert run.admits()[0][1].units == 3


def _gpu_case():
    """One node of 2 GPUs (80 GB); models A and B of 40 GB; the split gives A GPU 0 and B GPU 1.

    Two trajectories: a 1 s tool then an A reward of 2 s, issued together.
    """
    wl = make_workload([kind("tool")],
                       [kind("rA", "gpu", dur=2.0, model="A", weight=0.9),
                        kind("rB", "gpu", dur=2.0, model="B", weight=0.1)],
                       trajectories=2, models={"A": {"gpu_memory_gb": 40, "load_s": 10},
                                               "B": {"gpu_memory_gb": 40, "load_s": 10}})
    gen = hand_run(wl, [[(1.0, "tool", 1.0), (0.0, "rA", 2.0)]] * 2)
    cl = make_cluster(cpu=[{"slots": 4}], gpu=[{"gpus": 2, "gpu_memory_gb": 80}], cold=3.0)
    return gen, cl


def test_waits_for_a_replica_of_its_own_model_and_never_loads():
    """Rewards issued at 5 (cold 3 + LLM 1 + tool 1): the first runs on A's replica 5-7, the second
    waits for it (7-9) although GPU 1 is idle and has room for A: static never loads or evicts."""
    gen, cl = _gpu_case()
    run = simulate(gen, cl, "static")
    starts = run.starts()
    assert ([(starts[a][0], starts[a][1].gpus, starts[a][1].load) for a in (1, 3)]
            == [(5.0, (0,), False), (7.0, (0,), False)])
    assert run.act[[1, 3]].tolist() == approx([2.0, 4.0])
    assert run.metrics["model_loads"] == 0
    assert all(not d.evict for _, d in starts.values())


def test_fifo_on_the_same_case_loads_a_second_replica():
    """The contrast: fifo loads A beside B on GPU 1 (40 + 40 GB fit), paying load_s 10."""
    gen, cl = _gpu_case()
    run = simulate(gen, cl, "fifo")
    second = run.starts()[3][1]
    assert (second.gpus, second.load, second.evict) == ((1,), True, ())
    assert run.act[[1, 3]].tolist() == approx([2.0, 12.0])
    assert run.metrics["model_loads"] == 1


def test_static_actions_never_restore():
    """A stateful tool always runs in its trajectory's own sandbox: never a restore."""
    wl = make_workload([kind("S", affinity="trajectory", restore_s=3.0)], [kind("rw")], trajectories=4, turns=3)
    gen = generate(wl)
    run = simulate(gen, make_cluster(cpu=[{"count": 2, "slots": 2}], cold=1.0), "static")
    assert run.metrics["restores"] == 0
    assert run.metrics["cold_starts"] == 4
    # two sandboxes at a time, one per node; every action runs on its trajectory's node
    home = {a.trajectory: a.node for _, a in run.admits()}
    assert home == {"0/0": "cpu-0", "0/1": "cpu-1", "0/2": "cpu-0", "0/3": "cpu-1"}
    for _, d in run.starts().values():
        t = int(np.searchsorted(gen.first, d.action, side="right")) - 1
        assert d.node == home[f"0/{t}"]


def test_static_rejects_an_action_of_a_trajectory_never_admitted():
    pol = make_policy("static", make_cluster(cpu=[{"slots": 2}]), make_workload())
    from tangram_dask import make_spec

    with pytest.raises(ValueError, match="never admitted"):
        pol.submit(0, make_spec("tool", trajectory="ghost"), 0.0)


def test_static_admit_is_an_admit_decision():
    pol = make_policy("static", make_cluster(cpu=[{"slots": 2}], cold=2.0), make_workload())
    pol.begin_trajectory("t", 0.0)
    assert pol.schedule(0.0) == [Admit("t", 2.0, "cpu-0", 2, 0)]
    pol.begin_trajectory("u", 0.0)
    assert pol.schedule(0.0) == []  # no second sandbox of 2 slots
    pol.end_trajectory("t", 5.0)
    assert pol.schedule(5.0) == [Admit("u", 2.0, "cpu-0", 2, 0)]


# -- what static cannot serve: a clear report, not a silent hang -------------------------------
def test_a_model_left_out_of_the_split_is_named():
    """One GPU, three models: the split places only A. static never loads, so B's action waits for
    good; the run says which kind waits and why."""
    gen, _ = lru_case()
    cl = make_cluster(cpu=[{"slots": 2}], gpu=[{"gpus": 1, "gpu_memory_gb": 80}])
    with pytest.raises(AuditError, match=r"1 x gB \(gpu, model B: no replica resident\)"):
        simulate(gen, cl, "static")
    assert simulate(gen, cl, "fifo").metrics["model_loads"] == 3  # fifo serves it, loading on demand


def test_a_sandbox_larger_than_every_node_is_named():
    wl = make_workload([kind("tool")], [kind("reward")], trajectories=2, static={"sandbox_units": 4})
    with pytest.raises(AuditError, match="2 trajectories not admitted"):
        simulate(wl, make_cluster(cpu=[{"count": 2, "slots": 3}]), "static")


def test_cold_starts_are_counted_even_when_free():
    """cold_start_s 0: static still starts one sandbox per trajectory at admission, and counts it."""
    wl = make_workload([kind("tool")], [kind("reward")], trajectories=3)
    run = simulate(wl, make_cluster(cpu=[{"slots": 2}], cold=0.0), "static")
    assert run.metrics["cold_starts"] == 3
    assert run.metrics["step_s"] == approx(3 * 3.0)  # one sandbox at a time: 1 s LLM + 1 s tool + 1 s reward each
