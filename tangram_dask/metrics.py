"""The contract's metrics (WORKLOAD.md, "Metrics") from a simulated or live run.

Pure: no Dask import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .cluster import ClusterSpec
from .costs import CostModel
from .workload import Generated


def act_ideal(gen: Generated, cluster: ClusterSpec) -> np.ndarray:
    """Per action: its ideal completion time (``ideal_act_mean_s``), alone on ``units.max`` with a warm sandbox
    (:meth:`CostModel.ideal_s`, vectorised per kind). The simulator, the live bench and the benchmarks read it."""
    costs = CostModel.of(cluster, gen.spec.models)
    protos = [k.spec(None, "t") for k in gen.spec.kinds]
    fixed = np.array([costs.ideal_s(p, 0.0) for p in protos])
    factor = np.array([costs.ideal_s(p, 1.0) for p in protos]) - fixed
    return gen.duration * factor[gen.kind] + fixed[gen.kind] if len(gen.kind) else np.zeros(0)


def act_floor(gen: Generated, cluster: ClusterSpec) -> np.ndarray:
    """Per action: the least completion time any policy can give it under WORKLOAD.md (``floor_act_mean_s``).

    The ideal (``ideal_act_mean_s``) runs every action alone on ``units.max``. A GPU action cannot always
    get there: a replica is loaded on the smallest k >= units.min whose share of the model fits one GPU
    (WORKLOAD.md), and the action runs on its replica's k GPUs. Its floor is the best replica the contract
    allows on any GPU node of the cluster (k for any ``units.min`` among its model's kinds, since a background
    load may be sized for any of them; ``cross_group_slowdown`` slower where k is more than the node's largest
    group), with no load and no queue. A CPU or API action's floor is ``units.max`` with no sandbox start (a
    sandbox bound to its trajectory pays none after its first; the ideal adds a warm start). A kind no GPU
    node can hold keeps its ideal's factor."""
    kinds = gen.spec.kinds
    mins: dict[str, set[int]] = {}
    for k in kinds:
        if k.resource == "gpu":
            mins.setdefault(k.model, set()).add(k.units_min)
    factor = np.empty(len(kinds))
    for i, k in enumerate(kinds):
        spec = k.spec(None, "t")
        best = spec.scale(spec.units_max)
        if k.resource == "gpu":
            model = gen.spec.models[k.model]
            sizes = [(model.replica_gpus(u, n.gpu_memory_gb), n) for n in cluster.gpu_nodes for u in mins[k.model]]
            times = [spec.scale(min(g, spec.units_max)) * (cluster.cross_group_slowdown if g > max(n.groups) else 1.0)
                     for g, n in sizes if g <= n.gpus]
            if times:
                best = min(times)
        factor[i] = best
    return gen.duration * factor[gen.kind] if len(gen.kind) else np.zeros(0)


def _pcts(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {"act_mean_s": 0.0, "act_p50_s": 0.0, "act_p99_s": 0.0}
    p50, p99 = np.percentile(x, [50, 99])
    return {"act_mean_s": float(x.mean()), "act_p50_s": float(p50), "act_p99_s": float(p99)}


def summarize(gen: Generated, *, policy: str, issue: np.ndarray, end: np.ndarray, ideal: np.ndarray,
              step_start: list[float], step_end: list[float], ideal_step: list[float],
              model_loads: int, cold_starts: int, restores: int,
              busy: dict[str, float], capacity: dict[str, int], floor: np.ndarray | None = None) -> dict[str, Any]:
    """The contract's metrics; with ``floor`` (:func:`act_floor`), ``floor_act_mean_s`` too, beside the ideal's."""
    act = end - issue
    out: dict[str, Any] = {"policy": policy, "workload": gen.spec.name, "actions": int(len(act))}
    out.update(_pcts(act))
    out["ideal_act_mean_s"] = float(ideal.mean()) if len(ideal) else 0.0
    if floor is not None:
        out["floor_act_mean_s"] = float(floor.mean()) if len(floor) else 0.0
    by_kind = {}
    for i, k in enumerate(gen.spec.kinds):
        sel = gen.kind == i
        if sel.any():
            d = _pcts(act[sel])
            d["ideal_act_mean_s"] = float(ideal[sel].mean())
            if floor is not None:
                d["floor_act_mean_s"] = float(floor[sel].mean())
            d["count"] = int(sel.sum())
            by_kind[k.kind] = d
    out["by_kind"] = by_kind
    steps = [e - s for s, e in zip(step_start, step_end)]
    out["step_s"] = float(np.mean(steps)) if steps else 0.0
    out["ideal_step_s"] = float(np.mean(ideal_step)) if ideal_step else 0.0
    out["model_loads"] = int(model_loads)
    out["cold_starts"] = int(cold_starts)
    out["restores"] = int(restores)
    span = (step_end[-1] - step_start[0]) if step_end else 0.0
    out["utilization"] = {r: (float(busy.get(r, 0.0) / (capacity[r] * span)) if capacity.get(r) and span > 0 else 0.0)
                          for r in ("cpu", "gpu", "api")}
    return out


def utilization_series(spans: list[tuple[float, float, str, int]], capacity: dict[str, int], start: float,
                       end: float, bins: int = 120) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Busy units over capacity per resource, averaged over ``bins`` equal slices of ``[start, end]``.

    ``spans`` are what a traced run held: ``(t0, t1, resource, units)``. Each slice's figure is exact
    (the integral of busy units over the slice), so the slices' mean is the run's ``utilization``.
    Returns the slices' midpoints and, per resource with capacity, one fraction per slice.
    """
    edges = np.linspace(start, end, bins + 1)
    out: dict[str, np.ndarray] = {}
    for r in ("cpu", "gpu", "api"):
        if not capacity.get(r):
            continue
        sel = [(t0, t1, u) for t0, t1, res, u in spans if res == r]
        if not sel or end <= start:
            out[r] = np.zeros(bins)
            continue
        a = np.array(sel, dtype=float)
        t = np.concatenate([a[:, 0], a[:, 1]])
        du = np.concatenate([a[:, 2], -a[:, 2]])
        order = np.argsort(t, kind="stable")
        t, du = t[order], du[order]
        level = np.cumsum(du)  # busy units from t[i] to t[i + 1]
        area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(t))])  # busy unit-seconds up to t[i]
        at = np.interp(edges, t, area)  # exact: the area is linear between events
        out[r] = np.diff(at) / (np.diff(edges) * capacity[r])
    return (edges[:-1] + edges[1:]) / 2, out
