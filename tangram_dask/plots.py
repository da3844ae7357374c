"""PNG figures of a simulated bench run: ``tangram-dask bench WORKLOAD CLUSTER --plot DIR``.

Three figures per run, each with a line (or bar) per policy, named after the
workload and the cluster so that several runs can share one folder:

- ``{workload}-{cluster}-act-cdf.png``: the CDF of action completion times,
  with the ideal's (every action on ``units.max``, nothing queued) dashed;
- ``{workload}-{cluster}-utilization.png``: busy units over capacity through
  the run, one panel per resource (CPU slots, GPUs, API tokens);
- ``{workload}-{cluster}-step.png``: the step time per policy against the
  ideal step, and when each trajectory finished.

The figures are drawn from :class:`~tangram_dask.bench.Trace` objects
(``bench.run(..., traces=[])``); :func:`act_cdf`, :func:`trajectory_cdf`
and the traces' utilization series are the data, kept apart from the drawing
so that tests can check them. matplotlib is optional (the ``plots`` extra):
it is imported here only, when a figure is drawn, with the Agg backend (no
display needed).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .bench import Trace

INSTALL = "pip install 'tangram-dask[plots]'"
COLORS = {"tangram": "#1f77b4", "fifo": "#ff7f0e", "static": "#2ca02c"}
RESOURCES = (("cpu", "CPU slots"), ("gpu", "GPUs"), ("api", "API tokens"))
#: PNG metadata: no matplotlib version in the file, so the same figures give the same bytes.
METADATA = {"Software": None}


def missing() -> str | None:
    """Why figures cannot be drawn here (matplotlib is not importable), with the fix; None when they can."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"--plot needs matplotlib, which is not installed ({e}); install it with: {INSTALL}"
    return None


def act_cdf(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of the trace's ACTs: sorted ACTs (s), and the fraction of actions done by each."""
    x = np.sort(trace.act)
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def trajectory_cdf(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """Sorted trajectory completion times (from their step's start, s) and the fraction finished by each."""
    x = np.sort(trace.trajectory_s)
    return x, np.arange(1, len(x) + 1) / max(len(x), 1)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(traces: Sequence[Trace], what: str) -> str:
    t = traces[0]
    return f"{what}: workload {t.workload} ({len(t.act):,} actions) on cluster {t.cluster}"


def _save(fig: Any, path: Path) -> Path:
    fig.savefig(path, dpi=100, metadata=METADATA)
    _pyplot().close(fig)
    return path


def plot_act_cdf(traces: Sequence[Trace], path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), layout="constrained")
    x = np.sort(traces[0].ideal_act)  # the same for every policy
    y = np.arange(1, len(x) + 1) / max(len(x), 1)
    ax.step(x, y, where="post", color="0.5", ls="--", label=f"ideal (mean {x.mean():.2f} s)")
    for t in traces:
        x, y = act_cdf(t)
        ax.step(x, y, where="post", color=COLORS.get(t.policy), label=f"{t.policy} (mean {x.mean():.2f} s)")
    ax.set_xscale("log")
    ax.set_xlabel("action completion time (s, log scale): issue to end, queueing and setup included")
    ax.set_ylabel("fraction of actions")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(_title(traces, "ACT CDF"), fontsize=10)
    return _save(fig, path)


def plot_utilization(traces: Sequence[Trace], path: Path) -> Path:
    plt = _pyplot()
    capacity = traces[0].capacity
    rows = [(r, label) for r, label in RESOURCES if capacity.get(r)]
    fig, axes = plt.subplots(len(rows), 1, figsize=(9.5, 2.2 * len(rows) + 0.8), sharex=True, squeeze=False,
                             layout="constrained")
    for ax, (r, label) in zip(axes[:, 0], rows):
        for t in traces:
            u = t.utilization[r]
            ax.plot(t.times, 100 * u, color=COLORS.get(t.policy), lw=1.2,
                    label=f"{t.policy} (mean {100 * u.mean():.0f}%)")
        ax.set_ylabel(f"{label}\nbusy of {capacity[r]:,} (%)", fontsize=9)
        ax.set_ylim(0, 102)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8)  # beside the panel, over no line
    axes[-1, 0].set_xlabel(f"time (s); each point the mean over 1/{len(traces[0].times)} of that policy's run")
    axes[0, 0].set_title(_title(traces, "Utilization"), fontsize=10)
    return _save(fig, path)


def plot_step(traces: Sequence[Trace], path: Path) -> Path:
    plt = _pyplot()
    fig, (bars, cdf) = plt.subplots(1, 2, figsize=(10, 4.5), layout="constrained",
                                    gridspec_kw={"width_ratios": [2, 3]})
    names = [t.policy for t in traces]
    steps = [float(np.mean(t.step_s)) for t in traces]
    bars.bar(names, steps, color=[COLORS.get(n, "0.4") for n in names])
    for i, s in enumerate(steps):
        bars.annotate(f"{s:.1f} s", (i, s), ha="center", va="bottom", fontsize=9)
    ideal = traces[0].ideal_step_s
    bars.axhline(ideal, color="0.4", ls="--", lw=1)
    bars.set_ylabel("step time (s)" + (", mean over steps" if len(traces[0].step_s) > 1 else ""))
    bars.set_ylim(0, 1.12 * max(steps + [ideal]))
    bars.set_title(f"step (dashed: the ideal, {ideal:.1f} s)", fontsize=10)
    for t in traces:
        x, y = trajectory_cdf(t)
        cdf.step(x, y, where="post", color=COLORS.get(t.policy), label=t.policy)
    cdf.set_xlabel("trajectory completion time, from its step's start (s)")
    cdf.set_ylabel("fraction of trajectories finished")
    cdf.set_ylim(0, 1.01)
    cdf.grid(True, alpha=0.3)
    cdf.legend(loc="lower right")
    cdf.set_title("trajectories", fontsize=10)
    fig.suptitle(_title(traces, "Step"), fontsize=10)
    return _save(fig, path)


def write(traces: Sequence[Trace], folder: str | Path) -> list[Path]:
    """Draw the three figures of one run (one trace per policy) into ``folder`` (made if missing)."""
    if not traces:
        return []
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{traces[0].workload}-{traces[0].cluster}"
    return [plot_act_cdf(traces, out / f"{stem}-act-cdf.png"),
            plot_utilization(traces, out / f"{stem}-utilization.png"),
            plot_step(traces, out / f"{stem}-step.png")]
