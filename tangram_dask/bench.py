"""Simulated benchmark runs: one workload file, one cluster file, any policies.

Pure: no Dask import. ``run(...)`` returns the contract's metrics (the JSON
keys of WORKLOAD.md) for one policy; ``parity(...)`` finds the smallest
fraction of the cluster at which ``tangram`` finishes the step no later than
``static`` does on the whole of it.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .cluster import ClusterSpec
from .errors import FileFormatError
from .metrics import summarize
from .policy import make_policy
from .sim import Simulator
from .workload import Generated, WorkloadSpec, generate

POLICIES = ("tangram", "fifo", "static")
GRID = [round(0.05 * i, 2) for i in range(1, 21)]


def simulate(gen: Generated, cluster: ClusterSpec, policy: str, *, audit: bool = False,
             progress: Callable[[int, int], None] | None = None, time_policy: bool = False,
             options: Any = None) -> dict[str, Any]:
    pol = make_policy(policy, cluster, gen.spec, options=options)
    res = Simulator(gen, cluster, pol, audit=audit, progress=progress, time_policy=time_policy,
                    timer=time.perf_counter).run()
    out = summarize(gen, policy=policy, issue=res.issue, end=res.end, ideal=res.ideal,
                    step_start=res.step_start, step_end=res.step_end, ideal_step=res.ideal_step,
                    model_loads=res.model_loads, cold_starts=res.cold_starts, restores=res.restores,
                    busy=res.busy, capacity=res.capacity)
    out["cluster"] = cluster.name
    out["sim_wall_s"] = round(res.wall_s, 3)
    out["decisions"] = res.decisions
    if time_policy and res.decisions:
        out["policy_us_per_decision"] = round(res.policy_s / res.decisions * 1e6, 2)
    return out


def parity(gen: Generated, cluster: ClusterSpec, static_step_s: float, *, options: Any = None) -> float | None:
    """Smallest f on the 0.05 grid at which tangram's step <= static's on the whole cluster."""
    for f in GRID:
        try:
            r = simulate(gen, cluster.scaled(f), "tangram", options=options)
        except FileFormatError:
            continue  # some action can never run on a cluster this small: no parity at f
        if r["step_s"] <= static_step_s + 1e-9:
            return f
    return None


def run(workload: WorkloadSpec, cluster: ClusterSpec, policies: tuple[str, ...] = POLICIES, *,
        with_parity: bool = False, audit: bool = False, progress: Callable[[str, int, int], None] | None = None,
        time_policy: bool = False, options: Any = None) -> list[dict[str, Any]]:
    gen = generate(workload)
    results = []
    for name in policies:
        cb = (lambda d, n, _p=name: progress(_p, d, n)) if progress else None
        results.append(simulate(gen, cluster, name, audit=audit, progress=cb, time_policy=time_policy,
                                options=options if name == "tangram" else None))
    if with_parity:
        static = next((r for r in results if r["policy"] == "static"), None)
        if static is None:
            static = simulate(gen, cluster, "static")
        f = parity(gen, cluster, static["step_s"], options=options)
        for r in results:
            if r["policy"] == "tangram":
                r["capacity_for_parity"] = f
                r["static_step_s"] = static["step_s"]
    return results
