"""Many actions queued at once on the scheduler: its memory and the dispatch cost per action.

    python benchmarks/queue_scale.py [--sizes 1000 5000 10000]

A scheduler process started as a Kubernetes pod would start it
(``dask scheduler --preload scheduler_plugin``) and two worker processes with
two slots each. For each size N: every slot is held by a blocker action, N
no-op actions are submitted in one ``client.map`` (one graph, queued at
once: they wait in the policy's queue, parked in ``no-worker``), the
scheduler's RSS is read, then the blockers are released and the queue
drains. Prints the scheduler's memory per queued action and the plugin's
dispatch cost per action (policy + applying the grants + Dask's own
transitions for them, i.e. ``flush_s / started``); both should stay flat as N
grows (linear totals).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distributed import Client, Event, wait

import tangram_dask

ROOT = Path(__file__).resolve().parents[1]


def noop(i: int) -> int:
    return i


def hold(name: str) -> int:
    Event(name).wait(600)
    return 0


def _rss(dask_scheduler=None) -> int:
    import psutil
    gc.collect()
    return psutil.Process().memory_info().rss


def _plugin_stats(dask_scheduler=None) -> dict:
    from dataclasses import asdict
    return asdict(dask_scheduler.plugins["tangram"].stats)


def measure(client: Client, n: int, gate: str) -> dict:
    Event(gate, client=client).clear()
    with tangram_dask.action(kind="blocker", resource="cpu", units=2, hint_s=100):
        blockers = [client.submit(hold, gate, pure=False) for _ in range(2)]
    while client.run_on_scheduler(_plugin_stats)["started"] < client.run_on_scheduler(_plugin_stats)["submitted"]:
        time.sleep(0.05)
    time.sleep(0.3)
    rss0 = client.run_on_scheduler(_rss)
    before = client.run_on_scheduler(_plugin_stats)
    t = time.perf_counter()
    with tangram_dask.action(kind="noop", resource="cpu", units=1, hint_s=0.0):
        futs = client.map(noop, range(n), pure=False)
    while client.run_on_scheduler(_plugin_stats)["submitted"] - before["submitted"] < n:
        time.sleep(0.05)
    queue_s = time.perf_counter() - t
    rss1 = client.run_on_scheduler(_rss)
    Event(gate, client=client).set()
    t = time.perf_counter()
    wait(futs)
    drain_s = time.perf_counter() - t
    wait(blockers)
    after = client.run_on_scheduler(_plugin_stats)
    started = after["started"] - before["started"]
    flush = after["flush_s"] - before["flush_s"]
    del futs, blockers
    return {"n": n, "rss_mb": (rss1 - rss0) / 2**20, "bytes_per_action": (rss1 - rss0) / n,
            "queue_s": queue_s, "drain_s": drain_s, "dispatch_us_per_action": flush / max(started, 1) * 1e6,
            "drain_us_per_action": drain_s / n * 1e6, "flushes": after["flushes"] - before["flushes"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    args = ap.parse_args(argv)
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}
    with tempfile.TemporaryDirectory() as tmp:
        sched_file = os.path.join(tmp, "scheduler.json")
        procs = [subprocess.Popen([str(bindir / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                   "--no-dashboard", "--scheduler-file", sched_file, "--preload", "scheduler_plugin"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            while not os.path.exists(sched_file):
                time.sleep(0.1)
            for _ in range(2):
                procs.append(subprocess.Popen(
                    [str(bindir / "dask"), "worker", "--scheduler-file", sched_file, "--host", "127.0.0.1",
                     "--nthreads", "2", "--resources", "slots=2", "--no-dashboard", "--memory-limit", "0"],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            with Client(scheduler_file=sched_file) as client:
                client.wait_for_workers(2)
                measure(client, 200, "tangram-warmup")
                rows = [measure(client, n, f"tangram-gate-{n}") for n in args.sizes]
        finally:
            for p in reversed(procs):
                p.terminate()
            for p in procs:
                p.wait(20)
    print(f"{'queued':>8} {'sched RSS +MB':>14} {'bytes/action':>13} {'dispatch us/action':>19} "
          f"{'drain us/action':>16} {'queue s':>8} {'drain s':>8}")
    for r in rows:
        print(f"{r['n']:>8} {r['rss_mb']:>14.1f} {r['bytes_per_action']:>13.0f} {r['dispatch_us_per_action']:>19.1f} "
              f"{r['drain_us_per_action']:>16.1f} {r['queue_s']:>8.2f} {r['drain_s']:>8.2f}")
    a, b = rows[0], rows[-1]
    print(f"growth {a['n']} -> {b['n']} ({b['n'] / a['n']:.0f}x actions): "
          f"memory x{b['rss_mb'] / max(a['rss_mb'], 1e-9):.1f}, "
          f"dispatch cost per action x{b['dispatch_us_per_action'] / a['dispatch_us_per_action']:.2f}")


if __name__ == "__main__":
    main()
