"""``fifo`` (WORKLOAD.md): small hand-made runs whose every number is worked out on paper.

Constant distributions and ``hint_sigma: 0`` make every duration exact; the
runs are simulated under audit (an independent ledger checks every decision).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import approx, hand_run, kind, lru_case, make_cluster, make_workload, simulate, topology_case


def test_units_min_first_fit_and_warm_start():
    """Two trajectories, one turn: LLM 1 s, a tool of units 1..2 (p = 1, 4 s on 1 unit), a 1 s reward.

    fifo runs both tools on units.min = 1 on cpu-0, the first node that fits
    (cpu-1 stays idle although it is free), each paying warm_start 0.5 s:
    tool ACT 0.5 + 4 = 4.5 (ends 5.5), reward ACT 0.5 + 1 = 1.5 (ends 7).
    Ideal: tool on units.max 2: 4 x S(1)/S(2) = 2, + 0.5 warm = 2.5; reward 1.5.
    """
    wl = make_workload([kind("tool", dur=4.0, units=(1, 2), p=1.0)], [kind("reward", dur=1.0)], trajectories=2)
    cl = make_cluster(cpu=[{"count": 2, "slots": 2}], warm=0.5, cold=3.0)
    run = simulate(wl, cl, "fifo")
    starts = run.starts()
    assert ([(starts[a][1].node, starts[a][1].units, starts[a][1].sandbox) for a in range(4)]
            == [("cpu-0", 1, "warm")] * 4)
    assert run.act.tolist() == approx([4.5, 1.5, 4.5, 1.5])
    m = run.metrics
    assert m["step_s"] == approx(7.0)
    assert m["ideal_act_mean_s"] == approx(2.0)
    assert m["by_kind"]["tool"]["ideal_act_mean_s"] == approx(2.5)
    assert m["ideal_step_s"] == approx(1.0 + 2.5 + 1.5)
    assert (m["cold_starts"], m["model_loads"], m["restores"]) == (0, 0, 0)
    # busy: per trajectory 1 unit x (0.5 + 4) + 1 x (0.5 + 1) = 6; capacity 4 slots x 7 s
    assert m["utilization"] == approx({"cpu": 12 / 28, "gpu": 0.0, "api": 0.0})


def test_one_slot_serialises_in_arrival_order_and_metrics_by_hand():
    """Three trajectories, one slot, no sandbox cost: tools of 2 s issued together at t = 1, rewards of 1 s.

    t 1-3 tool0, 3-5 tool1, 5-7 tool2 (arrival order); reward0 issued at 3
    waits behind the older tools: 7-8; reward1 (issued 5) 8-9; reward2 (issued 7) 9-10.
    ACTs: tools 2, 4, 6; rewards 5, 4, 3.
    """
    wl = make_workload([kind("tool", dur=2.0)], [kind("reward", dur=1.0)], trajectories=3)
    run = simulate(wl, make_cluster(cpu=[{"slots": 1}]), "fifo")
    r = run.result
    assert r.issue.tolist() == [1, 3, 1, 5, 1, 7]
    assert r.end.tolist() == [3, 8, 5, 9, 7, 10]
    start_order = [d.action for _, d in sorted(run.starts().values(), key=lambda x: x[0])]
    assert start_order == [0, 2, 4, 1, 3, 5]
    m = run.metrics
    # all ACTs 2 5 4 4 6 3: sorted 2 3 4 4 5 6; p99 at position 0.99 x 5 = 4.95: 5 + 0.95 x (6 - 5)
    assert (m["act_mean_s"], m["act_p50_s"], m["act_p99_s"]) == approx((4.0, 4.0, 5.95))
    # tools 2 4 6: p99 at 1.98 -> 4 + 0.98 x 2; rewards 3 4 5 -> 4 + 0.98
    assert m["by_kind"]["tool"] == approx({"act_mean_s": 4.0, "act_p50_s": 4.0, "act_p99_s": 5.96,
                                          "ideal_act_mean_s": 2.0, "floor_act_mean_s": 2.0, "count": 3})
    assert m["by_kind"]["reward"] == approx({"act_mean_s": 4.0, "act_p50_s": 4.0, "act_p99_s": 4.98,
                                            "ideal_act_mean_s": 1.0, "floor_act_mean_s": 1.0, "count": 3})
    assert m["act_p99_s"] == approx(float(np.percentile(run.act, 99)))
    # no sandbox cost here, and units.max is 1: the floor is the ideal
    assert (m["step_s"], m["ideal_step_s"]) == approx((10.0, 4.0))
    assert (m["ideal_act_mean_s"], m["floor_act_mean_s"]) == approx((1.5, 1.5))
    # 9 busy slot-seconds over 1 slot x 10 s
    assert m["utilization"] == approx({"cpu": 0.9, "gpu": 0.0, "api": 0.0})
    assert m["actions"] == 6


def test_an_action_that_does_not_fit_does_not_block_younger_ones():
    """As with Dask worker resources: a 2-slot tool waiting for room lets a younger 1-slot one pass.

    One node of 2 slots. t=1 a (1 slot, 5 s) starts; t=2 b (2 slots) does not
    fit; t=3 c (1 slot, 1 s) starts at once; b starts when a ends at 6.
    """
    wl = make_workload([kind("one", dur=5.0), kind("two", dur=1.0, units=(2, 2)), kind("short", dur=1.0)],
                       [kind("reward", "api", dur=0.5)], trajectories=3)
    gen = hand_run(wl, [[(1.0, "one", 5.0), (0.0, "reward", 0.5)],
                        [(2.0, "two", 1.0), (0.0, "reward", 0.5)],
                        [(3.0, "short", 1.0), (0.0, "reward", 0.5)]])
    run = simulate(gen, make_cluster(cpu=[{"slots": 2}], tokens=4), "fifo")
    starts = run.starts()
    assert {a: starts[a][0] for a in (0, 2, 4)} == {0: 1.0, 2: 6.0, 4: 3.0}
    assert run.act[[0, 2, 4]].tolist() == approx([5.0, 5.0, 1.0])


def test_api_tokens_are_held_per_action():
    """One token, two trajectories whose search actions (2 s) are issued together at t = 1: one waits."""
    wl = make_workload([kind("search", "api", dur=2.0)], [kind("reward", dur=0.5)], trajectories=2)
    run = simulate(wl, make_cluster(cpu=[{"slots": 4}], tokens=1), "fifo")
    assert run.act[[0, 2]].tolist() == approx([2.0, 4.0])
    assert all(d.units == 1 and d.node == "api" for _, d in run.starts().values() if d.action in (0, 2))
    assert run.metrics["utilization"]["api"] == approx(4.0 / (1 * 5.5))  # 4 token-s over a 5.5 s step


def test_loads_on_demand_and_evicts_least_recently_used():
    gen, cl = lru_case()
    run = simulate(gen, cl, "fifo")
    assert [(r.model, r.gpus) for r in run.policy.gpu.replicas.values()] == [("C", (0,)), ("B", (0,))]
    starts = run.starts()
    # replica ids: A is 0 (resident at t = 0), then B 1, C 2, B again 3
    got = [(t, d.replica, d.load, d.evict) for a, (t, d) in sorted(starts.items())]
    assert got == [(1.0, 1, True, ()), (13.0, 0, False, ()), (15.0, 2, True, (1,)), (26.0, 3, True, (0,))]
    assert run.act.tolist() == approx([11.0, 1.0, 11.0, 11.0])
    m = run.metrics
    assert (m["model_loads"], m["step_s"]) == (3, approx(37.0))
    # load time holds the GPU: busy 11 + 1 + 11 + 11 = 34 GPU-s over 37 s
    assert m["utilization"]["gpu"] == approx(34 / 37)
    assert m["ideal_act_mean_s"] == approx(1.0)


def test_blind_to_topology_spans_groups_and_pays_the_slowdown():
    """The first L takes the resident replica (GPUs 1,2); the second loads on the first idle GPUs, 0 and 3,
    which span groups: ACT = load 30 + 4 x slowdown 2 = 38 (the slowdown is not applied to the load)."""
    gen, cl = topology_case()
    run = simulate(gen, cl, "fifo")
    starts = run.starts()
    first, second = starts[1][1], starts[3][1]
    assert (first.gpus, first.load, first.cross_group) == ((1, 2), False, False)
    assert (second.gpus, second.load, second.cross_group, second.evict) == ((0, 3), True, True, ())
    assert run.act[[1, 3]].tolist() == approx([4.0, 38.0])
    assert run.metrics["model_loads"] == 1
    assert run.metrics["step_s"] == approx(40.0)


def test_restore_when_a_stateful_action_moves_node():
    """Two nodes of one slot. T0: stateful S (5 s) then S again (1 s); T1: plain P (1 s), then P (10 s) after 4.5 s.

    t=1 T0's S on cpu-0 (first stateful: no restore), T1's P on cpu-1.
    t=6.5 T1's P takes cpu-0 (free since 6); t=7 T0's second S finds only cpu-1:
    it moves, paying restore_s 3: ACT 3 + 1 = 4.
    """
    wl = make_workload([kind("S", affinity="trajectory", restore_s=3.0), kind("P")], [kind("rw", dur=0.5)],
                       trajectories=2)
    gen = hand_run(wl, [[(1.0, "S", 5.0), (1.0, "S", 1.0), (0.0, "rw", 0.5)],
                        [(1.0, "P", 1.0), (4.5, "P", 10.0), (0.0, "rw", 0.5)]])
    run = simulate(gen, make_cluster(cpu=[{"count": 2, "slots": 1}]), "fifo")
    starts = run.starts()
    assert [(starts[a][1].node, starts[a][1].restore) for a in (0, 1)] == [("cpu-0", False), ("cpu-1", True)]
    assert starts[4][1].node == "cpu-0"
    assert run.act.tolist() == approx([5.0, 4.0, 0.5, 1.0, 10.0, 0.5])
    m = run.metrics
    assert (m["restores"], m["step_s"]) == (1, approx(17.0))
    # the restore holds the slot: busy 5 + (3 + 1) + 0.5 + 1 + 10 + 0.5 = 21 over 2 slots x 17 s
    assert m["utilization"]["cpu"] == approx(21 / 34)


def test_first_stateful_action_never_pays_restore():
    """Every stateful action of a lone trajectory on one node: no restore, ever."""
    wl = make_workload([kind("S", affinity="trajectory", restore_s=3.0)], [kind("rw")], turns=3)
    run = simulate(wl, make_cluster(cpu=[{"slots": 1}]), "fifo")
    assert run.metrics["restores"] == 0
    assert run.act.tolist() == approx([1.0] * 4)


@pytest.mark.parametrize("policy", ["fifo", "tangram"])
def test_lru_case_audits_clean_under_every_dynamic_policy(policy):
    gen, cl = lru_case()
    run = simulate(gen, cl, policy)
    assert (run.result.end > 0).all()
    assert run.metrics["model_loads"] >= 2  # B and C are not resident at t = 0


def test_completion_frees_its_slot_for_an_issue_at_the_same_instant():
    """Simultaneous events: completions before issues, then one scheduling pass. One slot: T0's tool
    runs 1-2; T1's tool is issued at exactly 2 and starts at once (ACT 1, no wait)."""
    wl = make_workload([kind("tool")], [kind("reward", "api")], trajectories=2)
    gen = hand_run(wl, [[(1.0, "tool", 1.0), (0.0, "reward", 1.0)], [(2.0, "tool", 1.0), (0.0, "reward", 1.0)]])
    run = simulate(gen, make_cluster(cpu=[{"slots": 1}], tokens=2), "fifo")
    assert run.starts()[2][0] == 2.0
    assert run.act.tolist() == approx([1.0, 1.0, 1.0, 1.0])


def test_steps_follow_each_other_after_train_time():
    """The one-slot case above, two steps, train_time_s 5: step 2 starts at 10 + 5 = 15 and repeats
    step 1 shifted (step_s 10 each). Utilization spans 0..25, training gap included: 18 / 25."""
    wl = make_workload([kind("tool", dur=2.0)], [kind("reward", dur=1.0)], trajectories=3, steps=2, train_time_s=5.0)
    run = simulate(wl, make_cluster(cpu=[{"slots": 1}]), "fifo")
    r = run.result
    assert (r.step_start, r.step_end) == ([0.0, 15.0], [10.0, 25.0])
    assert r.end[6:].tolist() == [e + 15 for e in r.end[:6].tolist()]
    m = run.metrics
    assert (m["step_s"], m["ideal_step_s"]) == approx((10.0, 4.0))
    assert m["utilization"]["cpu"] == approx(18 / 25)
    assert m["actions"] == 12


def test_helper_metrics_match_bench_simulate():
    """The recording helper of these tests computes exactly what tangram_dask.bench.simulate reports."""
    from tangram_dask.bench import simulate as bench_simulate
    from tangram_dask.workload import generate

    gen, cl = topology_case()
    for policy in ("fifo", "static", "tangram"):
        ours = simulate(gen, cl, policy).metrics
        theirs = bench_simulate(gen, cl, policy, audit=True)
        assert {k: theirs[k] for k in ours} == ours
    wl = make_workload([kind("tool", dur=2.0)], [kind("reward", dur=1.0)], trajectories=3)
    cl = make_cluster(cpu=[{"slots": 1}])
    assert bench_simulate(generate(wl), cl, "fifo", audit=True)["act_p99_s"] == approx(5.95)


def test_cancel_frees_what_it_held_and_is_safe_twice():
    from tangram_dask import make_spec
    from tangram_dask.policy import FifoPolicy

    pol = FifoPolicy(make_cluster(cpu=[{"slots": 2}]), {}, [])
    pol.submit("a", make_spec("tool", units=2), 0.0)
    pol.submit("b", make_spec("tool"), 0.0)
    assert [d.action for d in pol.schedule(0.0)] == ["a"]
    assert pol.cpu.total_free == 0
    assert pol.cancel("a") is True and pol.cancel("a") is False
    assert pol.cpu.total_free == 2
    assert pol.cancel("b") is True and pol.cancel("b") is False  # pending: forgotten
    assert pol.schedule(1.0) == []
    pol.finish("a", 2.0, 1.0)  # a late completion of a cancelled action changes nothing
    assert pol.cpu.total_free == 2


def test_first_idle_replica_by_node_then_gpu_index():
    """Two replicas of A (GPUs 0 and 1). GPU 0 serves 1-6, GPU 1 serves 2-3, so GPU 1 became idle first;
    at t = 7 both are idle and fifo takes GPU 0, the first by node then GPU index."""
    wl = make_workload([kind("gA", "gpu", model="A")], [kind("rw", "api", dur=0.1)], trajectories=3,
                       models={"A": {"gpu_memory_gb": 10, "load_s": 10}})
    gen = hand_run(wl, [[(1.0, "gA", 5.0), (0.0, "rw", 0.1)], [(2.0, "gA", 1.0), (0.0, "rw", 0.1)],
                        [(7.0, "gA", 1.0), (0.0, "rw", 0.1)]])
    run = simulate(gen, make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 2, "gpu_memory_gb": 80}], tokens=1), "fifo")
    starts = run.starts()
    assert [(starts[a][0], starts[a][1].gpus) for a in (0, 2, 4)] == [(1.0, (0,)), (2.0, (1,)), (7.0, (0,))]
    assert run.metrics["model_loads"] == 0
