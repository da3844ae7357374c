"""Why GPU actions wait under tangram: every second of waiting, put in one class, per model.

After each scheduling pass, each GPU action still waiting counts the time until the next pass under the
reason ``TangramPolicy.gpu_waiting`` gives for its model (the scheduler exports the same live, as
``dask_tangram_gpu_waiting_actions``), the first that holds for one of its replicas:

- ``idle``: one of them is idle on idle GPUs (the policy chose to wait: a claim, a larger head first);
- ``gpu_shared``: one is idle, but its GPUs serve another model's action (a GPU runs one action at a time);
- ``gpu_loading``: one is idle, but its GPUs are held by another replica's load;
- ``loading``: one is loading itself;
- ``busy``: all of them serve this model's actions;
- ``no_replica``: the model has none.

Printed per model in seconds per action of the step, over the mean ideal ACT (the units of ACT/ideal: a
variant meets the GPU-bound target, ACT <= 1.5x ideal, only where its floor plus these stays under 1.5).
The classes add up to the GPU actions' waiting, start - issue, which is printed beside them as a check.

    python benchmarks/gpu_waits.py WORKLOAD CLUSTER [-o key=value ...]
    python benchmarks/gpu_waits.py --family gpu,gpux [--over 1.5] [-o key=value ...]   # the named variants
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.cluster import ClusterSpec, load_cluster, parse_cluster  # noqa: E402
from tangram_dask.policy import TangramOptions, make_policy  # noqa: E402
from tangram_dask.policy.types import GPU_WAIT_REASONS, Start  # noqa: E402
from tangram_dask.sim import Simulator  # noqa: E402
from tangram_dask.workload import Generated, generate, load_workload, parse_workload  # noqa: E402


def gpu_waits(gen: Generated, cluster: ClusterSpec, options: TangramOptions | None = None) -> dict:
    """Run tangram on ``gen`` and classify its GPU actions' waiting. Returns ``seconds`` (a Counter keyed by
    ``(class, model)``), ``waited`` (the GPU actions' start - issue, summed), ``actions``, ``ideal_mean``
    and ``act_mean``."""
    pol = make_policy("tangram", cluster, gen.spec, options=options)
    seconds: Counter = Counter()
    starts: dict[int, float] = {}
    last: list = [None, []]
    schedule = pol.schedule

    def observed(now: float):
        if last[0] is not None:
            dt = now - last[0]
            for model, cls, n in last[1]:
                seconds[(cls, model)] += n * dt
        out = schedule(now)
        for d in out:
            if isinstance(d, Start):
                starts[d.action] = now
        last[0], last[1] = now, pol.gpu_waiting()
        return out

    pol.schedule = observed
    res = Simulator(gen, cluster, pol, timer=time.perf_counter).run()
    gpu_kinds = [i for i, k in enumerate(gen.spec.kinds) if k.resource == "gpu"]
    mask = np.isin(gen.kind, gpu_kinds)
    waited = sum(starts[a] - res.issue[a] for a in np.flatnonzero(mask))
    return {"seconds": seconds, "waited": float(waited), "actions": int(gen.n_actions),
            "ideal_mean": float(res.ideal.mean()), "act_mean": float((res.end - res.issue).mean())}


def report(name: str, w: dict) -> str:
    scale = w["actions"] * w["ideal_mean"]
    by_class = Counter()
    for (cls, _), s in w["seconds"].items():
        by_class[cls] += s
    lines = [f"{name}: ACT/ideal {w['act_mean'] / w['ideal_mean']:.3f}; GPU waiting {w['waited'] / scale:.3f} "
             f"(classified {sum(by_class.values()) / scale:.3f}): "
             + ", ".join(f"{c} {by_class[c] / scale:.3f}" for c in GPU_WAIT_REASONS if by_class[c])]
    models = sorted({m for _, m in w["seconds"]})
    for m in models:
        parts = [f"{c} {w['seconds'][(c, m)] / scale:.3f}" for c in GPU_WAIT_REASONS if w["seconds"][(c, m)] > 0]
        lines.append(f"    {m:<14}" + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", metavar="WORKLOAD CLUSTER")
    ap.add_argument("--family", help="comma-separated families of benchmarks/variants.py (their named variants)")
    ap.add_argument("--over", type=float, default=0.0, help="only the variants whose ACT/ideal is over this")
    ap.add_argument("-o", "--policy-option", action="append", default=[], help="a tangram option, key=value")
    a = ap.parse_args()
    opts = TangramOptions(**{k: float(v) for k, v in (kv.split("=") for kv in a.policy_option)})
    if a.family:
        import variants as V  # benchmarks/variants.py, beside this file

        for fam in a.family.split(","):
            for wd, cd in V.family(fam, False):
                w = gpu_waits(generate(parse_workload(wd, wd["name"])), parse_cluster(cd, cd["name"]), opts)
                if w["act_mean"] / w["ideal_mean"] > a.over:
                    print(report(f"{wd['name']} ({cd['name']})", w))
    elif len(a.files) == 2:
        gen, cl = generate(load_workload(a.files[0])), load_cluster(a.files[1])
        print(report(f"{gen.spec.name} on {cl.name}", gpu_waits(gen, cl, opts)))
    else:
        ap.error("give WORKLOAD CLUSTER, or --family")


if __name__ == "__main__":
    main()
