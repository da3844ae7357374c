"""One GPU shared by three small reward models: tangram against fifo (static cannot serve this shape).

    python benchmarks/onegpu.py [--seeds 5] [--set k=v,...]

The simulator's counterpart of ``benchmarks/residency.py --nvml`` on a real
GPU: one GPU whose memory holds two of three 10 GB models (0.15 s loads),
scoring calls of 0.03 s (lognormal, sigma 0.3) issued as tools by 20
trajectories (geometric turns, mean 3; LLM delays uniform 0-6 s), under two
mixes: one model rare (0.5 / 0.45 / 0.05) and all three alike. Every call is
a GPU action; the API reward ends each trajectory. Static's split places
replicas of two models only, so it cannot serve the third: only tangram and
fifo are compared.

Prints per seed and mix: mean ACT and model loads of each policy, then the
mean of tangram's ACT over fifo's.
"""

from __future__ import annotations

import argparse

import numpy as np

from tangram_dask.bench import simulate
from tangram_dask.cluster import parse_cluster
from tangram_dask.policy.tangram import TangramOptions
from tangram_dask.workload import generate, parse_workload

MIXES = ((0.5, 0.45, 0.05), (0.34, 0.33, 0.33))
MODELS = ("rm-a", "rm-b", "rm-c")


def workload(seed: int, mix: tuple[float, ...]) -> dict:
    tools = [{"kind": f"score-{m}", "weight": w, "resource": "gpu", "model": m, "units": {"min": 1, "max": 1},
              "duration_s": {"dist": "lognormal", "median": 0.03, "sigma": 0.3}} for m, w in zip(MODELS, mix)]
    return {"name": f"onegpu-{seed}", "seed": seed, "trajectories": 20,
            "turns": {"dist": "geometric", "mean": 3, "max": 10},
            "llm_time_s": {"dist": "uniform", "low": 0.0, "high": 6.0}, "hint_sigma": 1.0, "tools": tools,
            "rewards": [{"kind": "ret", "weight": 1.0, "resource": "api", "units": {"min": 1, "max": 1},
                         "duration_s": {"dist": "constant", "value": 0.01}}],
            "models": {m: {"gpu_memory_gb": 10, "load_s": 0.15} for m in MODELS}}


CLUSTER = {"name": "onegpu", "cpu": {"nodes": [{"count": 1, "slots": 64}]},
           "gpu": {"nodes": [{"count": 1, "gpus": 1, "gpu_memory_gb": 20, "groups": [1]}],
                   "cross_group_slowdown": 2.0},
           "api": {"tokens": 4}, "sandbox": {"cold_start_s": 0.0, "warm_start_s": 0.0}}


def measure(seeds: int, opts: dict) -> list[dict]:
    cs = parse_cluster(CLUSTER, "onegpu")
    rows = []
    for seed in range(seeds):
        for mix in MIXES:
            gen = generate(parse_workload(workload(seed, mix), f"onegpu-{seed}"))
            t = simulate(gen, cs, "tangram", options=TangramOptions(**opts))
            f = simulate(gen, cs, "fifo")
            rows.append({"seed": seed, "mix": mix, "tangram_act": t["act_mean_s"], "fifo_act": f["act_mean_s"],
                         "tangram_loads": t["model_loads"], "fifo_loads": f["model_loads"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--set", default="", help="tangram options, k=v,...")
    a = ap.parse_args(argv)
    opts = {k: float(v) for k, v in (kv.split("=") for kv in a.set.split(",") if kv)}
    rows = measure(a.seeds, opts)
    print(f"{'seed':>4} {'mix':18s} {'tangram ACT':>11} {'fifo ACT':>9} {'ratio':>6} {'loads t/f':>9}")
    for r in rows:
        print(f"{r['seed']:>4} {str(r['mix']):18s} {r['tangram_act']:>11.3f} {r['fifo_act']:>9.3f} "
              f"{r['tangram_act'] / r['fifo_act']:>6.2f} {r['tangram_loads']:>4}/{r['fifo_loads']:<4}")
    ratio = np.array([r["tangram_act"] / r["fifo_act"] for r in rows])
    print(f"ACT tangram/fifo: mean {ratio.mean():.3f}, max {ratio.max():.3f}, under 1 on {(ratio < 1).sum()}"
          f"/{len(ratio)}; loads tangram {sum(r['tangram_loads'] for r in rows)}, "
          f"fifo {sum(r['fifo_loads'] for r in rows)}")


if __name__ == "__main__":
    main()
