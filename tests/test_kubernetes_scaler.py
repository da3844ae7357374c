"""tangram-dask k8s-scale and the dask-kubernetes operator's own code, against a real scheduler.

Real: a LocalCluster (worker processes) whose scheduler runs the tangram plugin; the
operator's ``get_desired_workers`` and ``retire_workers`` (dask_kubernetes.operator.controller),
unchanged; kr8s, which the scaler talks to Kubernetes through.

Stand-ins, because no Kubernetes API server can run here:
- ``FakeKubernetesAPI``: a small aiohttp server answering the few Kubernetes API calls the
  scaler makes (list DaskWorkerGroups and DaskAutoscalers, PATCH a group's ``scale``
  subresource, PATCH its annotations) and recording them. It is not Kubernetes: it neither
  validates nor reconciles (no operator creates or deletes pods from it).
- the operator's ``get_scheduler_address`` (a Service lookup through the API server) is
  replaced by the LocalCluster's own addresses.
"""

from __future__ import annotations

import asyncio
import logging
import time

import dask
import pytest
from distributed import Client, Event, LocalCluster

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.k8s import COOLDOWN_ANNOTATION, bounds_of, kind_of_group, plan_scale, scale_once

aiohttp_web = pytest.importorskip("aiohttp.web")
kr8s = pytest.importorskip("kr8s")

# name, (current, target, minimum, maximum, now, cooldown_until), desired
PLANS = [
    ("up to the target", (1, 4, 0, 10, 100.0, 0.0), 4),
    ("clamped to the maximum", (1, 40, 0, 6, 100.0, 0.0), 6),
    ("clamped to the minimum", (3, 0, 2, 6, 100.0, 0.0), 2),
    ("down by at most a quarter", (8, 0, 0, 10, 100.0, 0.0), 6),
    ("down by at least one", (2, 0, 0, 10, 100.0, 0.0), 1),
    ("from zero, straight to the target", (0, 3, 0, 10, 100.0, 0.0), 3),
    ("cooldown holds", (1, 4, 0, 10, 100.0, 110.0), 1),
    ("cooldown over", (1, 4, 0, 10, 120.0, 110.0), 4),
    ("same", (3, 3, 0, 10, 100.0, 0.0), 3),
]


@pytest.mark.parametrize("name,args,desired", PLANS, ids=[p[0] for p in PLANS])
def test_plan_scale_follows_the_operators_rules(name, args, desired):
    current, target, lo, hi, now, cool = args
    p = plan_scale("g", "k", current, target, lo, hi, now, cool)
    assert p.desired == desired, p
    assert p.changes == (desired != current)


def test_bounds_and_group_kinds():
    assert bounds_of({}, 1, 8) == (1, 8)
    assert bounds_of({"tangram.dask.org/minimum": "0", "tangram.dask.org/maximum": "3"}, 1, 8) == (0, 3)
    with pytest.raises(ValueError, match="minimum <= maximum"):
        bounds_of({"tangram.dask.org/minimum": "5", "tangram.dask.org/maximum": "3"}, 1, 8)
    with pytest.raises(ValueError, match="tangram.dask.org/maximum='four' is not a whole number"):
        bounds_of({"tangram.dask.org/maximum": "four"}, 1, 8)
    kinds = {"cpu": {"group": "t-default"}, "gpu": {"group": "t-gpu"}}
    assert kind_of_group("t-default", {}, kinds) == "cpu"
    assert kind_of_group("other", {"tangram.dask.org/kind": "gpu"}, kinds) == "gpu"
    assert kind_of_group("other", {}, kinds) is None
    assert kind_of_group("other", {"tangram.dask.org/kind": "tpu"}, kinds) is None


class FakeKubernetesAPI:
    """A stand-in for the Kubernetes API server (see the module docstring): DaskWorkerGroups in memory."""

    def __init__(self, groups: dict[str, dict], autoscalers: list[dict] | None = None):
        self.groups = groups
        self.autoscalers = autoscalers or []
        self.calls: list[tuple[str, str, dict | None]] = []
        app = aiohttp_web.Application()
        base = "/apis/kubernetes.dask.org/v1/namespaces/{ns}"
        app.router.add_get("/version", self.version)
        app.router.add_get("/version/", self.version)
        app.router.add_get(base + "/daskworkergroups", self.list_groups)
        app.router.add_get(base + "/daskautoscalers", self.list_autoscalers)
        app.router.add_patch(base + "/daskworkergroups/{name}/scale", self.patch_scale)
        app.router.add_patch(base + "/daskworkergroups/{name}", self.patch_group)
        self.runner = aiohttp_web.AppRunner(app)
        self.url = ""

    async def start(self) -> None:
        await self.runner.setup()
        site = aiohttp_web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        await self.runner.cleanup()

    async def version(self, request):
        return aiohttp_web.json_response({"major": "1", "minor": "30", "gitVersion": "v1.30.0"})

    async def list_groups(self, request):
        self.calls.append(("GET", request.path_qs, None))
        sel = request.query.get("labelSelector", "")
        items = [g for g in self.groups.values()
                 if all(g["metadata"].get("labels", {}).get(k) == v
                        for k, v in (p.split("=") for p in sel.split(",") if p))]
        return aiohttp_web.json_response({"kind": "DaskWorkerGroupList", "items": items})

    async def list_autoscalers(self, request):
        self.calls.append(("GET", request.path_qs, None))
        return aiohttp_web.json_response({"kind": "DaskAutoscalerList", "items": self.autoscalers})

    async def patch_scale(self, request):
        assert request.content_type == "application/merge-patch+json", request.content_type
        body = await request.json()
        name = request.match_info["name"]
        self.calls.append(("PATCH", request.path, body))
        g = self.groups[name]
        g["spec"]["worker"]["replicas"] = int(body["spec"]["replicas"])
        return aiohttp_web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                          "metadata": {"name": name}, "spec": body["spec"]})

    async def patch_group(self, request):
        body = await request.json()
        name = request.match_info["name"]
        self.calls.append(("PATCH", request.path, body))
        ann = self.groups[name]["metadata"].setdefault("annotations", {})
        ann.update(body.get("metadata", {}).get("annotations", {}))
        return aiohttp_web.json_response(self.groups[name])


def group(name: str, replicas: int, annotations: dict | None = None) -> dict:
    return {"apiVersion": "kubernetes.dask.org/v1", "kind": "DaskWorkerGroup",
            "metadata": {"name": name, "namespace": "ns", "labels": {"dask.org/cluster-name": "tangram"},
                         "annotations": dict(annotations or {})},
            "spec": {"cluster": "tangram", "worker": {"replicas": replicas, "spec": {"containers": []}}}}


KINDS = [{"name": "cpu", "slots": 1, "group": "tangram-default"},
         {"name": "gpu", "gpus": 1, "gpu-memory-gb": 24, "group": "tangram-gpu"}]
ROUTES = ["distributed.http.scheduler.api", "distributed.http.health"]


def hold(name: str) -> str:
    Event(name).wait(60)
    return "done"


async def wait_for(pred, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _scenario(monkeypatch) -> None:
    from dask_kubernetes.operator.controller import controller

    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0, models={"rm": ModelSpec("rm", 16, 0.5)})
    fake = FakeKubernetesAPI({"tangram-default": group("tangram-default", 2),
                              "tangram-gpu": group("tangram-gpu", 0, {"tangram.dask.org/kind": "gpu",
                                                                      "tangram.dask.org/maximum": "2"})})
    await fake.start()
    try:
        async with LocalCluster(n_workers=2, threads_per_worker=1, resources={"slots": 1}, processes=True,
                                dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]},
                                asynchronous=True) as cluster, \
                Client(cluster, asynchronous=True) as client:
            sched = cluster.scheduler
            http = f"http://127.0.0.1:{sched.http_server.port}"

            async def addresses(service_name, namespace, port_name="tcp-comm", **kw):  # the Service lookup
                assert service_name == "tangram-scheduler"
                return http if port_name == "http-dashboard" else sched.address

            monkeypatch.setattr(controller, "get_scheduler_address", addresses)
            # 5 GPU actions and no GPU worker; nothing else waits
            with tangram_dask.action(kind="score", resource="gpu", units=1, hint_s=1.0, model="rm"):
                gpu = [client.submit(hold, "never", pure=False) for _ in range(5)]
            await client.scheduler.tangram_targets()  # an autoscaler is watching
            await wait_for(lambda: len(plugin.policy.snapshot().unplaceable) == 5, what="5 unplaceable")

            # the operator's own code reads the total from /api/v1/adaptive_target of this scheduler
            desired = await controller.get_desired_workers("tangram-scheduler", "ns")
            assert desired == await client.scheduler.adaptive_target() == sched.adaptive_target() == 1

            api = await kr8s.asyncio.api(url=fake.url)
            t0 = time.time()
            plans = {p.group: p for p in await scale_once(api, "tangram", "ns", sched.address, minimum=1,
                                                          maximum=10)}
            assert plans["tangram-gpu"].desired == 1  # GPU demand grows the GPU group
            assert plans["tangram-default"].desired == 1  # and not the CPU one: down to its minimum
            patches = [(p, b) for m, p, b in fake.calls if m == "PATCH" and p.endswith("/scale")]
            assert sorted(patches, key=lambda pb: pb[0]) == [
                ("/apis/kubernetes.dask.org/v1/namespaces/ns/daskworkergroups/tangram-default/scale",
                 {"spec": {"replicas": 1}}),
                ("/apis/kubernetes.dask.org/v1/namespaces/ns/daskworkergroups/tangram-gpu/scale",
                 {"spec": {"replicas": 1}})]
            for g in fake.groups.values():
                assert float(g["metadata"]["annotations"][COOLDOWN_ANNOTATION]) >= t0 + 15
            # the scaler drained one CPU worker before lowering the group; the operator's retirement
            # (its /api/v1/retire_workers call) retires exactly that one
            ext = sched.plugins["tangram-adaptive"]
            reserved = set(ext.reserved)
            assert len(reserved) == 1
            drained = [str(sched.workers[a].name) for a in reserved]
            names = await controller.retire_workers(1, "tangram-scheduler", "tangram-default", "ns",
                                                    logging.getLogger("test"))
            assert [str(n) for n in names] == drained
            await wait_for(lambda: not (reserved & set(sched.workers)), what="the drained worker to leave")
            assert len(sched.workers) == 1

            # a second pass inside the cooldown changes nothing
            n = len(fake.calls)
            plans = await scale_once(api, "tangram", "ns", sched.address, minimum=1, maximum=10)
            assert all(not p.changes and "cooldown" in p.reason for p in plans)
            assert not [c for c in fake.calls[n:] if c[0] == "PATCH"]

            # a DaskAutoscaler on the cluster: the default group is left to the operator
            fake.autoscalers.append({"spec": {"cluster": "tangram", "minimum": 1, "maximum": 4}})
            for g in fake.groups.values():
                g["metadata"]["annotations"].pop(COOLDOWN_ANNOTATION)
            plans = await scale_once(api, "tangram", "ns", sched.address, minimum=1, maximum=10)
            assert [p.group for p in plans] == ["tangram-gpu"]

            # a group with a bad annotation is left as it is, named in the log; the others are scaled (before
            # session 31 int("four") failed every pass, so no group was ever scaled again)
            fake.autoscalers.clear()
            for g in fake.groups.values():
                g["metadata"]["annotations"].pop(COOLDOWN_ANNOTATION, None)
            fake.groups["tangram-gpu"]["metadata"]["annotations"]["tangram.dask.org/maximum"] = "four"
            plans = await scale_once(api, "tangram", "ns", sched.address, minimum=1, maximum=10)
            assert [p.group for p in plans] == ["tangram-default"]
            await client.cancel(gpu)
    finally:
        await fake.stop()


def test_scaler_sizes_each_group_per_kind_and_the_operator_reads_and_retires(monkeypatch):
    with dask.config.set({"distributed.scheduler.http.routes": ROUTES, "tangram.adaptive.kinds": KINDS}):
        asyncio.run(asyncio.wait_for(_scenario(monkeypatch), 120))


def test_the_cli_has_k8s_scale():
    from click.testing import CliRunner

    from tangram_dask import cli

    r = CliRunner().invoke(cli.cli, ["k8s-scale", "--help"])
    assert r.exit_code == 0, r.output
    assert "--cluster" in r.output and "--once" in r.output
    r = CliRunner().invoke(cli.cli, ["k8s-scale"])
    assert r.exit_code == 2 and "--cluster" in r.output  # required
