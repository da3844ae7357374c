"""tangram against fifo and static on variants of the standard files it was not tuned on.

Not timed: relative outcomes of the same simulated step. The claims checked
per variant are the ones that held on every variant measured (benchmarks/variants.py):
tangram's ACT beats fifo's, its step beats static's and fifo's, and no decision
over-allocates (audit on). On the GPU-bound and heavy-tail families
(benchmarks/variants.py --family gpu,tail) tangram's ACT and step also beat
static's, with fewer model loads than fifo's. Its step against fifo's on the
half cluster, a margin of 10-20% that one trajectory's luck moves by as much,
is also checked as a rate over 24 seeds (benchmarks/half_seeds.py): one of
the variants here (``noisy-hints``) is among the seeds where it does not hold.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tangram_dask.bench import simulate
from tangram_dask.cluster import parse_cluster
from tangram_dask.workload import generate, parse_workload

BENCH = Path(__file__).resolve().parents[1] / "resources" / "bench"


def _load(name: str) -> dict:
    return yaml.safe_load((BENCH / name).read_text())


def _variant(**changes) -> dict:
    d = _load("standard.yaml")
    d["trajectories"] = 96  # a third of the standard step keeps the test fast
    for k, v in changes.items():
        if k == "weights":
            for tool, w in zip(d["tools"], v):
                tool["weight"] = w
        else:
            d[k] = v
    return d


def _odd_cluster() -> dict:
    c = copy.deepcopy(_load("cluster-standard.yaml"))
    c["name"] = "odd"
    c["cpu"]["nodes"] = [{"count": 1, "slots": 24}, {"count": 3, "slots": 6}]
    c["gpu"]["nodes"] = [{"count": 2, "gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]}]
    c["api"]["tokens"] = 12
    return c


def _gpu_bound(seed: int, **changes) -> dict:
    d = _load("../variants/gpu-bound.yaml")
    d["seed"] = seed
    d.update(changes)
    return d


def _heavy_tail(seed: int, hint_sigma: float, **changes) -> dict:
    d = _load("standard.yaml")
    d.update(seed=seed, hint_sigma=hint_sigma, **changes)
    d["tools"][0]["duration_s"]["sigma"] = 1.5  # code_exec
    d["tools"][1]["duration_s"]["sigma"] = 1.5  # run_tests
    return d


def _half_cluster() -> dict:
    c = copy.deepcopy(_load("cluster-tight.yaml"))
    c["cpu"]["nodes"] = [{"count": 2, "slots": 16}]
    return c


VARIANTS = {
    "seed-21": (_variant(seed=21), _half_cluster()),
    "sharp-hints": (_variant(seed=22, hint_sigma=0.3), _half_cluster()),
    "noisy-hints": (_variant(seed=23, hint_sigma=1.6), _half_cluster()),
    "test-heavy-mix": (_variant(seed=24, weights=[0.35, 0.5, 0.15]), _half_cluster()),
    "odd-cluster": (_variant(seed=25), _odd_cluster()),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tangram_beats_baselines_on_untuned_variants(name):
    wd, cd = VARIANTS[name]
    gen = generate(parse_workload(wd, name))
    cluster = parse_cluster(cd, cd["name"])
    t = simulate(gen, cluster, "tangram", audit=True)
    f = simulate(gen, cluster, "fifo", audit=True)
    s = simulate(gen, cluster, "static", audit=True)
    assert t["act_mean_s"] < f["act_mean_s"], (t["act_mean_s"], f["act_mean_s"])
    assert t["step_s"] < s["step_s"], (t["step_s"], s["step_s"])
    if name != "noisy-hints":  # its step is over fifo's since the knee at 0.9 (622 s / 572): the rate test below
        assert t["step_s"] < f["step_s"], (t["step_s"], f["step_s"])
    assert t["act_mean_s"] >= t["ideal_act_mean_s"] and t["step_s"] >= t["ideal_step_s"]


def test_on_24_seeds_of_the_half_cluster_the_step_beats_fifos_and_the_act_statics():
    """The half-cluster shape above on seeds 100-123 (benchmarks/half_seeds.py, none of them the variants').
    tangram's step against fifo's there is 0.80-0.85 on average and one trajectory moves it by 10-20%:
    on 120 seeds of the shape 108-109 are under fifo's, with the CPU knee at 0.9 and at 1.0 alike
    (``noisy-hints`` above, seed 23, is one of the others at 0.9: 622 s against fifo's 572). Measured on
    these 24: step under fifo's on 21 (23 with the knee at 1.0), ACT under static's on 22 (17); since
    ``pair_floor`` and the knee at 0.8 (session 11), 20 and 24."""
    import sys

    sys.path.insert(0, str(BENCH.parents[1]))
    from benchmarks.half_seeds import SEEDS, measure

    res = [measure(seed, {}) for seed in SEEDS]
    step_fifo = sum(t["step_s"] < f["step_s"] for _, t, f, _ in res)
    act_static = sum(t["act_mean_s"] < s["act_mean_s"] for _, t, _, s in res)
    assert step_fifo >= 20 and act_static >= 20, (step_fifo, act_static, len(res))


# GPU-bound (four reward models that exceed GPU memory together, a 140 GB judge on 2-GPU replicas, a process
# reward model called as a tool, 80 GB and 141 GB GPUs) and heavy tails with poor hints, several steps:
# members of benchmarks/variants.py's "gpu" and "tail" families.
WINS = {
    "gpu-seed31": (_gpu_bound(31), _load("../variants/cluster-gpu-mixed.yaml")),
    "gpu-steps-2": (_gpu_bound(38, steps=2, train_time_s=20, trajectories=96, hint_sigma=1.5),
                    _load("../variants/cluster-gpu-mixed.yaml")),
    "tail-judge": (_heavy_tail(44, 1.5, steps=3, train_time_s=30, trajectories=96), _load("cluster-standard.yaml")),
    "tail-h2.0": (_heavy_tail(42, 2.0, steps=2, train_time_s=20, trajectories=128), _load("cluster-standard.yaml")),
    # a 2,139 s test run with a 1,380 s hint, issued at t = 9 s: before the kind's spread was learned from hints
    # too, its estimate was 36 s, it ran on 1 unit and the step was 1.70x static's
    "tail-1step": (_heavy_tail(49, 1.5, trajectories=256), _load("cluster-standard.yaml")),
}


@pytest.mark.parametrize("name", list(WINS))
def test_tangram_beats_static_on_act_and_step(name):
    wd, cd = WINS[name]
    gen = generate(parse_workload(wd, name))
    cluster = parse_cluster(cd, cd["name"])
    t = simulate(gen, cluster, "tangram", audit=True)
    f = simulate(gen, cluster, "fifo", audit=True)
    s = simulate(gen, cluster, "static", audit=True)
    assert t["act_mean_s"] < s["act_mean_s"], (t["act_mean_s"], s["act_mean_s"])
    assert t["step_s"] < s["step_s"], (t["step_s"], s["step_s"])
    assert t["act_mean_s"] < f["act_mean_s"] and t["step_s"] < f["step_s"]
    assert t["model_loads"] <= f["model_loads"], (t["model_loads"], f["model_loads"])


def test_on_the_api_heavy_file_tangram_beats_static_on_both_and_fifo_on_act():
    """benchmarks/variants.py's "api" family, its base file: static's calls never wait (it binds a token per
    trajectory), so tangram's ACT wins only by the code executions' second slot (0.984x static's, step 0.51x).
    Its step is over fifo's (1.33x: fifo admits everyone, its ACT 2.1x tangram's): docs/scheduling.md,
    Measured, session 13."""
    wd, cd = _load("../variants/api-heavy.yaml"), _load("../variants/cluster-api.yaml")
    gen = generate(parse_workload(wd, "api-heavy"))
    cluster = parse_cluster(cd, cd["name"])
    t = simulate(gen, cluster, "tangram", audit=True)
    f = simulate(gen, cluster, "fifo", audit=True)
    s = simulate(gen, cluster, "static", audit=True)
    assert t["act_mean_s"] < s["act_mean_s"] and t["step_s"] < s["step_s"], (t, s)
    assert t["act_mean_s"] < 0.6 * f["act_mean_s"]


@pytest.mark.parametrize("name, actions", [("demo-like", 112), ("demo-live", 64)])
def test_the_demo_shape_runs_and_tangram_keeps_its_act(name, actions):
    """resources/variants/demo-like.yaml and demo-live.yaml on cluster-demo.yaml, the shapes of ``tangram-dask
    demo`` (docs/scheduling.md, Known limits): valid files, no over-allocation, tangram's ACT below fifo's.
    The step is not claimed: on demo-like (half-length LLM delays) it is about fifo's since idle admission,
    on demo-live (the demo as it runs live) 1.3-1.5x fifo's, as live (the gate's warm-up and its GPU term)."""
    variants = BENCH.parent / "variants"
    wd = yaml.safe_load((variants / f"{name}.yaml").read_text())
    cd = yaml.safe_load((variants / "cluster-demo.yaml").read_text())
    gen = generate(parse_workload(wd, name))
    cluster = parse_cluster(cd, cd["name"])
    t = simulate(gen, cluster, "tangram", audit=True)
    f = simulate(gen, cluster, "fifo", audit=True)
    assert t["actions"] == f["actions"] == actions
    assert t["act_mean_s"] < f["act_mean_s"], (t["act_mean_s"], f["act_mean_s"])


def test_the_sweep_draws_the_same_variant_from_a_seed_and_measures_every_option_set_on_it():
    """benchmarks/sweep.py: a seed is one variant (so option sets compare on the same draws), and each set
    gets its own ratios. Seed 2148 is the variant where ``home_reserve`` took the step from 1.77x static's
    to about 1x (an elephant that waited at home, then ran on 1 slot of 8 for 3,117 s). Measured with
    ``pair_floor=0`` and ``open_share=0``, as then; ``pair_floor`` alone (two slots for it) takes it most of the
    way back, and so does the opening per API token (``open_share``: 0.42x static's without either)."""
    import sys

    sys.path.insert(0, str(BENCH.parents[1]))
    from benchmarks.sweep import measure, variant

    assert variant(2148) == variant(2148) and variant(2148) != variant(2149)
    then = {"pair_floor": 0.0, "open_share": 0.0}  # the defaults of the time (the opening since then: 0.42x)
    name, rows = measure(2148, [{"home_reserve": 0.0, **then}, then, {"home_reserve": 0.0, "open_share": 0.0}])
    assert name == "s2148-std" and len(rows) == 3
    (act0, step0, _, ideal0), (act1, step1, _, ideal1), (_, step2, _, _) = rows
    assert step0 > 1.5 and step1 < 0.5 * step0  # step/static, without the home waiter's reservation and with it
    assert step2 < 0.6 * step0
    assert ideal0 >= 1.0 and ideal1 >= 1.0


def test_one_gpu_shared_by_three_models_gpu_merge_brings_tangram_to_fifos_act():
    """benchmarks/onegpu.py, 20 seeds x 2 mixes (deterministic): draining the models' queues as one
    (gpu_merge) takes tangram's mean ACT from over fifo's to under it (1.048 -> 0.989), and its worst
    case down (2.01 -> 1.44). On the first 5 seeds alone the mean with gpu_merge went from 0.986 to 1.013
    when the models' demand horizon became 20 loads' worth (3 s for these 0.15 s loads; 20 seeds: 0.978
    -> 0.989): too few draws for a ratio this close to 1. Measured with the opening of the time (one trajectory
    per CPU slot, ``open_share=0``); with the opening per API token as well, 0.998 -> 0.987 (worst 1.48 ->
    1.54)."""
    import numpy as np

    from benchmarks.onegpu import measure
    ratio = {m: np.array([r["tangram_act"] / r["fifo_act"] for r in measure(20, {"gpu_merge": m, "open_share": 0.0})])
             for m in (0.0, 1.0)}
    assert ratio[0.0].mean() > 1.0 > ratio[1.0].mean()
    assert ratio[1.0].max() < ratio[0.0].max()


def test_the_residency_benchmarks_stream_replayed_tangram_loads_fewer_than_fifo():
    """benchmarks/residency.py --nvml --replay 20: the real-GPU stream (one GPU holding two of three
    models, 0.1 s loads, 8 ms calls, the mix shifting half-way) replayed through each policy on a
    simulated clock. Tangram loads fewer than fifo over the 20 seeds; with each model's demand read over
    30 s (``demand_loads=0``) it loaded more than fifo, as the H200 showed (docs/models.md)."""
    import sys
    sys.path.insert(0, str(BENCH.parents[1]))
    from benchmarks.residency import main

    now = {r["policy"]: r["model_loads"] for r in main(["--nvml", "--replay", "20"])}
    before = {r["policy"]: r["model_loads"] for r in main(["--nvml", "--replay", "20", "-o", "demand_loads=0"])}
    assert before["fifo"] == now["fifo"]  # fifo has no such option: the same run
    assert now["tangram"] < now["fifo"] < before["tangram"]


def test_reseed_draws_each_variant_again_on_other_seeds_and_measures_every_option_set_on_the_same_draw():
    """benchmarks/reseed.py: each variant keeps its shape and is drawn again on k seeds none of the families
    uses (1000 + 17 i + its own), the same draws every run; each option set is measured on the same draw."""
    import sys

    sys.path.insert(0, str(BENCH.parents[1]))
    from benchmarks.reseed import draws, measure, summary

    ds = draws(["live"], 2)
    assert ds == draws(["live"], 2) and len(ds) == 16
    assert [w["seed"] for _, w, _ in ds[:2]] == [1011, 1028] and ds[0][1]["name"] == "live-seed11@1011"
    assert ds[0][1]["trajectories"] == ds[1][1]["trajectories"] and ds[0][2] == ds[1][2]  # one shape
    fam, name, rows = measure(ds[0], [{}, {"gpu_merge": 0.0}, {}])
    assert (fam, name, len(rows)) == ("live", "live-seed11@1011", 3)
    assert rows[0] == rows[2]  # deterministic: the same set on the same draw measures the same
    for act, step, ideal, loads, fifo_loads, floor in rows:
        assert act > 0 and step > 0 and ideal >= 1.0 and loads >= 0 and fifo_loads >= 0 and floor >= 1.0
    m = summary(rows)
    assert m["floor_mean"] >= 1.0
    assert m["n"] == 3 and 0 <= m["both"] <= 3 and m["act_max"] >= m["act_mean"]

    # --steps N: the same draws, each at least N RL steps, with 30 s of training between them where the
    # variant gives none; a variant of more steps keeps its own
    many = draws(["live", "tail"], 1, steps=3)
    assert [w["seed"] for _, w, _ in many] == [w["seed"] for _, w, _ in draws(["live", "tail"], 1)]
    live = [w for f, w, _ in many if f == "live"]
    assert all(w["steps"] == 3 and w["train_time_s"] == 30.0 for w in live)
    judge = next(w for _, w, _ in many if w["name"].startswith("tail-judge@"))  # 3 steps, 30 s of its own
    assert (judge["steps"], judge["train_time_s"]) == (3, 30)
    assert "steps" not in draws(["live"], 1)[0][1]  # without --steps, as given


def test_reseed_pairs_each_set_with_the_first_per_draw():
    """benchmarks/reseed.py's paired figures: per-draw changes of ACT/ideal and step/static against the
    first set, their mean and standard error, and the draws each way (rows as ``measure`` gives them:
    ACT/static, step/static, ACT/ideal, loads, fifo's loads, ACT/floor; the last is not read here)."""
    import math
    import sys

    sys.path.insert(0, str(BENCH.parents[1]))
    from benchmarks.reseed import paired

    base = [(0.6, 0.7, 1.50, 3, 40), (0.6, 0.8, 1.40, 3, 40), (0.6, 0.9, 1.60, 3, 40)]
    other = [(0.6, 0.7, 1.40, 3, 40), (0.6, 0.8, 1.40, 3, 40), (0.6, 1.0, 1.70, 3, 40)]
    p = paired(base, other)
    assert p["n"] == 3 and (p["better"], p["worse"]) == (1, 1)
    assert math.isclose(p["act"], 0.0, abs_tol=1e-12) and math.isclose(p["act_se"], 0.1 / math.sqrt(3))
    assert math.isclose(p["step"], 0.1 / 3) and p["step_se"] > 0
    assert paired(base, base)["act_se"] == 0.0 and paired(base, base)["better"] == 0


def test_in_the_steps_tail_a_long_test_run_reserves_slots_rather_than_set_the_step_on_one():
    """``tail-tight-b`` drawn on seed 1065 (benchmarks/reseed.py): a test run estimated at 139 s (328 s on one
    slot) was not in its kind's top tail (heavy tails, hint sigma 1.5), started on 1 slot of 8 with no
    trajectory waiting for admission, and the mean step was 1.29x static's. With ``elephant_tail`` (the
    default) it counts as an elephant and reserves slots: the step falls under static's, ACT with it.
    Measured with ``pair_floor=0`` and the knee at 0.9, as then; ``pair_floor`` alone brings the step under
    static's too."""
    import sys

    sys.path.insert(0, str(BENCH.parents[1]))
    from benchmarks.reseed import draws, measure

    (draw,) = [d for d in draws(["tail"], 4) if d[1]["name"] == "tail-tight-b@1065"]
    # the admission gate's GPU term before session 27, and its opening's share before session 28
    gate = {"gate_runs": 0.0, "admission_gpu": 0.6, "open_prior": 0.0}
    then = {"pair_floor": 0.0, "admission_knee": 0.9, **gate}  # the defaults of session 10
    _, _, ((act0, step0, *_), (act1, step1, *_), (_, step2, *_)) = measure(
        draw, [{"elephant_tail": 0.0, **then}, then, {"elephant_tail": 0.0, "admission_knee": 0.9, **gate}])
    assert step0 > 1.2 and step1 < 0.7 and step2 < 0.95
    assert act1 < act0 < 1.0


def test_the_decision_cost_benchmark_loads_and_places_reward_models():
    """benchmarks/decision_cost.py's GPU loop (small here): four reward models (16 to 140 GB, the largest on
    2-GPU replicas), none resident at the start, so it places and loads a replica of each (on 2 nodes nothing
    is evicted). The figure it prints (microseconds per started action) is a wall-clock time: not asserted."""
    import math

    from benchmarks.decision_cost import measure_gpu

    us, loads = measure_gpu(200, 2, iters=400)
    assert loads >= 4 and math.isfinite(us)
