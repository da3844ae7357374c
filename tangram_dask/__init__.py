"""tangram-dask: action-level elastic scheduling of agentic-RL external work on Dask.

The public surface. Names that need Dask are imported on first use, so the
pure core (``tangram_dask.policy``, ``tangram_dask.sim``) loads without Dask.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .errors import (ConfigError, FileFormatError, ModelError, PlacementError, PluginMissingError, SandboxError,
                     SpecError, TangramError, TrajectoryError)
from .spec import ActionSpec, make_spec

__version__ = "0.1.0"

# name -> module that defines it (loaded lazily: these import Dask)
_LAZY = {
    "action": "annotate",
    "submit_action": "annotate",
    "check_plugin": "annotate",
    "ANNOTATION": "annotate",
    "current_allocation": "allocation",
    "Allocation": "allocation",
    "run_code": "sandbox",
    "run_command": "sandbox",
    "RunResult": "sandbox",
    "SandboxPlugin": "sandbox",
    "TangramSchedulerPlugin": "scheduler",
    "TangramWorkerPlugin": "workers",
    "begin_trajectory": "client",
    "expect_trajectories": "client",
    "end_trajectory": "client",
    "run_live": "live",
    "register_model": "models",
    "reward_model": "models",
    "models_snapshot": "models",
    "TangramOptions": "policy",  # (pure, no Dask: lazy only so that importing the package stays light)
}

__all__ = [
    "ActionSpec", "make_spec",
    "TangramError", "SpecError", "FileFormatError", "PlacementError", "SandboxError", "ConfigError", "TrajectoryError",
    "PluginMissingError", "ModelError",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'tangram_dask' has no attribute {name!r}")
    value = getattr(import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value
