"""Sandboxes for untrusted code: warm, isolated, per worker.

    from tangram_dask.sandbox import SandboxPlugin, run_code, run_command
    client.register_plugin(SandboxPlugin())            # every worker: a warm pool
    with tangram_dask.action(kind="tests", resource="cpu", units=2):
        fut = client.submit(lambda: run_command(["pytest", "-x"], files=...).reason)

Modules: ``backends`` (bwrap and process isolation behind one interface),
``pool`` (the warm pool), ``workspace`` (trajectory dirs), ``plugin`` (the
worker plugin), ``api`` (the calls above). The Dask-free parts load without
Dask; ``SandboxPlugin`` is imported on first use.
"""

from __future__ import annotations

from typing import Any

from .api import (
    current_pool,
    end_trajectory,
    end_trajectory_everywhere,
    move_trajectory,
    restore_trajectory,
    run_code,
    run_command,
    snapshot_trajectory,
)
from .backends import THREATS, Containment, Sandbox, bwrap_available, containment
from .options import REASONS, Limits, PoolOptions
from .pool import Lease, PoolStats, SandboxPool
from .result import RunResult

__all__ = [
    "run_code", "run_command", "RunResult", "REASONS",
    "end_trajectory", "snapshot_trajectory", "restore_trajectory", "move_trajectory", "end_trajectory_everywhere",
    "SandboxPlugin", "SandboxPool", "Lease", "PoolStats", "PoolOptions", "Limits",
    "Sandbox", "Containment", "containment", "bwrap_available", "THREATS", "current_pool",
]


def __getattr__(name: str) -> Any:
    if name == "SandboxPlugin":
        from .plugin import SandboxPlugin
        globals()[name] = SandboxPlugin
        return SandboxPlugin
    raise AttributeError(f"module 'tangram_dask.sandbox' has no attribute {name!r}")
