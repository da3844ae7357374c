"""Calls a client makes about its trajectories (the scheduler and every worker hear them).

Like distributed's own client methods, each works with a synchronous client
(it blocks and returns the answer) and with an asynchronous one
(``Client(asynchronous=True)``: it returns an awaitable), through ``client.sync``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping

from .annotate import _HAS_PLUGIN, _check_async
from .errors import TrajectoryError, _show
from .messages import BEGIN_TRAJECTORY_HANDLER, END_TRAJECTORY_HANDLER, EXPECT_TRAJECTORIES_HANDLER


async def _ensure_plugin(client: Any) -> None:
    """PluginMissingError unless the scheduler runs the tangram plugin (asked once per scheduler)."""
    address = client.scheduler.address
    if address not in _HAS_PLUGIN:
        await _check_async(client, address)


def check_expected_s(value: Any) -> float | None:
    """``begin_trajectory``'s ``expected_s`` as a float (None stays None), else TrajectoryError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TrajectoryError(f"begin_trajectory: expected_s = {_show(value)}: must be a number of seconds >= 0 "
                              "(what you expect of the trajectory's length) or None")
    try:
        f = float(value)
    except (OverflowError, ValueError, TypeError):
        f = math.nan
    if not (math.isfinite(f) and f >= 0):
        raise TrajectoryError(f"begin_trajectory: expected_s = {_show(value)}: must be a finite number of "
                              "seconds >= 0 or None")
    return f


def check_trajectory(value: Any, what: str) -> str:
    """A trajectory id as ``begin_trajectory`` / ``end_trajectory`` take it, else TrajectoryError naming it: a
    non-empty string, the one its actions name with ``trajectory=``. (Before session 31 None, 5 or "" were
    admitted, each holding a place in the gate until the TTL that no action could ever use.)"""
    if not isinstance(value, str) or not value:
        raise TrajectoryError(f"{what}: the trajectory id {_show(value)} must be a non-empty string (the id its "
                              "actions give as trajectory=)")
    return value


def check_expectations(value: Any) -> list[tuple[str, float | None]]:
    """``expect_trajectories``' mapping as ``(name, expected_s)`` pairs, else TrajectoryError naming the entry."""
    if not isinstance(value, Mapping):
        raise TrajectoryError(f"expect_trajectories: {_show(value)}: must be a mapping of trajectory names to "
                              "expected_s (seconds >= 0, or None)")
    out = []
    for name, e in value.items():
        if not isinstance(name, str):
            raise TrajectoryError(f"expect_trajectories: the name {_show(name)} is not a string")
        if not name:
            raise TrajectoryError("expect_trajectories: a name is empty (a trajectory id is a non-empty string)")
        try:
            out.append((name, check_expected_s(e)))
        except TrajectoryError as err:
            raise TrajectoryError(f"expect_trajectories: trajectory {name!r}: {err}") from None
    return out


async def _call(client: Any, handler: str, **kw: Any) -> Any:
    """Call a trajectory handler with this client's id (the scheduler ends a departed client's trajectories); a
    scheduler plugin of an earlier release takes no ``client``, and is asked again without it."""
    try:
        return await getattr(client.scheduler, handler)(client=client.id, **kw)
    except TypeError as e:
        if "client" not in str(e):
            raise
        return await getattr(client.scheduler, handler)(**kw)


async def _expect(client: Any, expected: Mapping[str, float | None]) -> Any:
    await _ensure_plugin(client)
    out = await _call(client, EXPECT_TRAJECTORIES_HANDLER, trajectories={t: e for t, e in check_expectations(expected)})
    if isinstance(out, dict) and out.get("status") == "error":
        raise TrajectoryError(out.get("message", "expect_trajectories: refused by the scheduler"))
    return out


async def _begin(client: Any, trajectory: str, expected_s: float | None) -> Any:
    await _ensure_plugin(client)
    kw = {} if expected_s is None else {"expected_s": expected_s}  # (a scheduler of an older release takes none)
    out = await _call(client, BEGIN_TRAJECTORY_HANDLER, trajectory=trajectory, **kw)
    if isinstance(out, dict) and out.get("status") == "error":
        raise TrajectoryError(out.get("message", "begin_trajectory: refused by the scheduler"))
    return out


async def _end(client: Any, trajectory: str) -> list[str]:
    from .sandbox.api import _end_everywhere

    await _ensure_plugin(client)
    out = await getattr(client.scheduler, END_TRAJECTORY_HANDLER)(trajectory=trajectory)
    if isinstance(out, dict) and out.get("status") == "error":
        raise TrajectoryError(out.get("message", "end_trajectory: refused by the scheduler"))
    return await _end_everywhere(client, trajectory)


def begin_trajectory(client: Any, trajectory: str, expected_s: float | None = None) -> Any:
    """A trajectory is about to start: returns once the scheduler admits it (``{"status": "OK"}``).

    With the default policy that is at once. With admission control
    (``TangramOptions(admission=...)``) it waits while the external pool is
    saturated, so a rollout starts only when its tools will not queue.
    ``expected_s``: what you expect of the trajectory's length in seconds (say,
    the same prompt's rollouts in earlier epochs): the gate admits the long
    ones first (``admit_long``, on by default; docs/scheduling.md). A bad one
    raises :class:`~tangram_dask.errors.TrajectoryError`.
    Raises :class:`~tangram_dask.errors.PluginMissingError` where the scheduler
    does not run the tangram plugin. On an asynchronous client, returns an
    awaitable: ``await tangram_dask.begin_trajectory(client, "t-1")``.
    """
    return client.sync(_begin, client, check_trajectory(trajectory, "begin_trajectory"), check_expected_s(expected_s))


def expect_trajectories(client: Any, expected: Mapping[str, float | None]) -> Any:
    """The trajectories a step is about to run, queued for admission in one call: ``{name: expected_s}``
    (seconds, or None). Returns ``{"status": "OK", "queued": n}`` at once; each rollout then calls
    ``begin_trajectory(client, name)``, which returns once that one is admitted (at once if it already is).

    Separate ``begin_trajectory`` calls reach the scheduler one by one, and the gate admits the first
    ones before the others arrive, so with ``admit_long`` the order among those it holds back is the
    only order it can choose. Queued together, it chooses among all of them. Names already waiting or
    admitted keep their place. A bad entry raises :class:`~tangram_dask.errors.TrajectoryError` naming
    it, and nothing is queued."""
    return client.sync(_expect, client, expected)


def end_trajectory(client: Any, trajectory: str) -> Any:
    """A trajectory is over: the policy forgets its home node, and every worker removes its
    stateful sandbox directory. Returns the workers that had one (sorted addresses). Safe to call
    twice. On an asynchronous client, returns an awaitable of that list."""
    return client.sync(_end, client, check_trajectory(trajectory, "end_trajectory"))
