"""Tangram against fifo and static on workloads it was not tuned on, in families.

- ``std``: variants of the standard files (seed, load, hint quality, tool mix,
  several steps, an odd cluster shape);
- ``gpu``: GPU-bound steps (``resources/variants/gpu-bound.yaml`` on
  ``cluster-gpu-mixed.yaml``): four reward models whose replicas together
  exceed GPU memory, a 140 GB judge on 2-GPU replicas, a process reward model
  called as a tool on most turns, a vision judge on 2..4 GPUs, few CPU
  actions, 80 GB and 141 GB GPUs; seeds, load, node shapes and the mix vary;
- ``tail``: heavy tails with poor hints (hint sigma 1.5-2.0, kinds with
  duration sigma 1.5, several steps).
- ``gpux``: 12 more GPU-bound seeds over the four GPU cluster shapes;
- ``small``: small steps (48-64 trajectories) on the GPU-bound, heavy-tail
  and standard workloads, where most of the step passes before the
  admission gate has learned anything.
- ``api``: API-heavy steps (``resources/variants/api-heavy.yaml`` on
  ``cluster-api.yaml``): most tool calls and most rewards hold tokens of an
  API quota (static binds one per trajectory), a batched call on 2 tokens,
  few code executions; seeds, quota, load, tails, mix and steps vary.
- ``demo`` (by name only, not in ``all``): the shape of ``tangram-dask demo``
  (16 trajectories, mostly LLM generation, on 4 CPU slots and 2 GPUs;
  ``resources/variants/demo-like.yaml``), three seeds: the whole step passes
  before the gate has learned anything; and the demo as it runs live
  (``demo-live.yaml``: whole LLM delays, the reward as long as it is live), three seeds.

Prints one line per variant with the ratios the targets are stated in, then
min/mean/max of each ratio per family. Not a test: figures to read.

    python benchmarks/variants.py [--family std,gpu,tail,small,gpux,live,api,demo] [--quick] [-j 2] [-o key=value ...]
                                  [--trajectory-hints SIGMA]
"""

from __future__ import annotations

import argparse
import copy
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import parity, simulate  # noqa: E402
from tangram_dask.cluster import parse_cluster  # noqa: E402
from tangram_dask.policy import TangramOptions  # noqa: E402
from tangram_dask.workload import generate, parse_workload  # noqa: E402

BENCH = ROOT / "resources" / "bench"
FAMILIES = ("std", "gpu", "tail", "small", "gpux", "live", "api")  # "all"; demo by name only (not in the docs)


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _with(d0: dict, name: str, **changes) -> dict:
    d = copy.deepcopy(d0)
    d["name"] = name
    for k, v in changes.items():
        if callable(v):
            v(d)
        else:
            d[k] = v
    return d


def as_steps(wd: dict, steps: int, train_time_s: float = 30.0) -> dict:
    """The workload ``wd`` run as at least ``steps`` RL steps (what a training run repeats), ``train_time_s``
    between them where it gives none; a workload of more steps keeps its own. A copy."""
    d = copy.deepcopy(wd)
    if steps > d.get("steps", 1):
        d["steps"] = steps
        d["train_time_s"] = d.get("train_time_s") or train_time_s
    return d


def std_family(quick: bool) -> list[tuple[dict, dict]]:
    w0 = _yaml(BENCH / "standard.yaml")
    c_std = _yaml(BENCH / "cluster-standard.yaml")
    c_tight = _yaml(BENCH / "cluster-tight.yaml")
    c_odd = copy.deepcopy(c_std)
    c_odd["name"] = "odd"
    c_odd["cpu"]["nodes"] = [{"count": 2, "slots": 48}, {"count": 4, "slots": 8}]
    c_odd["gpu"]["nodes"] = [{"count": 3, "gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]}]
    out = []
    for s in ([1, 2] if quick else [1, 2, 3, 4]):
        out.append((_with(w0, f"seed{s}", seed=s), c_std))
        out.append((_with(w0, f"seed{s}", seed=s), c_tight))
    out.append((_with(w0, "load-x1.5", trajectories=384, seed=5), c_std))
    out.append((_with(w0, "load-x0.5", trajectories=128, seed=6), c_std))
    out.append((_with(w0, "hint-sharp", hint_sigma=0.3, seed=7), c_std))
    out.append((_with(w0, "hint-noisy", hint_sigma=1.6, seed=8), c_std))

    def heavy_tests(d):
        d["tools"][0]["weight"] = 0.35
        d["tools"][1]["weight"] = 0.5
    out.append((_with(w0, "mix-tests", seed=9, _=heavy_tests), c_std))
    out.append((_with(w0, "steps-3", steps=3, train_time_s=30, trajectories=128, seed=10), c_std))
    out.append((_with(w0, "seed11-odd", seed=11), c_odd))
    return out


def gpu_family(quick: bool) -> list[tuple[dict, dict]]:
    w0 = _yaml(ROOT / "resources" / "variants" / "gpu-bound.yaml")
    c0 = _yaml(ROOT / "resources" / "variants" / "cluster-gpu-mixed.yaml")
    c_h200 = copy.deepcopy(c0)  # more large-memory GPUs, fewer 80 GB ones
    c_h200["name"] = "gpu-h200"
    c_h200["gpu"]["nodes"] = [{"count": 1, "gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]},
                              {"count": 1, "gpus": 8, "gpu_memory_gb": 141, "groups": [2, 2, 2, 2]}]
    c_small = copy.deepcopy(c0)  # 8 GPUs only: every model fights for memory
    c_small["name"] = "gpu-small"
    c_small["gpu"]["nodes"] = [{"count": 1, "gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]},
                               {"count": 1, "gpus": 4, "gpu_memory_gb": 141, "groups": [2, 2]}]

    def xl_heavy(d):  # the 140 GB judge is most of the rewards
        d["rewards"][0]["weight"] = 0.6
        d["rewards"][1]["weight"] = 0.2
        d["rewards"][2]["weight"] = 0.2

    def prm_always(d):  # the process reward model on almost every turn
        d["tools"][0]["weight"] = 0.85
        d["tools"][1]["weight"] = 0.10
        d["tools"][2]["weight"] = 0.05

    out = [(_with(w0, "gpu-seed31", seed=31), c0),
           (_with(w0, "gpu-seed32", seed=32), c0),
           (_with(w0, "gpu-h200", seed=33), c_h200),
           (_with(w0, "gpu-small", seed=34, trajectories=96), c_small),
           (_with(w0, "gpu-xl-heavy", seed=35, _=xl_heavy), c0),
           (_with(w0, "gpu-prm-always", seed=36, _=prm_always), c0)]
    if not quick:
        out += [(_with(w0, "gpu-load-x2", seed=37, trajectories=256), c0),
                (_with(w0, "gpu-steps-2", seed=38, steps=2, train_time_s=20, trajectories=96, hint_sigma=1.5), c0)]
        # more seeds and shapes, so that a family mean is not one variant's luck
        c_wide = copy.deepcopy(c0)  # 4-GPU groups: the 2..4-GPU judges fit a group on units.max
        c_wide["name"] = "gpu-wide"
        c_wide["gpu"]["nodes"] = [{"count": 1, "gpus": 8, "gpu_memory_gb": 80, "groups": [4, 4]},
                                  {"count": 1, "gpus": 4, "gpu_memory_gb": 141, "groups": [4]}]

        def turns_long(d):  # longer trajectories: more tool calls per reward
            d["turns"] = {"dist": "geometric", "mean": 10, "max": 40}
        out += [(_with(w0, "gpu-seed39", seed=39), c0),
                (_with(w0, "gpu-wide", seed=40), c_wide),
                (_with(w0, "gpu-turns-10", seed=41, _=turns_long), c0),
                (_with(w0, "gpu-h200-b", seed=42, trajectories=160), c_h200),
                (_with(w0, "gpu-small-b", seed=43, trajectories=128, hint_sigma=1.5), c_small)]
    return out


def tail_family(quick: bool) -> list[tuple[dict, dict]]:
    w0 = _yaml(BENCH / "standard.yaml")
    c_std = _yaml(BENCH / "cluster-standard.yaml")
    c_tight = _yaml(BENCH / "cluster-tight.yaml")

    def tails(sig_tests=1.5, sig_code=1.5, sig_judge=None):
        def f(d):
            d["tools"][0]["duration_s"]["sigma"] = sig_code
            d["tools"][1]["duration_s"]["sigma"] = sig_tests
            if sig_judge is not None:
                d["rewards"][1]["duration_s"]["sigma"] = sig_judge
        return f

    out = [(_with(w0, "tail-h1.5", seed=41, hint_sigma=1.5, steps=2, train_time_s=20, trajectories=160,
                  _=tails()), c_std),
           (_with(w0, "tail-h2.0", seed=42, hint_sigma=2.0, steps=2, train_time_s=20, trajectories=160,
                  _=tails()), c_std),
           (_with(w0, "tail-tight", seed=43, hint_sigma=1.6, steps=2, train_time_s=20, trajectories=128,
                  _=tails()), c_tight),
           (_with(w0, "tail-judge", seed=44, hint_sigma=1.5, steps=3, train_time_s=30, trajectories=96,
                  _=tails(1.5, 1.3, 1.5)), c_std),
           (_with(w0, "tail-long", seed=45, hint_sigma=1.8, steps=2, train_time_s=20, trajectories=128,
                  turns={"dist": "geometric", "mean": 12, "max": 60}, _=tails(1.6, 1.0)), c_std)]
    if not quick:
        out.append((_with(w0, "tail-load", seed=46, hint_sigma=1.5, steps=2, train_time_s=20, trajectories=256,
                          _=tails()), c_std))
        out += [(_with(w0, "tail-seed47", seed=47, hint_sigma=1.5, steps=2, train_time_s=20, trajectories=160,
                       _=tails()), c_std),
                (_with(w0, "tail-tight-b", seed=48, hint_sigma=2.0, steps=2, train_time_s=20, trajectories=160,
                       _=tails(1.6, 1.6)), c_tight),
                (_with(w0, "tail-1step", seed=49, hint_sigma=1.5, trajectories=256, _=tails()), c_std),
                (_with(w0, "tail-judge-b", seed=50, hint_sigma=1.8, steps=2, train_time_s=20, trajectories=128,
                       _=tails(1.5, 1.5, 1.5)), c_tight)]
    return out


def gpux_family(quick: bool) -> list[tuple[dict, dict]]:
    """More GPU-bound seeds (12) over the four GPU cluster shapes: residency decisions cascade (one
    load evicts a replica that is loaded back 100 s later), so one variant moves a lot with any change;
    a rule is judged on the mean over many."""
    w0 = _yaml(ROOT / "resources" / "variants" / "gpu-bound.yaml")
    shapes = {c[1]["name"]: c[1] for c in gpu_family(False)}
    names = ["gpu-mixed", "gpu-h200", "gpu-small", "gpu-wide"]
    out = []
    for i, seed in enumerate(range(101, 113)):
        c = shapes[names[i % 4]]
        n = 96 if c["name"] == "gpu-small" else 128
        out.append((_with(w0, f"gpux-{seed}", seed=seed, trajectories=n, hint_sigma=(1.0, 1.5)[i % 2]), c))
    return out[:4] if quick else out


def small_family(quick: bool) -> list[tuple[dict, dict]]:
    """Small steps (48-64 trajectories): most of the step passes before the gate has learned."""
    g0 = _yaml(ROOT / "resources" / "variants" / "gpu-bound.yaml")
    c_gpu = _yaml(ROOT / "resources" / "variants" / "cluster-gpu-mixed.yaml")
    w0 = _yaml(BENCH / "standard.yaml")
    c_std = _yaml(BENCH / "cluster-standard.yaml")
    c_half = copy.deepcopy(_yaml(BENCH / "cluster-tight.yaml"))  # half of the tight cluster
    c_half["name"] = "half-tight"
    c_half["cpu"]["nodes"] = [{"count": 1, "slots": 32}]
    c_half["api"]["tokens"] = 16

    def tails(d):
        d["tools"][0]["duration_s"]["sigma"] = 1.5
        d["tools"][1]["duration_s"]["sigma"] = 1.5
    out = [(_with(g0, f"small-gpu{s}", seed=s, trajectories=48 + 4 * (s - 51)), c_gpu) for s in (51, 52, 53, 54)]
    out += [(_with(w0, f"small-tail{s}", seed=s, hint_sigma=1.5, trajectories=64, _=tails), c_half)
            for s in (61, 62, 63)]
    out += [(_with(w0, f"small-std{s}", seed=s, trajectories=64), c) for s, c in ((64, c_std), (65, c_half))]
    return out[:4] if quick else out


def live_family(quick: bool) -> list[tuple[dict, dict]]:
    """The live benchmark's files (``bench --live``: small.yaml on cluster-laptop.yaml) on 8 seeds: 32
    trajectories, 16 CPU slots, 4 GPUs in two groups of 2 holding one 140 GB judge and two 16 GB ones."""
    w0 = _yaml(BENCH / "small.yaml")
    c0 = _yaml(BENCH / "cluster-laptop.yaml")
    return [(_with(w0, f"live-seed{s}", seed=s), c0) for s in ((11,) if quick else (11, 1, 2, 3, 4, 5, 6, 7))]


def api_family(quick: bool) -> list[tuple[dict, dict]]:
    """API-heavy steps: calls with no elastic size, against a quota that static binds per trajectory."""
    w0 = _yaml(ROOT / "resources" / "variants" / "api-heavy.yaml")
    c0 = _yaml(ROOT / "resources" / "variants" / "cluster-api.yaml")
    c_tight = _with(c0, "api-tight", api={"tokens": 12})
    c_wide = _with(c0, "api-wide", api={"tokens": 64}, cpu={"nodes": [{"count": 2, "slots": 32}]})

    def tails(d):  # page fetches and batched calls with heavy tails
        d["tools"][1]["duration_s"]["sigma"] = 1.5
        d["tools"][3]["duration_s"]["sigma"] = 1.5

    def batch_heavy(d):  # the 2-token batched call on a third of the turns
        for t, w in zip(d["tools"], (0.30, 0.15, 0.25, 0.30)):
            t["weight"] = w

    def gpu_judged(d):  # most rewards on the GPU judge
        d["rewards"][0]["weight"] = 0.3
        d["rewards"][1]["weight"] = 0.7
    out = [(_with(w0, "api-seed61", seed=61), c0),
           (_with(w0, "api-seed62", seed=62), c0),
           (_with(w0, "api-tight", seed=63, trajectories=96), c_tight),
           (_with(w0, "api-wide", seed=64, trajectories=256), c_wide)]
    if not quick:
        out += [(_with(w0, "api-tail", seed=65, hint_sigma=1.6, steps=2, train_time_s=20, _=tails), c0),
                (_with(w0, "api-batch", seed=66, _=batch_heavy), c0),
                (_with(w0, "api-gpu-judge", seed=67, _=gpu_judged), c0),
                (_with(w0, "api-steps-3", seed=68, steps=3, train_time_s=30, trajectories=96), c0)]
    return out


def demo_family(quick: bool) -> list[tuple[dict, dict]]:
    """The shape of ``tangram-dask demo``: trajectories idle in LLM generation most of the time
    (``demo-like.yaml``), and the demo as it runs live (``demo-live.yaml``: whole LLM delays, the reward
    as long as it is live in a crowd)."""
    w0 = _yaml(ROOT / "resources" / "variants" / "demo-like.yaml")
    w1 = _yaml(ROOT / "resources" / "variants" / "demo-live.yaml")
    c0 = _yaml(ROOT / "resources" / "variants" / "cluster-demo.yaml")
    seeds = (0,) if quick else (0, 1, 2)
    return ([(_with(w0, f"demo-seed{s}", seed=s), c0) for s in seeds]
            + [(_with(w1, f"demo-live-seed{s}", seed=s), c0) for s in seeds])


def family(name: str, quick: bool) -> list[tuple[dict, dict]]:
    return {"std": std_family, "gpu": gpu_family, "tail": tail_family, "small": small_family,
            "gpux": gpux_family, "live": live_family, "api": api_family, "demo": demo_family}[name](quick)


COLS = ("act/ideal", "step/ideal", "act/stat", "step/stat", "act/fifo", "step/fifo")


def measure(fam: str, wd: dict, cd: dict, opts: dict, with_parity: bool, hints: float | None = None) -> dict:
    """One variant: tangram (``opts``; ``hints``, a sigma: each trajectory begins with a hint of its length,
    beyond WORKLOAD.md) against fifo and static."""
    options = TangramOptions(**opts)
    ws = parse_workload(wd, wd["name"])
    cs = parse_cluster(cd, cd["name"])
    gen = generate(ws)
    t = simulate(gen, cs, "tangram", options=options, trajectory_hints=hints)
    f = simulate(gen, cs, "fifo")
    s = simulate(gen, cs, "static")
    par = parity(gen, cs, s["step_s"], options=options, trajectory_hints=hints) if with_parity else None
    ratios = (t["act_mean_s"] / t["ideal_act_mean_s"], t["step_s"] / t["ideal_step_s"],
              t["act_mean_s"] / s["act_mean_s"], t["step_s"] / s["step_s"],
              t["act_mean_s"] / f["act_mean_s"], t["step_s"] / f["step_s"])
    return {"family": fam, "variant": ws.name, "cluster": cs.name, "ratios": ratios, "parity": par,
            "loads": t["model_loads"], "fifo_loads": f["model_loads"], "restores": t["restores"],
            "act": (t["act_mean_s"], s["act_mean_s"], f["act_mean_s"]),
            "act_floor": t["act_mean_s"] / t["floor_act_mean_s"]}  # ACT over what any policy could reach


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="std",
                    help="comma-separated: std, gpu, tail, small, gpux, live, api, demo (or all)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("-o", "--policy-option", action="append", default=[])
    ap.add_argument("--trajectory-hints", type=float, default=None, metavar="SIGMA",
                    help="beyond WORKLOAD.md: tangram's trajectories begin with hints of their lengths (admit_long)")
    a = ap.parse_args()
    opts = {}
    for kv in a.policy_option:
        k, v = kv.split("=")
        opts[k] = float(v)
    fams = FAMILIES if a.family == "all" else tuple(a.family.split(","))
    jobs = [(fam, wd, cd) for fam in fams for wd, cd in family(fam, a.quick)]
    print(f"{'variant':<16}{'cluster':<10}" + "".join(f"{c:>11}" for c in COLS)
          + f"{'parity':>7}{'loads':>6}{'fifo':>6}{'rest':>5}")
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else _Inline() as ex:
        results = list(ex.map(measure, *zip(*[(f, w, c, opts, a.parity, a.trajectory_hints) for f, w, c in jobs])))
    by_fam: dict[str, list[dict]] = {}
    for r in results:
        by_fam.setdefault(r["family"], []).append(r)
        par = f"{r['parity']:>7.2f}" if r["parity"] is not None else f"{'-':>7}"  # (-: not asked, --parity)
        print(f"{r['variant']:<16}{r['cluster']:<10}" + "".join(f"{x:>11.3f}" for x in r["ratios"])
              + f"{par}{r['loads']:>6}{r['fifo_loads']:>6}{r['restores']:>5}")
    for fam, rs in by_fam.items():
        m = np.array([r["ratios"] for r in rs])
        print(f"\nfamily {fam}: {len(rs)} variants; tangram's ACT and step below static's on "
              f"{int(((m[:, 2] < 1) & (m[:, 3] < 1)).sum())}; model loads at most fifo's on "
              f"{sum(r['loads'] <= r['fifo_loads'] for r in rs)} (fewer on "
              f"{sum(r['loads'] < r['fifo_loads'] for r in rs)})")
        print(f"{'':<26}" + "".join(f"{c:>11}" for c in COLS))
        for label, fn in (("min", np.min), ("mean", np.mean), ("max", np.max)):
            print(f"{label:<26}" + "".join(f"{x:>11.3f}" for x in fn(m, axis=0)))


class _Inline:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def map(self, fn, *its):
        return map(fn, *its)


if __name__ == "__main__":
    main()
