"""The simulator (``tangram_dask/sim.py``) through its public API, as tables of named cases.

``Simulator(gen, cluster, policy, audit=True).run()`` on tiny hand-made runs
(``conftest.hand_run``: per trajectory, ``(llm delay, kind, true duration)``;
hints equal the truth), with every issue and end time worked out by hand in
the case's comment. The policies used are the simplest that make the cost
under test happen: ``fifo`` (units.min, first node that fits, warm sandbox),
``static`` (a sandbox bound per trajectory, started cold at admission) and,
for elastic sizing, ``tangram`` on an idle cluster with parallel fraction 1
(a unit more always saves exactly what it costs, so it takes units.max).
The fifo and static cases with GPUs, LRU and topology live in test_fifo.py
and test_static.py; these cases are about what the simulator charges.
"""

from __future__ import annotations

import pytest
from conftest import hand_run, kind, make_cluster, make_workload

from tangram_dask.errors import FileFormatError
from tangram_dask.policy import make_policy
from tangram_dask.sim import Simulator, check_fits


def run(policy: str, tools: list[dict], rewards: list[dict], trajectories: list[list[tuple]], cluster: dict,
        **wl):
    spec = make_workload(tools, rewards, trajectories=len(trajectories), **wl)
    gen = hand_run(spec, trajectories)
    cl = make_cluster(**cluster)
    return Simulator(gen, cl, make_policy(policy, cl, spec), audit=True).run()


REWARD = kind("reward", dur=1.0)

SIM_CASES = [
    # warm start 0.5 on every CPU action. t=1 tool issued, runs 0.5 + 2 -> ends 3.5; the reward is issued
    # at once (llm 0), runs 0.5 + 1 -> ends 5.
    pytest.param("fifo", [kind("tool", dur=2.0)], [REWARD], [[(1.0, "tool", 2.0), (0.0, "reward", 1.0)]],
                 {"cpu": [{"slots": 1}], "warm": 0.5, "cold": 3.0},
                 [1.0, 3.5], [3.5, 5.0], (0, 0, 0), id="warm-start"),
    # static: the trajectory's sandbox starts cold at admission (t=0, 3 s), its first action is issued
    # after that and its LLM delay: 3 + 1 = 4; a bound sandbox costs nothing more: ends 4 + 2 = 6; reward 6 -> 7
    pytest.param("static", [kind("tool", dur=2.0)], [REWARD], [[(1.0, "tool", 2.0), (0.0, "reward", 1.0)]],
                 {"cpu": [{"slots": 2}], "warm": 0.5, "cold": 3.0},
                 [4.0, 6.0], [6.0, 7.0], (0, 1, 0), id="cold-start-at-admission"),
    # restore: "st" keeps state on its trajectory's node (restore 2 s). Two nodes of 1 slot, fifo (first fit).
    # T0: st at 1 on cpu-0, ends 2. T1: st (10 s) issued 2.5 -> cpu-0 (first free), ends 12.5; reward 12.5 ->
    # cpu-0 -> 13.5. T0: st issued 2 + 1 = 3, cpu-0 busy -> cpu-1, state moves: 2 + 1 -> ends 6; its reward
    # at 6 -> cpu-1 -> 7. One restore.
    pytest.param("fifo", [kind("st", dur=1.0, affinity="trajectory", restore_s=2.0)], [REWARD],
                 [[(1.0, "st", 1.0), (1.0, "st", 1.0), (0.0, "reward", 1.0)],
                  [(2.5, "st", 10.0), (0.0, "reward", 1.0)]],
                 {"cpu": [{"count": 2, "slots": 1}]},
                 [1.0, 3.0, 6.0, 2.5, 12.5], [2.0, 6.0, 7.0, 12.5, 13.5], (0, 0, 1), id="restore-when-state-moves"),
    # no restore when the state stays: same as above on one node of 2 slots: T0's second st runs where its
    # state is (3 -> 4), reward 4 -> 5; T1 2.5 -> 12.5 -> 13.5
    pytest.param("fifo", [kind("st", dur=1.0, affinity="trajectory", restore_s=2.0)], [REWARD],
                 [[(1.0, "st", 1.0), (1.0, "st", 1.0), (0.0, "reward", 1.0)],
                  [(2.5, "st", 10.0), (0.0, "reward", 1.0)]],
                 {"cpu": [{"slots": 2}]},
                 [1.0, 3.0, 4.0, 2.5, 12.5], [2.0, 4.0, 5.0, 12.5, 13.5], (0, 0, 0), id="no-restore-on-home"),
    # Amdahl on 4 units: tangram on an idle node of 4 slots, tool units 1..4, p = 1: S(4) = 4:
    # 8 s of work on 1 unit -> 2 s: 1 -> 3; reward 3 -> 4
    pytest.param("tangram", [kind("tool", dur=8.0, units=(1, 4), p=1.0)], [REWARD],
                 [[(1.0, "tool", 8.0), (0.0, "reward", 1.0)]], {"cpu": [{"slots": 4}]},
                 [1.0, 3.0], [3.0, 4.0], (0, 0, 0), id="amdahl-p1-on-units-max"),
    # fifo runs the same tool on units.min = 1: 8 s: 1 -> 9; reward 9 -> 10
    pytest.param("fifo", [kind("tool", dur=8.0, units=(1, 4), p=1.0)], [REWARD],
                 [[(1.0, "tool", 8.0), (0.0, "reward", 1.0)]], {"cpu": [{"slots": 4}]},
                 [1.0, 9.0], [9.0, 10.0], (0, 0, 0), id="amdahl-units-min-no-speedup"),
    # API tokens: 1 token, two searches (2 s) issued at t=1 together: the second waits: ends 3 and 5;
    # rewards (cpu, 4 slots) right after: 3 -> 4 and 5 -> 6
    pytest.param("fifo", [kind("search", "api", dur=2.0)], [REWARD],
                 [[(1.0, "search", 2.0), (0.0, "reward", 1.0)], [(1.0, "search", 2.0), (0.0, "reward", 1.0)]],
                 {"cpu": [{"slots": 4}], "tokens": 1},
                 [1.0, 3.0, 1.0, 5.0], [3.0, 4.0, 5.0, 6.0], (0, 0, 0), id="api-token-serialises"),
    # model load: one 80 GB GPU, models A (60 GB, most demand: resident at t=0) and B (60 GB, load 10 s):
    # both cannot be resident. tool 1 -> 2; reward on B issued at 2: evict A, load B 10 s, run 2 s: ends 14
    pytest.param("fifo", [kind("tool", dur=1.0), kind("gA", "gpu", model="A", weight=1.0)],
                 [kind("rB", "gpu", dur=2.0, model="B", weight=0.1)],
                 [[(1.0, "tool", 1.0), (0.0, "rB", 2.0)]],
                 {"cpu": [{"slots": 1}], "gpu": [{"gpus": 1, "gpu_memory_gb": 80}]},
                 [1.0, 2.0], [2.0, 14.0], (1, 0, 0), id="model-load"),
    # resident model: the reward on A needs no load: 2 -> 4
    pytest.param("fifo", [kind("tool", dur=1.0), kind("gA", "gpu", model="A", weight=1.0)],
                 [kind("rA", "gpu", dur=2.0, model="A", weight=1.0)],
                 [[(1.0, "tool", 1.0), (0.0, "rA", 2.0)]],
                 {"cpu": [{"slots": 1}], "gpu": [{"gpus": 1, "gpu_memory_gb": 80}]},
                 [1.0, 2.0], [2.0, 4.0], (0, 0, 0), id="model-resident-no-load"),
]


@pytest.mark.parametrize("policy, tools, rewards, trajectories, cluster, issue, end, counts", SIM_CASES)
def test_simulated_times(policy, tools, rewards, trajectories, cluster, issue, end, counts):
    models = {}
    for k in tools + rewards:
        if k.get("model"):
            models[k["model"]] = {"gpu_memory_gb": 60, "load_s": 10}
    res = run(policy, tools, rewards, trajectories, cluster, **({"models": models} if models else {}))
    assert res.issue.tolist() == pytest.approx(issue, abs=1e-9)
    assert res.end.tolist() == pytest.approx(end, abs=1e-9)
    assert (res.model_loads, res.cold_starts, res.restores) == counts
    assert res.step_end == [pytest.approx(max(end))]


@pytest.mark.parametrize("units, p, dur, warm, ideal", [
    # ideal = duration on units.max (Amdahl, relative to units.min) + the warm start
    # (1, 4), p = 0.5: S(1) = 1, S(4) = 1 / (0.5 + 0.125) = 1.6: 10 / 1.6 = 6.25
    pytest.param((1, 4), 0.5, 10.0, 0.0, 6.25, id="p0.5-1-to-4"),
    # (2, 4), p = 0.5: S(2) = 1 / 0.75 = 4/3; 10 x S(2) / S(4) = 10 x (4/3) / 1.6 = 8.333...; + warm 0.5
    pytest.param((2, 4), 0.5, 10.0, 0.5, 10 * (4 / 3) / 1.6 + 0.5, id="p0.5-2-to-4-plus-warm"),
    # p = 0: no speedup whatever the units
    pytest.param((1, 8), 0.0, 10.0, 0.0, 10.0, id="p0-no-speedup"),
    # p = 1: linear: 12 / 3
    pytest.param((1, 3), 1.0, 12.0, 0.0, 4.0, id="p1-linear"),
])
def test_ideal_uses_amdahl_on_units_max(units, p, dur, warm, ideal):
    res = run("fifo", [kind("tool", dur=dur, units=units, p=p)], [REWARD],
              [[(1.0, "tool", dur), (0.0, "reward", 1.0)]], {"cpu": [{"slots": 8}], "warm": warm})
    assert res.ideal[0] == pytest.approx(ideal, rel=1e-12)
    assert res.ideal[1] == pytest.approx(1.0 + warm)


def test_cross_group_slowdown():
    """Two 80 GB GPUs in groups [1, 1]; model L (100 GB) needs both, so its replica spans the groups.

    The static split at t=0 places no replica across groups, so L is loaded on demand.
    t=1 tool -> 2; the reward on L: load 30 s (not slowed), then 4 s x slowdown 3 = 12: ends 2 + 30 + 12 = 44.
    """
    spec = make_workload([kind("tool")], [kind("rL", "gpu", dur=4.0, model="L", units=(2, 2))],
                         models={"L": {"gpu_memory_gb": 100, "load_s": 30}})
    gen = hand_run(spec, [[(1.0, "tool", 1.0), (0.0, "rL", 4.0)]])
    cl = make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 2, "gpu_memory_gb": 80, "groups": [1, 1]}], slowdown=3.0)
    res = Simulator(gen, cl, make_policy("fifo", cl, spec), audit=True).run()
    assert res.end.tolist() == pytest.approx([2.0, 44.0])
    assert res.model_loads == 1


FITS_ERRORS = [
    # a tool of units.min 3 on nodes of 2 slots
    pytest.param([kind("tool", units=(3, 4))], [REWARD], {"cpu": [{"count": 2, "slots": 2}]},
                 [[(1.0, "tool", 1.0), (0.0, "reward", 1.0)]], "tools[0].units.min", ("3", "2"), id="cpu-too-big"),
    # the second tool kind needs 2 tokens, the cluster has 1
    pytest.param([kind("tool"), kind("search", "api", units=(2, 2))], [REWARD], {"cpu": [{"slots": 2}], "tokens": 1},
                 [[(1.0, "search", 1.0), (0.0, "reward", 1.0)]], "tools[1].units.min", ("2", "1"),
                 id="api-too-few-tokens"),
    # a 200 GB model on 80 GB GPUs, two per node: a replica needs 3 GPUs
    pytest.param([kind("tool")], [kind("rm", "gpu", model="big")], {"cpu": [{"slots": 1}],
                                                                    "gpu": [{"gpus": 2, "gpu_memory_gb": 80}]},
                 [[(1.0, "tool", 1.0), (0.0, "rm", 1.0)]], "rewards[0].model", ("big",), id="gpu-model-fits-no-node"),
    # a reward on the API with no tokens at all
    pytest.param([kind("tool")], [kind("judge", "api")], {"cpu": [{"slots": 1}]},
                 [[(1.0, "tool", 1.0), (0.0, "judge", 1.0)]], "rewards[0].units.min", ("judge",), id="api-no-tokens"),
]


@pytest.mark.parametrize("tools, rewards, cluster, trajectories, key, words", FITS_ERRORS)
def test_check_fits_errors(tools, rewards, cluster, trajectories, key, words):
    models = {"big": {"gpu_memory_gb": 200, "load_s": 10}} if any(k.get("model") == "big" for k in rewards) else {}
    spec = make_workload(tools, rewards, trajectories=len(trajectories), **({"models": models} if models else {}))
    gen = hand_run(spec, trajectories)
    cl = make_cluster(**cluster)
    with pytest.raises(FileFormatError) as info:
        check_fits(gen, cl)
    assert info.value.key == key
    assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(FileFormatError):  # run() checks first, whatever the policy
        Simulator(gen, cl, make_policy("fifo", cl, spec)).run()


def test_check_fits_ignores_kinds_the_run_never_uses():
    """A kind too big for the cluster that no trajectory issues is no error."""
    spec = make_workload([kind("tool"), kind("huge", units=(9, 9), weight=0.01)], [REWARD])
    gen = hand_run(spec, [[(1.0, "tool", 1.0), (0.0, "reward", 1.0)]])
    cl = make_cluster(cpu=[{"slots": 2}])
    check_fits(gen, cl)
    assert Simulator(gen, cl, make_policy("fifo", cl, spec), audit=True).run().end.tolist() == [2.0, 3.0]


@pytest.mark.parametrize("background", [0.0, 1.0])
def test_a_replica_wider_than_the_contracts_is_refused_unless_the_policy_says_so(background):
    """WORKLOAD.md: "A replica is loaded on the smallest k >= units.min whose share fits a GPU". A 30 GB
    model whose calls take 1..2 GPUs (and run faster on 2), on two idle 80 GB GPUs: tangram with ``wide_replicas``
    (opt-in) loads a 2-GPU replica. Declared (``beyond_contract``), the run goes on and the bench names the option;
    with the declaration taken away, the simulator stops at that load, naming the rule and the size.
    (The policy starts with nothing resident, so that the first call loads.)"""
    from tangram_dask.bench import simulate as bench_simulate
    from tangram_dask.policy import TangramOptions, TangramPolicy
    from tangram_dask.sim import AuditError

    spec = make_workload([kind("tool")], [kind("prm", "gpu", dur=1.0, model="prm", units=(1, 2), p=0.5)],
                         models={"prm": {"gpu_memory_gb": 30, "load_s": 5}})
    gen = hand_run(spec, [[(1.0, "tool", 1.0), (0.0, "prm", 1.0)]])
    cl = make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 2, "gpu_memory_gb": 80, "groups": [2]}])
    opts = TangramOptions(wide_replicas=1.0, background_load=background)
    assert bench_simulate(gen, cl, "tangram", options=opts)["beyond_contract"] == ["wide_replicas"]
    assert "beyond_contract" not in bench_simulate(gen, cl, "tangram")
    assert Simulator(gen, cl, TangramPolicy(cl, spec.models, (), options=opts)).run().model_loads == 1
    assert Simulator(gen, cl, TangramPolicy(cl, spec.models, ())).run().model_loads == 1  # the default: 1 GPU
    pol = TangramPolicy(cl, spec.models, (), options=opts)
    pol.beyond_contract = ()
    with pytest.raises(AuditError, match=r"replica of prm on 2 GPUs of gpu-0, where WORKLOAD.md loads one on 1 "):
        Simulator(gen, cl, pol).run()
