"""The Tangram page: Bokeh components in the style of distributed's ``dashboard/components/nvml.py``.

Every component reads :meth:`TangramView.state` (one cached build a tick shared
by all) and updates its ``ColumnDataSource`` with distributed's ``update``.
"""

from __future__ import annotations

import bisect
import os
from html import escape
from typing import Any, Callable

from bokeh.core.properties import without_property_validation
from bokeh.models import ColumnDataSource, Div, FactorRange, HoverTool, Range1d
from bokeh.plotting import figure
from distributed.dashboard.components import DashboardComponent, add_periodic_callback
from distributed.dashboard.components.scheduler import BOKEH_THEME
from distributed.dashboard.utils import update
from distributed.utils import log_errors
from jinja2 import ChoiceLoader, Environment, FileSystemLoader

import distributed.http

from .state import TangramView

env = Environment(loader=ChoiceLoader([
    FileSystemLoader(os.path.join(os.path.dirname(__file__), "templates")),
    FileSystemLoader(os.path.join(os.path.dirname(distributed.http.__file__), "templates")),
]))

STATE_COLORS = {"waiting": "#c7c7c7", "pending": "#ff7f0e", "running": "#1f77b4"}
GPU_COLORS = {"empty": "#e0e0e0", "idle": "#9ecae1", "loading": "#fdae6b", "serving": "#31a354"}
SLOT_COLORS = {"free": "#e0e0e0", "busy": "#1f77b4"}
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
RESOURCE_COLORS = {"cpu": "#1f77b4", "gpu": "#2ca02c", "api": "#ff7f0e"}
_TOOLS = "pan,wheel_zoom,box_zoom,reset"
_TABLE_CSS = "border-collapse: collapse; font-size: 13px; text-align: left"
_CELL_CSS = "padding: 3px 14px 3px 4px; border-bottom: 1px solid #ddd"


def _short(addr: str) -> str:
    return addr.split("://", 1)[-1]


def _span(rng: Range1d, lo: float, hi: float) -> None:
    """Set an explicit range from the server. Bokeh's automatic ranges are computed in the browser and
    sent back to the server as a patch on every data change: a measured cost on the scheduler."""
    if not hi > lo:
        hi = lo + 1.0
    if rng.start != lo:
        rng.start = lo
    if rng.end != hi:
        rng.end = hi


def _new_points(ts: list[float], source: ColumnDataSource) -> int:
    """Index of the first sample in ``ts`` newer than what ``source`` holds."""
    have = source.data["t"]
    last = have[-1] if len(have) else -1.0
    return bisect.bisect_right(ts, last)


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


class ActionsByKind(DashboardComponent):
    """Live actions per kind: waiting (dependencies), pending (in the policy's queue), running."""

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.source = ColumnDataSource({"kind": [], "resource": [], "waiting": [], "pending": [], "running": []})
        fig = figure(title="Actions by kind", x_range=FactorRange(), y_range=Range1d(0, 1), tools="",
                     name="tangram_actions",
                     height=260, **kwargs)
        fig.vbar_stack(["waiting", "pending", "running"], x="kind", width=0.8, source=self.source,
                       color=[STATE_COLORS[s] for s in ("waiting", "pending", "running")],
                       legend_label=["waiting", "pending", "running"])
        fig.add_tools(HoverTool(tooltips="@kind (@resource): @pending pending, @running running, "
                                         "@waiting waiting"))
        fig.legend.location = "top_right"
        fig.legend.orientation = "horizontal"
        fig.toolbar_location = None
        self.root = fig

    @without_property_validation
    @log_errors
    def update(self) -> None:
        rows: dict[str, dict[str, Any]] = {}
        for a in self.view.state()["actions"]:
            r = rows.setdefault(a["kind"], {"resource": a["resource"], "waiting": 0, "pending": 0, "running": 0})
            r[a["state"]] += a["count"]
        for kind, t in self.view.state()["act"]["totals"].items():  # kinds seen before stay on the axis
            rows.setdefault(kind, {"resource": t["resource"], "waiting": 0, "pending": 0, "running": 0})
        kinds = sorted(rows)
        if list(self.root.x_range.factors) != kinds:
            self.root.x_range.factors = kinds
        update(self.source, {"kind": kinds, **{c: [rows[k][c] for k in kinds]
                                               for c in ("resource", "waiting", "pending", "running")}})
        _span(self.root.y_range, 0, 1.25 * max([r["waiting"] + r["pending"] + r["running"] for r in rows.values()],
                                               default=1))
        p = sum(r["pending"] for r in rows.values())
        self.root.title.text = f"Actions by kind: {p} pending, {sum(r['running'] for r in rows.values())} running"


class PoolTable(DashboardComponent):
    """Every pool and why its head waits (the policy's ``Shortfall``); unplaceable actions below."""

    COLUMNS = (("pool", "pool"), ("resource", "resource"), ("capacity", "capacity"), ("free", "free"),
               ("running", "running"), ("queued", "queued"), ("queued_units", "queued units"),
               ("head", "head waits for"), ("reason", "why"), ("replicas", "its replicas"))
    # a model's row: what holds its replicas while its actions wait (the policy's gpu_waiting)
    REPLICAS = {"idle": "one idle, held for a later start", "gpu_shared": "GPUs serving another model",
                "gpu_loading": "GPUs held by another model's load", "loading": "one loading",
                "busy": "all serving", "paused": "on paused workers", "no_replica": "none"}

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.source = ColumnDataSource({k: [] for k, _ in self.COLUMNS}, name="tangram_pools_source")
        # an HTML table in a Div (a DataTable's grid was seen to keep showing old rows in headless chromium)
        self.root = Div(text="", name="tangram_pools", **kwargs)
        self._last: dict[str, list[Any]] = {}

    @without_property_validation
    @log_errors
    def update(self) -> None:
        pol = self.view.state()["policy"]
        rows: dict[str, list[Any]] = {k: [] for k, _ in self.COLUMNS}
        held = {w["model"]: self.REPLICAS.get(w["reason"], w["reason"]) for w in pol.get("gpu_waiting", ())}

        def add(pool: str, res: str, cap: Any, free: Any, run: Any, q: Any, qu: Any, sf: dict | None) -> None:
            for k, v in zip(("pool", "resource", "capacity", "free", "running", "queued", "queued_units"),
                            (pool, res, cap, free, run, q, qu)):
                rows[k].append(v)
            rows["replicas"].append(held.get(pool, "") if res == "gpu" and pool != "gpu" else "")
            if sf:
                # (free: on the freest node as the page reads it, dispatch-ahead units included; the pool's own
                # free column counts real units, and the reason was given when the head last tried)
                ahead = " incl. dispatch-ahead" if sf["resource"] == "cpu" else ""
                rows["head"].append(f"{sf['requested']} {sf['resource']} (freest node {sf['free']}{ahead}, "
                                    f"largest node {sf['largest']})" + (" never fits" if sf.get("never") else ""))
                rows["reason"].append(sf.get("reason") or "")
            else:
                rows["head"].append("")
                rows["reason"].append("")

        for p in pol.get("pools", ()):
            add(p["pool"] or p["resource"], p["resource"], p["capacity"], p["free"], p["running"], p["queued"],
                p.get("queued_units", 0), p.get("head"))
        for sf in pol["unplaceable"]:  # grouped: one row per distinct shortfall
            add(f"unplaceable: {sf['kind'] or sf['pool']}", sf["resource"], None, None, None, sf["count"],
                sf["requested"] * sf["count"], sf)
        if rows == self._last:
            return
        self._last = rows
        update(self.source, rows)
        n = len(rows["pool"])
        head = "".join(f'<th style="{_CELL_CSS}">{escape(t)}</th>' for _, t in self.COLUMNS)
        body = "".join("<tr>" + "".join(f'<td style="{_CELL_CSS}">'
                                        f"{escape('' if rows[k][i] is None else str(rows[k][i]))}</td>"
                                        for k, _ in self.COLUMNS) + "</tr>" for i in range(n))
        self.root.text = (f'<table class="tangram-pools" style="{_TABLE_CSS}"><thead><tr>{head}</tr></thead>'
                          f"<tbody>{body}</tbody></table>")


class WorkerMap(DashboardComponent):
    """One row per worker: its CPU slots (busy or free), or its GPUs laid out by topology group with
    the replicas resident on each and their state (empty, idle, loading, serving)."""

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.source = ColumnDataSource({"x": [], "y": [], "color": [], "label": [], "info": [], "worker": []})
        fig = figure(title="Workers: CPU slots and GPUs by topology group", y_range=FactorRange(),
                     x_range=Range1d(-0.5, 8), tools="", name="tangram_workers", height=260, **kwargs)
        fig.rect(x="x", y="y", width=0.9, height=0.8, color="color", source=self.source, line_color="white")
        fig.text(x="x", y="y", text="label", source=self.source, text_align="center", text_baseline="middle",
                 text_font_size="9px")
        fig.add_tools(HoverTool(tooltips="@worker: @info"))
        fig.xaxis.visible = False
        fig.xgrid.visible = False
        fig.ygrid.visible = False
        fig.toolbar_location = None
        self.root = fig

    @without_property_validation
    @log_errors
    def update(self) -> None:
        st = self.view.state()
        d: dict[str, list[Any]] = {"x": [], "y": [], "color": [], "label": [], "info": [], "worker": []}
        ys: list[str] = []
        width = 1
        for n in sorted(st["policy"]["nodes"], key=lambda n: n["node"]):
            if n["resource"] != "cpu":
                continue
            y = f"{_short(n['node'])} slots"
            ys.append(y)
            used = max(0, n["capacity"] - n["free"])
            for i in range(n["capacity"]):
                busy = i < used
                d["x"].append(i)
                d["y"].append(y)
                d["color"].append(SLOT_COLORS["busy" if busy else "free"])
                d["label"].append("")
                d["info"].append(f"slot {i} {'busy' if busy else 'free'} ({n['running']} actions running, "
                                 f"{n.get('homes', 0)} trajectory homes)")
                d["worker"].append(n["node"])
            width = max(width, n["capacity"])
        for g in st["gpus"]:
            y = f"{_short(g['worker'])} gpus"
            if y not in ys:
                ys.append(y)
            x = g["gpu"] + g["group"]  # one empty cell between NVLink groups
            d["x"].append(x)
            d["y"].append(y)
            d["color"].append(GPU_COLORS[g["state"]])
            d["label"].append(",".join(g["models"]))
            rep = ", ".join(f"{m} {st}" for m, st in g["reported"])
            d["info"].append(f"GPU {g['gpu']} (group {g['group']}): {g['state']} {', '.join(g['models'])}"
                             + (f" (worker reports: {rep})" if rep else ""))
            d["worker"].append(g["worker"])
            width = max(width, x + 1)
        if list(self.root.y_range.factors) != ys:
            self.root.y_range.factors = ys
        self.root.x_range.end = width - 0.5
        update(self.source, d)


class ActOverTime(DashboardComponent):
    """ACT per kind over time windows: mean (solid) and p99 (dashed)."""

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.mean = ColumnDataSource({"xs": [], "ys": [], "kind": [], "color": []})
        self.p99 = ColumnDataSource({"xs": [], "ys": [], "kind": [], "color": []})
        fig = figure(title="ACT per kind (s): mean, p99 dashed", tools=_TOOLS, name="tangram_act", height=260,
                     x_range=Range1d(0, 1), y_range=Range1d(0, 1), **kwargs)
        fig.multi_line(xs="xs", ys="ys", color="color", source=self.mean, line_width=2, legend_field="kind")
        fig.multi_line(xs="xs", ys="ys", color="color", source=self.p99, line_width=1, line_dash="dashed")
        fig.add_tools(HoverTool(tooltips="@kind"))
        fig.xaxis.axis_label = "policy time (s)"
        fig.legend.location = "top_left"
        self.root = fig
        self.colors: dict[str, str] = {}

    @without_property_validation
    @log_errors
    def update(self) -> None:
        series = self.view.state()["act"]["series"]
        kinds = sorted(series)
        for k in kinds:
            self.colors.setdefault(k, _color(len(self.colors)))
        for src, stat in ((self.mean, "mean_s"), (self.p99, "p99_s")):
            update(src, {"xs": [series[k]["t"] for k in kinds], "ys": [series[k][stat] for k in kinds],
                         "kind": kinds, "color": [self.colors[k] for k in kinds]})
        ts = [t for k in kinds for t in series[k]["t"]]
        if ts:
            w = self.view.state()["act"]["window_s"]
            _span(self.root.x_range, min(ts), max(ts) + w)
            _span(self.root.y_range, 0, 1.1 * max(v for k in kinds for v in series[k]["p99_s"]))


class Utilization(DashboardComponent):
    """Units in use over capacity, per resource, over time."""

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.source = ColumnDataSource({"t": [], "cpu": [], "gpu": [], "api": []})
        fig = figure(title="Utilization per resource", tools=_TOOLS, name="tangram_utilization", height=220,
                     x_range=Range1d(0, 1), y_range=Range1d(0, 1.05), **kwargs)
        for r, c in RESOURCE_COLORS.items():
            fig.line(x="t", y=r, source=self.source, color=c, line_width=2, legend_label=r)
        fig.legend.location = "top_left"
        fig.legend.orientation = "horizontal"
        fig.xaxis.axis_label = "policy time (s)"
        self.root = fig

    @without_property_validation
    @log_errors
    def update(self) -> None:
        h = self.view.state()["history"]
        k = _new_points(h["t"], self.source)
        if k < len(h["t"]):  # only the new samples go to the browser
            self.source.stream({"t": h["t"][k:], **{r: [u.get(r, 0.0) for u in h["utilization"][k:]]
                                                   for r in RESOURCE_COLORS}}, rollover=HISTORY)
            _span(self.root.x_range, self.source.data["t"][0], self.source.data["t"][-1])
        u = self.view.state()["utilization"]
        self.root.title.text = "Utilization: " + ", ".join(f"{r} {u[r]:.0%}" for r in RESOURCE_COLORS if r in u)


class AdmissionQueue(DashboardComponent):
    """Trajectories waiting for admission, and actions pending in the policy, over time."""

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.source = ColumnDataSource({"t": [], "admission": [], "pending": []})
        fig = figure(title="Admission queue", tools=_TOOLS, name="tangram_admission", height=220,
                     x_range=Range1d(0, 1), y_range=Range1d(0, 1), **kwargs)
        fig.line(x="t", y="admission", source=self.source, color="#d62728", line_width=2,
                 legend_label="trajectories waiting")
        fig.line(x="t", y="pending", source=self.source, color="#ff7f0e", line_width=1,
                 legend_label="actions pending")
        fig.legend.location = "top_left"
        fig.xaxis.axis_label = "policy time (s)"
        self.root = fig

    @without_property_validation
    @log_errors
    def update(self) -> None:
        h = self.view.state()["history"]
        k = _new_points(h["t"], self.source)
        if k < len(h["t"]):
            self.source.stream({"t": h["t"][k:], "admission": h["admission_queue"][k:], "pending": h["pending"][k:]},
                               rollover=HISTORY)
            d = self.source.data
            _span(self.root.x_range, d["t"][0], d["t"][-1])
            _span(self.root.y_range, 0, 1.15 * max(max(d["admission"]), max(d["pending"]), 1))
        self.root.title.text = f"Admission queue: {h['admission_queue'][-1] if h['t'] else 0} trajectories waiting"


class SandboxPools(DashboardComponent):
    """Each worker's sandbox pool: warm, in use, starting; cold starts (the policy's) and starts in the hover."""

    def __init__(self, view: TangramView, **kwargs: Any):
        self.view = view
        self.source = ColumnDataSource({"worker": [], "warm": [], "in_use": [], "starting": [], "cold_starts": [],
                                        "started": []})
        fig = figure(title="Sandbox pools", y_range=FactorRange(), x_range=Range1d(0, 1), tools="",
                     name="tangram_sandboxes", height=220, **kwargs)
        fig.hbar_stack(["warm", "in_use", "starting"], y="worker", height=0.8, source=self.source,
                       color=["#31a354", "#1f77b4", "#fdae6b"], legend_label=["warm", "in use", "starting"])
        fig.add_tools(HoverTool(tooltips="@worker: @warm warm, @in_use in use, @starting starting, "
                                         "@cold_starts cold starts, @started started"))
        fig.legend.location = "bottom_right"
        fig.legend.orientation = "horizontal"
        fig.toolbar_location = None
        self.root = fig

    @without_property_validation
    @log_errors
    def update(self) -> None:
        sb = self.view.state()["sandboxes"]
        ws = sorted(sb)
        names = [_short(w) for w in ws]
        if list(self.root.y_range.factors) != names:
            self.root.y_range.factors = names
        update(self.source, {"worker": names, "warm": [sb[w].get("ready", 0) for w in ws],
                             "in_use": [sb[w].get("in_use", 0) for w in ws],
                             "starting": [sb[w].get("starting", 0) for w in ws],
                             "cold_starts": [sb[w].get("cold_starts", 0) for w in ws],
                             "started": [sb[w].get("started", 0) for w in ws]})
        _span(self.root.x_range, 0, 1.05 * max([sb[w].get("size", 0) for w in ws] + [sb[w].get("ready", 0) +
                                               sb[w].get("in_use", 0) + sb[w].get("starting", 0) for w in ws],
                                              default=1))
        self.root.title.text = (f"Sandbox pools: {sum(sb[w].get('ready', 0) for w in ws)} warm, "
                                f"{sum(sb[w].get('cold_starts', 0) for w in ws)} cold starts")


COMPONENTS: dict[str, type[DashboardComponent]] = {
    "actions": ActionsByKind, "pools": PoolTable, "workers": WorkerMap, "act": ActOverTime,
    "utilization": Utilization, "admission": AdmissionQueue, "sandboxes": SandboxPools,
}
INTERVAL_MS = 1000
HISTORY = 600  # samples kept in the browser (one a second at most: ten minutes)


class _All(DashboardComponent):
    """Every component of a page, updated in one tick whose changes go to the browser as one message."""

    def __init__(self, parts: list[DashboardComponent], doc: Any = None):
        self.parts = parts
        self.doc = doc

    def update(self) -> None:
        doc = self.doc
        if doc is not None:
            doc.hold("combine")
        try:
            for p in self.parts:
                p.update()
        finally:
            if doc is not None:
                doc.unhold()


def _missing(doc: Any) -> None:
    doc.add_root(Div(text="<p>The tangram scheduler plugin is not installed on this scheduler "
                          "(<code>client.register_plugin(TangramSchedulerPlugin())</code>).</p>",
                     name="tangram_missing"))
    doc.theme = BOKEH_THEME


def make_docs(find_view: Callable[[Any], TangramView | None]) -> dict[str, Callable]:
    """The Bokeh applications: ``/tangram`` (the page) and one ``/individual-tangram-<part>`` per component."""

    @log_errors
    def tangram_doc(scheduler: Any, extra: dict, doc: Any) -> None:
        doc.title = "Dask: Tangram"
        view = find_view(scheduler)
        if view is None:
            _missing(doc)
            return
        parts = {k: c(view, sizing_mode="stretch_width") for k, c in COMPONENTS.items()}
        allp = _All(list(parts.values()))
        allp.update()
        allp.doc = doc
        add_periodic_callback(doc, allp, INTERVAL_MS)
        for p in parts.values():
            doc.add_root(p.root)
        doc.template = env.get_template("tangram.html")
        doc.template_variables.update(extra)
        doc.theme = BOKEH_THEME

    def individual(kind: type[DashboardComponent]) -> Callable:
        @log_errors
        def doc_fn(scheduler: Any, extra: dict, doc: Any) -> None:
            view = find_view(scheduler)
            if view is None:
                _missing(doc)
                return
            part = kind(view, sizing_mode="stretch_both")
            part.update()
            add_periodic_callback(doc, part, INTERVAL_MS)
            doc.add_root(part.root)
            doc.theme = BOKEH_THEME
        return doc_fn

    apps = {"/tangram": tangram_doc}
    for k, c in COMPONENTS.items():
        apps[f"/individual-tangram-{k}"] = individual(c)
    return apps
