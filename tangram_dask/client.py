"""Calls a client makes about its trajectories (the scheduler and every worker hear them)."""

from __future__ import annotations

from typing import Any

from .scheduler import end_trajectory as _end_on_scheduler


def end_trajectory(client: Any, trajectory: str) -> list[str]:
    """A trajectory is over: the policy forgets its home node, and every worker removes its
    stateful sandbox directory. Returns the workers that had one. Safe to call twice."""
    _end_on_scheduler(client, trajectory)
    from .sandbox import end_trajectory_everywhere

    return end_trajectory_everywhere(client, trajectory)
