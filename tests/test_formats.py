"""Workload and cluster files (format v1): errors name the file and the key; generation is deterministic."""

from __future__ import annotations

import math
from bisect import bisect_right

import numpy as np
import pytest
import yaml
from conftest import cluster_dict, const, deep, kind, workload_dict

from tangram_dask import FileFormatError
from tangram_dask.cluster import load_cluster, parse_cluster
from tangram_dask.workload import generate, load_workload, parse_workload

BENCH = "resources/bench"


def _gpu_workload() -> dict:
    return workload_dict(
        [kind("code_exec", units=(1, 2), p=0.3), kind("search", "api")],
        [kind("judge", "gpu", model="rm", units=(1, 2))],
        models={"rm": {"gpu_memory_gb": 16, "load_s": 10}},
    )


def _set(path: list, value):
    def edit(d: dict) -> dict:
        cur = d
        for p in path[:-1]:
            cur = cur[p]
        if value is _DELETE:
            del cur[path[-1]]
        else:
            cur[path[-1]] = value
        return d
    return edit


_DELETE = object()

# (id, edit of a valid workload dict, key named, words the problem must contain)
BAD_WORKLOADS = [
    ("unknown-top-key", _set(["colour"], "red"), "colour", "unknown key"),
    ("unknown-key-in-tool", _set(["tools", 0, "cores"], 2), "tools[0].cores", "unknown key"),
    ("unknown-key-in-units", _set(["tools", 1, "units", "best"], 2), "tools[1].units.best", "unknown key"),
    ("missing-name", _set(["name"], _DELETE), "name", "required"),
    ("missing-seed", _set(["seed"], _DELETE), "seed", "required"),
    ("missing-trajectories", _set(["trajectories"], _DELETE), "trajectories", "required"),
    ("missing-turns", _set(["turns"], _DELETE), "turns", "required"),
    ("missing-tools", _set(["tools"], _DELETE), "tools", "required"),
    ("missing-kind-weight", _set(["tools", 0, "weight"], _DELETE), "tools[0].weight", "required"),
    ("missing-duration", _set(["rewards", 0, "duration_s"], _DELETE), "rewards[0].duration_s", "required"),
    ("units-max-below-min", _set(["tools", 1, "units"], {"min": 4, "max": 2}), "tools[1].units.max", "units.min = 4"),
    ("units-min-zero", _set(["tools", 0, "units", "min"], 0), "tools[0].units.min", ">= 1"),
    ("unknown-dist", _set(["tools", 0, "duration_s"], {"dist": "pareto", "alpha": 2}), "tools[0].duration_s.dist",
     "pareto"),
    ("unknown-dist-turns", _set(["turns"], {"dist": "poisson", "mean": 3}), "turns.dist", "poisson"),
    ("dist-extra-key", _set(["llm_time_s"], {"dist": "constant", "value": 1, "sigma": 1}), "llm_time_s.sigma",
     "unknown key"),
    ("lognormal-missing-sigma", _set(["llm_time_s"], {"dist": "lognormal", "median": 1}), "llm_time_s.sigma",
     "required"),
    ("lognormal-median-zero", _set(["llm_time_s"], {"dist": "lognormal", "median": 0, "sigma": 1}), "llm_time_s.median",
     "> 0"),
    ("negative-duration", _set(["tools", 0, "duration_s"], const(-1)), "tools[0].duration_s.value", ">= 0"),
    ("uniform-high-below-low", _set(["llm_time_s"], {"dist": "uniform", "low": 3, "high": 1}), "llm_time_s.high",
     "low = 3"),
    ("geometric-mean-below-one", _set(["turns"], {"dist": "geometric", "mean": 0.5}), "turns.mean", ">= 1"),
    ("turns-constant-zero", _set(["turns"], const(0)), "turns.value", ">= 1"),
    ("gpu-kind-without-model", _set(["rewards", 0, "model"], _DELETE), "rewards[0].model", "required for gpu"),
    ("model-not-under-models", _set(["rewards", 0, "model"], "rm-huge"), "rewards[0].model",
     "not defined under models"),
    ("model-on-cpu-kind", _set(["tools", 0, "model"], "rm"), "tools[0].model", "only gpu actions"),
    ("unknown-resource", _set(["tools", 0, "resource"], "tpu"), "tools[0].resource", "tpu"),
    ("zero-weight", _set(["tools", 0, "weight"], 0), "tools[0].weight", "> 0"),
    ("parallel-fraction-above-one", _set(["tools", 0, "speedup", "parallel_fraction"], 1.5),
     "tools[0].speedup.parallel_fraction", "<= 1"),
    ("unknown-speedup-model", _set(["tools", 0, "speedup", "model"], "gustafson"), "tools[0].speedup.model", "amdahl"),
    ("affinity-on-gpu", _set(["rewards", 0, "affinity"], "trajectory"), "rewards[0].affinity", "only cpu"),
    ("unknown-affinity", _set(["tools", 0, "affinity"], "node"), "tools[0].affinity", "trajectory"),
    ("negative-restore", _set(["tools", 0, "restore_s"], -1), "tools[0].restore_s", ">= 0"),
    ("model-memory-zero", _set(["models", "rm", "gpu_memory_gb"], 0), "models.rm.gpu_memory_gb", "> 0"),
    ("model-unknown-key", _set(["models", "rm", "vram"], 16), "models.rm.vram", "unknown key"),
    ("model-missing-load", _set(["models", "rm", "load_s"], _DELETE), "models.rm.load_s", "required"),
    ("models-not-a-mapping", _set(["models"], ["rm"]), "models", "mapping"),
    ("no-tools", _set(["tools"], []), "tools", "at least one"),
    ("tools-not-a-list", _set(["tools"], {"kind": "x"}), "tools", "must be a list"),
    ("tool-not-a-mapping", _set(["tools", 0], "code_exec"), "tools[0]", "mapping"),
    ("duplicate-kind", _set(["rewards", 0, "kind"], "code_exec"), "tools/rewards", "defined twice"),
    ("trajectories-zero", _set(["trajectories"], 0), "trajectories", ">= 1"),
    ("seed-negative", _set(["seed"], -1), "seed", ">= 0"),
    ("seed-not-whole", _set(["seed"], 1.5), "seed", "whole number"),
    ("steps-zero", _set(["steps"], 0), "steps", ">= 1"),
    ("negative-hint-sigma", _set(["hint_sigma"], -0.5), "hint_sigma", ">= 0"),
    ("sandbox-units-zero", _set(["static"], {"sandbox_units": 0}), "static.sandbox_units", ">= 1"),
    ("static-unknown-key", _set(["static"], {"slots": 2}), "static.slots", "unknown key"),
    ("name-empty", _set(["name"], ""), "name", "non-empty"),
]


@pytest.mark.parametrize("edit, key, words", [c[1:] for c in BAD_WORKLOADS], ids=[c[0] for c in BAD_WORKLOADS])
def test_bad_workload_names_file_and_key(edit, key, words):
    data = edit(deep(_gpu_workload()))
    with pytest.raises(FileFormatError) as info:
        parse_workload(data, "wl.yaml")
    e = info.value
    assert (e.path, e.key) == ("wl.yaml", key)
    assert str(e).startswith(f"wl.yaml: {key}: ")
    assert words in e.problem


def _valid_cluster() -> dict:
    return cluster_dict(cpu=[{"count": 2, "slots": 4}],
                        gpu=[{"count": 1, "gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]}],
                        tokens=4, cold=3.0, warm=0.05)


BAD_CLUSTERS = [
    ("groups-not-summing-to-gpus", _set(["gpu", "nodes", 0, "groups"], [2, 1]), "gpu.nodes[0].groups",
     "sum to gpus = 4"),
    ("groups-empty", _set(["gpu", "nodes", 0, "groups"], []), "gpu.nodes[0].groups", "whole numbers"),
    ("groups-zero-size", _set(["gpu", "nodes", 0, "groups"], [4, 0]), "gpu.nodes[0].groups", "whole numbers"),
    ("negative-tokens", _set(["api", "tokens"], -1), "api.tokens", ">= 0"),
    ("missing-tokens", _set(["api"], {}), "api.tokens", "required"),
    ("missing-slots", _set(["cpu", "nodes", 0], {"count": 2}), "cpu.nodes[0].slots", "required"),
    ("zero-slots", _set(["cpu", "nodes", 0, "slots"], 0), "cpu.nodes[0].slots", ">= 1"),
    ("unknown-node-key", _set(["cpu", "nodes", 0, "cores"], 8), "cpu.nodes[0].cores", "unknown key"),
    ("unknown-top-key", _set(["storage"], {"gb": 1}), "storage", "unknown key"),
    ("unknown-sandbox-key", _set(["sandbox", "pool"], 3), "sandbox.pool", "unknown key"),
    ("missing-name", _set(["name"], _DELETE), "name", "required"),
    ("gpu-memory-zero", _set(["gpu", "nodes", 0, "gpu_memory_gb"], 0), "gpu.nodes[0].gpu_memory_gb", "> 0"),
    ("missing-gpus", _set(["gpu", "nodes", 0, "gpus"], _DELETE), "gpu.nodes[0].gpus", "required"),
    ("slowdown-below-one", _set(["gpu", "cross_group_slowdown"], 0.5), "gpu.cross_group_slowdown", ">= 1"),
    ("negative-cold-start", _set(["sandbox", "cold_start_s"], -3), "sandbox.cold_start_s", ">= 0"),
    ("nodes-not-a-list", _set(["cpu", "nodes"], {"slots": 4}), "cpu.nodes", "must be a list"),
    ("count-zero", _set(["cpu", "nodes", 0, "count"], 0), "cpu.nodes[0].count", ">= 1"),
]


@pytest.mark.parametrize("edit, key, words", [c[1:] for c in BAD_CLUSTERS], ids=[c[0] for c in BAD_CLUSTERS])
def test_bad_cluster_names_file_and_key(edit, key, words):
    data = edit(deep(_valid_cluster()))
    with pytest.raises(FileFormatError) as info:
        parse_cluster(data, "cl.yaml")
    e = info.value
    assert (e.path, e.key) == ("cl.yaml", key)
    assert words in e.problem


def test_top_level_not_a_mapping():
    with pytest.raises(FileFormatError) as info:
        parse_workload(["name", "x"], "wl.yaml")
    assert info.value.key == "<top>"


def test_the_two_files_swapped_are_named_as_such():
    """``tangram-dask bench CLUSTER WORKLOAD``: before session 34 it said "seed: required key is missing"."""
    with pytest.raises(FileFormatError, match="looks like a cluster file.*the workload comes first"):
        load_workload(f"{BENCH}/cluster-laptop.yaml")
    with pytest.raises(FileFormatError, match="looks like a workload file.*the workload comes first"):
        load_cluster(f"{BENCH}/small.yaml")


def test_error_from_a_file_names_the_path(tmp_path):
    data = _gpu_workload()
    data["tools"][1]["units"] = {"min": 3, "max": 1}
    path = tmp_path / "my-workload.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(FileFormatError) as info:
        load_workload(path)
    assert str(info.value).startswith(f"{path}: tools[1].units.max: ")


def test_missing_and_unparsable_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(FileFormatError) as info:
        load_cluster(missing)
    assert (info.value.path, info.value.key) == (str(missing), "<file>")
    assert "no such file" in str(info.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(FileFormatError, match="not valid YAML") as info:
        load_workload(broken)
    assert info.value.path == str(broken)


def test_cluster_file_is_read_as_documented():
    cl = load_cluster(f"{BENCH}/cluster-standard.yaml")
    assert [n.slots for n in cl.cpu_nodes] == [32, 32, 32, 32]
    assert [n.name for n in cl.cpu_nodes] == ["cpu-0", "cpu-1", "cpu-2", "cpu-3"]
    assert [(n.gpus, n.gpu_memory_gb, n.groups) for n in cl.gpu_nodes] == [(8, 80.0, (4, 4))] * 2
    assert cl.gpu_nodes[0].group_of() == (0, 0, 0, 0, 1, 1, 1, 1)
    assert (cl.cross_group_slowdown, cl.api_tokens, cl.cold_start_s, cl.warm_start_s) == (2.0, 64, 3.0, 0.05)
    assert cl.capacity() == {"cpu": 128, "gpu": 16, "api": 64}


def test_defaults_of_optional_keys():
    wl = parse_workload(workload_dict())
    assert (wl.steps, wl.train_time_s, wl.static_sandbox_units) == (1, 0.0, 2)
    d = workload_dict()
    del d["hint_sigma"]
    assert parse_workload(d).hint_sigma == 1.0
    t = parse_workload(workload_dict([{"kind": "x", "weight": 1, "resource": "cpu", "duration_s": const(1)}])).tools[0]
    assert (t.units_min, t.units_max, t.parallel_fraction, t.affinity, t.restore_s) == (1, 1, 0.0, None, 0.0)
    cl = parse_cluster({"name": "bare", "cpu": {"nodes": [{"slots": 2}]},
                        "gpu": {"nodes": [{"gpus": 2, "gpu_memory_gb": 24}]}})
    assert cl.gpu_nodes[0].groups == (2,)  # one group when none is given
    assert (cl.cross_group_slowdown, cl.api_tokens, cl.cold_start_s, cl.warm_start_s) == (1.0, 0, 0.0, 0.0)


def test_scaled_cluster_follows_the_parity_rule():
    cl = load_cluster(f"{BENCH}/cluster-standard.yaml")
    half = cl.scaled(0.45)
    # slots per CPU node and tokens scaled, rounded up; GPU nodes keep their shape, count rounded up
    assert [n.slots for n in half.cpu_nodes] == [15] * 4  # ceil(32 * 0.45 = 14.4)
    assert half.api_tokens == 29  # ceil(64 * 0.45 = 28.8)
    assert [n.gpus for n in half.gpu_nodes] == [8]  # ceil(2 * 0.45 = 0.9) = 1
    assert cl.scaled(0.55).gpu_nodes == cl.gpu_nodes  # ceil(1.1) = 2
    assert cl.scaled(0.5).cpu_nodes[0].slots == 16  # exact products do not round up


# -- generation ----------------------------------------------------------------------------
def _arrays(gen):
    return [gen.first, gen.kind, gen.llm, gen.duration, gen.hint]


def test_same_seed_gives_identical_arrays():
    wl = load_workload(f"{BENCH}/standard.yaml")
    a, b = generate(wl), generate(wl)
    for x, y in zip(_arrays(a), _arrays(b)):
        np.testing.assert_array_equal(x, y)
    assert a.n_trajectories == 256


@pytest.mark.parametrize("name", ["standard", "small"])
def test_batched_draws_give_the_same_arrays_as_one_draw_at_a_time(name):
    """Where every duration is lognormal, generate() takes consecutive normal draws in one call: the
    arrays must be those of the draw-by-draw loop, to the bit (several steps, so the stream runs on)."""
    d = yaml.safe_load(open(f"{BENCH}/{name}.yaml"))
    d["steps"] = 3
    wl = parse_workload(d)
    for x, y in zip(_arrays(generate(wl)), _arrays(generate(wl, batched=False))):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)


def test_different_seed_gives_different_draws():
    d = yaml.safe_load(open(f"{BENCH}/small.yaml"))
    a = generate(parse_workload(d))
    d["seed"] += 1
    b = generate(parse_workload(d))
    assert a.n_trajectories == b.n_trajectories == 32
    assert not (len(a.kind) == len(b.kind) and np.array_equal(a.duration, b.duration))
    n = min(len(a.llm), len(b.llm))
    assert not np.array_equal(a.llm[:n], b.llm[:n])


def _lognormal(rng, median, sigma):
    return median * math.exp(sigma * rng.standard_normal())


def test_first_trajectory_rederived_by_hand_from_the_documented_draw_order():
    """WORKLOAD.md "Details": turns, then per turn LLM delay, tool kind, duration, hint; then the reward."""
    wl = load_workload(f"{BENCH}/standard.yaml")
    gen = generate(wl)
    rng = np.random.default_rng(7)
    tools = [  # (median, sigma) of code_exec, run_tests, web_search
        (1.0, 1.3), (12.0, 1.0), (1.5, 0.6)]
    rewards = [(1.5, 0.5), (4.0, 0.5)]  # judge_small, judge_large
    cum_tools = [0.55, 0.85, 1.0]
    cum_rewards = [0.6, 1.0]
    turns = min(int(rng.geometric(1 / 8)), 40)
    kinds, llm, dur, hint = [], [], [], []
    for _ in range(turns):
        llm.append(_lognormal(rng, 4.0, 0.8))
        i = bisect_right(cum_tools, rng.random())
        d = _lognormal(rng, *tools[i])
        kinds.append(i)
        dur.append(d)
        hint.append(d * math.exp(1.0 * rng.standard_normal()))
    i = bisect_right(cum_rewards, rng.random())
    d = _lognormal(rng, *rewards[i])
    kinds.append(3 + i)
    llm.append(0.0)
    dur.append(d)
    hint.append(d * math.exp(1.0 * rng.standard_normal()))

    n = len(kinds)
    assert gen.first[0] == 0 and gen.first[1] == n == turns + 1
    np.testing.assert_array_equal(gen.kind[:n], kinds)
    np.testing.assert_allclose(gen.llm[:n], llm, rtol=1e-14)
    np.testing.assert_allclose(gen.duration[:n], dur, rtol=1e-14)
    np.testing.assert_allclose(gen.hint[:n], hint, rtol=1e-14)
    # the second trajectory continues the same stream: its turn count is the next draw
    assert gen.first[2] - gen.first[1] == min(int(rng.geometric(1 / 8)), 40) + 1


def test_constant_draws_nothing_and_uniform_draws_once():
    """Two trajectories of 2 turns: constant turns and durations take no draw; uniform LLM delays do."""
    wl = parse_workload(workload_dict(
        [kind("a", dur=2.0, weight=1), kind("b", duration_s={"dist": "uniform", "low": 1, "high": 3}, weight=3)],
        [kind("r", dur=0.5)],
        trajectories=2, turns=2, llm={"dist": "uniform", "low": 0.5, "high": 1.5}, hint_sigma=0.5, seed=3,
    ))
    gen = generate(wl)
    rng = np.random.default_rng(3)
    expect = []
    for _t in range(2):
        for _turn in range(2):
            delay = float(rng.uniform(0.5, 1.5))
            i = bisect_right([0.25, 1.0], rng.random())
            d = 2.0 if i == 0 else float(rng.uniform(1, 3))
            expect.append((i, delay, d, d * math.exp(0.5 * rng.standard_normal())))
        # the one reward kind still takes its rng.random(); its constant duration takes nothing
        rng.random()
        expect.append((2, 0.0, 0.5, 0.5 * math.exp(0.5 * rng.standard_normal())))
    assert gen.first.tolist() == [0, 3, 6]
    e = np.array(expect)
    np.testing.assert_array_equal(gen.kind, e[:, 0])
    assert set(gen.kind.tolist()) == {0, 1, 2}  # both tool kinds were drawn: the test sees both paths
    np.testing.assert_allclose(np.c_[gen.llm, gen.duration, gen.hint], e[:, 1:], rtol=1e-14)


def test_hint_sigma_zero_gives_exact_hints_and_steps_repeat_trajectories():
    wl = parse_workload(workload_dict(trajectories=3, steps=2, hint_sigma=0.0,
                                      turns={"dist": "geometric", "mean": 2, "max": 3}))
    gen = generate(wl)
    assert gen.n_trajectories == 6
    np.testing.assert_array_equal(gen.hint, gen.duration)
    sizes = np.diff(gen.first)
    assert ((sizes >= 2) & (sizes <= 4)).all()  # 1..3 turns (capped at max) plus the reward
    # rewards are last in each trajectory and issued with no LLM delay
    assert (gen.kind[gen.first[1:] - 1] == 1).all() and (gen.llm[gen.first[1:] - 1] == 0).all()
