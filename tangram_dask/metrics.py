"""The contract's metrics (WORKLOAD.md, "Metrics") from a simulated or live run.

Pure: no Dask import.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .workload import Generated


def _pcts(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {"act_mean_s": 0.0, "act_p50_s": 0.0, "act_p99_s": 0.0}
    p50, p99 = np.percentile(x, [50, 99])
    return {"act_mean_s": float(x.mean()), "act_p50_s": float(p50), "act_p99_s": float(p99)}


def summarize(gen: Generated, *, policy: str, issue: np.ndarray, end: np.ndarray, ideal: np.ndarray,
              step_start: list[float], step_end: list[float], ideal_step: list[float],
              model_loads: int, cold_starts: int, restores: int,
              busy: dict[str, float], capacity: dict[str, int]) -> dict[str, Any]:
    act = end - issue
    out: dict[str, Any] = {"policy": policy, "workload": gen.spec.name, "actions": int(len(act))}
    out.update(_pcts(act))
    out["ideal_act_mean_s"] = float(ideal.mean()) if len(ideal) else 0.0
    by_kind = {}
    for i, k in enumerate(gen.spec.kinds):
        sel = gen.kind == i
        if sel.any():
            d = _pcts(act[sel])
            d["ideal_act_mean_s"] = float(ideal[sel].mean())
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
