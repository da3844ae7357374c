"""Actions on a cluster you started yourself: a scheduler with the tangram preload and plain workers.

    dask scheduler --preload scheduler_plugin --port 8786 &
    dask worker tcp://127.0.0.1:8786 --nthreads 4 --resources slots=4 &
    dask worker tcp://127.0.0.1:8786 --nthreads 4 --resources slots=4 &
    python examples/existing_cluster.py tcp://127.0.0.1:8786 [--workers 2]
    kill %1 %2 %3

``--preload scheduler_plugin`` installs the tangram scheduler plugin (and, through
it, the worker side on every worker); ``--resources slots=4`` says how many
sandbox slots a worker has. Each ``client.submit`` below is an ordinary Dask
submit inside ``tangram_dask.action(...)``: the plugin decides on which worker
and on how many slots it runs, and the code runs in a warm sandbox of that size.
"""

from __future__ import annotations

import argparse

from distributed import Client

import tangram_dask
from tangram_dask.sandbox import SandboxPlugin

PROGRAM = "import os\nprint(len(os.sched_getaffinity(0)), sum(range(10)))"  # the CPUs it may use, and work


def run_tests(program: str) -> str:
    alloc = tangram_dask.current_allocation()  # what the scheduler granted this action
    result = tangram_dask.run_code(program, timeout=10)  # in a sandbox pinned to the granted CPUs
    cpus, total = result.stdout.split()
    return f"{alloc.units} slots on {alloc.node}, sandbox saw {cpus} cpus -> {result.reason} {total}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scheduler", nargs="?", default="tcp://127.0.0.1:8786", help="the scheduler's address")
    ap.add_argument("--workers", type=int, default=2, help="wait for this many workers")
    args = ap.parse_args()

    with Client(args.scheduler) as client:
        client.wait_for_workers(args.workers, timeout=60)
        client.register_plugin(SandboxPlugin())  # warm sandboxes on every worker (size: its slots)
        futures = []
        for i in range(4):
            with tangram_dask.action(kind="run_tests", resource="cpu", units=(1, 4), speedup=0.9, hint_s=1.0,
                                     trajectory=f"t-{i}"):
                futures.append(client.submit(run_tests, PROGRAM, pure=False))
        for line in client.gather(futures):
            print(line)
        for i in range(4):
            tangram_dask.end_trajectory(client, f"t-{i}")
        plugins = client.run_on_scheduler(lambda dask_scheduler: sorted(dask_scheduler.plugins))
        print("scheduler plugins:", ", ".join(p for p in plugins if p.startswith("tangram")))


if __name__ == "__main__":
    main()
