"""The live scheduler plugin against the simulator: same files, same policy objects.

Runs tangram and fifo on a real LocalCluster (one worker process per node of
the cluster file, actions sleeping their scaled true durations) and in the
simulator, and prints each act_mean_s and step_s with the live/sim ratios
(target: within 10% for tangram). The live plugin runs with the options it
ships (dispatch-ahead included), as ``tangram-dask bench --live`` does.

    python benchmarks/fidelity.py [WORKLOAD] [CLUSTER] [--time-scale 0.2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import run  # noqa: E402
from tangram_dask.cluster import load_cluster  # noqa: E402
from tangram_dask.live import run_live  # noqa: E402
from tangram_dask.workload import load_workload  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", nargs="?", default=str(ROOT / "resources/bench/small.yaml"))
    ap.add_argument("cluster", nargs="?", default=str(ROOT / "resources/bench/cluster-laptop.yaml"))
    ap.add_argument("--time-scale", type=float, default=0.2)
    a = ap.parse_args()
    wl, cl = load_workload(a.workload), load_cluster(a.cluster)
    policies = ("tangram", "fifo")
    sim = {r["policy"]: r for r in run(wl, cl, policies)}
    live = {r["policy"]: r for r in run_live(wl, cl, policies, time_scale=a.time_scale)}
    print(f"{wl.name} on {cl.name}, time scale {a.time_scale}")
    print(f"{'policy':>8}{'live ACT':>10}{'sim ACT':>10}{'ratio':>8}{'live step':>11}{'sim step':>10}{'ratio':>8}")
    for p in policies:
        lv, sm = live[p], sim[p]
        print(f"{p:>8}{lv['act_mean_s']:>10.3f}{sm['act_mean_s']:>10.3f}{lv['act_mean_s'] / sm['act_mean_s']:>8.3f}"
              f"{lv['step_s']:>11.1f}{sm['step_s']:>10.1f}{lv['step_s'] / sm['step_s']:>8.3f}")


if __name__ == "__main__":
    main()
