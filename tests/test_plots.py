"""``tangram-dask bench ... --plot DIR``: the PNGs, the data they are drawn from, and the missing-matplotlib error.

The data checks tie each figure to the run's JSON results: the ACT CDF runs
from the run's smallest to its largest ACT and its mean, median and p99 are
the JSON's; the utilization series average to the JSON's ``utilization``;
the last trajectory ends the step. Tracing (what --plot turns on) changes
no figure of the run. No timings are asserted.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import hand_run, kind, make_cluster, make_workload

from tangram_dask import cli
from tangram_dask.bench import POLICIES, run, simulate
from tangram_dask.cluster import load_cluster
from tangram_dask.metrics import utilization_series
from tangram_dask.policy import make_policy
from tangram_dask.sim import Simulator
from tangram_dask.workload import generate, load_workload

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
SMALL = str(ROOT / "resources/bench/small.yaml")
LAPTOP = str(ROOT / "resources/bench/cluster-laptop.yaml")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURES = ("act-cdf", "utilization", "step")


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the magic)."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def small_run() -> tuple[list[dict], list]:
    traces: list = []
    results = run(load_workload(SMALL), load_cluster(LAPTOP), POLICIES, traces=traces)
    return results, traces


# -- the command ----------------------------------------------------------------------------------
def test_plot_writes_three_pngs_per_run_and_keeps_stdout_json(capsys, tmp_path):
    out = tmp_path / "figs" / "nested"  # made if missing
    assert cli.main(["bench", SMALL, LAPTOP, "--json", "--plot", str(out)]) == 0
    cap = capsys.readouterr()
    results = json.loads(cap.out)  # the figures are announced on stderr, stdout stays JSON
    assert [r["policy"] for r in results] == list(POLICIES)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(f"small-laptop-{f}.png" for f in FIGURES)
    for name in names:
        path = out / name
        w, h = _png_size(path)
        assert w >= 600 and h >= 400, (name, w, h)
        assert path.stat().st_size > 20_000, name  # drawn, not an empty canvas
        assert f"wrote {path}" in cap.err


def test_the_same_run_gives_the_same_bytes(tmp_path):
    """No version or date in the files: regenerated figures change only when the figures do."""
    for d in ("a", "b"):
        assert cli.main(["bench", SMALL, LAPTOP, "--policy", "tangram,static", "--plot", str(tmp_path / d)]) == 0
    for f in FIGURES:
        a, b = (tmp_path / d / f"small-laptop-{f}.png" for d in ("a", "b"))
        assert a.read_bytes() == b.read_bytes(), f


def test_one_policy_draws_too(capsys, tmp_path):
    assert cli.main(["bench", SMALL, LAPTOP, "--policy", "fifo", "--plot", str(tmp_path)]) == 0
    assert len(list(tmp_path.glob("*.png"))) == 3


def test_plot_with_live_is_a_usage_error(capsys, tmp_path):
    assert cli.main(["bench", SMALL, LAPTOP, "--live", "--plot", str(tmp_path / "x")]) == 2
    assert "--plot draws simulated runs" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_without_matplotlib_plot_exits_2_naming_the_extra(tmp_path):
    """matplotlib made unimportable in a fresh interpreter: ``sys.modules['matplotlib'] = None`` makes
    every ``import matplotlib`` raise ImportError, as if it were not installed."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tangram_dask.cli import main\n"
            f"sys.exit(main(['bench', {SMALL!r}, {LAPTOP!r}, '--plot', {str(tmp_path / 'figs')!r}]))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2, p.stderr
    assert "pip install 'tangram-dask[plots]'" in p.stderr
    assert p.stderr.startswith("Error: --plot needs matplotlib")
    assert p.stdout == ""  # it fails before simulating anything
    assert not (tmp_path / "figs").exists()


def test_without_plot_matplotlib_is_not_needed(tmp_path):
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tangram_dask.cli import main\n"
            f"sys.exit(main(['bench', {SMALL!r}, {LAPTOP!r}, '--policy', 'tangram']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert "tangram" in p.stdout


# -- the data the figures are drawn from ----------------------------------------------------------
def test_act_cdf_matches_the_json_results(small_run):
    from tangram_dask.plots import act_cdf

    results, traces = small_run
    assert [t.policy for t in traces] == [r["policy"] for r in results]
    for r, t in zip(results, traces):
        x, y = act_cdf(t)
        assert len(x) == r["actions"] and y[-1] == 1.0 and np.all(np.diff(x) >= 0) and np.all(np.diff(y) > 0)
        assert (x[0], x[-1]) == (t.act.min(), t.act.max())  # the endpoints: the run's smallest and largest ACT
        assert x.mean() == pytest.approx(r["act_mean_s"], rel=1e-12)
        assert np.percentile(x, 50) == pytest.approx(r["act_p50_s"], rel=1e-12)
        assert np.percentile(x, 99) == pytest.approx(r["act_p99_s"], rel=1e-12)
        assert t.ideal_act.mean() == pytest.approx(r["ideal_act_mean_s"], rel=1e-12)


def test_utilization_series_average_to_the_json_utilization(small_run):
    results, traces = small_run
    for r, t in zip(results, traces):
        assert set(t.utilization) == {"cpu", "gpu", "api"} == {k for k, v in t.capacity.items() if v}
        for res, u in t.utilization.items():
            assert len(u) == len(t.times)
            assert np.all(u >= -1e-12) and np.all(u <= 1 + 1e-9), (r["policy"], res)
            assert u.mean() == pytest.approx(r["utilization"][res], rel=1e-9, abs=1e-12), (r["policy"], res)


def test_step_and_trajectory_times_match_the_json_results(small_run):
    from tangram_dask.plots import trajectory_cdf

    results, traces = small_run
    for r, t in zip(results, traces):
        x, y = trajectory_cdf(t)
        assert len(x) == 32 and y[-1] == 1.0
        assert float(np.mean(t.step_s)) == pytest.approx(r["step_s"], rel=1e-12)
        assert x[-1] == pytest.approx(r["step_s"], rel=1e-12)  # the last trajectory ends the step
        assert t.ideal_step_s == r["ideal_step_s"]


def test_tracing_changes_no_figure_and_is_off_by_default():
    wl, cl = load_workload(SMALL), load_cluster(LAPTOP)
    plain = run(wl, cl, POLICIES)
    traced = run(wl, cl, POLICIES, traces=[])
    for a, b in zip(plain, traced):
        a.pop("sim_wall_s"), b.pop("sim_wall_s")
        assert a == b
    gen = generate(wl)
    assert Simulator(gen, cl, make_policy("tangram", cl, wl)).run().spans is None  # nothing kept unless asked


def test_several_steps_time_trajectories_from_their_own_step():
    tools = [kind("tool", "cpu", 1.0)]
    rewards = [kind("reward", "cpu", 1.0)]
    spec = make_workload(tools, rewards, trajectories=2, steps=2, train_time_s=5.0)
    cl = make_cluster(cpu=[{"count": 1, "slots": 1}])
    traces: list = []
    r = simulate_hand(spec, cl, traces)
    (t,) = traces
    # one slot: step 1 runs a then b (tool 1-2, tool 2-3, rewards 3-4 and 4-5): trajectories end at 4 and 5
    assert sorted(t.trajectory_s.tolist()) == [4.0, 4.0, 5.0, 5.0]
    assert t.step_s == [5.0, 5.0] and r["step_s"] == 5.0


def simulate_hand(spec, cl, traces):
    gen = hand_run(spec, [[(1.0, "tool", 1.0), (0.0, "reward", 1.0)]] * 4)
    return simulate(gen, cl, "fifo", traces=traces)


# -- utilization_series by hand -------------------------------------------------------------------
SERIES = [
    # (id, spans, capacity, start, end, bins, expected per resource)
    ("one unit for a third", [(1.0, 2.0, "cpu", 1)], {"cpu": 1}, 0.0, 3.0, 3, {"cpu": [0.0, 1.0, 0.0]}),
    ("half a slice", [(0.5, 1.0, "cpu", 2)], {"cpu": 2}, 0.0, 2.0, 2, {"cpu": [0.5, 0.0]}),
    ("overlapping spans add up", [(0.0, 2.0, "gpu", 1), (1.0, 2.0, "gpu", 3)], {"gpu": 4}, 0.0, 2.0, 2,
     {"gpu": [0.25, 1.0]}),
    ("a span across slices", [(0.5, 2.5, "api", 1)], {"api": 1}, 0.0, 3.0, 3, {"api": [0.5, 1.0, 0.5]}),
    ("no capacity, no series", [(0.0, 1.0, "cpu", 1)], {"cpu": 1, "gpu": 0}, 0.0, 1.0, 1, {"cpu": [1.0]}),
    ("capacity, nothing busy", [], {"api": 3}, 0.0, 1.0, 2, {"api": [0.0, 0.0]}),
]


@pytest.mark.parametrize("spans, capacity, start, end, bins, want", [c[1:] for c in SERIES],
                         ids=[c[0] for c in SERIES])
def test_utilization_series(spans, capacity, start, end, bins, want):
    times, got = utilization_series(spans, capacity, start, end, bins)
    assert times.tolist() == pytest.approx(np.linspace(start, end, 2 * bins + 1)[1::2].tolist())
    assert set(got) == set(want)
    for r, w in want.items():
        assert got[r].tolist() == pytest.approx(w)


def test_a_hand_run_traces_what_it_holds():
    """One trajectory on one node of 2 slots: LLM 1 s, a 1 s tool on 1 slot, a 1 s reward on 1 slot."""
    spec = make_workload([kind("tool", "cpu", 1.0)], [kind("reward", "cpu", 1.0)])
    cl = make_cluster(cpu=[{"count": 1, "slots": 2}])
    gen = hand_run(spec, [[(1.0, "tool", 1.0), (0.0, "reward", 1.0)]])
    traces: list = []
    r = simulate(gen, cl, "fifo", traces=traces)
    (t,) = traces
    assert t.act.tolist() == [1.0, 1.0] and t.trajectory_s.tolist() == [3.0] and r["step_s"] == 3.0
    assert r["utilization"]["cpu"] == pytest.approx(1 / 3)
    assert t.utilization["cpu"].mean() == pytest.approx(1 / 3)
    assert set(t.utilization) == {"cpu"}
    third = len(t.times) // 3
    assert t.utilization["cpu"][:third].max() == 0.0 and t.utilization["cpu"][third:].min() == pytest.approx(0.5)
