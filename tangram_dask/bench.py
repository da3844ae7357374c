"""Simulated benchmark runs: one workload file, one cluster file, any policies.

Pure: no Dask import. ``run(...)`` returns the contract's metrics (the JSON
keys of WORKLOAD.md) for one policy; ``parity(...)`` finds the smallest
fraction of the cluster at which ``tangram`` finishes the step no later than
``static`` does on the whole of it. ``run(..., traces=[])`` also collects, per
policy, a :class:`Trace`: what ``tangram_dask.plots`` draws (per-action ACT,
per-trajectory completion, utilization over time); off by default, it costs
nothing then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .cluster import ClusterSpec
from .errors import FileFormatError
from .metrics import act_floor, summarize, utilization_series
from .policy import make_policy
from .sim import Simulator
from .workload import Generated, WorkloadSpec, generate

POLICIES = ("tangram", "fifo", "static")
GRID = [round(0.05 * i, 2) for i in range(1, 21)]


@dataclass(frozen=True)
class Trace:
    """One policy's run in detail, for plots: per action, per trajectory and over time."""

    policy: str
    workload: str
    cluster: str
    act: np.ndarray  # per action, in action order: completion time, issue to end (s)
    ideal_act: np.ndarray  # per action: its lower bound (ideal_act_mean_s is the mean)
    trajectory_s: np.ndarray  # per trajectory: when it finished, from its step's start (s)
    step_s: list[float]  # per step (step_s is the mean)
    ideal_step_s: float
    capacity: dict[str, int]  # units per resource: cpu slots, GPUs, API tokens
    times: np.ndarray  # midpoints of equal slices of the run (s)
    utilization: dict[str, np.ndarray]  # per resource with capacity: busy / capacity in each slice


def _trace(gen: Generated, cluster: ClusterSpec, res: Any, out: dict[str, Any]) -> Trace:
    last = gen.first[1:] - 1  # each trajectory's reward action ends it
    step_of = np.arange(gen.n_trajectories) // gen.spec.trajectories
    times, util = utilization_series(res.spans, res.capacity, res.step_start[0], res.step_end[-1])
    return Trace(out["policy"], gen.spec.name, cluster.name, res.end - res.issue, res.ideal,
                 res.end[last] - np.asarray(res.step_start)[step_of],
                 [e - s for s, e in zip(res.step_start, res.step_end)], out["ideal_step_s"], dict(res.capacity),
                 times, util)


def simulate(gen: Generated, cluster: ClusterSpec, policy: str, *, audit: bool = False,
             progress: Callable[[int, int], None] | None = None, time_policy: bool = False,
             options: Any = None, traces: list[Trace] | None = None,
             trajectory_hints: float | None = None) -> dict[str, Any]:
    """The contract's metrics of one policy's run; with ``traces`` (a list), its :class:`Trace` is appended.
    ``trajectory_hints`` (a sigma, beyond WORKLOAD.md): each trajectory begins with a hint of its length,
    its ideal length x exp(sigma x N(0, 1)) (see :class:`~tangram_dask.sim.Simulator`)."""
    pol = make_policy(policy, cluster, gen.spec, options=options)
    res = Simulator(gen, cluster, pol, audit=audit, progress=progress, time_policy=time_policy,
                    timer=time.perf_counter, trace=traces is not None,
                    trajectory_hint_sigma=trajectory_hints).run()
    out = summarize(gen, policy=policy, issue=res.issue, end=res.end, ideal=res.ideal,
                    step_start=res.step_start, step_end=res.step_end, ideal_step=res.ideal_step,
                    model_loads=res.model_loads, cold_starts=res.cold_starts, restores=res.restores,
                    busy=res.busy, capacity=res.capacity, floor=act_floor(gen, cluster))
    out["cluster"] = cluster.name
    if pol.beyond_contract:  # options that load replicas the contract does not (WORKLOAD.md): said beside the figures
        out["beyond_contract"] = list(pol.beyond_contract)
    if trajectory_hints is not None:  # the world told more than WORKLOAD.md's: said beside the figures too
        out["trajectory_hints"] = trajectory_hints
    out["sim_wall_s"] = round(res.wall_s, 3)
    out["decisions"] = res.decisions
    if time_policy and res.decisions:
        out["policy_us_per_decision"] = round(res.policy_s / res.decisions * 1e6, 2)
    if traces is not None:
        traces.append(_trace(gen, cluster, res, out))
    return out


def parity(gen: Generated, cluster: ClusterSpec, static_step_s: float, *, options: Any = None,
           trajectory_hints: float | None = None) -> float | None:
    """Smallest f on the 0.05 grid at which tangram's step <= static's on the whole cluster."""
    for f in GRID:
        try:
            r = simulate(gen, cluster.scaled(f), "tangram", options=options, trajectory_hints=trajectory_hints)
        except FileFormatError:
            continue  # some action can never run on a cluster this small: no parity at f
        if r["step_s"] <= static_step_s + 1e-9:
            return f
    return None


def run(workload: WorkloadSpec, cluster: ClusterSpec, policies: tuple[str, ...] = POLICIES, *,
        with_parity: bool = False, audit: bool = False, progress: Callable[[str, int, int], None] | None = None,
        time_policy: bool = False, options: Any = None, traces: list[Trace] | None = None,
        trajectory_hints: float | None = None) -> list[dict[str, Any]]:
    """One result per policy; with ``traces`` (a list), one :class:`Trace` per policy is appended to it.
    ``trajectory_hints``: see :func:`simulate` (every policy gets the same hints; only tangram's
    ``admit_long`` reads them)."""
    gen = generate(workload)
    results = []
    for name in policies:
        cb = (lambda d, n, _p=name: progress(_p, d, n)) if progress else None
        results.append(simulate(gen, cluster, name, audit=audit, progress=cb, time_policy=time_policy,
                                options=options if name == "tangram" else None, traces=traces,
                                trajectory_hints=trajectory_hints))
    if with_parity:
        static = next((r for r in results if r["policy"] == "static"), None)
        if static is None:
            static = simulate(gen, cluster, "static")
        f = parity(gen, cluster, static["step_s"], options=options, trajectory_hints=trajectory_hints)
        for r in results:
            if r["policy"] == "tangram":
                r["capacity_for_parity"] = f
                r["static_step_s"] = static["step_s"]
    return results
