"""How tangram's ACT and step approach their ideals as the CPU pool grows.

Separates what the policy decides from what capacity allows: on the standard
workload, ACT/ideal with 1x..4x the CPU slots of the standard cluster.

    python benchmarks/capacity.py [WORKLOAD] [CLUSTER]
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import simulate  # noqa: E402
from tangram_dask.cluster import load_cluster  # noqa: E402
from tangram_dask.workload import generate, load_workload  # noqa: E402


def main() -> None:
    wl = sys.argv[1] if len(sys.argv) > 1 else ROOT / "resources/bench/standard.yaml"
    cf = sys.argv[2] if len(sys.argv) > 2 else ROOT / "resources/bench/cluster-standard.yaml"
    gen = generate(load_workload(wl))
    base = load_cluster(cf)
    print(f"{'cpu slots':>10}{'act/ideal':>11}{'step/ideal':>12}")
    for m in (1, 1.5, 2, 3, 4):
        nodes = tuple(dataclasses.replace(n, slots=int(n.slots * m)) for n in base.cpu_nodes)
        r = simulate(gen, dataclasses.replace(base, cpu_nodes=nodes), "tangram")
        print(f"{sum(n.slots for n in nodes):>10}{r['act_mean_s'] / r['ideal_act_mean_s']:>11.3f}"
              f"{r['step_s'] / r['ideal_step_s']:>12.3f}")


if __name__ == "__main__":
    main()
