"""Calls a client makes about its trajectories (the scheduler and every worker hear them)."""

from __future__ import annotations

from typing import Any

from .annotate import check_plugin
from .scheduler import begin_trajectory as _begin_on_scheduler
from .scheduler import end_trajectory as _end_on_scheduler


def begin_trajectory(client: Any, trajectory: str) -> Any:
    """A trajectory is about to start: returns once the scheduler admits it.

    With the default policy that is at once. With admission control
    (``TangramOptions(admission=...)``) it waits while the external pool is
    saturated, so a rollout starts only when its tools will not queue.
    Raises :class:`~tangram_dask.errors.PluginMissingError` where the scheduler
    does not run the tangram plugin (a synchronous client is checked once).
    """
    if not getattr(client, "asynchronous", False):
        check_plugin(client)
    return _begin_on_scheduler(client, trajectory)


def end_trajectory(client: Any, trajectory: str) -> list[str]:
    """A trajectory is over: the policy forgets its home node, and every worker removes its
    stateful sandbox directory. Returns the workers that had one. Safe to call twice."""
    if not getattr(client, "asynchronous", False):
        check_plugin(client)
    _end_on_scheduler(client, trajectory)
    from .sandbox import end_trajectory_everywhere

    return end_trajectory_everywhere(client, trajectory)
