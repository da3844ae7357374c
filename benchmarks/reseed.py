"""The families of benchmarks/variants.py on other seeds: how often each claim holds, per family.

Each variant of benchmarks/variants.py is one seed, and on the GPU-bound shapes one load decision
cascades: a rule that moves one load wins or loses a variant by chance (session 10: a change that
lost ``gpu-small-b``'s step at seed 43 won it on 15 of 16 other seeds). Here every variant keeps its
shape (workload, cluster, options of the shape) and is drawn again with ``k`` other seeds
(``1000 + 17 i + its own seed``, i < k), static and fifo measured once per draw, each option set on
the same draws. Prints, per family and set: draws with ACT and step both under static's, model
loads at most fifo's, the mean and max of ACT/static and step/static, ACT/ideal's mean and max and
how many draws are over 1.5x ideal (the GPU-bound target).

    python benchmarks/reseed.py [--family all] [--k 3] [-j 2] [--set k=v,k=v ...] [--steps N] [--losers]

``--set ""`` is the defaults; several ``--set`` compare option sets on the same draws, and each set
after the first is also paired with it draw by draw: the mean change of ACT/ideal and of step/static,
its standard error, and the draws each way (``paired``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.variants as V  # noqa: E402
from benchmarks.sweep import _opts, runs  # noqa: E402

FAMILIES = V.FAMILIES


def draws(families: list[str], k: int, steps: int = 0) -> list[tuple[str, dict, dict]]:
    """``(family, workload, cluster)`` for each variant of ``families`` on ``k`` seeds other than its own; with
    ``steps``, each runs at least that many RL steps (``train_time_s`` 30 between them where it has none)."""
    out = []
    for fam in families:
        for wd, cd in V.family(fam, False):
            for i in range(k):
                w = V.as_steps(wd, steps)
                w["seed"] = 1000 + 17 * i + int(wd["seed"])
                w["name"] = f"{wd['name']}@{w['seed']}"
                out.append((fam, w, cd))
    return out


def measure(draw: tuple[str, dict, dict], sets: list[dict[str, float]]) -> tuple[str, str, list[tuple]]:
    """One draw: per option set, ``(ACT/static, step/static, ACT/ideal, loads, fifo's loads, ACT/floor)`` (the
    floor: ``tangram_dask.metrics.act_floor``, what any policy could reach under WORKLOAD.md's replica sizes)."""
    fam, wd, cd = draw
    s, f, ts = runs(wd, cd, sets)
    return fam, wd["name"], [(t["act_mean_s"] / s["act_mean_s"], t["step_s"] / s["step_s"],
                              t["act_mean_s"] / t["ideal_act_mean_s"], t["model_loads"], f["model_loads"],
                              t["act_mean_s"] / t["floor_act_mean_s"]) for t in ts]


def summary(rows: list[tuple]) -> dict[str, float]:
    act, step, ideal = ([r[i] for r in rows] for i in range(3))
    return {"n": len(rows), "both": sum(a < 1 and s < 1 for a, s in zip(act, step)),
            "loads": sum(r[3] <= r[4] for r in rows),
            "act_mean": statistics.mean(act), "act_max": max(act),
            "step_mean": statistics.mean(step), "step_max": max(step),
            "ideal_mean": statistics.mean(ideal), "ideal_max": max(ideal), "over_1.5": sum(x > 1.5 for x in ideal),
            "floor_mean": statistics.mean(r[5] for r in rows)}


def paired(base: list[tuple], other: list[tuple]) -> dict[str, float]:
    """``other`` against ``base`` on the same draws: the mean per-draw change of ACT/ideal and of
    step/static, with its standard error, and how many draws each way (ACT/ideal). A change of a few
    thousandths over a family is noise unless it is several standard errors (a load decision moves
    one draw by tenths either way)."""
    n = len(base)
    d_act = [o[2] - b[2] for b, o in zip(base, other)]
    d_step = [o[1] - b[1] for b, o in zip(base, other)]

    def se(xs: list[float]) -> float:
        return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan

    return {"n": n, "act": statistics.mean(d_act), "act_se": se(d_act), "step": statistics.mean(d_step),
            "step_se": se(d_step), "better": sum(d < -1e-9 for d in d_act), "worse": sum(d > 1e-9 for d in d_act)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="all", help="comma-separated: " + ", ".join(FAMILIES) + " (or all)")
    ap.add_argument("--k", type=int, default=3, help="seeds per variant")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    ap.add_argument("--set", action="append", default=None, help='options "k=v,k=v" ("" = the defaults)')
    ap.add_argument("--steps", type=int, default=0,
                    help="run each draw as at least this many RL steps (what a training run repeats)")
    ap.add_argument("--losers", action="store_true", help="list the draws some set loses on")
    a = ap.parse_args()
    fams = list(FAMILIES) if a.family == "all" else a.family.split(",")
    texts = a.set if a.set is not None else [""]
    sets = [_opts(x) for x in texts]
    ds = draws(fams, a.k, a.steps)
    with ProcessPoolExecutor(a.jobs) as ex:
        res = list(ex.map(measure, ds, [sets] * len(ds)))
    print(f"{'family':7}{'set':28}{'both':>9}{'loads':>9}{'act/stat':>16}{'step/stat':>16}{'act/ideal':>16}{'>1.5':>6}"
          f"{'act/floor':>10}")
    for fam in fams:
        for j, text in enumerate(texts):
            m = summary([r[j] for f, _, r in res if f == fam])
            print(f"{fam:7}{(text or 'defaults')[:27]:28}{m['both']:>4}/{m['n']:<4}{m['loads']:>4}/{m['n']:<4}"
                  f"{m['act_mean']:>8.3f}{m['act_max']:>8.3f}{m['step_mean']:>8.3f}{m['step_max']:>8.3f}"
                  f"{m['ideal_mean']:>8.3f}{m['ideal_max']:>8.3f}{m['over_1.5']:>6}{m['floor_mean']:>10.3f}")
    print("(act/stat, step/stat, act/ideal: mean then max over the draws; both: ACT and step under static's; "
          "loads: model loads at most fifo's; act/floor: mean, ACT over what any policy could reach)")
    if len(texts) > 1:
        print(f"\npaired, per draw, against {texts[0] or 'the defaults'!r}:")
        print(f"{'family':7}{'set':28}{'act/ideal':>10}{'(se)':>8}{'step/stat':>11}{'(se)':>8}{'better':>8}{'worse':>7}")
        for fam in fams:
            rows = [r for f, _, r in res if f == fam]
            for j in range(1, len(texts)):
                p = paired([r[0] for r in rows], [r[j] for r in rows])
                print(f"{fam:7}{(texts[j] or 'defaults')[:27]:28}{p['act']:>+10.4f}{p['act_se']:>8.4f}"
                      f"{p['step']:>+11.4f}{p['step_se']:>8.4f}{p['better']:>8}{p['worse']:>7}")
    if a.losers:
        for fam, name, r in res:
            if any(x[0] >= 1 or x[1] >= 1 for x in r):
                print(f"{name:22}" + " | ".join(f"{x[0]:.3f} {x[1]:.3f}" for x in r))


if __name__ == "__main__":
    main()
