"""Watching tangram: a page in the Dask dashboard, ``/tangram/state.json``, Prometheus metrics, events.

The scheduler plugin installs everything with one call in ``start`` and
takes it out with one in ``close``::

    install_dashboard(plugin, scheduler)     # TangramSchedulerPlugin.start
    uninstall_dashboard(scheduler)           # TangramSchedulerPlugin.close

What it installs on that scheduler:

- a :class:`~.monitor.TangramMonitor` scheduler plugin (``tangram-monitor``) that
  times actions and counts placement decisions, logging them as events
  (:func:`~.events.emit`, topic ``"tangram"``);
- the Bokeh page ``/tangram`` and one ``/individual-tangram-<part>`` per plot,
  listed in the dashboard's "More..." menu and in ``/individual-plots.json``.
  When the scheduler was started with ``--preload scheduler_plugin``, the
  preload's :func:`register_bokeh_apps` put them into distributed's
  ``applications`` before the Bokeh server was built; otherwise (``register_plugin``,
  ``scheduler_kwargs``) they are served by a second Bokeh application added to
  ``scheduler.http_application``, placed first so that ``/individual-plots.json``
  (which reads the first one) lists its plots and the dashboard's own;
- ``/tangram/state.json``: the same data as JSON (:class:`~.state.TangramView`);
- the ``dask_tangram_*`` Prometheus families on ``/metrics`` (:mod:`.metrics`).

On a worker, :func:`install_worker` (called by the sandbox plugin's ``setup``)
exports its sandbox pool: a heartbeat metric the page reads and the
``dask_tangram_sandbox_*`` families on the worker's ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

from tornado import web

from .events import KINDS as EVENT_KINDS
from .events import TOPIC as EVENT_TOPIC
from .events import emit
from .metrics import TangramSchedulerCollector, TangramWorkerCollector, register, unregister
from .monitor import ActStats, TangramMonitor
from .state import SANDBOX_METRIC, TangramView

__all__ = ["install_dashboard", "uninstall_dashboard", "install_worker", "register_bokeh_apps", "emit",
           "EVENT_KINDS", "EVENT_TOPIC", "ActStats", "TangramMonitor", "TangramView", "STATE_ROUTE"]

logger = logging.getLogger("tangram_dask.dashboard")

STATE_ROUTE = "tangram/state.json"
PAGE = "/tangram"


@dataclass
class _Installed:
    view: TangramView
    monitor: TangramMonitor
    collector: TangramSchedulerCollector
    routes: web.Application
    bokeh: Any = None  # our own Bokeh application (late installs only)
    plots: list[dict[str, str]] = field(default_factory=list)  # entries added to the "More..." menu


_installed: "weakref.WeakKeyDictionary[Any, _Installed]" = weakref.WeakKeyDictionary()


def find_view(scheduler: Any) -> TangramView | None:
    inst = _installed.get(scheduler)
    return inst.view if inst is not None else None


def _apps() -> dict[str, Any]:
    from .components import make_docs
    return make_docs(find_view)


def register_bokeh_apps() -> None:
    """Add the Tangram page to distributed's dashboard applications (before a Scheduler builds its
    Bokeh server: the preload module calls this at import). Idempotent; a scheduler without the
    tangram plugin shows a line saying so."""
    try:
        from distributed.dashboard.scheduler import applications
    except ImportError:  # no bokeh: the scheduler serves no dashboard at all
        logger.info("tangram: bokeh is not importable; no Tangram dashboard page")
        return
    for path, fn in _apps().items():
        applications.setdefault(path, fn)


class StateHandler(web.RequestHandler):
    """``GET /tangram/state.json``: :meth:`TangramView.state` as JSON."""

    def initialize(self, view: TangramView) -> None:
        self.view = view

    def get(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(self.view.state(), default=_json_default))


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


def _main_bokeh(scheduler: Any) -> Any:
    """The scheduler's Bokeh application (what ``/individual-plots.json`` reads), or None."""
    try:
        from bokeh.server.tornado import BokehTornado
    except ImportError:
        return None
    http = getattr(scheduler, "http_application", None)
    for app in getattr(http, "applications", ()):
        if isinstance(app, BokehTornado):
            return app
    return None


def _menu_name(path: str) -> str:
    return " ".join(path.strip("/").split("-")[1:]).title() if "individual" in path else "Tangram"


def install_dashboard(plugin: Any, scheduler: Any) -> None:
    """Install the monitor, the page, the JSON route and the collector on ``scheduler`` (idempotent).

    A failure here is logged and leaves scheduling alone: watching must never stop the work.
    """
    if scheduler in _installed:
        return
    try:
        _install(plugin, scheduler)
    except Exception:
        logger.exception("tangram: the dashboard could not be installed; scheduling is not affected")


def _install(plugin: Any, scheduler: Any) -> None:
    monitor = TangramMonitor(plugin)
    scheduler.add_plugin(monitor, name=TangramMonitor.name, idempotent=True)
    view = TangramView(plugin, monitor)
    collector = TangramSchedulerCollector(scheduler, view)
    main = _main_bokeh(scheduler)
    prefix = (main.prefix if main is not None else "") or ""
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    routes = web.Application([(prefix + STATE_ROUTE, StateHandler, {"view": view})])
    inst = _Installed(view, monitor, collector, routes)
    _installed[scheduler] = inst
    http = getattr(scheduler, "http_application", None)
    if http is not None:
        http.add_application(routes)
    register(collector)
    if main is None:
        return
    from distributed.dashboard.scheduler import template_variables
    apps = _apps()
    if PAGE not in main.app_paths:  # installed after the Bokeh server was built
        inst.bokeh = _late_bokeh(apps, scheduler, main, template_variables(scheduler))
        http.applications.insert(0, inst.bokeh)
    plots = template_variables(scheduler)["plots"]  # the "More..." menu (a list shared by every page)
    have = {p["url"] for p in plots}
    for path in apps:
        url = path.strip("/")
        if url not in have:
            entry = {"url": url, "name": _menu_name(path)}
            plots.append(entry)
            inst.plots.append(entry)
    plots.sort(key=lambda d: d["name"])


def _late_bokeh(apps: dict[str, Any], scheduler: Any, main: Any, variables: dict) -> Any:
    import functools

    import dask
    from bokeh.application import Application
    from bokeh.application.handlers.function import FunctionHandler
    from bokeh.server.util import create_hosts_allowlist
    from distributed.dashboard.core import DaskBokehTornado
    from tornado.ioloop import IOLoop

    class TangramBokeh(DaskBokehTornado):
        """Our pages, on a Bokeh application of their own; lists the dashboard's plots too."""

        @property
        def app_paths(self) -> set[str]:
            return set(super().app_paths) | set(main.app_paths)

    prefix = main.prefix or ""
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    extra = {"prefix": prefix, **variables}
    kwargs = dask.config.get("distributed.scheduler.dashboard.bokeh-application").copy()
    origins = create_hosts_allowlist(kwargs.pop("allow_websocket_origin"), scheduler.http_server.port)
    app = TangramBokeh({k: Application(FunctionHandler(functools.partial(v, scheduler, extra)))
                        for k, v in apps.items()},
                       prefix=prefix, use_index=False, extra_websocket_origins=origins, absolute_url="", **kwargs)
    app.initialize(IOLoop.current())
    app.start()
    return app


async def uninstall_dashboard(scheduler: Any) -> None:
    """Undo :func:`install_dashboard` (safe to call twice, or without an install).

    The page's Bokeh server stops as distributed stops its own (``Node._stop_services``): ``stop_async``
    where Bokeh has it (3.10 on: there ``stop()`` on the running loop raises), else ``stop()``."""
    inst = _installed.pop(scheduler, None)
    if inst is None:
        return
    unregister(inst.collector)
    http = getattr(scheduler, "http_application", None)
    apps = getattr(http, "applications", [])
    for a in (inst.routes, inst.bokeh):
        if a is not None and a in apps:
            apps.remove(a)
    if inst.bokeh is not None:
        try:
            stop_async = getattr(inst.bokeh, "stop_async", None)
            if callable(stop_async):
                await stop_async()
            else:
                inst.bokeh.stop()
        except Exception:  # the page's own server: the rest of the uninstall (menu, monitor) still goes
            logger.exception("tangram dashboard: stopping the page's Bokeh server failed; uninstalling the rest")
    if inst.plots:
        from distributed.dashboard.scheduler import template_variables
        plots = template_variables(scheduler)["plots"]
        for e in inst.plots:
            if e in plots:
                plots.remove(e)
    if TangramMonitor.name in getattr(scheduler, "plugins", {}):
        scheduler.remove_plugin(name=TangramMonitor.name)


def install_worker(worker: Any, sandbox_plugin: Any) -> None:
    """On a worker: export its sandbox pool (``sandbox_plugin.pool.statistics()``) as the heartbeat
    metric ``tangram-sandbox`` (the page's sandbox plot) and as ``dask_tangram_sandbox_*`` on the
    worker's ``/metrics``. Idempotent per worker; a closed worker's families disappear."""
    ref = weakref.ref(sandbox_plugin)

    def stats() -> Any:
        p = ref()
        pool = p.pool if p is not None else None
        return pool.statistics() if pool is not None else None

    def heartbeat(_: Any) -> dict[str, Any] | None:
        s = stats()
        return asdict(s) if s is not None else None

    worker.metrics[SANDBOX_METRIC] = heartbeat
    old = _worker_collectors.get(worker)
    if old is not None:
        unregister(old)
    _worker_collectors[worker] = c = TangramWorkerCollector(worker, stats)
    register(c)


_worker_collectors: "weakref.WeakKeyDictionary[Any, TangramWorkerCollector]" = weakref.WeakKeyDictionary()
