"""Calls a client makes about its trajectories (the scheduler and every worker hear them).

Like distributed's own client methods, each works with a synchronous client
(it blocks and returns the answer) and with an asynchronous one
(``Client(asynchronous=True)``: it returns an awaitable), through ``client.sync``.
"""

from __future__ import annotations

from typing import Any

from .annotate import _HAS_PLUGIN, _check_async
from .messages import BEGIN_TRAJECTORY_HANDLER, END_TRAJECTORY_HANDLER


async def _ensure_plugin(client: Any) -> None:
    """PluginMissingError unless the scheduler runs the tangram plugin (asked once per scheduler)."""
    address = client.scheduler.address
    if address not in _HAS_PLUGIN:
        await _check_async(client, address)


async def _begin(client: Any, trajectory: str) -> Any:
    await _ensure_plugin(client)
    return await getattr(client.scheduler, BEGIN_TRAJECTORY_HANDLER)(trajectory=trajectory)


async def _end(client: Any, trajectory: str) -> list[str]:
    from .sandbox.api import _end_everywhere

    await _ensure_plugin(client)
    await getattr(client.scheduler, END_TRAJECTORY_HANDLER)(trajectory=trajectory)
    return await _end_everywhere(client, trajectory)


def begin_trajectory(client: Any, trajectory: str) -> Any:
    """A trajectory is about to start: returns once the scheduler admits it (``{"status": "OK"}``).

    With the default policy that is at once. With admission control
    (``TangramOptions(admission=...)``) it waits while the external pool is
    saturated, so a rollout starts only when its tools will not queue.
    Raises :class:`~tangram_dask.errors.PluginMissingError` where the scheduler
    does not run the tangram plugin. On an asynchronous client, returns an
    awaitable: ``await tangram_dask.begin_trajectory(client, "t-1")``.
    """
    return client.sync(_begin, client, trajectory)


def end_trajectory(client: Any, trajectory: str) -> Any:
    """A trajectory is over: the policy forgets its home node, and every worker removes its
    stateful sandbox directory. Returns the workers that had one (sorted addresses). Safe to call
    twice. On an asynchronous client, returns an awaitable of that list."""
    return client.sync(_end, client, trajectory)
