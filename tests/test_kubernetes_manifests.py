"""resources/kubernetes/ validated against the CRD schemas shipped in the dask-kubernetes wheel and
against Kubernetes' own schemas (kubernetes-validate), and checked for what the tangram pieces need.

No Kubernetes API server runs here: nothing is applied. The custom resources (DaskCluster,
DaskWorkerGroup, DaskAutoscaler) are checked against the ``openAPIV3Schema`` of the resolved CRDs
in dask-kubernetes' Helm chart (the ones an operator install applies); the pod specs inside them
and the plain resources (ServiceAccount, Role, RoleBinding, Deployment) against Kubernetes'
OpenAPI schemas in strict mode (an unknown field is an error).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml
from conftest import stop_workers_then_scheduler

jsonschema = pytest.importorskip("jsonschema")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
dask_kubernetes = pytest.importorskip("dask_kubernetes")

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "resources" / "kubernetes"
CRDS = Path(dask_kubernetes.__file__).parent / "operator" / "deployment" / "helm" / "dask-kubernetes-operator" / "crds"
K8S_VERSION = "1.30"  # the AppArmor annotation is read as securityContext.appArmorProfile from 1.30


def docs() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for d in yaml.safe_load_all(path.read_text()):
            if d:
                out.append((f"{path.name}:{d['kind']}/{d['metadata']['name']}", d))
    return out


DOCS = docs()
BY_KIND: dict[str, list[dict]] = {}
for _, _d in DOCS:
    BY_KIND.setdefault(_d["kind"], []).append(_d)


def closed(schema):
    """The schema as an API server reads a custom resource: a field the schema does not name is not kept
    (structural pruning; ``kubectl apply``'s default strict field validation refuses it), so here it is
    an error, except under ``x-kubernetes-preserve-unknown-fields``. The operator's schemas never say
    ``additionalProperties: false``, and plain JSON Schema would accept any misspelt field."""
    if not isinstance(schema, dict):
        return schema
    s = dict(schema)
    if "properties" in s:
        s["properties"] = {k: closed(v) for k, v in s["properties"].items()}
        if not s.get("x-kubernetes-preserve-unknown-fields") and "additionalProperties" not in s:
            s["additionalProperties"] = False
    if isinstance(s.get("items"), dict):
        s["items"] = closed(s["items"])
    if isinstance(s.get("additionalProperties"), dict):
        s["additionalProperties"] = closed(s["additionalProperties"])
    return s


def crd_schemas() -> dict[str, dict]:
    out = {}
    for path in CRDS.glob("*.yaml"):
        crd = yaml.safe_load(path.read_text())
        kind = crd["spec"]["names"]["kind"]
        version = next(v for v in crd["spec"]["versions"] if v["served"])
        out[kind] = closed(version["schema"]["openAPIV3Schema"])
    return out


SCHEMAS = crd_schemas()
CUSTOM = [(n, d) for n, d in DOCS if d["apiVersion"].startswith("kubernetes.dask.org/")]
NATIVE = [(n, d) for n, d in DOCS if not d["apiVersion"].startswith("kubernetes.dask.org/")]


def test_every_piece_is_there():
    assert {"DaskCluster", "DaskWorkerGroup", "DaskAutoscaler", "Deployment", "Role", "RoleBinding",
            "ServiceAccount"} <= set(BY_KIND)
    assert {"DaskCluster", "DaskWorkerGroup", "DaskAutoscaler"} <= set(SCHEMAS)


@pytest.mark.parametrize("name,doc", CUSTOM, ids=[n for n, _ in CUSTOM])
def test_custom_resources_match_the_operators_crd_schema(name, doc):
    schema = SCHEMAS[doc["kind"]]
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind", "metadata")}
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(body), key=lambda e: list(e.path))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]


def test_the_crd_schema_check_catches_mistakes():
    """The check above is not vacuous: a misspelt or missing required field fails it."""
    wg = yaml.safe_load((MANIFESTS / "gpu-workers.yaml").read_text())
    v = jsonschema.Draft7Validator(SCHEMAS["DaskWorkerGroup"])
    bad = {"spec": {"cluster": "tangram", "worker": {"replicas": "two", "spec": wg["spec"]["worker"]["spec"]}}}
    assert list(v.iter_errors(bad))
    misspelt = {"spec": {"cluster": "tangram", "worker": {"replcas": 2, "spec": wg["spec"]["worker"]["spec"]}}}
    assert list(v.iter_errors(misspelt))  # a field the operator's schema does not have
    pod = wg["spec"]["worker"]["spec"]
    not_in_crd = {**pod, "containers": [{**pod["containers"][0], "securityContext": {"appArmorProfile": {}}}]}
    assert list(v.iter_errors({"spec": {"cluster": "tangram", "worker": {"replicas": 2, "spec": not_in_crd}}}))
    assert list(v.iter_errors({"spec": {"worker": wg["spec"]["worker"]}}))  # no cluster
    a = jsonschema.Draft7Validator(SCHEMAS["DaskAutoscaler"])
    assert list(a.iter_errors({"spec": {"cluster": "tangram", "minimum": 1}}))  # no maximum


def pod_specs() -> list[tuple[str, dict]]:
    out = []
    for name, d in CUSTOM:
        spec = d["spec"]
        if d["kind"] == "DaskCluster":
            out.append((f"{name} worker", spec["worker"]["spec"]))
            out.append((f"{name} scheduler", spec["scheduler"]["spec"]))
        elif d["kind"] == "DaskWorkerGroup":
            out.append((f"{name} worker", spec["worker"]["spec"]))
    return out


PODS = pod_specs()


@pytest.mark.parametrize("name,spec", PODS, ids=[n for n, _ in PODS])
def test_pod_specs_are_valid_kubernetes(name, spec):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "check"}, "spec": spec}
    kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


@pytest.mark.parametrize("name,doc", NATIVE, ids=[n for n, _ in NATIVE])
def test_native_resources_are_valid_kubernetes(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_kubernetes_validate_catches_mistakes():
    spec = yaml.safe_load((MANIFESTS / "gpu-workers.yaml").read_text())["spec"]["worker"]["spec"]
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
           "spec": {**spec, "containers": [{**spec["containers"][0], "securityContxt": {}}]}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", ())}


def test_the_scheduler_loads_the_plugin_and_serves_the_routes_the_operator_reads():
    cluster = BY_KIND["DaskCluster"][0]
    c = cluster["spec"]["scheduler"]["spec"]["containers"][0]
    assert c["args"][:2] == ["dask", "scheduler"] and c["args"][2:] == ["--preload", "scheduler_plugin"]
    e = env(c)
    routes = ast.literal_eval(e["DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES"])
    assert "distributed.http.scheduler.api" in routes and "distributed.http.health" in routes
    assert ast.literal_eval(e["DASK_TANGRAM__SCHEDULER__WAIT_FOR_CAPACITY"]) is True
    ports = {p["name"] for p in c["ports"]}
    assert {"tcp-comm", "http-dashboard"} <= ports  # the operator finds the scheduler by these names


def test_every_kind_names_a_worker_group_of_its_shape():
    """The kinds the scheduler is told (read as dask reads the variable) match the groups' workers."""
    import dask.config
    from tangram_dask.adaptive import WorkerKind

    cluster = BY_KIND["DaskCluster"][0]
    name = cluster["metadata"]["name"]
    c = cluster["spec"]["scheduler"]["spec"]["containers"][0]
    cfg = dask.config.collect_env({"DASK_TANGRAM__ADAPTIVE__KINDS": env(c)["DASK_TANGRAM__ADAPTIVE__KINDS"]})
    kinds = [WorkerKind.from_dict(k) for k in cfg["tangram"]["adaptive"]["kinds"]]
    groups = {f"{name}-default": cluster["spec"]["worker"]["spec"]}
    for wg in BY_KIND["DaskWorkerGroup"]:
        assert wg["spec"]["cluster"] == name
        groups[wg["metadata"]["name"]] = wg["spec"]["worker"]["spec"]
    assert {k.group for k in kinds} == set(groups)
    for k in kinds:
        w = groups[k.group]["containers"][0]
        args = w["args"]
        res = args[args.index("--resources") + 1]
        if k.gpus:
            assert res == f"gpus={k.gpus}"
            assert w["resources"]["limits"]["nvidia.com/gpu"] == str(k.gpus)
        else:
            assert res == f"slots={k.slots}"
            assert int(args[args.index("--nthreads") + 1]) >= k.slots
            assert "$(DASK_WORKER_NAME)" in args  # the operator deletes the pod by this name on retirement


def test_the_sandbox_workers_may_start_bubblewrap():
    """The worker container may create bubblewrap's namespaces: SYS_ADMIN, seccomp Unconfined, and AppArmor
    unconfined by the annotation, which the operator's own code (``build_worker_deployment_spec``) puts on
    the worker pods it makes (the DaskCluster schema has no ``appArmorProfile`` field)."""
    from dask_kubernetes.operator.controller.controller import build_worker_deployment_spec

    worker = BY_KIND["DaskCluster"][0]["spec"]["worker"]
    c = worker["spec"]["containers"][0]
    sc = c["securityContext"]
    assert "SYS_ADMIN" in sc["capabilities"]["add"] and sc["seccompProfile"]["type"] == "Unconfined"
    deployment = build_worker_deployment_spec("tangram-default", "ns", "tangram", "abc", worker["spec"],
                                              worker["metadata"]["annotations"], {})
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["annotations"][f"container.apparmor.security.beta.kubernetes.io/{c['name']}"] \
        == "unconfined"
    assert pod["spec"]["containers"][0]["securityContext"] == sc


def test_the_scaler_may_patch_the_scale_subresource_and_runs_the_cli():
    role = BY_KIND["Role"][0]
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert {("daskworkergroups/scale", "patch"), ("daskworkergroups", "list"), ("daskworkergroups", "patch"),
            ("daskautoscalers", "list")} <= granted
    dep = BY_KIND["Deployment"][0]
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["args"][:2] == ["tangram-dask", "k8s-scale"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == BY_KIND["ServiceAccount"][0]["metadata"]["name"]
    auto = BY_KIND["DaskAutoscaler"][0]
    assert auto["spec"]["cluster"] == BY_KIND["DaskCluster"][0]["metadata"]["name"]


def test_the_scheduler_and_worker_commands_of_the_manifest_run_and_serve_the_targets(tmp_path):
    """The scheduler container's command and environment from cluster.yaml, run here as a process
    (ports moved to free ones); a worker started with the CPU group's arguments joins as kind cpu."""
    import json
    import os
    import re
    import subprocess
    import sys
    import time
    import urllib.request

    cluster = BY_KIND["DaskCluster"][0]
    sc = cluster["spec"]["scheduler"]["spec"]["containers"][0]
    wc = cluster["spec"]["worker"]["spec"]["containers"][0]
    bindir = Path(sys.executable).parent
    senv = {**os.environ, **env(sc)}
    log = tmp_path / "scheduler.log"
    cmd = [str(bindir / sc["args"][0]), *sc["args"][1:], "--host", "127.0.0.1", "--port", "0",
           "--dashboard-address", "127.0.0.1:0"]
    procs = []
    with open(log, "w") as out:
        procs.append(subprocess.Popen(cmd, env=senv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT))
        try:
            deadline = time.monotonic() + 60
            text = ""
            while not (re.search(r"Scheduler at:\s+(tcp://\S+)", text)
                       and re.search(r"dashboard at:\s+\S+:(\d+)", text)):
                assert time.monotonic() < deadline and procs[0].poll() is None, text
                time.sleep(0.2)
                text = log.read_text()
            addr = re.search(r"Scheduler at:\s+(tcp://\S+)", text).group(1)
            port = re.search(r"dashboard at:\s+\S+:(\d+)", text).group(1)
            wargs = [a.replace("$(DASK_WORKER_NAME)", "tangram-default-worker-0") for a in wc["args"]]
            wargs[wargs.index("--dashboard-address") + 1] = "127.0.0.1:0"
            wenv = {**os.environ, **env(wc), "DASK_SCHEDULER_ADDRESS": addr}
            procs.append(subprocess.Popen([str(bindir / wargs[0]), *wargs[1:], addr, "--host", "127.0.0.1"],
                                          env=wenv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT))

            def get(path):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
                    return json.loads(r.read())

            deadline = time.monotonic() + 60
            while get("/api/v1/tangram/targets")["kinds"]["cpu"]["current"] != 1:
                assert time.monotonic() < deadline, get("/api/v1/tangram/targets")
                time.sleep(0.3)
            targets = get("/api/v1/tangram/targets")
            assert set(targets["kinds"]) == {"cpu", "gpu"}
            assert targets["kinds"]["gpu"]["group"] == "tangram-gpu"
            assert get("/api/v1/adaptive_target")["workers"] == targets["total"]
        finally:
            stop_workers_then_scheduler(procs[0], procs[1:])
