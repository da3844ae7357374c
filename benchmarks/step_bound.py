"""How short could any policy make the step on a fraction of the cluster? A lower bound, beside tangram's.

For each fraction f of the parity grid, the cluster at f (``ClusterSpec.scaled``) and two bounds that hold
for every policy:

- the critical path: the longest trajectory with every action alone on ``units.max`` (the ideal step);
- work: for a resource and a pair (r, tau), every action that cannot be issued before r (its trajectory's
  LLM delays and ideal actions before it) and leaves at least tau of its trajectory after it must run
  within [r, step - tau], so step >= r + tau + (their least unit-seconds) / capacity. An action's least
  unit-seconds is its duration on the units (in units.min..units.max) that minimise units x time, plus a
  warm start per unit for CPU actions (no cold starts, no restores, no loads: a lower bound).

Prints, per f: the bound (and which term sets it), tangram's step, and static's on the whole cluster
(``capacity_for_parity`` is the first f where tangram's step is at most that). A bound over static's step
says parity at f is out of reach for any policy; under it, the gap is the policy's (or the bound's).

    python benchmarks/step_bound.py [WORKLOAD CLUSTER] [--trajectory-hints SIGMA -o admit_long=2 ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import GRID, simulate  # noqa: E402
from tangram_dask.cluster import ClusterSpec, load_cluster  # noqa: E402
from tangram_dask.costs import CostModel  # noqa: E402
from tangram_dask.policy import TangramOptions  # noqa: E402
from tangram_dask.workload import Generated, generate, load_workload  # noqa: E402


def per_action(gen: Generated, cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per action: its resource index (0 cpu, 1 gpu, 2 api), least unit-seconds, earliest issue, and the
    least time its trajectory needs after it ends."""
    kinds = gen.spec.kinds
    costs = CostModel.of(cluster, gen.spec.models)
    specs = [k.spec(None, "t") for k in kinds]
    res_of = {"cpu": 0, "gpu": 1, "api": 2}
    least = [min(u * specs[i].scale(u) for u in range(k.units_min, k.units_max + 1)) for i, k in enumerate(kinds)]
    fixed = [cluster.warm_start_s * k.units_min if k.resource == "cpu" else 0.0 for k in kinds]
    kind = gen.kind
    res = np.array([res_of[kinds[i].resource] for i in range(len(kinds))])[kind]
    work = gen.duration * np.array(least)[kind] + np.array(fixed)[kind]
    ideal = np.array([costs.ideal_s(specs[k], d) for k, d in zip(kind, gen.duration)])
    rel = np.zeros(gen.n_actions)
    tail = np.zeros(gen.n_actions)
    for t in range(gen.n_trajectories):
        a0, a1 = gen.first[t], gen.first[t + 1]
        along = np.cumsum(gen.llm[a0:a1] + ideal[a0:a1])
        rel[a0:a1] = along - ideal[a0:a1]
        tail[a0:a1] = along[-1] - along
    return res, work, rel, tail


def critical_path(gen: Generated, cluster: ClusterSpec, rel: np.ndarray) -> float:
    """The longest trajectory made of LLM delays and ideal actions (the ideal step): each one's last action's
    earliest issue plus its ideal time."""
    costs = CostModel.of(cluster, gen.spec.models)
    specs = [k.spec(None, "t") for k in gen.spec.kinds]
    return float(max(rel[a] + costs.ideal_s(specs[gen.kind[a]], gen.duration[a]) for a in gen.first[1:] - 1))


def bound(res: np.ndarray, work: np.ndarray, rel: np.ndarray, tail: np.ndarray, capacity: dict[str, int],
          critical: float) -> tuple[float, str]:
    best, why = critical, "critical path"
    for i, name in enumerate(("cpu", "gpu", "api")):
        cap = capacity.get(name, 0)
        m = res == i
        if not cap or not m.any():
            continue
        r_all, t_all, w_all = rel[m], tail[m], work[m]
        for r in np.unique(np.quantile(r_all, np.linspace(0, 0.95, 20))):
            sel_r = r_all >= r
            for tau in np.unique(np.quantile(t_all[sel_r], np.linspace(0, 0.95, 20))):
                v = r + tau + w_all[sel_r & (t_all >= tau)].sum() / cap
                if v > best:
                    best, why = v, f"{name} work (r {r:.0f} s, tau {tau:.0f} s)"
    return best, why


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", nargs="?", default=str(ROOT / "resources/bench/standard.yaml"))
    ap.add_argument("cluster", nargs="?", default=str(ROOT / "resources/bench/cluster-standard.yaml"))
    ap.add_argument("--trajectory-hints", type=float, default=None, metavar="SIGMA")
    ap.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    gen = generate(load_workload(a.workload))
    cl = load_cluster(a.cluster)
    options = TangramOptions(**{k: float(v) for k, v in (x.split("=", 1) for x in a.option)})
    res, work, rel, tail = per_action(gen, cl)
    critical = critical_path(gen, cl, rel)
    static = simulate(gen, cl, "static")["step_s"]
    print(f"{gen.spec.name} on {cl.name}: static's step {static:.1f} s on the whole cluster; "
          f"critical path {critical:.1f} s")
    print(f"{'f':>5} {'bound':>8}  {'tangram':>8}  set by")
    for f in GRID:
        c = cl.scaled(f)
        try:
            t = simulate(gen, c, "tangram", options=options, trajectory_hints=a.trajectory_hints)["step_s"]
        except Exception as e:  # an action no node of the scaled cluster can hold
            print(f"{f:>5.2f} {'-':>8}  {'-':>8}  ({type(e).__name__}: {e})")
            continue
        b, why = bound(res, work, rel, tail, c.capacity(), critical)
        print(f"{f:>5.2f} {b:>8.1f}  {t:>8.1f}  {why}{'  <- parity' if t <= static + 1e-9 else ''}")
        if t <= static + 1e-9:
            break  # parity: larger fractions only shorten both


if __name__ == "__main__":
    main()
