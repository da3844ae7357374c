"""Marking a Dask task as an action: one annotation namespace, ``tangram``.

    with tangram_dask.action(kind="run_tests", resource="cpu", units=(1, 8),
                             hint_s=12, trajectory="t-17"):
        fut = client.submit(run_tests, repo)

or, shorter, ``tangram_dask.submit_action(client, run_tests, repo, kind=..., ...)``.
The spec is validated here, at the call, so a wrong spec never reaches the
scheduler. Once per client and scheduler, the call also checks that the
scheduler runs the tangram plugin (:func:`check_plugin`): without it, Dask
would run the actions as plain tasks, with no placement and no grant.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import dask

from .errors import PluginMissingError
from .messages import SNAPSHOT_HANDLER
from .spec import ActionSpec, check_keywords, make_spec

#: The Dask annotation key under which an action's spec travels.
ANNOTATION = "tangram"

#: Scheduler addresses known to run the tangram plugin (only a positive answer is kept).
_HAS_PLUGIN: set[str] = set()


def _missing(address: str) -> PluginMissingError:
    return PluginMissingError(
        f"the Dask scheduler at {address} does not run the tangram scheduler plugin, so actions would run as "
        f"plain tasks (no placement, no grant). Start the scheduler with `dask scheduler --preload "
        f"scheduler_plugin`, or install the plugin from the client with "
        f"`client.register_plugin(tangram_dask.TangramSchedulerPlugin())` (a LocalCluster: "
        f"scheduler_kwargs={{'plugins': [TangramSchedulerPlugin()]}}). If the preload is configured, the "
        f"scheduler's log says why it did not start ('Failed to start preload').")


async def _scheduler_has_plugin(client: Any) -> bool:
    # First the scheduler's handler table is read (run_on_scheduler, a function shipped by value, so a scheduler
    # without tangram_dask installed can run it): a scheduler without the plugin then logs nothing. Where that is
    # refused (distributed.scheduler.pickle off), the snapshot handler itself is called: a scheduler without it
    # answers None and logs "No handler tangram_snapshot found" with a traceback; with the plugin the answer is
    # its snapshot, a dict. A handler that raised still proves the plugin.
    try:
        return bool(await client._run_on_scheduler(lambda dask_scheduler, h=SNAPSHOT_HANDLER:
                                                   h in dask_scheduler.handlers))
    except (OSError, TimeoutError):
        raise
    except Exception:
        pass
    try:
        reply = await getattr(client.scheduler, SNAPSHOT_HANDLER)()
    except (OSError, TimeoutError):
        raise
    except Exception:
        return True
    return isinstance(reply, dict)


def check_plugin(client: Any) -> Any:
    """Raise :class:`~tangram_dask.errors.PluginMissingError` unless ``client``'s scheduler runs the plugin.

    Asks the scheduler once; a positive answer is remembered per scheduler
    address, a negative one is asked again next time (the plugin may be
    registered later). On an asynchronous client, returns a coroutine to await.
    """
    address = client.scheduler.address
    if address in _HAS_PLUGIN:
        return None
    if getattr(client, "asynchronous", False):
        return _check_async(client, address)
    if not client.sync(_scheduler_has_plugin, client):
        raise _missing(address)
    _HAS_PLUGIN.add(address)
    return None


async def _check_async(client: Any, address: str) -> None:
    if not await _scheduler_has_plugin(client):
        raise _missing(address)
    _HAS_PLUGIN.add(address)


def _check_sync_client(client: Any) -> None:
    """check_plugin for a real, synchronous distributed Client; anything else is not checked here."""
    if client is None or id(client) in _CHECKED_CLIENTS:
        return
    from distributed import Client

    if not isinstance(client, Client) or client.asynchronous or client.status != "running":
        return
    if client.scheduler.address not in _HAS_PLUGIN:
        check_plugin(client)
    _CHECKED_CLIENTS[id(client)] = weakref.ref(client, lambda _, i=id(client): _CHECKED_CLIENTS.pop(i, None))


#: Clients already checked (by id, dropped when the client is collected): the hot path is one dict lookup.
_CHECKED_CLIENTS: dict[int, Any] = {}


def _default_client() -> Any:
    """The default distributed client, or None (no client yet: the graph is built before one exists)."""
    global _lookup
    if _lookup is None:
        from distributed.client import default_client

        _lookup = default_client
    try:
        return _lookup()
    except ValueError:  # "No clients found"
        return None


_lookup: Callable[[], Any] | None = None


@contextmanager
def action(kind: str, resource: str = "cpu", units: int | tuple[int, int] = 1, **fields: Any) -> Iterator[ActionSpec]:
    """Annotate every task submitted inside the block as an action of this spec.

    Fields: ``speedup`` (Amdahl parallel fraction), ``hint_s``, ``trajectory``,
    ``model`` (gpu), ``affinity`` ('trajectory'), ``restore_s``, ``timeout_s``.
    Raises :class:`tangram_dask.SpecError` at once for a wrong spec, an
    unknown field, or ``grant`` (reserved: the scheduler writes it), and
    :class:`tangram_dask.PluginMissingError` when the default client's
    scheduler does not run the tangram plugin.
    """
    check_keywords(fields)
    spec = make_spec(kind, resource, units, **fields)
    _check_sync_client(_default_client())
    with dask.annotate(**{ANNOTATION: spec.to_dict()}):
        yield spec


def submit_action(client: Any, fn: Callable[..., Any], *args: Any, kind: str, resource: str = "cpu",
                  units: int | tuple[int, int] = 1, spec_fields: dict[str, Any] | None = None,
                  **kwargs: Any) -> Any:
    """``client.submit(fn, *args, **kwargs)`` as an action; spec fields in ``spec_fields``.

    Dask's own submit keywords (``key``, ``pure``, ``retries``...) pass through in ``kwargs``.
    Raises :class:`tangram_dask.PluginMissingError` when ``client``'s scheduler does not run the plugin.
    """
    fields = {} if spec_fields is None else spec_fields
    check_keywords(fields)
    _check_sync_client(client)
    with action(kind, resource, units, **fields):
        return client.submit(fn, *args, **kwargs)
