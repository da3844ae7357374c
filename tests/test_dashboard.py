"""The Tangram dashboard page, /tangram/state.json and events, on a real LocalCluster.

One module-scoped cluster (worker processes): a CPU worker with 2 sandbox slots
and a warm sandbox pool, a GPU worker declared by config (4 GPUs in NVLink
groups [2, 2], 80 GB each) whose GPUs all hold ``rm-a`` replicas, and 2 API
tokens on the scheduler. The plugin arrives through ``scheduler_kwargs``, after
the Bokeh server was built (the preload path has its own test). A background
thread keeps a live workload going; the tests create the conditions they
check (actions held on a distributed ``Event`` behind a full worker).

The browser test drives Debian's chromium through chromium-driver (selenium)
and skips, saying so, where they are not installed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import dask
import pytest
from distributed import Client, Event, LocalCluster, Nanny

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.dashboard import EVENT_TOPIC
from tangram_dask.sandbox import SandboxPlugin
from tangram_dask.scheduler import TangramSchedulerPlugin

MODELS = {"rm-a": ModelSpec("rm-a", 60, 0.0), "rm-b": ModelSpec("rm-b", 60, 0.0)}
REPLICAS = {"gpu-0": tuple(("rm-a", (i,)) for i in range(4))}
PLOTS = ("tangram_actions", "tangram_pools", "tangram_workers", "tangram_act", "tangram_utilization",
         "tangram_admission", "tangram_sandboxes")
ROOT = Path(__file__).resolve().parents[1]


def _cpu_worker(name: str, slots: int) -> dict:
    return {"cls": Nanny, "options": {"name": name, "nthreads": slots + 1, "resources": {"slots": slots},
                                      "memory_limit": 0, "dashboard_address": ":0"}}


def _gpu_worker(name: str, groups: list[int]) -> dict:
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": sum(groups), "gpu-groups": groups, "gpu-memory-gb": 80}}}
    return {"cls": Nanny, "options": {"name": name, "nthreads": sum(groups), "resources": {"gpus": sum(groups)},
                                      "config": cfg, "memory_limit": 0, "dashboard_address": ":0"}}


def work(s: float, fail: bool = False) -> float:
    time.sleep(s)
    if fail:
        raise ValueError("a failing action")
    return s


def held(name: str, s: float = 0.0) -> str:
    Event(name).wait(60)
    time.sleep(s)
    return name


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def get_json(url: str):
    return json.loads(get(url))


def wave(client: Client) -> list:
    futs = []
    with tangram_dask.action(kind="code_exec", resource="cpu", units=1, hint_s=0.2):
        futs += [client.submit(work, 0.2, pure=False) for _ in range(6)]
    with tangram_dask.action(kind="test_run", resource="cpu", units=2, hint_s=0.4):
        futs += [client.submit(work, 0.4, pure=False) for _ in range(2)]
    with tangram_dask.action(kind="rm_score", resource="gpu", model="rm-a", units=1, hint_s=0.3):
        futs += [client.submit(work, 0.3, pure=False) for _ in range(4)]
    with tangram_dask.action(kind="web_search", resource="api", units=1, hint_s=0.1):
        futs += [client.submit(work, 0.1, pure=False) for _ in range(4)]
    return futs


@pytest.fixture(scope="module")
def env():
    with dask.config.set({"tangram.scheduler.wait-for-capacity": True}):  # unplaceable actions wait, shown
        plugin = TangramSchedulerPlugin("tangram", models=MODELS, api_tokens=2, pipeline=0, replicas=REPLICAS)
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address="127.0.0.1:0",
                           scheduler_kwargs={"plugins": [plugin]})
    cluster.worker_spec.update({"cpu-0": _cpu_worker("cpu-0", 2), "gpu-0": _gpu_worker("gpu-0", [2, 2])})
    cluster.sync(cluster._correct_state)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        client.register_plugin(SandboxPlugin(size=2))
        deadline = time.monotonic() + 30
        while len(plugin.nodes) < 2:
            assert time.monotonic() < deadline, plugin.nodes
            time.sleep(0.05)
        url = cluster.dashboard_link.rsplit("/", 1)[0]
        client.gather(wave(client))
        stop = threading.Event()

        def live() -> None:  # keeps the page moving while the tests look at it
            while not stop.is_set():
                try:
                    client.gather(wave(client))
                except Exception:
                    return
                stop.wait(0.3)

        threads = [threading.Thread(target=live, daemon=True)]
        threads[0].start()
        yield client, plugin, url, threads, stop
        stop.set()
        for th in threads:
            th.join(30)


def quiet(env) -> None:
    """Stop the live workload and wait until no action is left."""
    client, plugin, _, threads, stop = env
    stop.set()
    for th in threads:
        th.join(30)
    deadline = time.monotonic() + 30
    while plugin.actions:
        assert time.monotonic() < deadline, plugin.actions
        time.sleep(0.05)


def test_state_json_shows_why_the_head_waits_and_what_runs(env):
    client, plugin, url, _, _ = env
    quiet(env)
    ev = Event("hold-state", client=client)
    with tangram_dask.action(kind="hold", resource="cpu", units=2, hint_s=1.0):
        futs = [client.submit(held, "hold-state", pure=False) for _ in range(3)]
    with tangram_dask.action(kind="rm_hold", resource="gpu", model="rm-a", units=1, hint_s=1.0):
        gfut = client.submit(held, "hold-state", pure=False)
    with tangram_dask.action(kind="too_wide", resource="cpu", units=3, hint_s=1.0):
        wide = client.submit(held, "hold-state", pure=False)  # 3 slots: no worker has them
    deadline = time.monotonic() + 20
    while True:
        st = get_json(url + "/tangram/state.json")
        counts = {(a["kind"], a["state"]): a["count"] for a in st["actions"]}
        if counts.get(("hold", "running")) == 1 and counts.get(("hold", "pending")) == 2 \
                and counts.get(("rm_hold", "running")) == 1 and counts.get(("too_wide", "pending")) == 1:
            break
        assert time.monotonic() < deadline, st["actions"]
        time.sleep(0.2)
    cpu = next(p for p in st["policy"]["pools"] if p["pool"] in ("cpu", "") and p["resource"] == "cpu")
    assert (cpu["capacity"], cpu["free"], cpu["running"]) == (2, 0, 1) and cpu["queued"] in (2, 3), cpu
    head = cpu["head"]
    assert head is not None, "the policy does not say why the cpu pool's head waits (PoolStats.head)"
    assert (head["resource"], head["requested"], head["free"], head["largest"], head["never"]) == ("cpu", 2, 0, 2,
                                                                                                   False)
    assert st["utilization"]["cpu"] == 1.0
    serving = [g for g in st["gpus"] if g["state"] == "serving"]
    assert len(serving) == 1 and serving[0]["models"] == ["rm-a"], st["gpus"]
    assert sorted({g["group"] for g in st["gpus"]}) == [0, 1] and len(st["gpus"]) == 4
    cpu_node = next(n for n in st["policy"]["nodes"] if n["resource"] == "cpu")
    assert (cpu_node["capacity"], cpu_node["free"]) == (2, 0)
    sb = st["sandboxes"]
    assert len(sb) == 2 and all(s["size"] == 2 and s["ready"] + s["in_use"] + s["starting"] >= 1 for s in sb.values())
    # ACT per kind: the waves that ran before, as windows with mean <= p99
    for kind in ("code_exec", "test_run", "rm_score", "web_search"):
        s = st["act"]["series"][kind]
        assert s["count"] and all(0 < m <= p for m, p in zip(s["mean_s"], s["p99_s"])), (kind, s)
        assert st["act"]["totals"][kind]["finished"] >= 1
    unp = st["policy"]["unplaceable"]
    assert unp, "the policy lists no unplaceable action (PolicySnapshot.unplaceable)"
    assert [(u["kind"], u["requested"], u["largest"], u["never"], u["count"]) for u in unp] == \
        [("too_wide", 3, 2, True, 1)]
    assert json.loads(json.dumps(st)) == st  # plain JSON, nothing lost
    wide.cancel()
    ev.set()
    client.gather([*futs, gfut])


def test_page_is_listed_in_the_dashboard_navigation(env):
    _, _, url, _, _ = env
    plots = get_json(url + "/individual-plots.json")
    ours = {v for v in plots.values() if "tangram" in v}
    assert ours == {f"/individual-tangram-{p}" for p in
                    ("actions", "pools", "workers", "act", "utilization", "admission", "sandboxes")}
    assert "/individual-task-stream" in plots.values()  # the dashboard's own plots are still listed
    status = get(url + "/status").decode()
    assert 'href="tangram"' in status and 'href="individual-tangram-act"' in status  # the "More..." menu
    assert get(url + "/tangram").count(b"data-root-id") >= len(PLOTS)


# -- the page in a real browser -----------------------------------------------------------------------
CHROME_ARGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               "--disable-dev-shm-usage", "--window-size=1500,1250")


def chromium():
    """A selenium driver for Debian's chromium, or skip saying why."""
    binary = shutil.which("chromium")
    driver_bin = shutil.which("chromedriver")
    if binary is None or driver_bin is None:
        pytest.skip("chromium and chromium-driver are not installed (apt-get install chromium chromium-driver; "
                    ".ci/run installs them as root)")
    from selenium import webdriver
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for a in CHROME_ARGS:
        opts.add_argument(a)
    profile = tempfile.mkdtemp(prefix="tangram-chromium-")
    opts.add_argument(f"--user-data-dir={profile}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver_bin))
    drv.profile_dir = profile
    return drv


#: Rows in every data source of each named model (a figure's glyph renderers, or a table's source).
ROWS_JS = """
const names = arguments[0];
if (!(window.Bokeh && Bokeh.documents.length)) return null;
const doc = Bokeh.documents[0];
const len = (src) => { const d = src.data; const cols = d instanceof Map ? [...d.values()] : Object.values(d);
                       return cols.length ? Math.max(...cols.map((c) => c.length)) : 0; };
const out = {};
for (const n of names) {
  const m = doc.get_model_by_name(n);
  if (m == null) { out[n] = -1; continue; }
  if (m.source) { out[n] = len(m.source); continue; }
  if (m.text !== undefined) { out[n] = (m.text.match(/<tr>/g) || []).length - 1; continue; }  // an HTML table
  out[n] = Math.max(0, ...m.renderers.filter((r) => r.data_source).map((r) => len(r.data_source)));
}
return out;
"""


def test_page_in_a_headless_browser_holds_data_without_console_errors(env):
    client, plugin, url, threads, stop = env
    if stop.is_set():  # an earlier test quieted the cluster: the page must be watched live
        stop.clear()
        th = threading.Thread(target=lambda: [client.gather(wave(client)) for _ in range(8) if not stop.is_set()],
                              daemon=True)
        th.start()
        threads.append(th)
    drv = chromium()
    try:
        drv.get(url + "/tangram")
        deadline = time.monotonic() + 30
        rows = None
        while time.monotonic() < deadline:
            rows = drv.execute_script(ROWS_JS, list(PLOTS))
            if rows and all(v > 0 for v in rows.values()):
                break
            time.sleep(0.5)
        assert rows and all(v > 0 for v in rows.values()), f"empty plots on the page: {rows}"
        time.sleep(2.5)  # a few periodic updates, with the workload running
        rows2 = drv.execute_script(ROWS_JS, list(PLOTS))
        assert all(v > 0 for v in rows2.values()), rows2
        errors = [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        assert drv.title == "Dask: Tangram"
        if os.environ.get("TANGRAM_SCREENSHOT"):  # docs/dashboard.png: taken while actions wait and run
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                states = {a["state"] for a in get_json(url + "/tangram/state.json")["actions"]}
                if {"pending", "running"} <= states:
                    break
                time.sleep(0.1)
            time.sleep(1.1)  # one page update
            drv.save_screenshot(os.environ["TANGRAM_SCREENSHOT"])
        # one plot on its own page, as dask-labextension shows it
        drv.get(url + "/individual-tangram-workers")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = drv.execute_script(ROWS_JS, ["tangram_workers"])
            if r and r["tangram_workers"] > 0:
                break
            time.sleep(0.3)
        assert r and r["tangram_workers"] >= 2 + 4  # 2 CPU slots and 4 GPUs
        assert not [e for e in drv.get_log("browser") if e["level"] == "SEVERE"]
    finally:
        drv.quit()
        shutil.rmtree(drv.profile_dir, ignore_errors=True)


# -- events ---------------------------------------------------------------------------------------------
def test_decisions_are_events(env):
    client, plugin, url, _, _ = env
    quiet(env)
    seen: list = []
    client.subscribe_topic(EVENT_TOPIC, seen.append)
    with tangram_dask.action(kind="judge", resource="gpu", model="rm-b", units=1, hint_s=0.1):
        judged = client.submit(work, 0.1, pure=False)   # rm-b is nowhere: a load, evicting an idle rm-a
    with dask.annotate(tangram={"kind": "web_search", "resource": "api", "units": 0}):
        too_big = client.submit(work, 0.1, pure=False)  # a hand-written annotation with 0 units: rejected
    with tangram_dask.action(kind="code_exec", resource="cpu", units=1, hint_s=0.1):
        fails = client.submit(work, 0.0, True, pure=False)
    client.gather(judged)
    for f in (too_big, fails):
        with pytest.raises(Exception):
            f.result(timeout=20)
    deadline = time.monotonic() + 10
    want = {"tangram-placement", "tangram-load", "tangram-eviction", "tangram-rejection", "tangram-error"}
    while {m["action"] for _, m in client.get_events(EVENT_TOPIC)} < want or len(seen) < 3:
        assert time.monotonic() < deadline, {m["action"] for _, m in client.get_events(EVENT_TOPIC)}
        time.sleep(0.1)
    ev = [m for _, m in client.get_events(EVENT_TOPIC)]
    # a background load (the default: no action waits inside it, so no key) or one inside the action's grant
    load = next(m for m in ev if m["action"] == "tangram-load" and m.get("key", judged.key) == judged.key)
    assert load["model"] == "rm-b" and len(load["gpus"]) == 1
    assert any(m["action"] == "tangram-eviction" and m.get("key", judged.key) == judged.key
               and m["worker"] == load["worker"] for m in ev)
    rej = next(m for m in ev if m["action"] == "tangram-rejection" and m["key"] == too_big.key)
    assert "malformed tangram annotation" in rej["reason"] and "units" in rej["reason"], rej
    err = next(m for m in ev if m["action"] == "tangram-error" and m["key"] == fails.key)
    assert "a failing action" in err["error"]
    on_page = {m["action"] for _, m in client.get_events("all")}  # the dashboard's events page reads "all"
    assert want - {"tangram-placement"} <= on_page and "tangram-placement" not in on_page
    deadline = time.monotonic() + 5
    while True:  # state.json may be a build up to 0.9 s old
        st = get_json(url + "/tangram/state.json")
        if st["counters"]["errors"] >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert st["counters"]["loads"].get("rm-b", 0) >= 1 and sum(st["counters"]["evictions"].values()) >= 1
    assert st["counters"]["rejections"] >= 1 and st["counters"]["errors"] >= 1
    client.unsubscribe_topic(EVENT_TOPIC)


# -- installed by the preload ----------------------------------------------------------------------------
def test_preloaded_scheduler_serves_the_page(tmp_path):
    """``dask scheduler --preload scheduler_plugin``: the page is one of the Bokeh server's own."""
    env_ = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                             "--port", "0", "--dashboard-address", f"127.0.0.1:{port}", "--preload",
                             "scheduler_plugin"], env=env_, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                plots = get_json(url + "/individual-plots.json")
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
                time.sleep(0.2)
        assert "/individual-tangram-act" in plots.values()
        st = get_json(url + "/tangram/state.json")
        assert st["policy"]["policy"] == "tangram" and st["actions"] == []
        assert b"dask_tangram_units_free" in get(url + "/metrics")
        page = get(url + "/tangram").decode()
        assert page.count("data-root-id") >= len(PLOTS) and 'href="tangram"' in get(url + "/status").decode()
    finally:
        proc.terminate()
        proc.wait(20)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_pool_table_says_what_holds_a_waiting_models_replicas():
    """The Tangram page's pool table: a model's row says what holds its replicas while its actions wait (the
    policy's ``gpu_waiting``), in words; other rows leave it empty. Rendered from a state, no browser."""
    from tangram_dask.dashboard.components import PoolTable

    pools = [{"pool": "cpu", "resource": "cpu", "capacity": 4, "free": 0, "running": 4, "queued": 2, "head": None},
             {"pool": "gpu", "resource": "gpu", "capacity": 2, "free": 0, "running": 2, "queued": 3, "head": None},
             {"pool": "prm", "resource": "gpu", "capacity": 1, "free": 1, "running": 0, "queued": 3, "head": None},
             {"pool": "judge", "resource": "gpu", "capacity": 1, "free": 0, "running": 1, "queued": 0,
              "head": None}]
    state = {"policy": {"pools": pools, "unplaceable": [],
                        "gpu_waiting": [{"model": "prm", "reason": "gpu_shared", "count": 3}]}}

    class View:
        def state(self):
            return state

    table = PoolTable(View())
    table.update()
    assert table.source.data["replicas"] == ["", "", "GPUs serving another model", ""]
    assert "its replicas" in table.root.text and "GPUs serving another model" in table.root.text


def _own_page_scheduler_close(monkeypatch, stop_async_body) -> tuple[bool, bool]:
    """Start a Scheduler with the plugin and its page on its own Bokeh server, give that server Bokeh 3.10's
    ``stop`` (it raises on the running loop) and ``stop_async`` (``stop_async_body(real)``: ``real`` awaits the
    server's real stop), close the Scheduler; return whether the monitor and the menu entries are gone. The
    preload's registration, which an earlier test in this process may have made, is taken out first: the page
    must come after the Bokeh server."""
    from distributed import Scheduler
    from distributed.dashboard import scheduler as dashboard_scheduler
    from distributed.dashboard.scheduler import template_variables

    from tangram_dask.dashboard import TangramMonitor, _apps, _installed

    for path in _apps():
        monkeypatch.delitem(dashboard_scheduler.applications, path, raising=False)
    out: list[bool] = []

    async def main() -> None:
        plugin = TangramSchedulerPlugin("tangram")
        async with Scheduler(dashboard_address="127.0.0.1:0", port=0, plugins=[plugin]) as s:
            inst = _installed[s]
            assert inst.bokeh is not None and inst.plots  # the page came after the Bokeh server: its own
            assert TangramMonitor.name in s.plugins
            bokeh = inst.bokeh
            has_async = callable(getattr(bokeh, "stop_async", None))  # Bokeh 3.10 on (Python 3.12 on)
            real_stop, real_stop_async = bokeh.stop, getattr(bokeh, "stop_async", None)

            async def real() -> None:
                if has_async:
                    await real_stop_async()
                else:
                    real_stop()

            def stop(wait: bool = True) -> None:  # bokeh 3.10.2's, on the running loop
                raise RuntimeError("Cannot synchronously wait on a running event loop; use 'await stop_async()'")

            async def stop_async() -> None:
                await stop_async_body(real)

            bokeh.stop, bokeh.stop_async = stop, stop_async
        assert s not in _installed
        out.append(TangramMonitor.name not in s.plugins)
        out.append(not [p for p in template_variables(s)["plots"] if p["url"].startswith("individual-tangram")])

    asyncio.run(asyncio.wait_for(main(), 60))
    return out[0], out[1]


def test_close_stops_the_page_with_stop_async_where_bokeh_has_it(monkeypatch):
    """Bokeh 3.10 (it needs Python 3.12; CI's 3.11 gets 3.9) raises from ``stop()`` on the running loop and offers
    ``stop_async``: the plugin's close awaits it, as distributed does for its own Bokeh server, and then finishes
    the uninstall (menu entries, monitor). Bokeh 3.10's two methods stand in on the real server of either version;
    the stand-in ``stop_async`` stops it for real."""
    calls: list[str] = []

    async def body(real) -> None:
        calls.append("stop_async")
        await real()

    assert _own_page_scheduler_close(monkeypatch, body) == (True, True)  # the monitor and the menu entries went
    assert calls == ["stop_async"]


def test_close_uninstalls_the_rest_when_the_page_server_fails_to_stop(monkeypatch, caplog):
    """A failure stopping the page's own Bokeh server is logged, and the close still removes the monitor and the
    menu entries (and the Scheduler closes): the page does not outlive the plugin in the menu."""
    async def body(real) -> None:
        await real()
        raise RuntimeError("stand-in: stop failed")

    with caplog.at_level(logging.ERROR, logger="tangram_dask.dashboard"):
        assert _own_page_scheduler_close(monkeypatch, body) == (True, True)
    assert any("stopping the page's Bokeh server failed" in r.getMessage() and r.exc_info for r in caplog.records)
