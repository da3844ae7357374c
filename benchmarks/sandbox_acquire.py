"""Warm acquire against a cold start, with bubblewrap. Prints medians; no assertion.

    .venv/bin/python benchmarks/sandbox_acquire.py [--n 500] [--cold 30] [--backend bwrap]

warm acquire: ``pool.acquire()`` on a pool whose sandboxes are ready: the time
              to hand an action a ready sandbox (the release, which resets it, is
              not timed).
cold start:   a new sandbox started up to ready (bwrap namespaces + the Python
              zygote + its "ready" message), which is what an action would pay
              without the pool.
first action: the same two, plus running ``pass`` in it (what an action sees).
round trip:   acquire, run ``pass``, release on a warm pool, back to back: what
              every action pays for its sandbox (fresh tmpfs, fork, kill, unmount).
Target: warm acquire median <= 5 ms.

``--python`` sets the sandboxes' interpreter (a root worker's process backend
needs one that uid 65534 can read, e.g. /usr/bin/python3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from tangram_dask.sandbox import SandboxPool, bwrap_available
from tangram_dask.sandbox.backends import BACKEND_CLASSES
from tangram_dask.sandbox.options import PoolOptions


def _ms(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[int(0.9 * (len(xs) - 1))]
    return f"median {statistics.median(xs) * 1e3:8.3f} ms   p90 {p90 * 1e3:8.3f} ms   (n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=500, help="warm acquires")
    ap.add_argument("--cold", type=int, default=30, help="cold starts")
    ap.add_argument("--backend", default="bwrap", choices=["bwrap", "process"])
    ap.add_argument("--python", default=None, help="the sandboxes' interpreter (default: this one)")
    ap.add_argument("--trips", type=int, default=200, help="warm round trips")
    args = ap.parse_args()
    if args.backend == "bwrap":
        ok, why = bwrap_available()
        if not ok:
            raise SystemExit(f"bubblewrap unusable here: {why}")
    print(f"backend={args.backend} cpus={len(os.sched_getaffinity(0))} pid={os.getpid()}")

    extra = {"python": args.python} if args.python else {}
    with SandboxPool(backend=args.backend, size=2, **extra) as pool:
        assert pool.wait_ready(60)
        warm, warm_first = [], []
        for _ in range(args.n):
            t0 = time.perf_counter()
            lease = pool.acquire()
            warm.append(time.perf_counter() - t0)
            lease.release()
        for _ in range(args.cold):
            t0 = time.perf_counter()
            with pool.acquire() as lease:
                r = lease.run(code="pass")
                warm_first.append(time.perf_counter() - t0)
            assert r.ok, r
        trips = []
        for _ in range(args.trips):
            t0 = time.perf_counter()
            with pool.acquire() as lease:
                r = lease.run(code="pass")
            trips.append(time.perf_counter() - t0)
            assert r.ok, r

    cls = BACKEND_CLASSES[args.backend]
    opts = PoolOptions(**extra)
    cold, cold_first = [], []
    with tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o711)
        for i in range(args.cold):
            box = cls(os.path.join(root, f"c{i}"), opts)
            t0 = time.perf_counter()
            box.start()
            cold.append(time.perf_counter() - t0)
            r = box.run({"code": "pass"}, opts.limits)
            cold_first.append(time.perf_counter() - t0)
            assert r.ok, r
            box.close()

    print(f"warm acquire         {_ms(warm)}")
    print(f"cold start           {_ms(cold)}")
    print(f"first action, warm   {_ms(warm_first)}")
    print(f"first action, cold   {_ms(cold_first)}")
    print(f"round trip, warm     {_ms(trips)}")
    w, c = statistics.median(warm), statistics.median(cold)
    print(f"cold/warm acquire ratio: {c / w:,.0f}x   target warm <= 5 ms: {'met' if w <= 0.005 else 'NOT met'}")


if __name__ == "__main__":
    main()
