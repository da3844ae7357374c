"""Scheduler memory per queued action and per finished action held, against plain Dask tasks, in one run.

    python benchmarks/queue_memory.py [--n 100000] [--trace-n 20000] [--json] [--quick]

Every measurement uses a fresh scheduler process started as a pod would start
it (``dask scheduler --preload scheduler_plugin``: the plugin with its
defaults, also for the plain tasks, which it ignores) and two worker processes
(``--nthreads 2 --resources slots=2``), so one measurement's freed memory is
never reused by the next.

- **queued**: N tasks parked in ``no-worker`` (waiting for a worker with free
  capacity). Actions: both workers are held by a ``(2, 2)`` blocker action, N
  no-op ``(1, 1)`` actions are submitted in one ``client.map``; they wait in
  the policy's queue (all but the few the default dispatch-ahead sends to the
  workers). Plain: N no-op tasks with ``resources={"x": 1}``, which no worker
  has. Read: scheduler RSS after ``gc.collect()``, minus before.
- **held**: N no-op tasks that finish, their futures held (results in worker
  memory, the scheduler keeping their ``TaskState``). Scheduler RSS growth.

Then, in two more fresh schedulers (one per kind) with ``tracemalloc`` on
(12 frames), ``--trace-n`` tasks finished and held, then (after they are
released) the same number queued: traced bytes per task and the top
allocation sites (file:line, and the innermost tangram_dask frame of each
allocation's stack), actions against plain, so one sees what takes the
memory. Prints the ratios actions / plain.

Parked tasks are never cancelled: the processes are stopped instead (Dask
took 74 s to cancel 20,000 parked plain tasks here, growing faster than
linearly). ``--only KIND:WHAT`` runs one RSS measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import dask
from distributed import Client, Event, wait

ROOT = Path(__file__).resolve().parents[1]
SLOTS = 2
WORKERS = 2
ACTION = {"kind": "noop", "resource": "cpu", "units_min": 1, "units_max": 1, "hint_s": 0.0}
BLOCKER = {"kind": "blocker", "resource": "cpu", "units_min": SLOTS, "units_max": SLOTS, "hint_s": 100.0}


def noop(i: int) -> int:
    return i


def hold(name: str) -> int:
    Event(name).wait(900)
    return 0


# -- run on the scheduler -------------------------------------------------------------------------
def _rss(dask_scheduler=None) -> int:
    import psutil
    gc.collect()
    return psutil.Process().memory_info().rss


def _states(dask_scheduler=None) -> dict:
    out: dict[str, int] = {}
    for ts in dask_scheduler.tasks.values():
        out[ts.state] = out.get(ts.state, 0) + 1
    return out


def _trace_start(dask_scheduler=None) -> None:
    import tracemalloc
    tracemalloc.start(12)  # frames enough to see which tangram_dask line made a Dask allocation


def _trace_snap(dask_scheduler=None) -> int:
    """Take a snapshot, kept on the scheduler; returns its index."""
    import tracemalloc
    gc.collect()
    snaps = dask_scheduler.__dict__.setdefault("_qm_snaps", [])
    snaps.append(tracemalloc.take_snapshot())
    return len(snaps) - 1


def _trace_diff(a: int, b: int, top: int, dask_scheduler=None) -> dict:
    """Traced bytes from snapshot a to b, and the top sites by line (excluding tracemalloc's own)."""
    import tracemalloc
    snaps = dask_scheduler._qm_snaps
    flt = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")]
    sa, sb = snaps[a].filter_traces(flt), snaps[b].filter_traces(flt)
    stats = sb.compare_to(sa, "lineno")
    total = sum(s.size_diff for s in stats)
    rows = [{"site": f"{_short(s.traceback[0].filename)}:{s.traceback[0].lineno}", "bytes": s.size_diff,
             "count": s.count_diff, "line": _line(s.traceback[0].filename, s.traceback[0].lineno)}
            for s in sorted(stats, key=lambda s: -s.size_diff)[:top]]
    # the same, attributed to the innermost tangram_dask frame of each allocation (None: no tangram frame)
    by_tg: dict[str, list[int]] = {}
    for s in sb.compare_to(sa, "traceback"):
        frame = next((f for f in s.traceback if "tangram_dask" in f.filename), None)  # innermost first
        site = f"{_short(frame.filename)}:{frame.lineno}" if frame else "(no tangram_dask frame)"
        acc = by_tg.setdefault(site, [0, 0])
        acc[0] += s.size_diff
        acc[1] += s.count_diff
    tg = [{"site": k, "bytes": v[0], "count": v[1]} for k, v in sorted(by_tg.items(), key=lambda kv: -kv[1][0])]
    return {"bytes": total, "top": rows, "by_tangram_frame": tg[:top]}


def _short(path: str) -> str:
    for marker in ("site-packages/", "tangram_dask/"):
        i = path.find(marker)
        if i >= 0:
            return path[i + len(marker):] if marker == "site-packages/" else path[i:]
    return path


def _line(path: str, lineno: int) -> str:
    import linecache
    return linecache.getline(path, lineno).strip()[:100]


# -- the cluster ------------------------------------------------------------------------------------
@contextmanager
def fresh_cluster() -> Iterator[Client]:
    """A scheduler process with the tangram preload and two worker processes, gone afterwards."""
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory() as tmp:
        sched_file = os.path.join(tmp, "scheduler.json")
        procs = [subprocess.Popen([str(bindir / "dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
                                   "--no-dashboard", "--scheduler-file", sched_file, "--preload", "scheduler_plugin"],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            deadline = time.monotonic() + 60
            while not os.path.exists(sched_file):
                if time.monotonic() > deadline or procs[0].poll() is not None:
                    raise RuntimeError("the scheduler did not start")
                time.sleep(0.1)
            for _ in range(WORKERS):
                procs.append(subprocess.Popen(
                    [str(bindir / "dask"), "worker", "--scheduler-file", sched_file, "--host", "127.0.0.1",
                     "--nthreads", str(SLOTS), "--resources", f"slots={SLOTS}", "--no-dashboard",
                     "--memory-limit", "0"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            client = Client(scheduler_file=sched_file)
            try:
                client.wait_for_workers(WORKERS, timeout=60)
                # warm up both paths once (imports, first-time allocations), then forget them
                with dask.annotate(tangram=ACTION):
                    a = client.map(noop, range(50), pure=False)
                p = client.map(noop, range(50), pure=False)
                wait(a + p)
                del a, p
                _settle(client)
                yield client
            finally:  # stop the processes first: a scheduler holding 100,000 parked tasks answers slowly
                quiet = logging.getLogger("distributed.client")
                level = quiet.level
                quiet.setLevel(logging.CRITICAL)  # its reconnect attempts to the stopped scheduler, expected here
                try:
                    _stop(procs)
                    try:
                        client.close(timeout=10)
                    except Exception:  # noqa: BLE001  (the scheduler is gone; nothing to close cleanly)
                        pass
                finally:
                    quiet.setLevel(level)
        finally:
            _stop(procs)


def _stop(procs: list) -> None:
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()


def _settle(client: Client, timeout: float = 120) -> None:
    """Wait until the scheduler forgets every task no future holds."""
    deadline = time.monotonic() + timeout
    while sum(client.run_on_scheduler(_states).values()) > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"tasks left on the scheduler: {client.run_on_scheduler(_states)}")
        time.sleep(0.1)


def _until(client: Client, cond, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = client.run_on_scheduler(_states)
        if cond(st):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: scheduler task states {st}")
        time.sleep(0.1)


def submit_queued(client: Client, kind: str, n: int, gate: str) -> tuple[list, list]:
    """N tasks parked in no-worker (plus, for actions, the blockers that keep every slot busy)."""
    blockers: list = []
    if kind == "action":
        Event(gate, client=client).clear()
        with dask.annotate(tangram=BLOCKER):
            blockers = client.map(hold, [gate] * WORKERS, pure=False)
        _until(client, lambda st: st.get("processing", 0) >= WORKERS, 60, "blockers never started")
        with dask.annotate(tangram=ACTION):
            futs = client.map(noop, range(n), pure=False)
    else:
        futs = client.map(noop, range(n), pure=False, resources={"x": 1})
    # all parked but those the dispatch-ahead sends to the workers (at most pipeline units per worker)
    slack = 4 * WORKERS if kind == "action" else 0
    _until(client, lambda st: st.get("no-worker", 0) >= n - slack, 600, f"{n} {kind}s never all queued")
    time.sleep(0.5)
    return futs, blockers


def submit_held(client: Client, kind: str, n: int) -> list:
    if kind == "action":
        with dask.annotate(tangram=ACTION):
            futs = client.map(noop, range(n), pure=False)
    else:
        futs = client.map(noop, range(n), pure=False)
    wait(futs, timeout=1800)
    bad = [f for f in futs if f.status != "finished"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} {kind}s did not finish: {bad[0].status}")
    _until(client, lambda st: st.get("memory", 0) >= n, 60, f"{n} {kind}s not all in memory")
    return futs


def release(client: Client, futs: list, blockers: list, gate: str) -> None:
    client.cancel(futs)
    if blockers:
        Event(gate, client=client).set()
        wait(blockers)
    del futs[:], blockers[:]
    _settle(client)


def measure_rss(kind: str, what: str, n: int) -> dict:
    with fresh_cluster() as client:
        gate = f"qm-{kind}-{what}"
        rss0 = client.run_on_scheduler(_rss)
        t = time.perf_counter()
        # _futs is never read: holding it keeps the tasks alive while the scheduler is measured
        if what == "queued":
            _futs, blockers = submit_queued(client, kind, n, gate)
        else:
            _futs, blockers = submit_held(client, kind, n), []
        dt = time.perf_counter() - t
        rss1 = client.run_on_scheduler(_rss)
        states = client.run_on_scheduler(_states)
        # no release: the processes go (cancelling N parked tasks costs Dask minutes at N = 100,000)
        if blockers:
            Event(gate, client=client).set()
    return {"kind": kind, "what": what, "n": n, "rss_delta_mb": (rss1 - rss0) / 2**20,
            "bytes_per_task": (rss1 - rss0) / n, "submit_s": dt, "states": states}


def measure_trace(kind: str, n: int, top: int) -> dict:
    with fresh_cluster() as client:
        gate = f"qm-trace-{kind}"
        client.run_on_scheduler(_trace_start)
        # held first: releasing finished tasks is quick, releasing N parked ones is not (see measure_rss)
        s0 = client.run_on_scheduler(_trace_snap)
        held = submit_held(client, kind, n)
        s1 = client.run_on_scheduler(_trace_snap)
        release(client, held, [], gate)
        s2 = client.run_on_scheduler(_trace_snap)
        futs, blockers = submit_queued(client, kind, n, gate)
        s3 = client.run_on_scheduler(_trace_snap)
        held_d = client.run_on_scheduler(_trace_diff, s0, s1, top)
        queued = client.run_on_scheduler(_trace_diff, s2, s3, top)
        if blockers:
            Event(gate, client=client).set()
    return {"kind": kind, "n": n, "queued": queued, "held": held_d}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="tasks per RSS measurement")
    ap.add_argument("--trace-n", type=int, default=20_000, help="tasks per tracemalloc measurement (0: skip)")
    ap.add_argument("--top", type=int, default=12, help="allocation sites listed per measurement")
    ap.add_argument("--quick", action="store_true", help="--n 10000 --trace-n 5000")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=["plain:queued", "action:queued", "plain:held", "action:held"],
                    help="one RSS measurement, no tracemalloc (for iterating)")
    args = ap.parse_args(argv)
    if args.only:
        kind, what = args.only.split(":")
        t = time.perf_counter()
        r = measure_rss(kind, what, args.n)
        print(json.dumps({**r, "wall_s": time.perf_counter() - t}))
        return
    if args.quick:
        args.n, args.trace_n = 10_000, 5_000
    rows = {}
    for what in ("queued", "held"):
        for kind in ("plain", "action"):  # plain first, then actions: each in its own fresh scheduler
            rows[(kind, what)] = measure_rss(kind, what, args.n)
            print(f"  measured {kind} {what}: {rows[(kind, what)]['bytes_per_task']:.0f} B/task",
                  file=sys.stderr, flush=True)
    traces = {}
    if args.trace_n:
        for kind in ("plain", "action"):
            traces[kind] = measure_trace(kind, args.trace_n, args.top)
            print(f"  traced {kind}", file=sys.stderr, flush=True)
    ratios = {what: rows[("action", what)]["bytes_per_task"] / max(rows[("plain", what)]["bytes_per_task"], 1e-9)
              for what in ("queued", "held")}
    if args.json:
        print(json.dumps({"rss": [r for r in rows.values()], "ratio_action_over_plain": ratios,
                          "tracemalloc": traces}, indent=1, default=str))
        return
    print(f"scheduler RSS, {args.n} tasks, each measurement in a fresh scheduler process:")
    print(f"{'':8} {'kind':7} {'+MB':>8} {'bytes/task':>11} {'submit s':>9}")
    for (kind, what), r in rows.items():
        print(f"{what:8} {kind:7} {r['rss_delta_mb']:8.1f} {r['bytes_per_task']:11.0f} {r['submit_s']:9.1f}")
    for what, x in ratios.items():
        print(f"ratio action/plain, {what}: {x:.2f}")
    for kind, tr in traces.items():
        for what in ("queued", "held"):
            d = tr[what]
            print(f"\ntracemalloc, {tr['n']} {kind} tasks {what}: "
                  f"{d['bytes'] / tr['n']:.0f} traced bytes/task; top sites:")
            for row in d["top"]:
                print(f"  {row['bytes'] / tr['n']:7.0f} B/task {row['count'] / tr['n']:6.2f} obj/task  "
                      f"{row['site']}: {row['line']}")
            print("  by the innermost tangram_dask frame on the allocation's stack:")
            for row in d["by_tangram_frame"]:
                print(f"  {row['bytes'] / tr['n']:7.0f} B/task {row['count'] / tr['n']:6.2f} obj/task  {row['site']}")
    if traces:
        for what in ("queued", "held"):
            a, p = traces["action"][what]["bytes"], traces["plain"][what]["bytes"]
            print(f"traced ratio action/plain, {what}: {a / max(p, 1):.2f}")


if __name__ == "__main__":
    main()
