"""What the dashboard and the metrics need that no snapshot holds: per-action timing.

:class:`ActStats` is a bounded aggregator: cumulative counters and a fixed-bucket
ACT histogram per kind (for Prometheus), and a ring of fixed time windows
(``window_s`` wide, ``windows`` kept) holding per-kind ACT counts, sums and
log-spaced bucket counts (for mean and p99 over time). Memory is
``O(kinds x windows x buckets)``, never per finished action; kinds beyond
``max_kinds`` are counted as ``"other"``.

:class:`TangramMonitor` is a small scheduler plugin that feeds it from Dask's
transitions of tangram actions (the tangram plugin's own ``actions`` records
say which keys are actions, their spec and grant). It keeps one submit time
per *live* action, on the tangram plugin's own record of it (nothing of its own), counts
placements, model loads, evictions and sandbox cold starts from the grants,
and logs the matching events (:mod:`.events`).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Hashable

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import loads

from .events import emit

#: Upper bounds (seconds) of the Prometheus ACT histogram, ``+Inf`` implied.
ACT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                                  120.0, 300.0, 600.0, 1800.0, 3600.0)
#: Fine log-spaced bounds for window quantiles: 1 ms .. ~2 h, ratio 1.2 (p99 within 20%).
_FINE = tuple(1e-3 * 1.2 ** i for i in range(87))


def _fine_index(x: float) -> int:
    return bisect.bisect_left(_FINE, x)


def _quantile(buckets: dict[int, int], count: int, q: float) -> float:
    """The q-quantile of a fine-bucket histogram, interpolated inside its bucket (as PromQL does)."""
    rank = q * count
    seen = 0
    for i in sorted(buckets):
        n = buckets[i]
        if seen + n >= rank:
            lo = _FINE[i - 1] if i > 0 else 0.0
            hi = _FINE[i] if i < len(_FINE) else _FINE[-1] * 1.2
            return lo + (hi - lo) * ((rank - seen) / n)
        seen += n
    return _FINE[-1]


@dataclass
class KindTotals:
    """Cumulative figures of one action kind."""

    resource: str
    submitted: int = 0
    finished: int = 0
    failed: int = 0
    act_sum: float = 0.0
    act_buckets: list[int] = field(default_factory=lambda: [0] * (len(ACT_BUCKETS) + 1))  # last: +Inf


@dataclass
class Window:
    """One fixed time window: per kind ``[count, sum, {fine bucket: count}]``."""

    t0: float
    kinds: dict[str, list[Any]] = field(default_factory=dict)


class ActStats:
    """Bounded per-kind ACT statistics (see the module docstring)."""

    def __init__(self, window_s: float = 5.0, windows: int = 120, max_kinds: int = 64):
        if not (window_s > 0 and windows >= 1 and max_kinds >= 1):
            raise ValueError("ActStats: window_s > 0, windows >= 1 and max_kinds >= 1 are required")
        self.window_s = window_s
        self.max_kinds = max_kinds
        self.kinds: dict[str, KindTotals] = {}
        self.windows: deque[Window] = deque(maxlen=windows)

    def _kind(self, kind: str, resource: str) -> KindTotals:
        k = self.kinds.get(kind)
        if k is None:
            if len(self.kinds) >= self.max_kinds:
                kind = "other"
                k = self.kinds.get(kind)
            if k is None:
                k = self.kinds[kind] = KindTotals(resource)
        return k

    def submit(self, kind: str, resource: str) -> None:
        self._kind(kind, resource).submitted += 1

    def finish(self, kind: str, resource: str, act_s: float | None, now: float, ok: bool = True) -> None:
        """An action finished (``ok``) or failed at ``now``, ``act_s`` after it was submitted."""
        k = self._kind(kind, resource)
        if not ok:
            k.failed += 1
            return
        k.finished += 1
        if act_s is None or not math.isfinite(act_s) or act_s < 0:
            return
        k.act_sum += act_s
        k.act_buckets[bisect.bisect_left(ACT_BUCKETS, act_s)] += 1
        w = self._window(now)
        name = kind if kind in self.kinds else "other"
        rec = w.kinds.get(name)
        if rec is None:
            rec = w.kinds[name] = [0, 0.0, {}]
        rec[0] += 1
        rec[1] += act_s
        i = _fine_index(act_s)
        rec[2][i] = rec[2].get(i, 0) + 1

    def _window(self, now: float) -> Window:
        t0 = math.floor(now / self.window_s) * self.window_s
        ws = self.windows
        if not ws or ws[-1].t0 < t0:
            ws.append(Window(t0))
        return ws[-1]

    def series(self) -> dict[str, dict[str, list[float]]]:
        """Per kind: window start times, mean ACT and p99 ACT (windows with finishes only)."""
        out: dict[str, dict[str, list[float]]] = {}
        for w in self.windows:
            for kind, (n, s, b) in w.kinds.items():
                d = out.setdefault(kind, {"t": [], "mean_s": [], "p99_s": [], "count": []})
                d["t"].append(w.t0)
                d["mean_s"].append(s / n)
                d["p99_s"].append(_quantile(b, n, 0.99))
                d["count"].append(n)
        return out

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per kind: cumulative counters and the ACT histogram as ``[le, cumulative count]`` pairs (the last
        ``le`` is ``"+Inf"``), Prometheus-style."""
        out = {}
        for kind, k in self.kinds.items():
            cum, c = [], 0
            for n in k.act_buckets:
                c += n
                cum.append(c)
            out[kind] = {"resource": k.resource, "submitted": k.submitted, "finished": k.finished,
                         "failed": k.failed, "act_sum_s": k.act_sum,
                         "act_buckets": [[b, n] for b, n in zip([*ACT_BUCKETS, "+Inf"], cum)]}
        return out


@dataclass
class Counters:
    """Placement decisions, counted as they are applied."""

    placements: int = 0
    loads: dict[str, int] = field(default_factory=dict)        # by model
    evictions: dict[str, int] = field(default_factory=dict)    # by worker
    cold_starts: dict[str, int] = field(default_factory=dict)  # by worker: sandboxes the policy chose to start cold
    rejections: int = 0
    errors: int = 0
    admissions: int = 0         # trajectories admitted through the gate
    admission_wait_s: float = 0.0  # the seconds they waited for it, summed


class TangramMonitor(SchedulerPlugin):
    """Feeds :class:`ActStats` and :class:`Counters` from Dask transitions of tangram actions."""

    name = "tangram-monitor"

    def __init__(self, plugin: Any, stats: ActStats | None = None, events: bool = True):
        self.plugin = plugin
        self.stats = stats or ActStats()
        self.counters = Counters()
        self.events = events
        listeners = getattr(plugin, "load_listeners", None)
        if listeners is not None:
            listeners.append(self._background_load)
        listeners = getattr(plugin, "admit_listeners", None)
        if listeners is not None:
            listeners.append(self._admitted)

    def _admitted(self, trajectory: str, waited_s: float) -> None:
        """A trajectory admitted (no task transition shows one): counted, and logged on the topic
        ``tangram`` only (one per trajectory: many in a step, as placements are)."""
        c = self.counters
        c.admissions += 1
        c.admission_wait_s += waited_s
        if self.events:
            emit(self.plugin.scheduler, "admission", trajectory=trajectory, waited_s=round(waited_s, 6))

    def _background_load(self, d: Any) -> None:
        """A ``Load`` decision (a replica loaded ahead of its actions): counted and logged like a load
        made inside an action's grant, without a task key (no action waits in it)."""
        c = self.counters
        c.loads[d.model] = c.loads.get(d.model, 0) + 1
        if d.evict:
            c.evictions[d.node] = c.evictions.get(d.node, 0) + len(d.evict)
        if not self.events:
            return
        sched = self.plugin.scheduler
        emit(sched, "load", model=d.model, worker=d.node, gpus=list(d.gpus), replica=int(d.replica))
        if d.evict:
            emit(sched, "eviction", worker=d.node, replicas=[int(e) for e in d.evict], model=d.model)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        """A worker left: its counters (and so its ``{worker}`` series) go with it. A new worker is a new
        address (``cluster.adapt()``, a restart), so they grew for as long as the scheduler ran."""
        c = self.counters
        c.evictions.pop(worker, None)
        c.cold_starts.pop(worker, None)

    def _record(self, key: Hashable) -> Any:
        """The tangram plugin's record of ``key``: live, or the one that left it in this very transition
        (the tangram plugin sees each transition first; the monitor keeps nothing per action itself)."""
        plugin = self.plugin
        a = plugin.actions.get(key)
        if a is None and plugin.left is not None and plugin.left[0] == key:
            a = plugin.left[1]
        return a

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, stimulus_id: str = "",
                   **kwargs: Any) -> None:
        a = self._record(key)
        if a is None:
            return
        spec = a.spec
        kind, resource = (spec.kind, spec.resource) if spec is not None else ("malformed", "")
        if finish == "no-worker":  # the plugin sets the submit time (t0) on the record at its first arrival
            # Seen after the plugin, a first arrival is the one it names in ``arrived``. Seen before it, the
            # record has no t0 yet: ``client.register_plugin`` starts a plugin before it adds it to
            # ``scheduler.plugins``, so the monitor its start adds comes first (and ``arrived`` is the last
            # transition's). Counted from ``arrived`` alone, that path counted no submission at all.
            arrived = self.plugin.arrived
            if a.error is None and (a.t0 is None or (arrived is not None and arrived == key)):
                self.stats.submit(kind, resource)  # one that errs at once (bad spec) was never submitted
            return
        if a.t0 is None:
            return
        t, error = a.t0, a.error
        if start == "no-worker" and finish == "processing":
            self._placed(key, kind, spec, a.grant)
        elif start == "processing" and finish in ("memory", "erred"):
            now = self.plugin.now()
            ok = finish == "memory"
            self.stats.finish(kind, resource, now - t, now, ok)
            if not ok:
                self.counters.errors += 1
                if self.events:
                    emit(self.plugin.scheduler, "error", key=key, kind=kind, worker=str(kwargs.get("worker", "")),
                         error=_exception_text(self.plugin.scheduler, key, kwargs))
        elif start == "no-worker" and finish == "erred":
            self.counters.rejections += 1
            if self.events:
                emit(self.plugin.scheduler, "rejection", key=key, kind=kind,
                     reason=error or _exception_text(self.plugin.scheduler, key, kwargs))

    def _placed(self, key: Hashable, kind: str, spec: Any, g: Any) -> None:
        c = self.counters
        c.placements += 1
        if g is None:
            return
        worker = g.worker or g.node
        if g.load and spec is not None:
            c.loads[spec.model] = c.loads.get(spec.model, 0) + 1
        if g.evict:
            c.evictions[worker] = c.evictions.get(worker, 0) + len(g.evict)
        if g.sandbox == "cold" and spec is not None and spec.resource == "cpu":
            c.cold_starts[worker] = c.cold_starts.get(worker, 0) + 1
        if not self.events:
            return
        sched = self.plugin.scheduler
        emit(sched, "placement", key=key, kind=kind, worker=worker, units=g.units, gpus=g.gpus,
             sandbox=g.sandbox if spec is not None and spec.resource == "cpu" else "")
        if g.load and spec is not None:
            emit(sched, "load", key=key, model=spec.model, worker=worker, gpus=list(g.gpus))
        if g.evict:
            emit(sched, "eviction", key=key, worker=worker, replicas=list(g.evict))


def _exception_text(scheduler: Any, key: Hashable, kwargs: dict[str, Any]) -> str:
    """The error's text: Dask's ``exception_text``, else the pickled exception the plugin errs a task with."""
    text = kwargs.get("exception_text")
    if not text:
        ts = scheduler.tasks.get(key)
        text = ts.exception_text if ts is not None else ""
    exc = kwargs.get("exception")
    if not text and isinstance(exc, bytes):
        try:
            text = str(loads(exc))
        except Exception as e:  # not ours to fail on: say what is known
            text = f"(an exception that could not be read: {type(e).__name__})"
    return text or ""
