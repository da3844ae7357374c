"""Two MiniLM models registered at 0.01 GB (they take 0.091) on the first real GPU, capped to 0.15 GB.

    python benchmarks/results/h200-session12/misdecl_gpu.py MODEL_DIR

Run on the H200 in session 12 (output beside this file). The GPU holds one
of them at a time: the second model's first load does not fit beside the
first, and its failed report teaches the scheduler both models' size. Every
one of the six alternating calls should score.
"""

from __future__ import annotations

import os
import sys

from distributed import Client, Nanny

import tangram_dask
from tangram_dask.models import models_snapshot, register_model, sentence_transformer
from tangram_dask.scheduler import TangramSchedulerPlugin
from tangram_dask.workers import discover

sys.path.insert(0, "tests")
from test_models import start, wait_until  # noqa: E402


def judge(model: str):
    rm = tangram_dask.reward_model(model)
    return rm.score([("a cat", "a cat sat")])[0], rm.info()["devices"]


def main(model_dir: str) -> None:
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    facts, why = discover()
    if facts is None:
        raise SystemExit(f"no GPU through NVML here: {why}")
    frac = 0.15 / (facts.memory_bytes[0] / 1e9)
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    cfg = {"tangram": {"worker": {"nvml": True, "gpu-memory-fraction": frac}}}
    w = {"gpu-0": {"cls": Nanny, "options": {"name": "gpu-0", "nthreads": 1, "resources": {"gpus": 1}, "config": cfg,
                                             "memory_limit": 0, "dashboard_address": None}}}
    with start(plugin, w) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_until(lambda: len(plugin.nodes) == 1, timeout=60)
        for m in ("m1", "m2"):
            register_model(client, m, sentence_transformer(model_dir), memory_gb=0.01, load_s=1.0)
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


if __name__ == "__main__":
    main(sys.argv[1])
