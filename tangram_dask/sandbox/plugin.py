"""The Dask worker plugin that owns a worker's warm sandbox pool.

    client.register_plugin(SandboxPlugin(backend="auto", memory_bytes=512 * 2**20))

Options are checked here, in the client, so a wrong one fails at once. On each
worker, ``setup`` starts the pool (its size: the option, else the worker's
``slots`` resource, else its threads) under its ``root`` option, else in a new
0711 directory under /tmp; ``teardown`` closes every sandbox and removes that
directory.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from typing import Any

from distributed import WorkerPlugin

from ..dashboard import install_worker
from .api import DROP_HANDLER, PLUGIN_NAME, TAKE_HANDLER
from .options import PoolOptions
from .pool import SandboxPool


class SandboxPlugin(WorkerPlugin):
    """Warm sandboxes on every worker, for ``run_code``/``run_command`` in actions."""

    name = PLUGIN_NAME
    idempotent = False

    def __init__(self, options: PoolOptions | None = None, **kwargs: Any):
        # raises SandboxError for an unknown or bad option, naming it
        self.options = options if options is not None else PoolOptions.from_kwargs(**kwargs)
        self.pool: SandboxPool | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "pool": None}

    async def setup(self, worker: Any) -> None:
        size = self.options.size
        if size is None:
            slots = worker.state.total_resources.get("slots")
            size = int(slots) if slots else worker.state.nthreads
        # no root given: the pool makes a 0711 one under /tmp (removed at teardown), not one in the worker's
        # local directory, which Dask makes 0700 and a root worker's code uid (65534) could not pass
        self.pool = SandboxPool(replace(self.options, size=max(1, size)))
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", str(worker.name))[:40]
        self.pool.root_prefix = f"tangram-sandbox-{name}-"
        await asyncio.to_thread(self.pool.start)
        worker.handlers[TAKE_HANDLER] = self._take
        worker.handlers[DROP_HANDLER] = self._drop
        install_worker(worker, self)  # the pool on the Tangram dashboard page and the worker's /metrics

    async def _take(self, trajectory: str) -> bytes | None:
        """Another worker takes over a trajectory the scheduler moved: a snapshot of its dir.

        The dir stays here until that worker confirms the restore (:meth:`_drop`); a
        snapshot no restore would accept raises here, before anything is removed. While an action
        of the trajectory runs here with the dir, the snapshot waits for it to end (the pool's
        ``start_timeout_s`` at most, then :class:`SandboxError`, and the moved action fails saying so).
        Before session 34 that case answered "nothing here", and the moved action started with an
        empty dir while the trajectory's files stayed here.
        """
        pool = self.pool
        if pool is None or not pool.holds_trajectory(trajectory):
            return None
        return await asyncio.to_thread(pool.snapshot_trajectory, trajectory, pool.options.start_timeout_s)

    async def _drop(self, trajectory: str) -> bool:
        """The destination restored the trajectory: remove it here."""
        pool = self.pool
        return pool is not None and await asyncio.to_thread(pool.end_trajectory, trajectory)

    async def teardown(self, worker: Any) -> None:
        pool, self.pool = self.pool, None
        if pool is not None:
            await asyncio.to_thread(pool.close)
