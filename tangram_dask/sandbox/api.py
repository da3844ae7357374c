"""The user API: run code or a command in a sandbox, inside an action.

    result = tangram_dask.run_code("print(sum(range(10)))", timeout=10)
    result = tangram_dask.run_command(["pytest", "-x"], files={"test_a.py": src})
    result.reason, result.exit_code, result.stdout, result.wall_s ...

Inside a Dask task on a worker with the ``tangram-sandbox`` plugin, the pool is
the worker's and the CPUs are those the scheduler granted the action
(:func:`tangram_dask.current_allocation`: 1 outside a scheduled action). Outside
Dask, pass ``pool=`` a :class:`SandboxPool`. These calls block: call them from a
task (a worker thread), never from the event loop.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

from ..errors import SandboxError
from ..messages import STAYED_HANDLER
from .pool import SandboxPool
from .result import RunResult

PLUGIN_NAME = "tangram-sandbox"
TAKE_HANDLER = "tangram_sandbox_take"
DROP_HANDLER = "tangram_sandbox_drop"

logger = logging.getLogger("tangram_dask.sandbox")


def current_pool() -> SandboxPool:
    """The sandbox pool of the worker running this task."""
    try:
        from distributed import get_worker
        worker = get_worker()
    except (ImportError, ValueError):
        raise SandboxError("no sandbox pool here: call run_code/run_command inside a Dask task on a worker "
                           "with the sandbox plugin (client.register_plugin(SandboxPlugin())), or pass "
                           "pool=SandboxPool(...)") from None
    plugin = worker.plugins.get(PLUGIN_NAME)
    pool = getattr(plugin, "pool", None)
    if pool is None:
        raise SandboxError(f"worker {worker.address} has no {PLUGIN_NAME!r} plugin: register it with "
                           "client.register_plugin(tangram_dask.sandbox.SandboxPlugin()) before submitting")
    return pool


def _grant(units: int | None, trajectory: str | None) -> tuple[int, str | None, Any]:
    """Units and trajectory: the explicit ones, else the running action's grant, else 1 and none."""
    from ..allocation import current_allocation

    alloc = current_allocation()
    if units is None:
        units = alloc.units if alloc is not None else 1
    if trajectory is None and alloc is not None and alloc.affinity == "trajectory":
        trajectory = alloc.trajectory
    return units, trajectory, alloc


def _pull_moved_state(pool: SandboxPool, trajectory: str, alloc: Any) -> None:
    """The scheduler moved this trajectory here: take its working dir from the worker that had it."""
    from distributed import get_worker
    from distributed.utils import sync

    worker = get_worker()
    source = alloc.restore_from
    if not source or source == worker.address or pool.holds_trajectory(trajectory):
        return  # (held here, by an action of it running here too: this copy is the newer one)

    async def take() -> bytes | None:
        return await worker.rpc(source).tangram_sandbox_take(trajectory=trajectory)

    async def drop() -> bool:
        return await worker.rpc(source).tangram_sandbox_drop(trajectory=trajectory)

    async def stayed() -> None:  # the state is still at the source: the scheduler makes that its home again
        try:
            await getattr(worker.scheduler, STAYED_HANDLER)(trajectory=trajectory, worker=worker.address,
                                                            source=source)
        except Exception as e:  # (a scheduler without the handler: as before session 34)
            logger.warning("tangram sandbox: could not tell the scheduler that trajectory %s stays on %s: %s",
                           trajectory, source, e)

    try:
        data = sync(worker.loop, take)
    except SandboxError as e:  # the source refused the snapshot: it keeps the dir, the action fails
        sync(worker.loop, stayed)
        raise SandboxError(f"trajectory {trajectory!r} could not be moved here from {source}: {e}") from None
    except Exception as e:  # the source left: the trajectory starts afresh here, and says so
        logger.warning("tangram sandbox: could not take trajectory %s from %s (%s: %s); it starts with an "
                       "empty working dir here", trajectory, source, type(e).__name__, e)
        return
    if not data:
        return
    # a restore that fails raises here: the source still holds the dir (it drops it only below)
    try:
        pool.restore_trajectory(trajectory, data)
    except SandboxError:
        sync(worker.loop, stayed)
        raise
    try:
        sync(worker.loop, drop)
    except Exception as e:
        logger.warning("tangram sandbox: trajectory %s was restored here but %s could not drop its copy "
                       "(%s: %s); its TTL will", trajectory, source, type(e).__name__, e)


def _run(pool: SandboxPool | None, units: int | None, trajectory: str | None, limits: dict[str, Any],
         **kwargs: Any) -> RunResult:
    explicit_pool = pool is not None
    pool = pool if explicit_pool else current_pool()
    units, trajectory, alloc = _grant(units, trajectory)
    if trajectory is not None and alloc is not None and alloc.restore and not explicit_pool:
        _pull_moved_state(pool, trajectory, alloc)
    lim = pool.options.limits.merged(**limits)
    with pool.acquire(units, trajectory) as lease:
        return lease.run(limits=lim, **kwargs)


def run_code(code: str, stdin: str | bytes | None = None, timeout: float | None = None, *,
             files: Mapping[str, str | bytes] | None = None, env: Mapping[str, str] | None = None,
             memory_bytes: int | None = None, cpu_s: float | None = None, output_bytes: int | None = None,
             file_bytes: int | None = None, units: int | None = None, trajectory: str | None = None,
             pool: SandboxPool | None = None) -> RunResult:
    """Run Python source in a warm sandbox; the result says how it ended (never raises for the code).

    Limits not given (None) are the pool's: ``timeout`` (wall seconds, 10 by
    default), ``memory_bytes``, ``cpu_s``, ``output_bytes``, ``file_bytes``. ``trajectory``: run in that trajectory's
    working dir (kept between its actions on this node); by default the running
    action's trajectory if it has ``affinity='trajectory'``.
    """
    if not isinstance(code, str):
        raise SandboxError(f"code must be Python source as a str, got {type(code).__name__}")
    return _run(pool, units, trajectory,
                dict(timeout_s=timeout, memory_bytes=memory_bytes, cpu_s=cpu_s, output_bytes=output_bytes,
                     file_bytes=file_bytes),
                code=code, stdin=stdin, files=files, env=env)


def run_command(argv: Sequence[str], files: Mapping[str, str | bytes] | None = None,
                stdin: str | bytes | None = None, timeout: float | None = None, *,
                env: Mapping[str, str] | None = None,
                memory_bytes: int | None = None, cpu_s: float | None = None, output_bytes: int | None = None,
                file_bytes: int | None = None, units: int | None = None, trajectory: str | None = None,
                pool: SandboxPool | None = None) -> RunResult:
    """Run a command (``["pytest", "-x"]``) in a warm sandbox, after writing ``files`` into its working dir."""
    if isinstance(argv, str):
        raise SandboxError(f"command {argv!r}: pass a list of arguments, e.g. {argv.split()!r}")
    return _run(pool, units, trajectory,
                dict(timeout_s=timeout, memory_bytes=memory_bytes, cpu_s=cpu_s, output_bytes=output_bytes,
                     file_bytes=file_bytes),
                argv=list(argv), stdin=stdin, files=files, env=env)


def end_trajectory(trajectory: str, pool: SandboxPool | None = None) -> bool:
    """Remove a trajectory's working dir on this node; True if it had one. Safe to call twice."""
    return (pool if pool is not None else current_pool()).end_trajectory(trajectory)


def snapshot_trajectory(trajectory: str, pool: SandboxPool | None = None) -> bytes:
    """A trajectory's working dir on this node, as tar.gz bytes."""
    return (pool if pool is not None else current_pool()).snapshot_trajectory(trajectory)


def restore_trajectory(trajectory: str, data: bytes, pool: SandboxPool | None = None) -> None:
    """Make a trajectory's working dir on this node from a snapshot taken on another."""
    (pool if pool is not None else current_pool()).restore_trajectory(trajectory, data)


# -- cluster-side helpers (for the client or the scheduler side) ----------------

def _on_worker(fn: str, *args: Any, dask_worker: Any = None) -> Any:
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    if plugin is None or getattr(plugin, "pool", None) is None:
        raise SandboxError(f"worker has no {PLUGIN_NAME!r} plugin: register SandboxPlugin first")
    return getattr(plugin.pool, fn)(*args)


# Each works with a synchronous client (blocks) and an asynchronous one (returns an awaitable): the
# coroutine runs on the client's loop, where ``client.run`` returns an awaitable either way.

async def _move(client: Any, trajectory: str, source: str, destination: str) -> int:
    # the source removes its dir only once the destination has restored it
    data = (await client.run(_on_worker, "snapshot_trajectory", trajectory, workers=[source]))[source]
    await client.run(_on_worker, "restore_trajectory", trajectory, data, workers=[destination])
    await client.run(_on_worker, "end_trajectory", trajectory, workers=[source])
    return len(data)


def move_trajectory(client: Any, trajectory: str, source: str, destination: str) -> Any:
    """Move a trajectory's working dir from worker ``source`` to ``destination``; the bytes moved."""
    return client.sync(_move, client, trajectory, source, destination)


def _end_here(trajectory: str, dask_worker: Any = None) -> bool:
    plugin = dask_worker.plugins.get(PLUGIN_NAME) if dask_worker is not None else None
    pool = getattr(plugin, "pool", None)
    return pool is not None and pool.end_trajectory(trajectory)


async def _end_everywhere(client: Any, trajectory: str) -> list[str]:
    done = await client.run(_end_here, trajectory)
    return sorted(addr for addr, had in done.items() if had)


def end_trajectory_everywhere(client: Any, trajectory: str) -> Any:
    """End a trajectory on every worker that has sandboxes; the addresses of those that had its dir."""
    return client.sync(_end_everywhere, client, trajectory)
