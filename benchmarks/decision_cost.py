"""The tangram policy's cost per decision as pending actions and workers grow.

CPU: fills a cluster of CPU nodes (64 slots each), keeps N actions pending,
then repeats: one running action finishes, ``schedule`` starts what fits,
one new action arrives. GPU (``--gpu``, or both by default): the same loop
on GPU nodes (8 GPUs of 80 GB in two NVLink groups of 4) with reward-model
actions of four models (16 GB on 1..2 GPUs, 30 GB on 1..2, 60 GB on 2..4,
140 GB on 2..8) whose replicas do not all fit, so the policy loads and
evicts as it goes (a background load is ready 200 iterations later, 2 s of
the loop's clock). Prints microseconds per decision (submit + finish +
schedule per started action) and, for GPUs, the loads made. A cost that does
not grow with N or with the number of workers is what the issue asks for.

    python benchmarks/decision_cost.py [--cpu | --gpu]
"""

from __future__ import annotations

import bisect
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram_dask.cluster import ClusterSpec, CpuNode, GpuNode, ModelSpec  # noqa: E402
from tangram_dask.policy import TangramPolicy  # noqa: E402
from tangram_dask.policy.types import Load  # noqa: E402
from tangram_dask.spec import ActionSpec, make_spec  # noqa: E402

KINDS = [ActionSpec("code_exec", "cpu", 1, 2, 0.3, trajectory="t"),
         ActionSpec("run_tests", "cpu", 1, 8, 0.9, trajectory="t", affinity="trajectory", restore_s=3.0)]


def measure(n_pending: int, n_nodes: int, iters: int = 20000, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    cluster = ClusterSpec("bench", tuple(CpuNode(f"cpu-{i}", 64) for i in range(n_nodes)))
    pol = TangramPolicy(cluster, {})
    now = 0.0
    aid = 0
    running: deque[int] = deque()

    def submit() -> None:
        nonlocal aid
        k = int(rng.random() < 0.35)
        spec = KINDS[k].instance(float(np.exp(rng.normal(0.0 if k == 0 else 2.5, 1.0))), f"t{aid % 5000}")
        pol.submit(aid, spec, now)
        aid += 1

    def started(decisions) -> int:
        n = 0
        for d in decisions:
            if hasattr(d, "action"):
                running.append(d.action)
                n += 1
        return n

    while pol.cpu.total_free > 0:  # fill the cluster
        submit()
        started(pol.schedule(now))
    for _ in range(n_pending):
        submit()
    started(pol.schedule(now))
    decisions = 0
    t0 = time.perf_counter()
    for _ in range(iters):
        now += 0.01
        pol.finish(running.popleft(), now, 1.0)
        submit()
        decisions += started(pol.schedule(now))
    dt = time.perf_counter() - t0
    return dt / max(decisions, 1) * 1e6


MODELS = {"rm-16": ModelSpec("rm-16", 16, 20.0), "prm-30": ModelSpec("prm-30", 30, 30.0),
          "vlm-60": ModelSpec("vlm-60", 60, 60.0), "rm-140": ModelSpec("rm-140", 140, 90.0)}
GPU_KINDS = [  # (weight, spec, median duration s)
    (0.35, make_spec("prm", "gpu", (1, 2), speedup=0.6, model="prm-30"), 0.8),
    (0.25, make_spec("judge_small", "gpu", (1, 2), speedup=0.8, model="rm-16"), 1.5),
    (0.2, make_spec("vision_judge", "gpu", (2, 4), speedup=0.8, model="vlm-60"), 4.0),
    (0.2, make_spec("judge_large", "gpu", (2, 8), speedup=0.85, model="rm-140"), 4.0)]
LOAD_ITERS = 200  # a background load is ready this many iterations (of 0.01 s) after its decision


def measure_gpu(n_pending: int, n_nodes: int, iters: int = 20000, seed: int = 0) -> tuple[float, int]:
    """(us per decision, loads) for GPU reward-model actions on ``n_nodes`` nodes of 8 GPUs."""
    rng = np.random.default_rng(seed)
    cluster = ClusterSpec("bench", gpu_nodes=tuple(GpuNode(f"gpu-{i}", 8, 80.0, (4, 4)) for i in range(n_nodes)))
    pol = TangramPolicy(cluster, dict(MODELS))
    cum = np.cumsum([w for w, _, _ in GPU_KINDS])
    cum = list(cum / cum[-1])
    now = 0.0
    aid = 0
    it = 0
    running: deque[int] = deque()
    loading: deque[tuple[int, int]] = deque()  # (ready at iteration, replica)
    loads = 0

    def submit() -> None:
        nonlocal aid
        k = bisect.bisect_right(cum, rng.random())  # the kind, by weight (numpy's choice cost more than a decision)
        _, spec, median = GPU_KINDS[k]
        pol.submit(aid, spec.instance(float(median * np.exp(rng.normal(0.0, 1.0))), f"t{aid % 5000}"), now)
        aid += 1

    def started(decisions) -> int:
        nonlocal loads
        n = 0
        for d in decisions:
            if isinstance(d, Load):
                loading.append((it + LOAD_ITERS, d.replica))
                loads += 1
            elif hasattr(d, "action"):
                running.append(d.action)
                loads += bool(getattr(d, "load", False))
                n += 1
        return n

    def ready() -> None:
        while loading and loading[0][0] <= it:
            pol.loaded(loading.popleft()[1], now)

    for _ in range(4 * 8 * n_nodes):  # fill the GPUs (and what their loads let start)
        submit()
        started(pol.schedule(now))
    for _ in range(n_pending):
        submit()
    started(pol.schedule(now))
    decisions = 0
    t0 = time.perf_counter()
    for it in range(1, iters + 1):
        now += 0.01
        ready()
        if running:
            pol.finish(running.popleft(), now, 1.0)
        submit()
        decisions += started(pol.schedule(now))
    dt = time.perf_counter() - t0
    return dt / max(decisions, 1) * 1e6, loads


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if "--gpu" not in args:
        print("tangram policy, CPU actions: microseconds per decision (submit + finish + schedule per action started)")
        print(f"{'pending':>9}{'workers':>9}{'us/decision':>13}")
        for n in (1_000, 10_000, 100_000):
            print(f"{n:>9,}{400:>9}{measure(n, 400):>13.1f}")
        for w in (100, 1_600, 6_400):
            print(f"{10_000:>9,}{w:>9}{measure(10_000, w):>13.1f}")
    if "--cpu" not in args:
        print("tangram policy, GPU reward-model actions (4 models, loads and evictions): microseconds per decision")
        print(f"{'pending':>9}{'gpu nodes':>11}{'us/decision':>13}{'loads':>7}")
        for n, w in ((1_000, 64), (10_000, 64), (100_000, 64), (10_000, 8), (10_000, 512)):
            us, loads = measure_gpu(n, w)
            print(f"{n:>9,}{w:>11}{us:>13.1f}{loads:>7}")


if __name__ == "__main__":
    main()
