"""The live benchmark on a tiny workload: same keys as the simulator, every action done."""

from __future__ import annotations

from tangram_dask.bench import simulate
from tangram_dask.live import run_live, worker_specs
from tangram_dask.workload import generate

from conftest import kind, make_cluster, make_workload


def _tiny():
    wl = make_workload(
        tools=[kind("code", "cpu", 0.5, units=(1, 2), p=0.5), kind("search", "api", 0.3, weight=0.5)],
        rewards=[kind("judge", "gpu", 0.5, model="rm")],
        trajectories=3, turns=2, llm=0.2, models={"rm": {"gpu_memory_gb": 16, "load_s": 1.0}})
    cl = make_cluster(cpu=[{"count": 1, "slots": 2}],
                      gpu=[{"count": 1, "gpus": 2, "gpu_memory_gb": 80, "groups": [1, 1]}],
                      tokens=1, warm=0.05, cold=0.5)
    return wl, cl


def test_worker_specs_one_process_per_node_and_an_api_worker():
    _, cl = _tiny()
    specs = worker_specs(cl)
    assert sorted(specs) == ["api", "cpu-0", "gpu-0"]
    assert specs["cpu-0"]["options"]["resources"] == {"slots": 2}
    assert specs["gpu-0"]["options"]["config"]["tangram"]["worker"]["gpu-groups"] == [1, 1]


def test_live_run_reports_the_simulators_keys():
    wl, cl = _tiny()
    live = run_live(wl, cl, ("tangram", "fifo"), time_scale=0.05)
    sim = simulate(generate(wl), cl, "tangram")
    for r in live:
        assert set(sim) - {"sim_wall_s"} <= set(r)
        assert r["actions"] == generate(wl).n_actions == sum(k["count"] for k in r["by_kind"].values())
        assert r["act_mean_s"] >= r["ideal_act_mean_s"] * 0.9 > 0
        assert r["step_s"] > 0


def test_a_live_run_beyond_the_contract_says_so_as_the_simulator_does():
    """``grow`` may load replicas wider than WORKLOAD.md's smallest k: the live result names it
    (``beyond_contract``), as the simulator's bench does; at the defaults neither does."""
    from tangram_dask.policy import TangramOptions

    wl, cl = _tiny()
    (live,) = run_live(wl, cl, ("tangram",), time_scale=0.05, options=TangramOptions(grow=1.0))
    assert live["beyond_contract"] == ["grow"]
    assert simulate(generate(wl), cl, "tangram", options=TangramOptions(grow=1.0))["beyond_contract"] == ["grow"]
    assert "beyond_contract" not in simulate(generate(wl), cl, "tangram")


def test_a_live_run_with_trajectory_hints_queues_each_step_with_the_simulators_hints(monkeypatch):
    """``trajectory_hints``: live, each step is queued whole (``expect_trajectories``) with the hints the
    simulator gives, and the result says so as the simulator's does."""
    import tangram_dask.live as live_mod
    from tangram_dask.policy import TangramOptions
    from tangram_dask.sim import Simulator

    wl, cl = _tiny()
    seen: list[dict] = []
    real = live_mod.TangramSchedulerPlugin._handle_expect_trajectories

    def spy(self, trajectories=None):
        seen.append(dict(trajectories))
        return real(self, trajectories)

    monkeypatch.setattr(live_mod.TangramSchedulerPlugin, "_handle_expect_trajectories", spy)
    (live,) = run_live(wl, cl, ("tangram",), time_scale=0.05, options=TangramOptions(admit_long=2.0),
                       trajectory_hints=0.5)
    assert live["trajectory_hints"] == 0.5 and live["actions"] == generate(wl).n_actions
    sim = Simulator(generate(wl), cl, None, trajectory_hint_sigma=0.5)
    sim._setup()
    assert seen == [{f"0/{t}": h for t, h in enumerate(sim.traj_hint)}]
    assert simulate(generate(wl), cl, "tangram", trajectory_hints=0.5)["trajectory_hints"] == 0.5


def test_a_background_load_live_takes_its_load_time_and_counts(monkeypatch):
    """A ``Load`` decision, live: the GPUs are abstract and no model is registered, so the live bench plays
    the load as it plays actions, the replica ready after its ``load_s`` (scaled), as in the simulator.
    Before, the worker's load failed at once for want of a registered model, a failed background load
    reads as over, and the replica served at once: loads cost nothing live. The result counts the load,
    as the simulator's ``model_loads`` does."""
    import tangram_dask.live as live_mod
    from tangram_dask.policy.types import Load

    wl = make_workload(
        tools=[kind("prm", "gpu", 1.0, model="prm")], rewards=[kind("judge", "gpu", 0.5, model="rm")],
        trajectories=8, turns=4, llm=0.2,
        models={"prm": {"gpu_memory_gb": 16, "load_s": 2.0}, "rm": {"gpu_memory_gb": 16, "load_s": 2.0}})
    cl = make_cluster(cpu=[{"count": 1, "slots": 2}],
                      gpu=[{"count": 1, "gpus": 3, "gpu_memory_gb": 80, "groups": [1, 1, 1]}])
    sim = simulate(generate(wl), cl, "tangram")
    assert sim["model_loads"] >= 1  # the process reward model's calls outgrow its deployed replicas
    asked: dict[int, float] = {}
    ready: dict[int, float] = {}
    real_load, real_ready = live_mod.LivePlugin._load, live_mod.LivePlugin.replica_ready

    def load(self, d: Load) -> None:
        asked[d.replica] = self.now()
        real_load(self, d)

    def replica_ready(self, worker: str, replica: int) -> None:
        ready.setdefault(replica, self.now())
        real_ready(self, worker, replica)

    monkeypatch.setattr(live_mod.LivePlugin, "_load", load)
    monkeypatch.setattr(live_mod.LivePlugin, "replica_ready", replica_ready)
    (live,) = run_live(wl, cl, ("tangram",), time_scale=0.05)
    assert asked and set(asked) <= set(ready)
    assert all(ready[r] - t >= 2.0 * 0.95 for r, t in asked.items()), (asked, ready)
    assert live["model_loads"] >= len(asked) and live["actions"] == generate(wl).n_actions


def test_live_the_policy_sees_each_whole_step_end(monkeypatch):
    """``steps_knee`` and ``steps_gpu_lean`` apply once a whole step has ended (``TangramPolicy.lulls``): live,
    the plugin's policy sees the lull at each step's end as the simulator's does (every trajectory of the step
    ended through ``end_trajectory``, none waiting), here 8 trajectories a step, the warm-up's count."""
    from dataclasses import replace

    import tangram_dask.live as live_mod
    from tangram_dask.policy import make_policy
    from tangram_dask.sim import Simulator

    wl, cl = _tiny()
    wl = replace(wl, trajectories=8, steps=2, train_time_s=1.0)
    made = []
    real = live_mod.make_plugin

    def make_plugin(*a, **k):
        made.append(real(*a, **k))
        return made[-1]

    monkeypatch.setattr(live_mod, "make_plugin", make_plugin)
    (live,) = run_live(wl, cl, ("tangram",), time_scale=0.05)
    assert live["actions"] == generate(wl).n_actions and made[0].policy.lulls == 2
    pol = make_policy("tangram", cl, wl)
    Simulator(generate(wl), cl, pol).run()
    assert pol.lulls == 2
