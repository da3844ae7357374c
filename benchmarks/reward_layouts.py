"""Could another deployed layout give tangram static's reward ACT? Every layout of the contract's replicas, each run.

Issue 8 asks that the reward kinds' ACT on the standard files be no worse than static's. Static serves them from
the deployed split (WORKLOAD.md, "The static split") and, holding at most one trajectory per bound sandbox, rarely
queues one. Tangram starts from the same split and may reshape it, paying a load each time. This script gives
tangram every other split for free: each vector of replica counts, one replica or more per model, with replicas of
the contract's size, each within one topology group and none sharing a GPU, that leaves no room for one replica more.
Tangram starts from it (no load paid, every other rule the same) and the script prints each GPU kind's ACT, the
mean ACT and the step, beside static's on the contract's split (marked ``*``).

A reward kind that stays over static's on every layout cannot be brought to static's by any reshaping of the
contract's replicas: a reshape during the step only adds its loads. What is left is the rate at which rewards
arrive, which the admission gate sets (``-o admission_gpu=0.3`` shows that trade).

    python benchmarks/reward_layouts.py [WORKLOAD CLUSTER] [-o key=value ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from itertools import product
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.cluster import ClusterSpec, load_cluster  # noqa: E402
from tangram_dask.policy import TangramOptions, TangramPolicy, initial_replicas, make_policy  # noqa: E402
from tangram_dask.policy.split import Groups, replica_sizes  # noqa: E402
from tangram_dask.policy.types import ReplicaSpec  # noqa: E402
from tangram_dask.sim import Simulator  # noqa: E402
from tangram_dask.workload import Generated, generate, load_workload  # noqa: E402


def gpu_models(gen: Generated) -> dict[str, int]:
    """The workload's GPU models and the GPUs the contract gives a replica of each (before memory grows it):
    the largest ``units.min`` among the model's kinds, as the static split sizes it."""
    return replica_sizes((k.model, k.units_min) for k in gen.spec.kinds if k.resource == "gpu")


def place(cluster: ClusterSpec, gen: Generated, counts: dict[str, int]) -> list[ReplicaSpec] | None:
    """``counts`` replicas per model, larger models first, each placed as the static split places one
    (:class:`~tangram_dask.policy.split.Groups`); None where they do not all fit. One arrangement of those counts:
    on nodes of mixed shapes the static split, which interleaves the models, may put the same counts elsewhere."""
    groups = Groups(cluster, gen.spec.models, gpu_models(gen))
    for m in sorted(counts, key=lambda m: (-gen.spec.models[m].gpu_memory_gb, m)):
        for _ in range(counts[m]):
            if not groups.place(m):
                return None
    return groups.placed


def layouts(cluster: ClusterSpec, gen: Generated) -> list[dict[str, int]]:
    """Every count vector (one replica or more per model) that fits and leaves no room for one more.

    Tried by placing each vector whose replicas, at their fewest GPUs, do not exceed the GPUs: their number grows as
    the GPUs to the power of the models (the standard files: 2 models on 8 and 16 GPUs; the GPU-bound file: 4 on 12,
    about a second)."""
    size = gpu_models(gen)
    models = sorted(size)
    if not cluster.gpu_nodes:
        return []
    most = cluster.gpu_count
    least = [min(gen.spec.models[m].replica_gpus(size[m], n.gpu_memory_gb) for n in cluster.gpu_nodes)
             for m in models]
    fits = {}
    for counts in product(*(range(1, most // k + 1) for k in least)):
        if sum(n * k for n, k in zip(counts, least)) > most:
            continue
        c = dict(zip(models, counts))
        if place(cluster, gen, c) is not None:
            fits[counts] = c
    out = []
    for counts, c in fits.items():
        grown = (tuple(n + (i == j) for j, n in enumerate(counts)) for i in range(len(models)))
        if not any(g in fits for g in grown):
            out.append(c)
    return out


def run(gen: Generated, cluster: ClusterSpec, replicas: list[ReplicaSpec] | None,
        options: TangramOptions | None = None) -> dict:
    """Tangram from ``replicas`` (None: static on the contract's split): per GPU kind its mean ACT, then the mean
    ACT, the step and the model loads."""
    if replicas is None:
        pol = make_policy("static", cluster, gen.spec)
    else:
        pol = TangramPolicy(cluster, gen.spec.models, replicas, options=options)
    res = Simulator(gen, cluster, pol, timer=time.perf_counter).run()
    act = res.end - res.issue
    out = {k.kind: float(act[gen.kind == i].mean()) for i, k in enumerate(gen.spec.kinds)
           if k.resource == "gpu" and (gen.kind == i).any()}
    out.update(act=float(act.mean()), step=float(np.mean(np.subtract(res.step_end, res.step_start))),
               loads=res.model_loads)
    return out


def counts_of(replicas: list[ReplicaSpec]) -> dict[str, int]:
    return dict(Counter(r.model for r in replicas))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", nargs="?", default=str(ROOT / "resources/bench/standard.yaml"))
    ap.add_argument("cluster", nargs="?", default=str(ROOT / "resources/bench/cluster-standard.yaml"))
    ap.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    gen = generate(load_workload(a.workload))
    cl = load_cluster(a.cluster)
    options = TangramOptions(**{k: float(v) for k, v in (x.split("=", 1) for x in a.option)})
    deployed = initial_replicas(cl, gen.spec)
    contract = counts_of(deployed)
    kinds = [k.kind for k in gen.spec.kinds if k.resource == "gpu"]
    models = sorted(gpu_models(gen))
    static = run(gen, cl, None)
    print(f"{gen.spec.name} on {cl.name}: replicas per model ({', '.join(models)}); * the contract's split")
    head = f"{'layout':>14} {'policy':>8} " + " ".join(f"{k:>13}" for k in kinds) + f" {'ACT':>7} {'step':>7} loads"
    print(head)

    def row(c: dict[str, int], name: str, r: dict) -> str:
        lay = "/".join(str(c.get(m, 0)) for m in models) + ("*" if c == contract else " ")
        return (f"{lay:>14} {name:>8} " + " ".join(f"{r[k]:>13.3f}" for k in kinds)
                + f" {r['act']:>7.3f} {r['step']:>7.1f} {r['loads']:>5}")

    print(row(contract, "static", static))
    splits = layouts(cl, gen)
    if contract not in splits:  # the static split's interleaved order may leave room that place's would fill
        splits.append(contract)
    for c in sorted(splits, key=lambda c: [c.get(m, 0) for m in models]):
        # the contract's counts on the contract's GPUs (on nodes of mixed shapes place's order may put them elsewhere)
        r = run(gen, cl, deployed if c == contract else place(cl, gen, c), options)
        beats = [k for k in kinds if r[k] <= static[k] + 1e-9]
        print(row(c, "tangram", r) + (f"  no worse than static: {', '.join(beats)}" if beats else ""))


if __name__ == "__main__":
    main()
