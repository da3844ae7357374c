"""Prometheus collectors: ``dask_tangram_*`` on the scheduler's and the workers' ``/metrics``.

Dask serves ``/metrics`` from ``prometheus_client``'s process-wide registry. So
that several schedulers (or workers) in one process do not collide, the
collectors are not registered one by one: :func:`register` adds one to a
process-wide :class:`_Hub` (registered in the registry while it holds any
collector) and :func:`unregister` takes it out. The hub yields each family
once, with the samples of every live collector; every sample carries a
``scheduler`` (or ``worker``) label with its server's address.

Scheduler families (all read from :meth:`TangramView.state`):

- ``dask_tangram_actions{state,kind,resource}``: live actions (waiting, pending, running)
- ``dask_tangram_actions_submitted_total{kind,resource}``,
  ``dask_tangram_actions_finished_total{kind,resource,outcome}``
- ``dask_tangram_act_seconds{kind,resource}``: histogram of action completion time (submit to finish)
- ``dask_tangram_units_capacity|units_in_use|units_free{resource,pool}``; ``dask_tangram_queued_actions{resource,pool}``
- ``dask_tangram_unplaceable_actions``, ``dask_tangram_admission_queue``
- ``dask_tangram_gpu_waiting_actions{model,reason}``: GPU actions waiting, by what holds their model's replicas
  (``idle``, ``gpu_shared``: their GPUs serve another model, ``gpu_loading``, ``loading``, ``busy``, ``paused``:
  on paused workers, ``no_replica``)
- ``dask_tangram_paused_workers``: workers the policy has cordoned (Dask paused them: memory);
  ``dask_tangram_broken_models{model}``: 1 for each model refused after its loader failed ``BROKEN_AFTER`` times
  in a row
- ``dask_tangram_hints_bounded_total{kind}``: hints the policy counted out of bounds (``hint_bound``: over 6 sd
  from their kind's; docs/scheduling.md, "An absurd hint is bounded")
- ``dask_tangram_placements_total``, ``dask_tangram_model_loads_total{model}``,
  ``dask_tangram_model_evictions_total{worker}``, ``dask_tangram_sandbox_cold_starts_total{worker}``
  (the cold starts the policy decided), ``dask_tangram_rejections_total``, ``dask_tangram_errors_total``
- ``dask_tangram_admissions_total``, ``dask_tangram_admission_wait_seconds_total``: trajectories admitted, and
  the seconds they waited for it (their ratio is the mean wait)
- ``dask_tangram_model_replicas{model,state}``: reward-model replicas the workers report loading or resident;
  ``dask_tangram_model_memory_bytes{worker,gpu,model}``: the bytes they hold on each GPU, as each worker measured
  them (by CUDA where the model went to CUDA, else its parameter bytes)

Worker families (from the worker's sandbox pool statistics):
``dask_tangram_sandbox_size|warm|in_use|starting``, ``dask_tangram_sandbox_starts_total``,
``dask_tangram_sandbox_recycled_total``, ``dask_tangram_sandbox_failed_starts_total``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Callable

import prometheus_client
from distributed.http.prometheus import PrometheusCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

logger = logging.getLogger(__name__)

SUBSYSTEM = "tangram"


class TangramSchedulerCollector(PrometheusCollector):
    """The scheduler's ``dask_tangram_*`` families, from one :class:`~.state.TangramView`."""

    label = "scheduler"

    def __init__(self, scheduler: Any, view: Any):
        super().__init__(scheduler)
        self.subsystem = SUBSYSTEM
        self.view = view

    def address(self) -> str:
        return str(self.server.address)

    def collect(self) -> Iterator[Metric]:
        st = self.view.state()
        L = ["scheduler"]
        me = self.address()
        n = self.build_name

        actions = GaugeMetricFamily(n("actions"), "Live tangram actions by state, kind and resource",
                                    labels=[*L, "state", "kind", "resource"])
        for a in st["actions"]:
            actions.add_metric([me, a["state"], a["kind"], a["resource"]], a["count"])
        yield actions

        totals = st["act"]["totals"]
        sub = CounterMetricFamily(n("actions_submitted"), "Tangram actions submitted to the policy",
                                  labels=[*L, "kind", "resource"])
        fin = CounterMetricFamily(n("actions_finished"), "Tangram actions that left processing, by outcome",
                                  labels=[*L, "kind", "resource", "outcome"])
        act = HistogramMetricFamily(n("act_seconds"), "Action completion time, submit to finish (policy seconds)",
                                    labels=[*L, "kind", "resource"])
        for kind, t in totals.items():
            lab = [me, kind, t["resource"]]
            sub.add_metric(lab, t["submitted"])
            fin.add_metric([*lab, "ok"], t["finished"])
            fin.add_metric([*lab, "error"], t["failed"])
            act.add_metric(lab, [(_le(b), c) for b, c in t["act_buckets"]], sum_value=t["act_sum_s"])
        yield sub
        yield fin
        yield act

        pol = st["policy"]
        cap = GaugeMetricFamily(n("units_capacity"), "Units of each pool (CPU slots, GPUs, API tokens)",
                                labels=[*L, "resource", "pool"])
        use = GaugeMetricFamily(n("units_in_use"), "Units granted to running actions", labels=[*L, "resource", "pool"])
        free = GaugeMetricFamily(n("units_free"), "Units free now", labels=[*L, "resource", "pool"])
        queued = GaugeMetricFamily(n("queued_actions"), "Actions waiting in the policy's queue of each pool",
                                   labels=[*L, "resource", "pool"])
        for p in pol["pools"]:
            lab = [me, p["resource"], p["pool"] or p["resource"]]
            cap.add_metric(lab, p["capacity"])
            use.add_metric(lab, p["capacity"] - p["free"])
            free.add_metric(lab, p["free"])
            queued.add_metric(lab, p["queued"])
        yield cap
        yield use
        yield free
        yield queued
        yield _gauge(n("unplaceable_actions"), "Actions no current node can ever hold", L, me,
                     sum(u["count"] for u in pol["unplaceable"]))
        yield _gauge(n("admission_queue"), "Trajectories waiting to be admitted", L, me,
                     pol["admission_queue"])
        waiting = GaugeMetricFamily(n("gpu_waiting_actions"), "GPU actions waiting, by model and by what holds "
                                    "its replicas (idle, gpu_shared, gpu_loading, loading, busy, paused, no_replica)",
                                    labels=[*L, "model", "reason"])
        for w in pol.get("gpu_waiting", ()):
            waiting.add_metric([me, w["model"], w["reason"]], w["count"])
        yield waiting
        extra = pol.get("extra") or {}
        yield _gauge(n("paused_workers"), "Workers the policy takes nothing new to (Dask paused them)", L, me,
                     len(extra.get("cordoned", ())))
        broken = GaugeMetricFamily(n("broken_models"), "Models refused after their loader failed again and again "
                                   "(1 each)", labels=[*L, "model"])
        for m in extra.get("broken", ()):
            broken.add_metric([me, m], 1)
        yield broken
        bounded = CounterMetricFamily(n("hints_bounded"), "Action hints counted out of bounds (far outside their "
                                      "kind's hints: the code that sends them is likely off)", labels=[*L, "kind"])
        for k, c in sorted((extra.get("hints_bounded") or {}).items()):
            bounded.add_metric([me, k], c)
        yield bounded

        c = st["counters"]
        yield _counter(n("placements"), "Actions placed by the policy", L, me, c["placements"])
        yield _counter(n("rejections"), "Actions erred before placement (bad spec, unknown model, no quota)",
                       L, me, c["rejections"])
        yield _counter(n("errors"), "Actions that erred while running", L, me, c["errors"])
        yield _counter(n("admissions"), "Trajectories admitted through the gate", L, me, c["admissions"])
        yield _counter(n("admission_wait_seconds"), "Seconds the admitted trajectories waited for admission, summed",
                       L, me, c["admission_wait_s"])
        for name, doc, label, values in (
                ("model_loads", "Model replica loads granted", "model", c["loads"]),
                ("model_evictions", "Model replicas evicted", "worker", c["evictions"]),
                ("sandbox_cold_starts", "CPU actions the policy gave a cold sandbox", "worker", c["cold_starts"])):
            fam = CounterMetricFamily(n(name), doc, labels=[*L, label])
            for k, v in sorted(values.items()):
                fam.add_metric([me, k], v)
            yield fam
        yield from _residency(n, L, me, st.get("residency") or {})


class TangramWorkerCollector(PrometheusCollector):
    """A worker's ``dask_tangram_sandbox_*`` families, from its sandbox pool's ``statistics()``."""

    label = "worker"

    def __init__(self, worker: Any, stats: Callable[[], Any]):
        super().__init__(worker)
        self.subsystem = SUBSYSTEM
        self.stats = stats

    def address(self) -> str:
        return str(self.server.address)

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:
            return
        L, me, n = ["worker"], self.address(), self.build_name
        yield _gauge(n("sandbox_size"), "Sandboxes the pool keeps", L, me, s.size)
        yield _gauge(n("sandbox_warm"), "Sandboxes started and ready (warm)", L, me, s.ready)
        yield _gauge(n("sandbox_in_use"), "Sandboxes lent to running actions", L, me, s.in_use)
        yield _gauge(n("sandbox_starting"), "Sandboxes starting now", L, me, s.starting)
        yield _counter(n("sandbox_starts"), "Sandboxes started", L, me, s.started)
        yield _counter(n("sandbox_recycled"), "Sandboxes recycled", L, me, s.recycled)
        yield _counter(n("sandbox_failed_starts"), "Sandbox starts that failed", L, me, s.failed_starts)


def _residency(n: Callable[[str], str], L: list[str], me: str, residency: dict) -> Iterator[Metric]:
    """The replicas the workers report (loading or resident), and the bytes they hold on each GPU."""
    count: dict[tuple[str, str], int] = {}
    held: dict[tuple[str, str, str], int] = {}
    for worker, reps in sorted(residency.get("replicas", {}).items()):
        for r in reps.values():
            model, state = str(r.get("model", "")), str(r.get("state", ""))
            count[(model, state)] = count.get((model, state), 0) + 1
            for g in r.get("gpus", ()):
                key = (worker, str(g), model)
                held[key] = held.get(key, 0) + int(r.get("bytes_per_gpu", 0))
    reps_fam = GaugeMetricFamily(n("model_replicas"), "Reward-model replicas the workers report, by state",
                                 labels=[*L, "model", "state"])
    for (model, state), v in sorted(count.items()):
        reps_fam.add_metric([me, model, state], v)
    yield reps_fam
    mem = GaugeMetricFamily(n("model_memory_bytes"), "Bytes a model's replicas hold on one GPU of a worker, as the "
                            "worker measured them", labels=[*L, "worker", "gpu", "model"])
    for (worker, g, model), v in sorted(held.items()):
        mem.add_metric([me, worker, g, model], v)
    yield mem


def _le(b: Any) -> str:
    return "+Inf" if b == "+Inf" else repr(float(b))


def _gauge(name: str, doc: str, labels: list[str], me: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=labels)
    g.add_metric([me], value)
    return g


def _counter(name: str, doc: str, labels: list[str], me: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=labels)
    c.add_metric([me], value)
    return c


class _Hub:
    """One registration in the process-wide registry for every live tangram collector."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.collectors: list[weakref.ref] = []
        self.registered = False
        # collectors whose collect() raised (the first time is logged with its trace); weak, so that a new collector
        # that reuses a gone one's id() is not taken for it
        self.failed: weakref.WeakSet = weakref.WeakSet()

    def describe(self) -> list[Metric]:  # no names up front: the registry must not call collect() to find them
        return []

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            live = [c for c in (r() for r in self.collectors) if c is not None]
        merged: dict[str, Metric] = {}
        for c in live:
            if getattr(c.server, "status", None) is not None and c.server.status.name in ("closing", "closed"):
                continue
            try:
                fams = list(c.collect())
            except Exception:  # one collector's bug must not take the page (and Dask's own metrics) down
                first = c not in self.failed
                self.failed.add(c)
                logger.log(logging.WARNING if first else logging.DEBUG,
                           "tangram: the metrics of %s could not be collected; the rest of /metrics is served",
                           c.address(), exc_info=True)
                continue
            for fam in fams:
                m = merged.get(fam.name)
                if m is None:
                    merged[fam.name] = fam
                else:
                    m.samples.extend(fam.samples)
        yield from merged.values()


_hub = _Hub()


def register(collector: PrometheusCollector) -> None:
    """Export ``collector``'s families on this process's ``/metrics`` (idempotent)."""
    with _hub.lock:
        if any(r() is collector for r in _hub.collectors):
            return
        _hub.collectors.append(weakref.ref(collector))
        if not _hub.registered:
            prometheus_client.REGISTRY.register(_hub)
            _hub.registered = True


def unregister(collector: PrometheusCollector) -> None:
    """Stop exporting ``collector`` (safe to call twice)."""
    with _hub.lock:
        _hub.collectors = [r for r in _hub.collectors if r() is not None and r() is not collector]
        if not _hub.collectors and _hub.registered:
            prometheus_client.REGISTRY.unregister(_hub)
            _hub.registered = False
