"""How low could any policy bring ACT under WORKLOAD.md's replica sizes? A floor per action, beside tangram's.

The contract's ideal (``ideal_act_mean_s``) runs every action alone on ``units.max``. A GPU action cannot
always get there: WORKLOAD.md loads a replica on the smallest k >= units.min whose share of the model fits
one GPU (per node shape), a replica serves one action at a time, and the action runs on the replica's k GPUs.
So each action has a floor that holds for every policy that keeps the contract:

- CPU and API actions: ``units.max``, with no sandbox start (the ideal adds a warm start to CPU actions, but
  a sandbox bound to its trajectory, as static's, pays none after its first);
- GPU actions: the best replica the contract allows on any GPU node of the cluster: for each node shape and
  each ``units.min`` among its model's kinds (a background load may be sized for any of them), k GPUs of the
  node, the action on ``min(k, units.max)`` of them, ``cross_group_slowdown`` slower where k is more than
  the node's largest topology group; no load, no queue.

No queueing, no loads, no cold starts: a lower bound, not a target. Where the floor is over 1.5x the ideal
the GPU-bound target (ACT at most 1.5x ideal) is out of reach for every policy on that draw; elsewhere the gap
between a policy's ACT and the floor is what its queues, loads and sizes cost.

    python benchmarks/act_bound.py [WORKLOAD CLUSTER]     # per kind: ideal, floor, tangram, static, fifo
    python benchmarks/act_bound.py --family gpu,gpux [--k K] [-j 2]
        # per family, the named variants (--k 0) or K draws of each on other seeds (benchmarks/reseed.py's)
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
from tangram_dask.workload import Generated, generate, load_workload, parse_workload  # noqa: E402


def kind_factors(gen: Generated, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per kind: seconds per second of true work (``duration_s``, on ``units.min``) at the floor, and at the
    ideal. The ideal's warm start (CPU actions) is in neither: see :func:`floors`."""
    kinds = gen.spec.kinds
    specs = [k.spec(None, "t") for k in kinds]
    mins: dict[str, set[int]] = {}
    for k in kinds:
        if k.resource == "gpu":
            mins.setdefault(k.model, set()).add(k.units_min)
    floor, ideal = [], []
    for k, s in zip(kinds, specs):
        best = s.scale(s.units_max)
        ideal.append(best)
        if k.resource == "gpu":
            m = gen.spec.models[k.model]
            best = np.inf
            for n in cluster.gpu_nodes:
                for u in mins[k.model]:
                    g = m.replica_gpus(u, n.gpu_memory_gb)
                    if g > n.gpus:
                        continue
                    t = s.scale(min(g, s.units_max))
                    if g > max(n.groups):
                        t *= cluster.cross_group_slowdown
                    best = min(best, t)
        floor.append(best)
    return np.array(floor), np.array(ideal)


def floors(gen: Generated, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """Per action: its floor and its ideal (the simulator's ``ideal``), in seconds."""
    f, i = kind_factors(gen, cluster)
    warm = np.array([cluster.warm_start_s if k.resource == "cpu" else 0.0 for k in gen.spec.kinds])
    return gen.duration * f[gen.kind], gen.duration * i[gen.kind] + warm[gen.kind]


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


def _draw(d: tuple[str, dict, dict]) -> tuple[str, str, float, float]:
    fam, wd, cd = d
    gen = generate(parse_workload(wd, wd["name"]))
    cl = parse_cluster(cd, cd["name"])
    floor, ideal = floors(gen, cl)
    t = simulate(gen, cl, "tangram")
    return fam, wd["name"], floor.mean() / ideal.mean(), t["act_mean_s"] / t["ideal_act_mean_s"]


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
