"""One view of a tangram scheduler, as plain data: what the page draws, ``/tangram/state.json``
serves and the Prometheus collector exports.

It reads only ``plugin.policy.snapshot()`` (the frozen :class:`PolicySnapshot`),
the plugin's counters and worker declarations, the kind, state and grant of the
plugin's action records, the :class:`~.monitor.TangramMonitor`'s aggregates and each worker's
heartbeat metric ``tangram-sandbox``. It never touches the policy's internals.
"""

from __future__ import annotations

import math
from operator import attrgetter
import time
from collections import deque
from dataclasses import asdict, fields
from typing import Any

from ..policy.types import NodeStats, PolicySnapshot, PoolStats, Shortfall
from .monitor import TangramMonitor

#: The worker heartbeat metric carrying its sandbox pool's statistics.
SANDBOX_METRIC = "tangram-sandbox"
#: Action record states -> the states shown (done and failed ones are counted by the monitor).
SHOWN_STATES = {"new": "waiting", "pending": "pending", "granted": "running"}
RESOURCES = ("cpu", "gpu", "api")


class TangramView:
    """Builds :meth:`state` at most once per ``min_interval_s`` (the page and a scraper share it)."""

    def __init__(self, plugin: Any, monitor: TangramMonitor, min_interval_s: float = 0.9,
                 history: int = 600):
        self.plugin = plugin
        self.monitor = monitor
        self.min_interval_s = min_interval_s
        self._state: dict[str, Any] | None = None
        self._at = -math.inf
        #: (policy time, utilization by resource, admission queue, pending actions), one sample a second at most
        self.history: deque[tuple[float, dict[str, float], int, int]] = deque(maxlen=history)

    def state(self, fresh: bool = False) -> dict[str, Any]:
        t = time.monotonic()
        if fresh or self._state is None or t - self._at >= self.min_interval_s:
            self._state = self._build()
            self._at = t
        return self._state

    # -- building -------------------------------------------------------------------------
    def _build(self) -> dict[str, Any]:
        plugin, mon = self.plugin, self.monitor
        now = plugin.now()
        pol = policy_data(plugin.policy.snapshot()) if plugin.policy is not None else policy_data(None)
        workers = {addr: d.to_msg() for addr, d in list(plugin.nodes.items())}
        actions, loading = self._actions()
        residency = self._residency()
        util = {}
        for p in pol["pools"]:
            if p["pool"] in ("", p["resource"]) and p["resource"] in RESOURCES:
                cap = p["capacity"]
                util[p["resource"]] = (cap - p["free"]) / cap if cap > 0 else 0.0
        pending = sum(v for (_, _, st), v in actions.items() if st == "pending")
        adm = int(pol["admission_queue"])
        if not self.history or now - self.history[-1][0] >= 1.0:
            self.history.append((now, util, adm, pending))
        c = mon.counters
        return {
            "time": now,
            "wall_time": time.time(),
            "scheduler": plugin.scheduler.address if plugin.scheduler is not None else "",
            "policy": pol,
            "plugin": asdict(plugin.stats),
            "workers": workers,
            "actions": [{"kind": k, "resource": r, "state": s, "count": n} for (k, r, s), n in sorted(actions.items())],
            "act": {"window_s": mon.stats.window_s, "series": mon.stats.series(), "totals": mon.stats.totals()},
            "counters": {"placements": c.placements, "loads": dict(c.loads), "evictions": dict(c.evictions),
                         "cold_starts": dict(c.cold_starts), "rejections": c.rejections, "errors": c.errors,
                         "admissions": c.admissions, "admission_wait_s": c.admission_wait_s},
            "utilization": util,
            "history": {"t": [h[0] for h in self.history], "utilization": [h[1] for h in self.history],
                        "admission_queue": [h[2] for h in self.history],
                        "pending": [h[3] for h in self.history]},
            "gpus": self._gpus(pol, workers, loading, residency),
            "residency": residency,
            "sandboxes": self._sandboxes(),
        }

    def _actions(self) -> tuple[dict[tuple[str, str, str], int], set[tuple[str, int]]]:
        """Live actions by (kind, resource, state), and the (node, GPU) pairs a granted load is filling."""
        out: dict[tuple[str, str, str], int] = {}
        loading: set[tuple[str, int]] = set()
        for a in list(self.plugin.actions.values()):
            st = SHOWN_STATES.get(a.state)
            if st is None:
                continue
            spec = a.spec
            k = (spec.kind, spec.resource, st) if spec is not None else ("malformed", "", st)
            out[k] = out.get(k, 0) + 1
            g = a.grant
            if g is not None and g.load:
                loading.update((g.node, i) for i in g.gpus)
        return out, loading

    def _residency(self) -> dict[str, Any]:
        """What the workers report resident or loading (the residency view of ``tangram_dask.models``),
        as ``{"replicas": {worker: {replica: report}}, "counts": {...}}``; empty without it."""
        res = getattr(self.plugin, "residency", None)  # installed by the plugin's start, with reward models
        if res is None:
            return {"replicas": {}, "counts": {}}
        view = res.handle_models()
        return {"replicas": {w: {str(rid): r for rid, r in reps.items()} for w, reps in view["replicas"].items()},
                "counts": view.get("counts", {})}

    def _gpus(self, pol: dict[str, Any], workers: dict[str, Any], loading: set[tuple[str, int]],
              residency: dict[str, Any]) -> list[dict[str, Any]]:
        """One row per GPU of every GPU worker: its topology group, the replicas the policy holds on it
        (``models``), what the worker reports there (``reported``: model and state), and one state:
        loading (the worker reports a load, or a granted load is filling it), serving (a busy replica),
        idle (resident, not busy) or empty."""
        reported: dict[tuple[str, int], list[list[str]]] = {}
        for w, reps in residency["replicas"].items():
            for r in reps.values():
                for i in r.get("gpus", ()):
                    reported.setdefault((w, i), []).append([r.get("model", ""), r.get("state", "")])
                    if r.get("state") == "loading":
                        loading.add((w, i))
        resident: dict[tuple[str, int], list[tuple[str, bool]]] = {}
        for model, node, gpus, busy in pol["replicas"]:
            for i in gpus:
                resident.setdefault((node, i), []).append((model, bool(busy)))
        rows = []
        for addr, decl in workers.items():
            if not decl.get("gpus"):
                continue
            gid, left = 0, list(decl.get("groups") or [decl["gpus"]])
            for i in range(decl["gpus"]):
                while left and left[0] == 0:
                    left.pop(0)
                    gid += 1
                if left:
                    left[0] -= 1
                reps = resident.get((addr, i), [])
                if (addr, i) in loading:
                    state = "loading"
                elif any(b for _, b in reps):
                    state = "serving"
                elif reps:
                    state = "idle"
                else:
                    state = "empty"
                rows.append({"worker": addr, "gpu": i, "group": gid, "state": state,
                             "models": [m for m, _ in reps], "reported": reported.get((addr, i), [])})
        return rows

    def _sandboxes(self) -> dict[str, dict[str, Any]]:
        sched = self.plugin.scheduler
        out = {}
        cold = self.monitor.counters.cold_starts
        for addr, ws in list(sched.workers.items()) if sched is not None else ():
            m = ws.metrics.get(SANDBOX_METRIC)
            if isinstance(m, dict):
                out[addr] = {**m, "cold_starts": cold.get(addr, 0)}
        return out


def _fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


_SHORTFALL, _POOL, _NODE = _fields(Shortfall), _fields(PoolStats), _fields(NodeStats)
_sf_tuple = attrgetter(*_SHORTFALL)


def _shortfall(sf: Shortfall | None) -> dict[str, Any] | None:
    return None if sf is None else {f: getattr(sf, f) for f in _SHORTFALL}


def policy_data(snap: PolicySnapshot | None) -> dict[str, Any]:
    """A :class:`PolicySnapshot` as plain data (``dataclasses.asdict`` is too slow for thousands of
    unplaceable actions). Unplaceable actions are grouped: one entry per distinct shortfall, with a count."""
    if snap is None:
        return {"policy": "", "pools": [], "replicas": [], "decisions": 0, "extra": {}, "unplaceable": [],
                "admission_queue": 0, "nodes": [], "gpu_waiting": []}
    pools = []
    for p in snap.pools:
        d = {f: getattr(p, f) for f in _POOL}
        d["head"] = _shortfall(p.head)
        pools.append(d)
    groups: dict[tuple, int] = {}
    for t in map(_sf_tuple, snap.unplaceable):
        groups[t] = groups.get(t, 0) + 1
    unplaceable = [{**dict(zip(_SHORTFALL, t)), "count": n} for t, n in groups.items()]
    return {"policy": snap.policy, "pools": pools,
            "replicas": [[m, node, list(gpus), bool(busy)] for m, node, gpus, busy in snap.replicas],
            "decisions": snap.decisions, "extra": dict(snap.extra), "unplaceable": unplaceable,
            "admission_queue": snap.admission_queue, "nodes": [{f: getattr(n, f) for f in _NODE} for n in snap.nodes],
            "gpu_waiting": [{"model": m, "reason": r, "count": c} for m, r, c in snap.gpu_waiting]}
