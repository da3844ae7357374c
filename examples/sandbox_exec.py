"""Untrusted code in sandboxes: what is isolated, an escape that fails, and the resource limits.

    python examples/sandbox_exec.py [--backend auto|bwrap|process]

The sandbox worker plugin keeps warm sandboxes on every worker; each action's
``run_code`` runs in one, as an unprivileged user, with a fresh tmpfs for its
working dir, /tmp and /dev/shm and every other mount read-only (bubblewrap
where it can create its namespaces, else the process backend: see
docs/sandbox.md for what each contains). Below, on a LocalCluster with the
tangram scheduler plugin:

1. a program tries to write a file into a world-writable directory of the host
   and into /etc: both are refused, and nothing appears on the host;
2. what it writes in its own working dir and /tmp is gone for the next action;
3. limits end runaway code with a reason (memory, wall time, output) or refuse it (processes:
   the forks stop at the limit and are killed with the action);
4. the sandbox is pinned to the CPUs its action was granted.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.sandbox import SandboxPlugin, containment

ESCAPE = """
for path in [{outside!r}, "/etc/escaped.txt"]:
    try:
        open(path, "w").write("escaped")
        print(path, "WRITTEN")
    except OSError as e:
        print(path, "refused:", type(e).__name__, e.strerror)
"""
LEAVE = "open('left.txt', 'w').write('x'); open('/tmp/left.txt', 'w').write('x'); print('written')"
FIND = "import os; print('left.txt' in os.listdir('.'), os.path.exists('/tmp/left.txt'))"
RUNAWAY = {
    "memory": "x = bytearray(1 << 30)",  # 1 GiB against a 256 MiB limit
    "timeout": "while True: pass",
    "output_limit": "while True: print('y' * 1000)",
    "processes": "import os\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n            os.pause()\n"
                 "        n += 1\nexcept OSError as e:\n    print(n, 'forks, then', e.strerror)",
}


def sandboxed(code: str, timeout: float = 5.0) -> tuple[str, str, str, tuple[int, ...]]:
    r = tangram_dask.run_code(code, timeout=timeout)
    return r.reason, r.stdout.strip(), r.backend, r.cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="auto", choices=["auto", "bwrap", "process"])
    args = ap.parse_args()
    outside = tempfile.mkdtemp(prefix="tangram-host-")
    os.chmod(outside, 0o777)  # writable by anyone on the host: only the sandbox stands in the way
    target = os.path.join(outside, "escaped.txt")

    with LocalCluster(n_workers=1, threads_per_worker=2, resources={"slots": 2}, dashboard_address=":0",
                      scheduler_kwargs={"plugins": [tangram_dask.TangramSchedulerPlugin()]}) as cluster, \
            Client(cluster) as client:
        client.register_plugin(SandboxPlugin(backend=args.backend, memory_bytes=256 << 20, output_bytes=1 << 20,
                                             procs=32))

        def run(code: str, units: int = 1, timeout: float = 5.0):
            with tangram_dask.action(kind="exec", resource="cpu", units=units, hint_s=0.1):
                return client.submit(sandboxed, code, timeout, pure=False).result()

        reason, out, backend, _ = run(ESCAPE.format(outside=target))
        contained = containment(backend)
        print(f"backend {backend}: contains {sum(c.contained for c in contained.values())} of "
              f"{len(contained)} hostile cases here; a write outside its dirs: "
              f"{_SAID[contained['write_outside'].level]}")
        print(out)
        print("escaped.txt on the host:", os.path.exists(target))
        print("written inside:", run(LEAVE)[1], "-> next action finds (workdir, /tmp):", run(FIND)[1])
        for what, code in RUNAWAY.items():
            reason, out, _, _ = run(code, timeout=2.0)
            print(f"{what:>12}: {reason}", out if reason == "ok" else "")
        print("granted 1 unit, sandbox CPUs:", run("pass", units=1)[3])
        print("granted 2 units, sandbox CPUs:", run("pass", units=2)[3])
    shutil.rmtree(outside)


_SAID = {"yes": "contained", "partial": "partly contained", "no": "NOT contained"}  # (Containment levels)


if __name__ == "__main__":
    main()
