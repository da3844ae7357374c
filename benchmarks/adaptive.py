"""Elastic pool on a real LocalCluster: adapt(minimum=1, maximum=6) against a fixed 6 workers.

    .venv/bin/python benchmarks/adaptive.py [--json] [--trajectories 24] [--turns 6]

One live workload, run twice: on a LocalCluster that starts with 1 worker and
``cluster.adapt(Adaptive=adaptive_class(), minimum=1, maximum=6)`` (Dask's own
Adaptive asking the tangram target through the ``adaptive_target`` RPC and
retiring through ``workers_to_close``/``retire_workers``; the subclass only closes
the workers the scheduler actually retired), then on a fixed cluster of 6 workers.
With ``--move-state`` trajectory state is moved off workers to retire them; by
default a trajectory's home pins its worker.
Each worker is a process with 2 sandbox slots and the sandbox plugin.

The workload ramps up (trajectories start one every ``--ramp-s / trajectories``
seconds), holds, and drains with a long tail, as an RL step does: most
trajectories end after ``--turns`` turns, every ``--long-every``-th after
``--long-turns``.
Each turn is an LLM pause (``--llm-s``) then one stateful action
(``affinity="trajectory"``) that runs code in the trajectory's sandbox working
dir: it sleeps ``--action-s``, appends ``step i`` to ``log`` and returns the
file. The client checks every returned file: a missing line is a working dir
that did not survive (``state_lost``, per trajectory), a duplicated line an
action that ran twice (``ran_twice``); an action that never returned is
``lost``. Printed: worker count over time per kind, worker-seconds (the
integral of the worker count from the first submit to the last result), mean
ACT (submit to result, client side) of each run, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import dask
from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.adaptive import adaptive_class
from tangram_dask.sandbox import SandboxPlugin


def turn(i: int, sleep_s: float) -> dict:
    code = (f"import time; time.sleep({sleep_s}); open('log', 'a').write('step {i}\\n'); "
            "print(open('log').read(), end='')")
    r = tangram_dask.run_code(code, timeout=30)
    from distributed import get_worker
    return {"out": r.stdout, "reason": r.reason, "err": r.stderr[-300:], "worker": get_worker().address}


class Sampler(threading.Thread):
    """Samples the worker count per kind every ``dt`` seconds."""

    def __init__(self, cluster, dt: float = 0.5):
        super().__init__(daemon=True)
        self.cluster, self.dt = cluster, dt
        self.samples: list[tuple[float, dict[str, int]]] = []
        self.targets: list[tuple] = []  # (total target, cpu actions waiting, running) per sample
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def counts(self) -> dict[str, int]:
        sched = self.cluster.scheduler
        ext = sched.plugins.get("tangram-adaptive")
        kinds = ext.kinds() if ext is not None else ()
        out: dict[str, int] = {}
        for addr, k in (ext.worker_kinds(kinds) if ext is not None else {}).items():
            out[k or "unmanaged"] = out.get(k or "unmanaged", 0) + 1
        if not out:
            out["workers"] = len(sched.workers)
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic() - self.t0, self.counts()))
            ext = self.cluster.scheduler.plugins.get("tangram-adaptive")
            pol = self.cluster.scheduler.plugins["tangram"].policy
            try:
                cpu = next(p for p in pol.snapshot().pools if p.pool == "cpu")
                self.targets.append((ext.targets().total, cpu.queued, cpu.running))
            except Exception as e:  # sampled from another thread: a snapshot may race a change
                self.targets.append((None, None, repr(e)))
            time.sleep(self.dt)

    def worker_seconds(self, start: float, end: float) -> float:
        total = 0.0
        for (t, c), (t2, _) in zip(self.samples, self.samples[1:]):
            lo, hi = max(t, start), min(t2, end)
            if hi > lo:
                total += sum(c.values()) * (hi - lo)
        return total


def run_workload(adaptive: bool, args: argparse.Namespace) -> dict:
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", pipeline=0)
    n0 = 1 if adaptive else args.maximum
    with dask.config.set({"distributed.scheduler.worker-saturation": 1.0}), \
            LocalCluster(n_workers=n0, threads_per_worker=args.slots, resources={"slots": args.slots},
                         processes=True, dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]}) as cluster, \
            Client(cluster) as client:
        client.register_plugin(SandboxPlugin(size=args.slots))
        sampler = Sampler(cluster)
        if adaptive:
            # Dask's Adaptive, closing only the workers the scheduler actually retired (plain Adaptive
            # closes every worker it asked to retire, also one the scheduler refused as unsafe)
            cluster.adapt(Adaptive=adaptive_class(), minimum=1, maximum=args.maximum, interval="500ms",
                          wait_count=3, target_duration=f"{args.target_s}s")
            cluster.scheduler.plugins["tangram-adaptive"].move_state = args.move_state
        sampler.start()
        acts: list[float] = []
        result = {"lost": 0, "ran_twice": 0, "state_lost": 0, "errors": []}
        lock = threading.Lock()
        t_first = time.monotonic() - sampler.t0

        def trajectory(j: int) -> None:
            time.sleep(j * args.ramp_s / args.trajectories)
            t = f"t-{j}"
            lost_state = False
            turns = args.long_turns if args.long_every and j % args.long_every == args.long_every - 1 else args.turns
            for i in range(turns):
                time.sleep(args.llm_s)
                with tangram_dask.action(kind="edit", resource="cpu", units=1, hint_s=args.action_s,
                                         trajectory=t, affinity="trajectory", restore_s=0.05):
                    t0 = time.monotonic()
                    fut = client.submit(turn, i, args.action_s, pure=False)
                try:
                    r = fut.result(timeout=120)
                except Exception as e:
                    with lock:
                        result["lost"] += 1
                        result["errors"].append(f"{t} step {i}: {type(e).__name__}: {e}")
                    continue
                with lock:
                    acts.append(time.monotonic() - t0)
                lines = r["out"].splitlines()
                want = [f"step {k}" for k in range(i + 1)]
                if len(lines) != len(set(lines)):
                    with lock:
                        result["ran_twice"] += 1
                if sorted(set(lines), key=lambda s: int(s.split()[1])) != want and not lost_state:
                    lost_state = True
                    with lock:
                        result["state_lost"] += 1
                        result["errors"].append(f"{t} step {i} on {r['worker']}: {r['reason']} {lines} {r['err']}")
            tangram_dask.end_trajectory(client, t)

        with ThreadPoolExecutor(args.trajectories) as pool:
            list(pool.map(trajectory, range(args.trajectories)))
        t_last = time.monotonic() - sampler.t0
        if adaptive:  # let it drain back to the minimum
            deadline = time.monotonic() + args.settle_s
            while len(cluster.scheduler.workers) > 1 and time.monotonic() < deadline:
                time.sleep(0.5)
        sampler.stop.set()
        sampler.join()
        ext = cluster.scheduler.plugins["tangram-adaptive"]
        result.update({
            "mode": "adapt" if adaptive else "fixed",
            "actions": len(acts),
            "worker_seconds": round(sampler.worker_seconds(t_first, t_last), 1),
            "span_s": round(t_last - t_first, 1),
            "mean_act_s": round(statistics.fmean(acts), 3) if acts else None,
            "p90_act_s": round(sorted(acts)[int(0.9 * (len(acts) - 1))], 3) if acts else None,
            "peak_workers": max(sum(c.values()) for _, c in sampler.samples),
            "final_workers": len(cluster.scheduler.workers),
            "moves_before_retirement": ext.stats.moved,
            "retire_refused": ext.stats.refused,
            "move_log": [list(m) for m in ext.stats.log],
            "timeline": [(round(t, 1), c, *tg) for (t, c), tg in list(zip(sampler.samples, sampler.targets))[::2]],
        })
        return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trajectories", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4, help="turns of a short trajectory")
    ap.add_argument("--long-turns", type=int, default=14, help="turns of a long trajectory (the tail)")
    ap.add_argument("--long-every", type=int, default=4, help="every n-th trajectory is long (0: none)")
    ap.add_argument("--llm-s", type=float, default=0.5)
    ap.add_argument("--action-s", type=float, default=1.0)
    ap.add_argument("--ramp-s", type=float, default=12.0)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--maximum", type=int, default=6)
    ap.add_argument("--target-s", type=float, default=5.0)
    ap.add_argument("--settle-s", type=float, default=30.0)
    ap.add_argument("--move-state", action="store_true",
                    help="move trajectory state off workers to retire them (tangram.adaptive.move-state)")
    args = ap.parse_args(argv)
    runs = [run_workload(True, args), run_workload(False, args)]
    a, f = runs
    summary = {
        "worker_seconds_ratio_adapt_over_fixed": round(a["worker_seconds"] / f["worker_seconds"], 3),
        "mean_act_ratio_adapt_over_fixed": round(a["mean_act_s"] / f["mean_act_s"], 3)
        if a["mean_act_s"] and f["mean_act_s"] else None,
    }
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary, "args": vars(args)}, indent=1))
    else:
        for r in runs:
            print(f"{r['mode']:6s} actions {r['actions']}  lost {r['lost']}  ran_twice {r['ran_twice']}  "
                  f"state_lost {r['state_lost']}  worker-s {r['worker_seconds']}  mean ACT {r['mean_act_s']} s  "
                  f"p90 {r['p90_act_s']} s  peak {r['peak_workers']}  final {r['final_workers']}  "
                  f"moves {r['moves_before_retirement']}")
            print("        time s: workers per kind (target, waiting, running): " +
                  " ".join(f"{t}:{'+'.join(f'{n}' for n in c.values())}({tg},{q},{run})"
                           for t, c, tg, q, run in r["timeline"]))
            for e in r["errors"][:5]:
                print("        ", e)
        print(summary)
    bad = any(r["lost"] or r["ran_twice"] or r["state_lost"] for r in runs)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
