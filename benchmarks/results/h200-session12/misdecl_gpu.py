"""Two MiniLM models declared at 0.01 GB (real 0.091) on the real GPU capped to 0.15 GB: all calls should score."""
import os, sys, time
sys.path.insert(0, "tests")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
from distributed import Client, Nanny
import tangram_dask
from tangram_dask.models import models_snapshot, register_model, sentence_transformer
from tangram_dask.scheduler import TangramSchedulerPlugin
from tangram_dask.workers import discover
from test_models import start, wait_until

def judge(model):
    rm = tangram_dask.reward_model(model)
    return rm.score([("a cat", "a cat sat")])[0], rm.info()["devices"]

if __name__ == "__main__":
    facts, why = discover()
    frac = 0.15 / (facts.memory_bytes[0] / 1e9)
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    cfg = {"tangram": {"worker": {"nvml": True, "gpu-memory-fraction": frac}}}
    w = {"gpu-0": {"cls": Nanny, "options": {"name": "gpu-0", "nthreads": 1, "resources": {"gpus": 1}, "config": cfg,
                                             "memory_limit": 0, "dashboard_address": None}}}
    with start(plugin, w) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_until(lambda: len(plugin.nodes) == 1, timeout=60)
        for m in ("m1", "m2"):
            register_model(client, m, sentence_transformer(sys.argv[1]), memory_gb=0.01, load_s=1.0)
        for i, m in enumerate(["m1", "m2", "m1", "m2", "m1", "m2"]):
            with tangram_dask.action(kind=f"j:{m}", resource="gpu", model=m, hint_s=0.1):
                f = client.submit(judge, m, pure=False)
            try:
                print(i, m, "->", f.result(timeout=90))
            except Exception as e:
                print(i, m, "-> ERR", type(e).__name__, str(e)[:300])
        snap = models_snapshot(client)
        print("counts", snap["counts"])
        print("measured", {k: (round(v["memory_gb"], 4), v["measured_by"]) for k, v in snap["measured"].items()})
        print("ledger", {rid: (r.model, r.gpus, round(r.share_gb, 4)) for rid, r in plugin.policy.gpu.replicas.items()})
