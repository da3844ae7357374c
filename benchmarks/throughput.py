"""Throughput of trivial actions against plain ``client.submit``, alternating in one run.

    python benchmarks/throughput.py [--n 5000] [--rounds 3] [--pipeline 2]

One ``LocalCluster(n_workers=2, threads_per_worker=1)`` (worker processes,
each declaring one sandbox slot) with the tangram plugin installed. Each
round submits ``n`` no-op tasks plainly, then ``n`` no-op actions (1 unit),
and waits for all of them; the order alternates between rounds. Prints tasks
per second of each and the ratio actions / plain (the target is >= 0.9).
Also checks, on the workers, that no worker ever ran more actions at once
than its declared slots.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from distributed import Client, LocalCluster, wait

import tangram_dask
from tangram_dask.scheduler import TangramSchedulerPlugin

def noop(i: int) -> int:
    return i


def _counter() -> list:
    from distributed import get_worker
    w = get_worker()
    if not hasattr(w, "_tangram_count"):
        w._tangram_count = [threading.Lock(), 0, 0]  # lock, running now, most ever
    return w._tangram_count


def counted_noop(i: int) -> int:
    c = _counter()
    with c[0]:
        c[1] += 1
        c[2] = max(c[2], c[1])
    time.sleep(0.0005)
    with c[0]:
        c[1] -= 1
    return i


def most_at_once(dask_worker) -> int:
    c = getattr(dask_worker, "_tangram_count", None)
    return c[2] if c else 0


def run_plain(client: Client, n: int) -> float:
    t = time.perf_counter()
    futs = [client.submit(noop, i, pure=False) for i in range(n)]
    wait(futs)
    dt = time.perf_counter() - t
    del futs
    return n / dt


def run_actions(client: Client, n: int, fn=noop) -> float:
    t = time.perf_counter()
    with tangram_dask.action(kind="noop", resource="cpu", units=1, hint_s=0.0):
        futs = [client.submit(fn, i, pure=False) for i in range(n)]
    wait(futs)
    dt = time.perf_counter() - t
    del futs
    return n / dt


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--pipeline", type=int, default=2, help="units each CPU node is overbooked by (0 = exact)")
    args = ap.parse_args(argv)
    plugin = TangramSchedulerPlugin("tangram", pipeline=args.pipeline)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"slots": 1},
                      dashboard_address=None, scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        client.submit(noop, -1).result()
        run_actions(client, 200)  # warm up both paths
        run_plain(client, 200)
        plain, act = [], []
        for r in range(args.rounds):
            if r % 2 == 0:
                plain.append(run_plain(client, args.n))
                act.append(run_actions(client, args.n))
            else:
                act.append(run_actions(client, args.n))
                plain.append(run_plain(client, args.n))
            print(f"round {r}: plain {plain[-1]:7.0f} tasks/s   actions {act[-1]:7.0f} tasks/s   "
                  f"ratio {act[-1] / plain[-1]:.2f}", flush=True)
        run_actions(client, 2000, counted_noop)
        most = client.run(most_at_once)
        mp, ma = statistics.median(plain), statistics.median(act)
        print(f"median: plain {mp:.0f} tasks/s, actions {ma:.0f} tasks/s, ratio {ma / mp:.2f} "
              f"(pipeline {args.pipeline}; target >= 0.90)")
        print(f"most actions running at once per worker (1 slot each): {sorted(most.values())}")
        print(f"plugin: {plugin.stats}")


if __name__ == "__main__":
    main()
