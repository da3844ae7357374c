"""Session 17: the dashboard, state.json and Prometheus with a real GPU worker (NVML), a 1 GB HF reward model and
MiniLM resident. Prints what each endpoint says about the GPU, and NVML's memory beside the worker's ledger."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.getcwd())

from distributed import Client, LocalCluster, Nanny  # noqa: E402

import tangram_dask  # noqa: E402
from benchmarks.make_reward_model import write  # noqa: E402
from tangram_dask.cluster import ModelSpec  # noqa: E402
from tangram_dask.models import models_snapshot, sentence_transformer, sequence_classifier  # noqa: E402
from tangram_dask.scheduler import TangramSchedulerPlugin  # noqa: E402

nvml = "--abstract" not in sys.argv
minilm = os.environ.get("TANGRAM_TEST_MINILM_DIR")

def rm_call(name):
    rm = tangram_dask.reward_model(name)
    return rm.score([("What is 2 + 2?", "4")])[0], rm.info()["devices"]

def get(url):
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read().decode()
    except Exception as e:
        return type(e).__name__, str(e)

if __name__ == "__main__":
    d = write(tempfile.mkdtemp() + "/rm", 5e8, "bfloat16", "cuda" if nvml else "cpu", tokenizer_dir=minilm)
    print("model", d)
    plugin = TangramSchedulerPlugin("tangram", models={"rm-hf": ModelSpec("rm-hf", 1.1, 2.0),
                                                       "minilm": ModelSpec("minilm", 0.2, 2.0)}, pipeline=0)
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]})
    opts = {"name": "gpu-0", "nthreads": 1, "resources": {"gpus": 1}, "memory_limit": 0, "dashboard_address": None}
    if not nvml:
        opts["config"] = {"tangram": {"worker": {"nvml": False, "gpus": 1, "gpu-memory-gb": 4}}}
    cluster.worker_spec["gpu-0"] = {"cls": Nanny, "options": opts}
    cluster.sync(cluster._correct_state)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        while not plugin.nodes:
            time.sleep(0.05)
        print("declared", {a: (v.source, v.gpus, v.gpu_memory_gb) for a, v in plugin.nodes.items()})
        tangram_dask.register_model(client, "rm-hf", sequence_classifier(d["dir"]), memory_gb=1.1, load_s=2.0)
        tangram_dask.register_model(client, "minilm", sentence_transformer(minilm), memory_gb=0.2, load_s=2.0)
        futs = []
        for i in range(8):
            name = ("rm-hf", "minilm")[i % 2]
            with tangram_dask.action(kind=f"score:{name}", resource="gpu", model=name, hint_s=0.1):
                futs.append(client.submit(rm_call, name, pure=False))
        print("results", client.gather(futs))
        time.sleep(3)  # a heartbeat or two: NVML's sample and the residency reports reach the scheduler
        base = client.dashboard_link.rsplit("/", 1)[0]
        st, body = get(base + "/tangram/state.json")
        s = json.loads(body) if st == 200 else {}
        print("state.json", st, "gpus:", json.dumps(s.get("gpus")), "residency:", json.dumps(s.get("residency"))[:600])
        st, body = get(base + "/metrics")
        lines = body.splitlines()
        print("metrics", st, [x for x in lines if x.startswith(("dask_tangram_units", "dask_tangram_model"))
                              and "gpu" in x or x.startswith("dask_tangram_model")][:30])
        print("metrics dask gpu", [x for x in lines if "gpu" in x.lower() and not x.startswith("#")][:10])
        for page in ("/tangram", "/individual-gpu-memory", "/individual-gpu-utilization"):
            st, body = get(base + page)
            print("page", page, st, len(body))
        def wmetrics(dask_scheduler):
            return {a: {k: v for k, v in ws.metrics.items() if "gpu" in k} for a, ws in dask_scheduler.workers.items()}
        print("worker NVML metrics (distributed)", client.run_on_scheduler(wmetrics))
        snap = models_snapshot(client)
        print("snapshot", json.dumps(snap, default=str)[:1500])
        if nvml:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            print("NVML used GB", round(mem.used / 1e9, 3), "processes",
                  [(p.pid, round((p.usedGpuMemory or 0) / 1e9, 3)) for p in procs])
