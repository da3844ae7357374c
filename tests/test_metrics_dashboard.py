"""``dask_tangram_*`` on the scheduler's and the workers' ``/metrics``, on a real LocalCluster.

Parsed with ``prometheus_client.parser``: every family is present and, with the
cluster held still (actions waiting on a distributed ``Event`` behind a full
worker), its values are those of ``/tangram/state.json`` at the same moment.
Several schedulers in one process export side by side and leave cleanly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.request

import prometheus_client
import pytest
from distributed import Client, Event, LocalCluster, Nanny, Scheduler, Worker
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import AsyncHTTPClient

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.dashboard.monitor import ACT_BUCKETS, ActStats
from tangram_dask.sandbox import SandboxPlugin
from tangram_dask.scheduler import TangramSchedulerPlugin

SCHEDULER_FAMILIES = {
    "actions": "gauge", "actions_submitted": "counter", "actions_finished": "counter", "act_seconds": "histogram",
    "units_capacity": "gauge", "units_in_use": "gauge", "units_free": "gauge", "queued_actions": "gauge",
    "unplaceable_actions": "gauge", "admission_queue": "gauge", "placements": "counter", "rejections": "counter",
    "errors": "counter", "model_loads": "counter", "model_evictions": "counter", "sandbox_cold_starts": "counter",
    "model_replicas": "gauge", "model_memory_bytes": "gauge", "admissions": "counter",
    "admission_wait_seconds": "counter", "gpu_waiting_actions": "gauge", "paused_workers": "gauge",
    "broken_models": "gauge", "hints_bounded": "counter",
}
WORKER_FAMILIES = {"sandbox_size": "gauge", "sandbox_warm": "gauge", "sandbox_in_use": "gauge",
                   "sandbox_starting": "gauge", "sandbox_starts": "counter", "sandbox_recycled": "counter",
                   "sandbox_failed_starts": "counter"}


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("dask_tangram_")}


def work(s: float) -> float:
    time.sleep(s)
    return s


def held(name: str) -> str:
    Event(name).wait(60)
    return name


@pytest.fixture(scope="module")
def env():
    plugin = TangramSchedulerPlugin("tangram", models={"rm-a": ModelSpec("rm-a", 16, 0.0)}, api_tokens=2,
                                    pipeline=0)
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": 2, "gpu-groups": [2], "gpu-memory-gb": 80}}}
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address="127.0.0.1:0",
                           scheduler_kwargs={"plugins": [plugin]})
    cluster.worker_spec.update({
        "cpu-0": {"cls": Nanny, "options": {"name": "cpu-0", "nthreads": 3, "resources": {"slots": 2},
                                            "memory_limit": 0, "dashboard_address": "127.0.0.1:0"}},
        "gpu-0": {"cls": Nanny, "options": {"name": "gpu-0", "nthreads": 2, "resources": {"gpus": 2},
                                            "config": cfg, "memory_limit": 0, "dashboard_address": "127.0.0.1:0"}}})
    cluster.sync(cluster._correct_state)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        client.register_plugin(SandboxPlugin(size=2))
        deadline = time.monotonic() + 30
        while len(plugin.nodes) < 2:
            assert time.monotonic() < deadline, plugin.nodes
            time.sleep(0.05)
        yield client, plugin, cluster.dashboard_link.rsplit("/", 1)[0]


def test_every_family_matches_state_json_at_the_same_moment(env):
    client, plugin, url = env
    with tangram_dask.action(kind="code_exec", resource="cpu", units=1, hint_s=0.05):
        done = [client.submit(work, 0.05, pure=False) for _ in range(6)]
    with tangram_dask.action(kind="rm_score", resource="gpu", model="rm-a", units=1, hint_s=0.05):
        done += [client.submit(work, 0.05, pure=False) for _ in range(3)]
    with tangram_dask.action(kind="web_search", resource="api", units=1, hint_s=0.05):
        done += [client.submit(work, 0.05, pure=False) for _ in range(3)]
    client.gather(done)
    ev = Event("hold-metrics", client=client)
    with tangram_dask.action(kind="hold", resource="cpu", units=2, hint_s=1.0):
        holds = [client.submit(held, "hold-metrics", pure=False) for _ in range(3)]
    deadline = time.monotonic() + 20
    while sum(a.state == "pending" for a in list(plugin.actions.values())) != 2 or \
            sum(a.state == "granted" for a in list(plugin.actions.values())) != 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)  # the state is still (a build is reused for 0.9 s: let the last one age out)
    st = json.loads(get(url + "/tangram/state.json"))
    fams = families(get(url + "/metrics").decode())
    st2 = json.loads(get(url + "/tangram/state.json"))
    assert st2["actions"] == st["actions"] and st2["policy"]["pools"] == st["policy"]["pools"]
    me = st["scheduler"]
    for name, kind in SCHEDULER_FAMILIES.items():
        f = fams.get(f"dask_tangram_{name}")
        assert f is not None and f.type == kind, (name, f)

    def samples(name: str, suffix: str = "") -> dict:
        return {tuple(sorted((k, v) for k, v in s.labels.items() if k != "scheduler")): s.value
                for s in fams[f"dask_tangram_{name}"].samples
                if s.name == f"dask_tangram_{name}{suffix}" and s.labels["scheduler"] == me}

    assert samples("actions") == {(("kind", a["kind"]), ("resource", a["resource"]), ("state", a["state"])):
                                  a["count"] for a in st["actions"]}
    assert samples("actions") == {(("kind", "hold"), ("resource", "cpu"), ("state", "pending")): 2,
                                  (("kind", "hold"), ("resource", "cpu"), ("state", "running")): 1}
    for p in st["policy"]["pools"]:
        lab = (("pool", p["pool"] or p["resource"]), ("resource", p["resource"]))
        assert samples("units_capacity")[lab] == p["capacity"]
        assert samples("units_free")[lab] == p["free"]
        assert samples("units_in_use")[lab] == p["capacity"] - p["free"]
        assert samples("queued_actions")[lab] == p["queued"]
    cpu = (("pool", "cpu"), ("resource", "cpu"))
    assert (samples("units_in_use")[cpu], samples("queued_actions")[cpu]) == (2, 2)
    totals = st["act"]["totals"]
    for kind, t in totals.items():
        lab = (("kind", kind), ("resource", t["resource"]))
        assert samples("act_seconds", "_count")[lab] == t["finished"]
        assert samples("act_seconds", "_sum")[lab] == pytest.approx(t["act_sum_s"])
        assert samples("actions_submitted", "_total")[lab] == t["submitted"]
        assert samples("actions_finished", "_total")[(*lab[:1], ("outcome", "ok"), *lab[1:])] == t["finished"]
        buckets = {dict(k)["le"]: v for k, v in samples("act_seconds", "_bucket").items() if dict(k)["kind"] == kind}
        assert len(buckets) == len(ACT_BUCKETS) + 1 and buckets["+Inf"] == t["finished"]
    assert {k: totals[k]["finished"] for k in ("code_exec", "rm_score", "web_search")} == \
        {"code_exec": 6, "rm_score": 3, "web_search": 3}
    c = st["counters"]
    assert samples("placements", "_total")[()] == c["placements"] >= 13
    assert samples("admission_queue")[()] == st["policy"]["admission_queue"]
    assert samples("admissions", "_total")[()] == c["admissions"]
    assert samples("admission_wait_seconds", "_total")[()] == pytest.approx(c["admission_wait_s"])
    assert samples("unplaceable_actions")[()] == sum(u["count"] for u in st["policy"]["unplaceable"])
    assert samples("gpu_waiting_actions") == {(("model", w["model"]), ("reason", w["reason"])): w["count"]
                                              for w in st["policy"]["gpu_waiting"]}
    assert samples("model_loads", "_total") == {(("model", m),): v for m, v in c["loads"].items()}
    ev.set()
    client.gather(holds)


def _set_status(status: str, dask_worker=None) -> None:
    from distributed.core import Status
    dask_worker.status = Status[status]  # what the memory monitor does


def test_a_paused_worker_and_a_broken_model_are_exported(env):
    """While Dask has the GPU worker paused, the scheduler exports it (paused_workers 1) and the model whose
    only replica is there waits for the reason "paused"; a model the policy refuses shows in broken_models."""
    client, plugin, url = env

    def scrape() -> dict:
        fams = families(get(f"{url}/metrics").decode())
        return {"paused": fams["dask_tangram_paused_workers"].samples[0].value,
                "waiting": {(s.labels["model"], s.labels["reason"]): s.value
                            for s in fams["dask_tangram_gpu_waiting_actions"].samples},
                "broken": {s.labels["model"]: s.value for s in fams["dask_tangram_broken_models"].samples}}

    gpu = next(a for a, w in client.scheduler_info()["workers"].items() if w["name"] == "gpu-0")
    with tangram_dask.action(kind="rm_score", resource="gpu", model="rm-a", units=1, hint_s=0.05):
        client.submit(work, 0.05, pure=False).result(timeout=30)  # a replica of rm-a on gpu-0
    assert scrape()["paused"] == 0
    client.run(_set_status, "paused", workers=[gpu])
    try:
        deadline = time.monotonic() + 20
        while not plugin.policy.cordoned():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with tangram_dask.action(kind="rm_score", resource="gpu", model="rm-a", units=1, hint_s=0.05):
            waits = client.submit(work, 0.05, pure=False)
        plugin.scheduler.loop.add_callback(plugin.policy.model_broken, "rm-gone", "rm-gone is broken")
        deadline = time.monotonic() + 20
        while (got := scrape())["waiting"] != {("rm-a", "paused"): 1} or got["broken"] != {"rm-gone": 1}:
            assert time.monotonic() < deadline, got
            time.sleep(0.3)
        assert got["paused"] == 1 and not waits.done()
    finally:
        client.run(_set_status, "running", workers=[gpu])
    assert waits.result(timeout=30) == 0.05  # it runs once the worker runs again
    plugin.scheduler.loop.add_callback(plugin.policy.model_mended, "rm-gone")
    deadline = time.monotonic() + 20
    while (got := scrape())["paused"] != 0 or got["broken"]:
        assert time.monotonic() < deadline, got
        time.sleep(0.3)


def test_workers_export_their_sandbox_pools(env):
    client, plugin, url = env
    info = client.scheduler_info()["workers"]
    for addr, w in info.items():
        port = w["services"]["dashboard"]
        host = addr.split("://")[1].rsplit(":", 1)[0]
        fams = families(get(f"http://{host}:{port}/metrics").decode())
        deadline = time.monotonic() + 30
        while fams["dask_tangram_sandbox_starts"].samples[0].value < 1:  # the pool warms up after setup returns
            assert time.monotonic() < deadline, "no sandbox start counted in 30 s"
            time.sleep(0.2)
            fams = families(get(f"http://{host}:{port}/metrics").decode())
        for name, kind in WORKER_FAMILIES.items():
            f = fams.get(f"dask_tangram_{name}")
            assert f is not None and f.type == kind, (addr, name)
            assert [s.labels["worker"] for s in f.samples if not s.name.endswith("_created")] == [addr]
        assert fams["dask_tangram_sandbox_size"].samples[0].value == 2
        assert fams["dask_tangram_sandbox_starts"].samples[0].value >= 1
    st = json.loads(get(url + "/tangram/state.json"))  # the same pools, through the workers' heartbeats
    deadline = time.monotonic() + 10
    while len(st["sandboxes"]) < 2:
        assert time.monotonic() < deadline, st["sandboxes"]
        time.sleep(0.3)
        st = json.loads(get(url + "/tangram/state.json"))
    assert all(s["size"] == 2 for s in st["sandboxes"].values())


def test_register_plugin_on_a_running_scheduler_adds_the_page(monkeypatch):
    """``client.register_plugin``: the page arrives after the Bokeh server was built, and is listed."""
    from distributed.dashboard import scheduler as dashboard_apps

    # an earlier test in this process may have imported the preload, which registers the page for every
    # Scheduler built afterwards: this one must be built without it
    monkeypatch.setattr(dashboard_apps, "applications",
                        {k: v for k, v in dashboard_apps.applications.items() if "tangram" not in k})

    async def main() -> None:
        http = AsyncHTTPClient()
        async with Scheduler(dashboard_address="127.0.0.1:0", port=0) as s, \
                Client(s.address, asynchronous=True) as c:
            base = f"http://127.0.0.1:{s.http_server.port}"
            before = json.loads((await http.fetch(base + "/individual-plots.json")).body)
            await c.register_plugin(TangramSchedulerPlugin(api_tokens=4))
            plots = json.loads((await http.fetch(base + "/individual-plots.json")).body)
            assert set(plots.values()) - set(before.values()) >= {"/individual-tangram-act",
                                                                  "/individual-tangram-pools"}
            assert set(before.values()) <= set(plots.values())
            st = json.loads((await http.fetch(base + "/tangram/state.json")).body)
            assert [p["capacity"] for p in st["policy"]["pools"] if p["resource"] == "api"] == [4]
            page = (await http.fetch(base + "/tangram")).body.decode()
            assert page.count("data-root-id") >= 7  # the seven plots of the template
            status = (await http.fetch(base + "/status")).body.decode()
            assert 'href="tangram"' in status
    asyncio.run(main())


def test_register_plugin_counts_every_submission():
    """``client.register_plugin`` starts the plugin before adding it, so the monitor its start adds sees each
    transition before the plugin does: the submissions were counted from the plugin's ``arrived``, set only
    later in the same transition, and ``actions_submitted_total`` stayed at 0 while 5 actions finished."""
    from tangram_dask.dashboard import find_view

    async def main() -> None:
        async with Scheduler(dashboard_address="127.0.0.1:0", port=0) as s, \
                Worker(s.address, nthreads=2, resources={"slots": 2}), \
                Client(s.address, asynchronous=True) as c:
            await c.register_plugin(TangramSchedulerPlugin())
            with tangram_dask.action(kind="counted", resource="cpu", units=1, hint_s=0.01):
                futs = [c.submit(work, 0.01, pure=False) for _ in range(5)]
            assert await c.gather(futs) == [0.01] * 5
            t = find_view(s).state(fresh=True)["act"]["totals"]["counted"]
            assert (t["submitted"], t["finished"], t["failed"]) == (5, 5, 0)
    asyncio.run(main())


def _boom(x: float) -> float:
    raise ValueError("boom")


def test_an_action_whose_dependency_erred_is_not_shown_waiting():
    """Dask errs a task whose dependency erred straight from ``waiting``; its action never arrived, and its
    record stayed: the page and ``dask_tangram_actions{state="waiting"}`` counted it for as long as its
    future was held."""
    from tangram_dask.dashboard import find_view

    async def main() -> None:
        async with Scheduler(dashboard_address="127.0.0.1:0", port=0, plugins=[TangramSchedulerPlugin()]) as s, \
                Worker(s.address, nthreads=2, resources={"slots": 2}), \
                Client(s.address, asynchronous=True) as c:
            with tangram_dask.action(kind="first", resource="cpu", units=1, hint_s=0.01):
                a = c.submit(_boom, 1.0, pure=False)
            with tangram_dask.action(kind="second", resource="cpu", units=1, hint_s=0.01):
                bs = [c.submit(work, a, pure=False) for _ in range(3)]
            for b in bs:
                with pytest.raises(ValueError):
                    await b
            assert [s.tasks[b.key].state for b in bs] == ["erred"] * 3
            assert find_view(s).state(fresh=True)["actions"] == []
            assert not s.plugins["tangram"].actions
    asyncio.run(main())


def test_a_departed_workers_series_leave_with_it():
    """``sandbox_cold_starts_total{worker}`` and ``model_evictions_total{worker}`` kept a series for every worker
    that ever joined: under ``cluster.adapt()`` each new worker is a new address, so the label set (and the
    monitor's counters) grew for as long as the scheduler ran. A worker's series go when it leaves."""
    from tangram_dask.dashboard import find_view

    async def main() -> None:
        async with Scheduler(dashboard_address="127.0.0.1:0", port=0, plugins=[TangramSchedulerPlugin()]) as s, \
                Client(s.address, asynchronous=True) as c:
            seen = set()
            for i in range(3):  # three workers in turn, as adapt makes them
                async with Worker(s.address, nthreads=2, resources={"slots": 2}) as w:
                    with tangram_dask.action(kind="step", resource="cpu", units=1, hint_s=0.01):
                        await c.submit(work, 0.01, pure=False)
                    mon = find_view(s).monitor
                    mon.counters.cold_starts[w.address] = mon.counters.evictions[w.address] = 1  # as _placed counts
                    find_view(s).state(fresh=True)  # (a scrape reuses a build for 0.9 s)
                    fams = families(prometheus_client.generate_latest().decode())
                    assert {x.labels["worker"] for x in fams["dask_tangram_sandbox_cold_starts"].samples
                            if x.labels["scheduler"] == s.address} == {w.address}
                    seen.add(w.address)
                while w.address in s.workers:
                    await asyncio.sleep(0.01)
            find_view(s).state(fresh=True)
            fams = families(prometheus_client.generate_latest().decode())
            left = {x.labels["worker"] for name in ("sandbox_cold_starts", "model_evictions")
                    for x in fams[f"dask_tangram_{name}"].samples if x.labels["scheduler"] == s.address}
            assert not left & seen, left
            assert not mon.counters.cold_starts and not mon.counters.evictions
    asyncio.run(main())


def _scheduler_with_tokens(tokens: int) -> Scheduler:
    return Scheduler(dashboard_address="127.0.0.1:0", port=0, plugins=[TangramSchedulerPlugin(api_tokens=tokens)])


def test_several_schedulers_in_one_process_do_not_collide():
    async def main() -> None:
        http = AsyncHTTPClient()
        async with _scheduler_with_tokens(3) as a, _scheduler_with_tokens(5) as b:
            for s in (a, b):
                text = (await http.fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")).body.decode()
                free = {x.labels["scheduler"]: x.value for x in families(text)["dask_tangram_units_free"].samples
                        if x.labels["resource"] == "api"}
                assert (free[a.address], free[b.address]) == (3, 5)  # (a module's cluster may be there too)
            await b.close()
            text = prometheus_client.generate_latest().decode()
            free = [x.labels["scheduler"] for x in families(text)["dask_tangram_units_free"].samples]
            assert a.address in free and b.address not in free  # b's collector left with b
        text = prometheus_client.generate_latest().decode()
        assert a.address not in text and b.address not in text
    asyncio.run(main())


def test_a_collector_that_raises_leaves_the_rest_of_metrics(caplog):
    """One collector's bug (here: a's, made to raise) cost the whole /metrics page, Dask's own metrics
    included, of every scheduler in the process; now its families alone are missing, and it is logged."""
    from tangram_dask.dashboard import metrics

    async def main() -> None:
        http = AsyncHTTPClient()
        async with _scheduler_with_tokens(3) as a, _scheduler_with_tokens(5) as b:
            broken = [c for c in (r() for r in metrics._hub.collectors) if c is not None and c.server is a]
            assert broken

            def collect():
                raise RuntimeError("a collector's bug")
                yield

            for c in broken:
                c.collect = collect
            for _ in range(2):
                for s in (a, b):
                    text = (await http.fetch(f"http://127.0.0.1:{s.http_server.port}/metrics")).body.decode()
                    assert "dask_scheduler_workers" in {f.name for f in text_string_to_metric_families(text)}
                    fams = families(text)
                    free = {x.labels["scheduler"] for x in fams["dask_tangram_units_free"].samples}
                    assert b.address in free and a.address not in free
            logged = [r for r in caplog.records if "could not be collected" in r.getMessage()]
            assert logged and logged[0].exc_info and "a collector's bug" in str(logged[0].exc_info[1])
            assert a.address in logged[0].getMessage()
            assert sum(r.levelname == "WARNING" for r in logged) == 1  # once with its trace, not every scrape
    with caplog.at_level(logging.DEBUG, logger="tangram_dask.dashboard.metrics"):
        asyncio.run(main())


# -- the aggregator -----------------------------------------------------------------------------------
def test_act_stats_are_bounded_and_exact_where_they_can_be():
    s = ActStats(window_s=1.0, windows=3, max_kinds=2)
    for i in range(100):  # 100 finishes in window [0, 1): ACT 1..100 ms
        s.submit("a", "cpu")
        s.finish("a", "cpu", (i + 1) / 1000, now=0.5)
    ser = s.series()["a"]
    assert ser["count"] == [100] and ser["mean_s"] == [pytest.approx(0.0505)]
    assert 0.099 / 1.2 <= ser["p99_s"][0] <= 0.1 * 1.2  # within one fine bucket (ratio 1.2)
    for t in range(1, 10):
        s.finish("a", "cpu", 0.2, now=t + 0.5)
    assert len(s.windows) == 3 and s.series()["a"]["t"] == [7.0, 8.0, 9.0]  # fixed windows, the last 3
    tot = s.totals()["a"]
    assert (tot["submitted"], tot["finished"], tot["failed"]) == (100, 109, 0)
    assert dict((str(le), n) for le, n in tot["act_buckets"])["0.05"] == 50 and tot["act_buckets"][-1] == ["+Inf", 109]
    s.finish("b", "gpu", 1.0, now=9.5, ok=False)
    s.finish("c", "api", 1.0, now=9.5)  # a third kind is counted as "other"
    assert set(s.totals()) == {"a", "b", "other"} and s.totals()["b"]["failed"] == 1
    with pytest.raises(ValueError):
        ActStats(window_s=0)


def test_an_absurd_hint_is_counted_exported_and_logged(env, caplog):
    """Eight code runs hinted 0.05 s, then one hinted 1e9 s (milliseconds sent for seconds, say): the policy counts it
    as far less (docs/scheduling.md, "An absurd hint is bounded"), exports the count per kind, and says so once in
    the scheduler's log, naming the kind and the hint."""
    client, plugin, url = env
    with tangram_dask.action(kind="slip_exec", resource="cpu", units=1, hint_s=0.05):
        client.gather([client.submit(work, 0.01, pure=False) for _ in range(8)])
    with caplog.at_level("WARNING", logger="tangram_dask.scheduler"):
        with tangram_dask.action(kind="slip_exec", resource="cpu", units=1, hint_s=1e9):
            assert client.submit(work, 0.01, pure=False).result(timeout=30) == 0.01
        deadline = time.monotonic() + 20
        while not (got := {s.labels["kind"]: s.value for s in
                           families(get(f"{url}/metrics").decode())["dask_tangram_hints_bounded"].samples
                           if s.name.endswith("_total")}).get("slip_exec"):
            assert time.monotonic() < deadline, got
            time.sleep(0.3)
        assert got["slip_exec"] == 1
        plugin.scheduler.loop.add_callback(plugin._watch_unplaceable)
        deadline = time.monotonic() + 20
        while not [r for r in caplog.records if "slip_exec" in r.getMessage()]:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    (rec,) = [r for r in caplog.records if "slip_exec" in r.getMessage()]
    print(rec.getMessage())
    assert "1e+09 s" in rec.getMessage() and "hints_bounded" in rec.getMessage()
