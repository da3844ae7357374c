"""The command line: one click group, ``tangram-dask ...`` and ``dask tangram ...`` alike.

    tangram-dask bench WORKLOAD CLUSTER [--policy tangram,fifo,static] [--parity] [--json] [--audit] [--plot DIR]
    tangram-dask bench --live WORKLOAD CLUSTER [--time-scale S]
    dask tangram bench ...              # the same group, through dask's ``dask_cli`` entry point

Exit status: 0 on success; 2 when the caller can fix it (a bad option or
argument, a missing or malformed workload or cluster file, any
:class:`~tangram_dask.errors.TangramError`), with ``Error: ...`` on stderr.

Adding a subcommand: define a ``click.Command`` in its own module and either
name it in :data:`LAZY_COMMANDS` (imported only when used or listed, so a
heavy dependency does not slow every command) or call
``cli.add_command(command)``.
"""

from __future__ import annotations

import json
import sys
import time
from importlib import import_module
from typing import Any, Sequence

import click

from .errors import ConfigError, TangramError

PROGRESS_MIN_ACTIONS = 100_000
PROG = "tangram-dask"

#: Subcommands defined in other modules, imported on first use: name -> "module:attribute".
LAZY_COMMANDS: dict[str, str] = {
    "k8s-scale": "tangram_dask.k8s:k8s_scale",  # Kubernetes: every DaskWorkerGroup sized per kind
    "demo": "tangram_dask.demo:demo",  # a short rollout for real on a LocalCluster, tangram vs fifo
}


class InputError(click.ClickException):
    """Bad input the caller can fix (a file, a value): exit status 2, like click's usage errors."""

    exit_code = 2


class TangramGroup(click.Group):
    """A click group that loads :data:`LAZY_COMMANDS` on demand and turns TangramError into exit status 2."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is None and name in LAZY_COMMANDS:
            module, _, attr = LAZY_COMMANDS[name].partition(":")
            cmd = getattr(import_module(module), attr)
            self.add_command(cmd, name)
        return cmd

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TangramError as e:
            raise InputError(str(e)) from e


@click.group(name="tangram", cls=TangramGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="tangram-dask", prog_name=PROG)
def cli() -> None:
    """Action-level elastic scheduling of agentic-RL external work on Dask."""


#: What ``dask tangram`` runs (the ``dask_cli`` entry point in pyproject.toml): the same group.
dask_cli = cli


def main(argv: Sequence[str] | None = None) -> int:
    """``tangram-dask``: run the group, return the exit status (0, or 2 for errors the caller can fix)."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        rv = cli.main(args=args, prog_name=PROG, standalone_mode=False)
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:  # --help, --version
        return e.exit_code
    except click.Abort:
        click.echo("Aborted!", err=True)
        return 1
    return rv if isinstance(rv, int) else 0


# -- bench ------------------------------------------------------------------------------------
def _policies(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...] | None:
    from .policy import POLICY_NAMES

    if value is None:
        return None  # the default depends on --live
    names = tuple(p.strip() for p in value.split(",") if p.strip())
    if not names:
        raise click.BadParameter(f"{value!r}: name at least one of {', '.join(POLICY_NAMES)}")
    bad = [p for p in names if p not in POLICY_NAMES]
    if bad:
        raise click.BadParameter(f"unknown policy {bad[0]!r}; choose from {', '.join(POLICY_NAMES)}")
    return names


def _options(ctx: click.Context, param: click.Parameter, pairs: Sequence[str]) -> Any:
    """``-o KEY=VALUE`` pairs as TangramOptions (None when none is given); the knobs are read as the
    ``tangram.scheduler.policy-options`` config key is (:func:`tangram_dask.options.policy_options`)."""
    from .options import knob_pairs, policy_options
    from .policy import TangramOptions

    try:
        kw = policy_options(knob_pairs(pairs, "-o"), "-o")
    except ConfigError as e:
        raise click.BadParameter(str(e)) from None
    return TangramOptions(**kw) if kw else None


class Progress:
    """A progress bar on stderr for long runs: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
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
            ("act_p99_s", "p99", "{:.1f}"), ("ideal_act_mean_s", "ideal ACT", "{:.2f}"),
            ("floor_act_mean_s", "floor ACT", "{:.2f}"), ("step_s", "step", "{:.1f}"),
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
    for r in results:
        if r.get("beyond_contract"):
            opts = ", ".join(r["beyond_contract"])
            lines.append(f"note: {r['policy']} ran with {opts}, beyond WORKLOAD.md (replicas wider than its "
                         f"smallest k): its figures are not measured under the contract")
    hinted = [r for r in results if r.get("trajectory_hints") is not None]
    if hinted:
        lines.append(f"note: every trajectory began with a hint of its length (--trajectory-hints "
                     f"{hinted[0]['trajectory_hints']:g}), beyond WORKLOAD.md: these figures are not measured under "
                     f"the contract")
    return "\n".join(lines)


@cli.command()
@click.argument("workload")
@click.argument("cluster")
@click.option("--policy", "policies", default=None, callback=_policies,
              help="Comma-separated policies to run: tangram, fifo, static.  [default: tangram,fifo,static; "
                   "with --live, tangram,fifo]")
@click.option("--parity", is_flag=True, help="Also find capacity_for_parity for tangram.")
@click.option("--json", "as_json", is_flag=True, help="Print the contract's JSON keys, one object per policy.")
@click.option("--audit", is_flag=True, help="Check every decision against an independent ledger.")
@click.option("--time-policy", is_flag=True, help="Measure the policy's cost per decision.")
@click.option("--no-progress", is_flag=True, help="No progress bar on long runs.")
@click.option("--live", is_flag=True, help="Run on a real Dask LocalCluster instead of simulating.")
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=0.2, show_default=True,
              help="Live: wall seconds per workload second (each ms of the host's dispatch latency reads as "
                   "1/time-scale ms of workload time: smaller runs faster and reads the host more).")
@click.option("-o", "--option", "options", multiple=True, callback=_options, metavar="KEY=VALUE",
              help="A tangram policy option (repeatable), e.g. -o admission=0.")
@click.option("--trajectory-hints", "hint_sigma", type=click.FloatRange(min=0), default=None, metavar="SIGMA",
              help="Beyond WORKLOAD.md: begin each trajectory with a hint of its length, its ideal length x "
                   "exp(SIGMA x N(0, 1)) (0: exact), as an RL framework may know from earlier epochs; the policy "
                   "option admit_long (on by default) reads it. Live, each step is queued whole with the same "
                   "hints (expect_trajectories).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Also write PNG figures of the run into DIR (ACT CDF, utilization over time, step); "
                   "needs matplotlib: pip install 'tangram-dask[plots]'.")
def bench(workload: str, cluster: str, policies: tuple[str, ...] | None, parity: bool, as_json: bool, audit: bool,
          time_policy: bool, no_progress: bool, live: bool, time_scale: float, options: Any,
          hint_sigma: float | None, plot_dir: str | None) -> int:
    """Simulate (or run --live) one RL step of WORKLOAD on CLUSTER under each policy.

    WORKLOAD and CLUSTER are files in the format of resources/bench/WORKLOAD.md.
    """
    from .cluster import load_cluster
    from .workload import load_workload

    if plot_dir is not None:
        if live:
            raise click.UsageError("--plot draws simulated runs; it cannot be combined with --live")
        from .plots import missing

        why = missing()
        if why:
            raise InputError(why)

    if policies is None:
        policies = ("tangram", "fifo") if live else ("tangram", "fifo", "static")
    elif live and "static" in policies:
        raise click.UsageError("--live runs tangram and fifo: static binds whole trajectories to resources, "
                               "which the live plugin does not do (simulate it, without --live)")
    wl = load_workload(workload)
    cl = load_cluster(cluster)
    traces: list | None = [] if plot_dir is not None else None  # filled by the simulated run
    if live:
        from .live import run_live

        results = run_live(wl, cl, policies=policies, time_scale=time_scale, options=options,
                           trajectory_hints=hint_sigma)
    else:
        from .bench import run

        progress = None if no_progress else Progress()
        results = run(wl, cl, policies, with_parity=parity, audit=audit, progress=progress,
                      time_policy=time_policy, options=options, traces=traces, trajectory_hints=hint_sigma)
    if as_json:
        click.echo(json.dumps(results if len(results) > 1 else results[0], indent=2))
    else:
        click.echo(format_table(results))
    if traces:
        from .plots import write

        for path in write(traces, plot_dir):
            click.echo(f"wrote {path}", err=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
