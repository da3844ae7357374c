"""The tangram policy's cost per decision as pending actions and workers grow.

Fills a cluster of CPU nodes (64 slots each), keeps N actions pending, then
repeats: one running action finishes, ``schedule`` starts what fits, one new
action arrives. Prints microseconds per decision (submit + finish + schedule
per started action). A cost that does not grow with N or with the number of
workers is what the issue asks for.

    python benchmarks/decision_cost.py
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram_dask.cluster import ClusterSpec, CpuNode  # noqa: E402
from tangram_dask.policy import TangramPolicy  # noqa: E402
from tangram_dask.spec import ActionSpec  # noqa: E402

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


def main() -> None:
    print("tangram policy: microseconds per decision (submit + finish + schedule per action started)")
    print(f"{'pending':>9}{'workers':>9}{'us/decision':>13}")
    for n in (1_000, 10_000, 100_000):
        print(f"{n:>9,}{400:>9}{measure(n, 400):>13.1f}")
    for w in (100, 1_600, 6_400):
        print(f"{10_000:>9,}{w:>9}{measure(10_000, w):>13.1f}")


if __name__ == "__main__":
    main()
