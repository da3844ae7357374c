"""How low could any policy bring ACT under WORKLOAD.md's replica sizes? A floor per action, beside tangram's.

The floor is :func:`tangram_dask.metrics.act_floor`: each action alone, on the widest replica the contract
allows (GPU) or ``units.max`` (CPU, API), with no start, load or queue. Every bench run reports its mean
(``floor_act_mean_s``, the table's "floor ACT"); this script prints it per kind for one file, or per family
over many draws. A lower bound, not a target: where it is over 1.5x the ideal, the GPU-bound target (ACT at
most 1.5x ideal) is out of reach for every policy on that draw; elsewhere the gap between a policy's ACT and
the floor is what its queues, loads and sizes cost.

    python benchmarks/act_bound.py [WORKLOAD CLUSTER]     # per kind: ideal, floor, tangram, static, fifo
    python benchmarks/act_bound.py --family gpu,gpux [--k K] [-j 2]
        # per family, the named variants (--k 0) or K draws of each on other seeds (benchmarks/reseed.py's),
        # then where tangram's ACT over the floor is: per kind, its share of (ACT - floor) / ideal ACT,
        # over all draws and over those above 1.5x ideal
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import simulate  # noqa: E402
from tangram_dask.cluster import ClusterSpec, load_cluster, parse_cluster  # noqa: E402
from tangram_dask.metrics import act_floor, act_ideal  # noqa: E402
from tangram_dask.workload import Generated, generate, load_workload, parse_workload  # noqa: E402


def floors(gen: Generated, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per action: its floor and its ideal (:mod:`tangram_dask.metrics`), in seconds."""
    return act_floor(gen, cluster), act_ideal(gen, cluster)


def one_file(workload: str, cluster: str) -> None:
    gen = generate(load_workload(workload))
    cl = load_cluster(cluster)
    floor, ideal = floors(gen, cl)
    runs = {p: simulate(gen, cl, p) for p in ("tangram", "static", "fifo")}
    print(f"{gen.spec.name} on {cl.name}: ACT floor {floor.mean():.3f} s = {floor.mean() / ideal.mean():.3f}x ideal "
          f"({ideal.mean():.3f} s); tangram {runs['tangram']['act_mean_s']:.3f} s = "
          f"{runs['tangram']['act_mean_s'] / floor.mean():.3f}x the floor")
    print(f"{'kind':<16}{'actions':>8}{'ideal':>8}{'floor':>8}{'tangram':>9}{'static':>8}{'fifo':>8}")
    kinds = gen.spec.kinds
    for i, k in enumerate(kinds):
        m = gen.kind == i
        if not m.any():
            continue
        by = [runs[p]["by_kind"].get(k.kind, {}).get("act_mean_s", float("nan")) for p in ("tangram", "static", "fifo")]
        print(f"{k.kind:<16}{int(m.sum()):>8}{ideal[m].mean():>8.2f}{floor[m].mean():>8.2f}"
              + "".join(f"{x:>{w}.2f}" for x, w in zip(by, (9, 8, 8))))


def _draw(d: tuple[str, dict, dict]) -> tuple[str, str, float, float, dict[str, float]]:
    """One draw: floor / ideal, tangram's ACT / ideal, and per kind its part of (ACT - floor) / ideal ACT
    (the kinds' parts add up to tangram's ACT over the floor, in units of the ideal mean)."""
    fam, wd, cd = d
    gen = generate(parse_workload(wd, wd["name"]))
    cl = parse_cluster(cd, cd["name"])
    floor, ideal = floors(gen, cl)
    t = simulate(gen, cl, "tangram")
    n, ideal_mean = len(ideal), ideal.mean()
    excess = {}
    for i, k in enumerate(gen.spec.kinds):
        m = gen.kind == i
        if m.any():
            excess[k.kind] = float(m.sum() * (t["by_kind"][k.kind]["act_mean_s"] - floor[m].mean()) / n / ideal_mean)
    return fam, wd["name"], floor.mean() / ideal_mean, t["act_mean_s"] / t["ideal_act_mean_s"], excess


def _excess_table(rows: list[tuple]) -> None:
    """Per kind, the mean of its part of (ACT - floor) / ideal: over all draws, and over those above 1.5x ideal."""
    over = [x for x in rows if x[3] > 1.5]
    kinds: dict[str, None] = {}
    for x in rows:
        kinds.update(dict.fromkeys(x[4]))

    def mean(sel: list[tuple], kind: str | None) -> float:
        if not sel:
            return float("nan")
        return float(np.mean([sum(x[4].values()) if kind is None else x[4].get(kind, 0.0) for x in sel]))

    print(f"(ACT - floor) / ideal ACT, per kind: mean over all {len(rows)} draws, and over the {len(over)} "
          f"above 1.5x ideal")
    print(f"    {'all kinds':<18}{mean(rows, None):>8.3f}{mean(over, None):>8.3f}")
    for kind in sorted(kinds, key=lambda kd: -mean(over or rows, kd)):
        print(f"    {kind:<18}{mean(rows, kind):>8.3f}{mean(over, kind):>8.3f}")


def families(names: list[str], k: int, jobs: int) -> None:
    import benchmarks.variants as V
    from benchmarks.reseed import draws

    ds = draws(names, k) if k else [(f, w, c) for f in names for w, c in V.family(f, False)]
    with ProcessPoolExecutor(jobs) as ex:
        rows = list(ex.map(_draw, ds))
    print(f"{'family':<8}{'draws':>6}  {'floor/ideal mean, max':>22}  {'floor > 1.5':>11}  "
          f"{'tangram/ideal mean':>18}  {'over 1.5':>8}  {'tangram/floor mean, max':>24}")
    for fam in names:
        r = [x for x in rows if x[0] == fam]
        b = np.array([x[2] for x in r])
        a = np.array([x[3] for x in r])
        print(f"{fam:<8}{len(r):>6}  {b.mean():>14.3f}, {b.max():.3f}  {int((b > 1.5).sum()):>11}  "
              f"{a.mean():>18.3f}  {int((a > 1.5).sum()):>8}  {np.mean(a / b):>16.3f}, {np.max(a / b):.3f}")
        if not k:
            for x in r:
                print(f"    {x[1]:<24} floor {x[2]:.3f}  tangram {x[3]:.3f}")
    _excess_table(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", nargs="?", default=str(ROOT / "resources/bench/standard.yaml"))
    ap.add_argument("cluster", nargs="?", default=str(ROOT / "resources/bench/cluster-standard.yaml"))
    ap.add_argument("--family", default=None, help="comma-separated families of benchmarks/variants.py (or all)")
    ap.add_argument("--k", type=int, default=0, help="draws per variant on other seeds (0: the named variants)")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    a = ap.parse_args()
    if a.family:
        import benchmarks.variants as V

        names = list(V.FAMILIES) if a.family == "all" else a.family.split(",")
        families(names, a.k, a.jobs)
    else:
        one_file(a.workload, a.cluster)


if __name__ == "__main__":
    main()
