"""The first reward action on a fresh GPU worker, with and without ``tangram.worker.prepare-models``.

    python benchmarks/first_load.py [--loader st|hf] [--model-dir D] [--wait 15] [--rounds 2] [--nvml]

Per round and setting: a fresh LocalCluster (one worker process, one abstract
GPU, or with ``--nvml`` the GPUs NVML finds, the model loaded onto
``cuda:0``), the model registered, ``--wait`` seconds (a step's first turns), then
one scoring action: its ACT (submit to result) and the load time the worker
measured. With ``prepare-models`` on, the worker imported the loader's
libraries (sentence-transformers, or transformers and accelerate) on
registration, in the background; off, the first load imports them. The
settings alternate, so both see the same machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import dask
from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.models import models_snapshot, sentence_transformer, sequence_classifier

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.make_reward_model, run as a script


def score(model: str) -> float:
    return tangram_dask.reward_model(model).score([("What is 2 + 2?", "4")])[0]


def first_action(loader, prepare: bool, wait_s: float, nvml: bool = False, memory_gb: float = 0.2) -> dict:
    gpu = {} if nvml else {"tangram.worker.nvml": False, "tangram.worker.gpus": 1,
                           "tangram.worker.gpu-memory-gb": max(1.0, 2 * memory_gb)}
    cfg = {**gpu, "tangram.worker.prepare-models": prepare}
    with dask.config.set(cfg), \
            LocalCluster(n_workers=1, threads_per_worker=1, resources={"gpus": 1}, dashboard_address=":0",
                         scheduler_kwargs={"plugins": [tangram_dask.TangramSchedulerPlugin()]}) as cluster, \
            Client(cluster) as client:
        rm = tangram_dask.register_model(client, "rm", loader, memory_gb=memory_gb, load_s=2.0)
        time.sleep(wait_s)
        t0 = time.monotonic()
        with rm.action(hint_s=0.1):
            client.submit(score, "rm", pure=False).result()
        act = time.monotonic() - t0
        m = models_snapshot(client)["measured"]["rm"]
        return {"prepare": prepare, "act_s": round(act, 2), "load_s": round(m["load_s"], 2),
                "measured_gb": round(m["memory_gb"], 4)}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loader", choices=("st", "hf"), default="st")
    ap.add_argument("--model-dir", default=None, help="hf: the model (default: a small stand-in written here)")
    ap.add_argument("--wait", type=float, default=15.0, help="seconds between registration and the first action")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--memory-gb", type=float, default=0.2, help="the model's declared GB")
    ap.add_argument("--nvml", action="store_true", help="the worker's real GPUs (NVML) instead of an abstract one")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if a.loader == "hf":
            if a.model_dir is None:
                from benchmarks.make_reward_model import write
                a.model_dir = write(tmp + "/rm", 3e6)["dir"]
            loader = sequence_classifier(a.model_dir)
        else:
            loader = sentence_transformer(a.model_dir)
        rows = []
        for _ in range(a.rounds):
            for prepare in (True, False):
                rows.append(first_action(loader, prepare, a.wait, a.nvml, a.memory_gb))
                print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
