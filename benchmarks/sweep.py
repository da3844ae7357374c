"""Many random variants at once: how often tangram beats static on ACT and step together, per option set.

The families of benchmarks/variants.py are 59 hand-made variants and the step is one trajectory's end,
so a rule that moves one admission by 30 s wins or loses a variant by chance. Here each seed draws a
shape (the standard workload on the standard, tight or half cluster, tails of sigma 1.0-1.8, hint
sigma 0.5-2.0, 1 or 2 steps, 48-160 trajectories; or the GPU-bound workload on the mixed GPU cluster,
one seed in five) and every option set runs on the same draws, against static and fifo measured once.

    python benchmarks/sweep.py [--n 300] [--base 2000] [-j 2] [--set k=v,k=v ...] [--losers]

``--set ""`` is the defaults; several ``--set`` compare option sets on the same variants. Prints, per
set: the variants where ACT and step are both under static's, each alone, step under fifo's, and the
mean and max of ACT/static, step/static, step/fifo and ACT/ideal.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.variants as V  # noqa: E402
from tangram_dask.bench import simulate  # noqa: E402
from tangram_dask.cluster import parse_cluster  # noqa: E402
from tangram_dask.policy import TangramOptions  # noqa: E402
from tangram_dask.workload import generate, parse_workload  # noqa: E402


@functools.lru_cache(maxsize=1)
def _bases() -> dict[str, dict]:
    """The workloads and clusters the shapes start from, read once (``V._with`` copies a workload)."""
    small = V.small_family(False)
    return {"std": V._yaml(V.BENCH / "cluster-standard.yaml"), "tight": V._yaml(V.BENCH / "cluster-tight.yaml"),
            "half": small[4][1], "gpu": small[0][1], "standard.yaml": V._yaml(V.BENCH / "standard.yaml"),
            "gpu-bound.yaml": V._yaml(V.ROOT / "resources" / "variants" / "gpu-bound.yaml")}


def variant(seed: int) -> tuple[dict, dict]:
    """One seed's shape, drawn from ``random.Random(seed)`` (the same seed, the same variant)."""
    r = random.Random(seed)
    b = _bases()
    sigma = r.choice([1.0, 1.3, 1.5, 1.8])

    def tails(d):
        d["tools"][0]["duration_s"]["sigma"] = sigma
        d["tools"][1]["duration_s"]["sigma"] = sigma
    shape = r.choice(["std", "tight", "half", "half", "gpu"])
    if shape == "gpu":
        return V._with(b["gpu-bound.yaml"], f"s{seed}-gpu", seed=seed, trajectories=r.choice([48, 64, 96])), b["gpu"]
    n = r.choice([48, 64, 96]) if shape == "half" else r.choice([64, 96, 128, 160])
    return V._with(b["standard.yaml"], f"s{seed}-{shape}", seed=seed, hint_sigma=r.choice([0.5, 1.0, 1.5, 2.0]),
                   steps=r.choice([1, 2]), train_time_s=20, trajectories=n, _=tails), b[shape]


def runs(wd: dict, cd: dict, sets: list[dict[str, float]]) -> tuple[dict, dict, list[dict]]:
    """static's and fifo's metrics on one draw (workload and cluster as dicts), then tangram's per option set.
    A set's ``hints=SIGMA`` is not an option: tangram's run begins each trajectory with a hint of its length
    (``simulate``'s ``trajectory_hints``), for ``admit_long``."""
    gen = generate(parse_workload(wd, wd["name"]))
    cl = parse_cluster(cd, cd["name"])

    def tangram(opts: dict[str, float]) -> dict:
        opts = dict(opts)
        sigma = opts.pop("hints", None)
        return simulate(gen, cl, "tangram", options=TangramOptions(**opts), trajectory_hints=sigma)

    return simulate(gen, cl, "static"), simulate(gen, cl, "fifo"), [tangram(opts) for opts in sets]


def measure(seed: int, sets: list[dict[str, float]]) -> tuple[str, list[tuple[float, float, float, float]]]:
    wd, cd = variant(seed)
    s, f, ts = runs(wd, cd, sets)
    return wd["name"], [(t["act_mean_s"] / s["act_mean_s"], t["step_s"] / s["step_s"], t["step_s"] / f["step_s"],
                         t["act_mean_s"] / t["ideal_act_mean_s"]) for t in ts]


def _opts(text: str) -> dict[str, float]:
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--base", type=int, default=2000, help="first seed")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--set", action="append", default=None, help='options "k=v,k=v" ("" = the defaults)')
    ap.add_argument("--losers", action="store_true", help="list the variants some set loses on")
    a = ap.parse_args()
    texts = a.set if a.set is not None else [""]
    sets = [_opts(x) for x in texts]
    seeds = range(a.base, a.base + a.n)
    with ProcessPoolExecutor(a.jobs) as ex:
        res = list(ex.map(measure, seeds, [sets] * a.n))
    for j, text in enumerate(texts):
        rows = [r[j] for _, r in res]
        act, step, fifo, ideal = ([row[i] for row in rows] for i in range(4))
        both = sum(x < 1 and y < 1 for x, y in zip(act, step))
        print(f"[{text or 'defaults'}] both under static's {both}/{a.n}; ACT {sum(x < 1 for x in act)}, "
              f"step {sum(y < 1 for y in step)}; step under fifo's {sum(z < 1 for z in fifo)}")
        print(f"    ACT/static mean {statistics.mean(act):.3f} max {max(act):.3f}; step/static mean "
              f"{statistics.mean(step):.3f} max {max(step):.3f}; step/fifo mean {statistics.mean(fifo):.3f}; "
              f"ACT/ideal mean {statistics.mean(ideal):.3f}")
    if a.losers:
        for name, r in res:
            if any(x >= 1 or y >= 1 for x, y, _, _ in r):
                print(f"{name:16}" + " | ".join(f"{x:.3f} {y:.3f}" for x, y, _, _ in r))


if __name__ == "__main__":
    main()
