"""``tangram-dask``: the command line (also ``dask tangram ...`` through ``dask_cli``).

    tangram-dask bench WORKLOAD CLUSTER [--policy tangram,fifo,static] [--parity] [--json]
    tangram-dask bench --live WORKLOAD CLUSTER [--time-scale S]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Sequence

from .errors import TangramError

PROGRESS_MIN_ACTIONS = 100_000


def _options(pairs: Sequence[str]) -> Any:
    from .policy import TangramOptions

    fields = TangramOptions.__dataclass_fields__
    kw = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--option {pair!r}: expected KEY=VALUE with KEY one of {', '.join(fields)}")
        try:
            kw[key] = float(value)
        except ValueError:
            raise SystemExit(f"--option {pair!r}: {value!r} is not a number") from None
    return TangramOptions(**kw) if kw else None


class Progress:
    """A progress bar on stderr for long runs: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self.tty = stream.isatty()
        self.last: dict[str, int] = {}
        self.t0 = time.perf_counter()

    def __call__(self, policy: str, done: int, total: int) -> None:
        if total < PROGRESS_MIN_ACTIONS:
            return
        pct = int(100 * done / max(total, 1))
        step = 1 if self.tty else 10
        if pct // step == self.last.get(policy, -1) and done < total:
            return
        self.last[policy] = pct // step
        bar = "#" * (pct // 4) + "." * (25 - pct // 4)
        line = f"{policy:>8} [{bar}] {pct:3d}% {done:,}/{total:,} actions {time.perf_counter() - self.t0:6.1f}s"
        if self.tty:
            self.stream.write("\r" + line + ("\n" if done >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def format_table(results: list[dict[str, Any]]) -> str:
    cols = [("policy", "policy", "{}"), ("act_mean_s", "ACT mean", "{:.2f}"), ("act_p50_s", "p50", "{:.2f}"),
            ("act_p99_s", "p99", "{:.1f}"), ("ideal_act_mean_s", "ideal ACT", "{:.2f}"), ("step_s", "step", "{:.1f}"),
            ("ideal_step_s", "ideal step", "{:.1f}"), ("model_loads", "loads", "{}"), ("cold_starts", "cold", "{}"),
            ("restores", "restores", "{}")]
    rows = []
    for r in results:
        row = [fmt.format(r[k]) for k, _, fmt in cols]
        u = r["utilization"]
        row.append(f"{u['cpu']:.0%}/{u['gpu']:.0%}/{u['api']:.0%}")
        if any("capacity_for_parity" in x for x in results):
            f = r.get("capacity_for_parity", "")
            row.append("" if f == "" else "none" if f is None else f"{f:.2f}")
        rows.append(row)
    head = [h for _, h, _ in cols] + ["util cpu/gpu/api"]
    if any("capacity_for_parity" in r for r in results):
        head.append("parity")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    if results:
        r0 = results[0]
        lines.insert(0, f"workload {r0['workload']} ({r0['actions']:,} actions) on cluster {r0['cluster']}")
    return "\n".join(lines)


def cmd_bench(a: argparse.Namespace) -> int:
    from .cluster import load_cluster
    from .workload import load_workload

    policies = tuple(p.strip() for p in a.policy.split(",") if p.strip())
    from .policy import POLICY_NAMES

    bad = [p for p in policies if p not in POLICY_NAMES]
    if bad:
        raise SystemExit(f"--policy: unknown policy {bad[0]!r}; choose from {', '.join(POLICY_NAMES)}")
    workload = load_workload(a.workload)
    cluster = load_cluster(a.cluster)
    options = _options(a.option)
    if a.live:
        try:
            from .live import run_live
        except ImportError as e:  # pragma: no cover - live module ships with the package
            raise SystemExit(f"--live needs tangram_dask.live: {e}")
        results = run_live(workload, cluster, policies=policies, time_scale=a.time_scale, options=options)
    else:
        from .bench import run

        progress = None if a.no_progress else Progress()
        results = run(workload, cluster, policies, with_parity=a.parity, audit=a.audit, progress=progress,
                      time_policy=a.time_policy, options=options)
    if a.json:
        print(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        print(format_table(results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tangram-dask", description="Action-level elastic scheduling for agentic RL on Dask")
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="simulate (or run live) a workload file on a cluster file")
    b.add_argument("workload", help="workload file (format v1, see resources/bench/WORKLOAD.md)")
    b.add_argument("cluster", help="cluster file (format v1)")
    b.add_argument("--policy", default="tangram,fifo,static", help="comma-separated: tangram,fifo,static")
    b.add_argument("--parity", action="store_true", help="also find capacity_for_parity for tangram")
    b.add_argument("--json", action="store_true", help="print the contract's JSON keys, one object per policy")
    b.add_argument("--audit", action="store_true", help="check every decision against an independent ledger")
    b.add_argument("--time-policy", action="store_true", help="measure the policy's cost per decision")
    b.add_argument("--no-progress", action="store_true", help="no progress bar on long runs")
    b.add_argument("--live", action="store_true", help="run on a real Dask LocalCluster instead of simulating")
    b.add_argument("--time-scale", type=float, default=0.05, help="live: wall seconds per workload second")
    b.add_argument("-o", "--option", action="append", default=[], help="tangram option KEY=VALUE (repeatable)")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except TangramError as e:
        print(f"tangram-dask: error: {e}", file=sys.stderr)
        return 2


try:
    import click

    @click.command(name="tangram", context_settings={"ignore_unknown_options": True, "allow_extra_args": True,
                                                      "help_option_names": []})
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def dask_cli(args: tuple[str, ...]) -> None:
        """tangram-dask commands (``dask tangram bench ...``)."""
        sys.exit(main(list(args)))
except ImportError:  # pragma: no cover - click comes with dask
    dask_cli = None


if __name__ == "__main__":
    sys.exit(main())
