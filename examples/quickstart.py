"""tangram-dask in one screen: actions on a LocalCluster, placed by the tangram policy.

    python examples/quickstart.py

Two CPU workers of 4 sandbox slots each. Actions say what they need; the
scheduler plugin decides where, when and on how many slots each runs; inside
an action, current_allocation() says what it got, and run_code runs
untrusted code in a warm sandbox of that many CPUs.
"""

from __future__ import annotations

from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.sandbox import SandboxPlugin


def run_tests(repo: str) -> str:
    alloc = tangram_dask.current_allocation()
    return f"{repo}: {alloc.units} slots on {alloc.node}"


def score(code: str) -> str:
    result = tangram_dask.run_code(code, timeout=5)
    return f"{result.reason}: {result.stdout.strip()!r}"


def main() -> None:
    plugin = tangram_dask.TangramSchedulerPlugin("tangram")
    with LocalCluster(n_workers=2, threads_per_worker=4, resources={"slots": 4}, dashboard_address=":0",
                      scheduler_kwargs={"plugins": [plugin]}) as cluster, Client(cluster) as client:
        client.register_plugin(SandboxPlugin())
        with tangram_dask.action(kind="run_tests", resource="cpu", units=(1, 4), speedup=0.9, hint_s=2.0,
                                 trajectory="t-1", affinity="trajectory"):
            tests = client.submit(run_tests, "repo-a", pure=False)
        with tangram_dask.action(kind="code_exec", resource="cpu", units=1, hint_s=0.1, trajectory="t-2"):
            code = client.submit(score, "print(sum(range(10)))", pure=False)
        print(tests.result())
        print(code.result())
        tangram_dask.end_trajectory(client, "t-1")
        tangram_dask.end_trajectory(client, "t-2")


if __name__ == "__main__":
    main()
