"""Kubernetes: the manifests checked against the operator's CRDs, and what k8s-scale would do with them.

    pip install "tangram-dask[kubernetes]"
    python examples/kubernetes.py                      # no Kubernetes needed: a dry run
    python examples/kubernetes.py --api http://127.0.0.1:8001  # apply it through an API (`kubectl proxy`)

1. Every custom resource in resources/kubernetes/ (DaskCluster, DaskWorkerGroup,
   DaskAutoscaler) is validated against the ``openAPIV3Schema`` of the CRDs the
   dask-kubernetes operator installs (shipped in its wheel).
2. A LocalCluster stands in for the pods: its scheduler gets the dask config
   that cluster.yaml's scheduler container sets through its environment (the
   worker kinds, wait-for-capacity, the models), and one worker with the
   default group's ``--resources slots=4``.
3. Five GPU actions arrive, and there is no GPU worker: the scheduler's
   per-kind targets (what ``tangram-dask k8s-scale`` reads) ask for one GPU
   worker, and ``plan_scale`` (the operator's own rules) sizes each group of
   the manifests. With ``--api`` the same pass (``tangram_dask.k8s.scale_once``)
   patches the groups' ``scale`` subresources there.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import dask
import yaml
from distributed import Client, Event, LocalCluster

import tangram_dask
from tangram_dask import k8s

MANIFESTS = Path(__file__).resolve().parents[1] / "resources" / "kubernetes"


def manifests() -> list[dict]:
    return [d for p in sorted(MANIFESTS.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def check_against_crds(docs: list[dict]) -> None:
    import dask_kubernetes
    import jsonschema

    crds = Path(dask_kubernetes.__file__).parent / "operator/deployment/helm/dask-kubernetes-operator/crds"
    schemas = {}
    for p in crds.glob("*.yaml"):
        crd = yaml.safe_load(p.read_text())
        served = next(v for v in crd["spec"]["versions"] if v["served"])
        schemas[crd["spec"]["names"]["kind"]] = served["schema"]["openAPIV3Schema"]
    for d in docs:
        if d["apiVersion"] == k8s.API_VERSION:
            body = {k: v for k, v in d.items() if k not in ("apiVersion", "kind", "metadata")}
            jsonschema.validate(body, schemas[d["kind"]])  # raises, naming the field, if it does not match
            print(f"{d['kind']}/{d['metadata']['name']}: valid against the operator's CRD")


def scheduler_config(cluster: dict) -> dict:
    """The dask config cluster.yaml's scheduler container sets through DASK_* variables."""
    (container,) = cluster["spec"]["scheduler"]["spec"]["containers"]
    nested = dask.config.collect_env({e["name"]: e["value"] for e in container["env"]})

    def dotted(d: dict, prefix: str = "") -> dict:  # dask.config.set replaces a whole top-level dict
        return {k2: v2 for k, v in d.items()
                for k2, v2 in (dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}).items()}
    return dotted(nested)


def worker_groups(docs: list[dict]) -> list[dict]:
    """The DaskWorkerGroups the operator would hold: the cluster's default group and the others."""
    (cluster,) = [d for d in docs if d["kind"] == "DaskCluster"]
    name = cluster["metadata"]["name"]
    default = {"apiVersion": k8s.API_VERSION, "kind": "DaskWorkerGroup",
               "metadata": {"name": f"{name}-default", "labels": {"dask.org/cluster-name": name}},
               "spec": {"cluster": name, "worker": cluster["spec"]["worker"]}}
    return [default] + [d for d in docs if d["kind"] == "DaskWorkerGroup"]


def hold(name: str) -> None:
    Event(name).wait()


async def apply(api_url: str, cluster: str, scheduler: str) -> list[k8s.ScalePlan]:
    import kr8s.asyncio

    api = await kr8s.asyncio.api(url=api_url)
    return await k8s.scale_once(api, cluster, "default", scheduler, minimum=1, maximum=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--api", default=None, help="a Kubernetes API URL to apply the pass to (default: dry run)")
    args = ap.parse_args()
    docs = manifests()
    check_against_crds(docs)
    (cluster_doc,) = [d for d in docs if d["kind"] == "DaskCluster"]
    name = cluster_doc["metadata"]["name"]

    with dask.config.set(scheduler_config(cluster_doc)), \
            LocalCluster(n_workers=1, threads_per_worker=4, resources={"slots": 4}, dashboard_address=":0",
                         scheduler_kwargs={"plugins": [tangram_dask.TangramSchedulerPlugin()]}) as cluster, \
            Client(cluster) as client:
        with tangram_dask.action(kind="score", resource="gpu", model="rm-small", hint_s=1.0):
            waiting = [client.submit(hold, "never", pure=False) for _ in range(5)]
        deadline = time.monotonic() + 60
        while (targets := client.sync(k8s.read_targets, cluster.scheduler_address))["kinds"]["gpu"]["target"] < 1:
            assert time.monotonic() < deadline, targets
            time.sleep(0.1)
        for kind, t in targets["kinds"].items():
            print(f"kind {kind}: {t['current']} now, target {t['target']} ({t['why']})")

        for g in worker_groups(docs):
            meta = g["metadata"]
            kind = k8s.kind_of_group(meta["name"], meta.get("annotations", {}), targets["kinds"])
            lo, hi = k8s.bounds_of(meta.get("annotations", {}), 1, 10)
            plan = k8s.plan_scale(meta["name"], kind, g["spec"]["worker"]["replicas"],
                                  targets["kinds"][kind]["target"], lo, hi, now=time.time())
            print(f"group {plan.group} ({plan.kind}): {plan.current} -> {plan.desired} replicas: {plan.reason}")
        if args.api:
            for plan in asyncio.run(apply(args.api, name, cluster.scheduler_address)):
                print(f"applied {plan.group}: {plan.current} -> {plan.desired}")
        client.cancel(waiting)


if __name__ == "__main__":
    main()
