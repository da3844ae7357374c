"""Options of the sandbox pool and the per-action limits, checked where written.

Both are frozen dataclasses that raise :class:`tangram_dask.SandboxError` at
construction for a bad value, naming the option and the fix, so a wrong
option fails in the client (``SandboxPlugin(...)``), not later on a worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import SandboxError

BACKENDS = ("auto", "bwrap", "process")
MiB = 1 << 20

#: Why an action ended, as :attr:`RunResult.reason` says it.
REASONS = ("ok", "error", "timeout", "memory", "output_limit", "file_limit", "killed")


def _bad(name: str, value: object, need: str) -> SandboxError:
    return SandboxError(f"sandbox option {name!r} = {value!r}: {need}")


def _positive(name: str, value: object, *, integer: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    number = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not number or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        kind = "a whole number" if integer else "a finite number"
        raise _bad(name, value, f"must be {kind} > 0" + (" (or None)" if optional else ""))


@dataclass(frozen=True, slots=True)
class Limits:
    """What one action may use. ``cpu_s=None`` means ``timeout_s`` times its units.

    ``work_bytes`` and ``work_files`` bound the action's writable places together
    (working dir, /tmp, /dev/shm: one tmpfs), where the sandbox has a mount namespace.
    """

    timeout_s: float = 10.0
    cpu_s: float | None = None
    memory_bytes: int = 1024 * MiB
    output_bytes: int = 1 * MiB
    file_bytes: int = 64 * MiB
    procs: int = 64
    open_files: int = 256
    work_bytes: int = 256 * MiB
    work_files: int = 20_000

    def __post_init__(self) -> None:
        _positive("timeout_s", self.timeout_s)
        _positive("cpu_s", self.cpu_s, optional=True)
        for name in ("memory_bytes", "output_bytes", "file_bytes", "procs", "open_files", "work_bytes",
                     "work_files"):
            _positive(name, getattr(self, name), integer=True)
        if self.memory_bytes < 64 * MiB:
            raise _bad("memory_bytes", self.memory_bytes,
                       "below 64 MiB a Python interpreter cannot run; give at least 64 * 2**20")

    def merged(self, **overrides: Any) -> "Limits":
        """These limits with the given fields replaced (None leaves a field as it is)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise _bad(unknown[0], overrides[unknown[0]], f"unknown limit; known: {', '.join(sorted(known))}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True, slots=True)
class PoolOptions:
    """How a worker's sandbox pool is run.

    ``size``: sandboxes kept warm (None: the worker's ``slots`` resource, else its
    threads). ``max_starting``: sandboxes starting at once. ``max_uses``: a sandbox
    is replaced after this many actions. ``uid``: the user id untrusted code runs
    as when the worker is root ("auto": 65534, nobody; None: the worker's own).
    ``root``: the directory holding the sandboxes' dirs (None: a new 0711 directory
    under /tmp, made at pool start and removed at close). ``python``: the sandboxes'
    interpreter (None: the worker's own where the code's uid can run it, else a
    system ``python3`` it can; see :func:`~tangram_dask.sandbox.backends.resolve_python`).
    ``preload``: modules the warm interpreter
    imports once, so forked actions have them already. ``strict``: refuse to start
    a sandbox that cannot give each action fresh writable places (the process
    backend without namespaces). ``cgroup``: a delegated cgroup v2 dir (no
    processes in it) under which each sandbox gets its own cgroup with
    ``memory.max``, ``pids.max`` and ``cpu.max`` (None: rlimits only).
    """

    backend: str = "auto"
    size: int | None = None
    max_starting: int = 2
    max_uses: int = 100
    limits: Limits = field(default_factory=Limits)
    trajectory_ttl_s: float = 3600.0
    uid: int | str | None = "auto"
    root: str | None = None
    python: str | None = None
    preload: tuple[str, ...] = ()
    ro_binds: tuple[str, ...] = ()
    start_timeout_s: float = 30.0
    strict: bool = False
    cgroup: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise _bad("backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        _positive("size", self.size, integer=True, optional=True)
        _positive("max_starting", self.max_starting, integer=True)
        _positive("max_uses", self.max_uses, integer=True)
        _positive("trajectory_ttl_s", self.trajectory_ttl_s)
        _positive("start_timeout_s", self.start_timeout_s)
        if not isinstance(self.limits, Limits):
            raise _bad("limits", self.limits, "must be a tangram_dask.sandbox.Limits")
        if not (self.uid is None or self.uid == "auto" or (isinstance(self.uid, int)
                                                          and not isinstance(self.uid, bool) and self.uid > 0)):
            raise _bad("uid", self.uid, "must be 'auto', None (the worker's own) or a user id > 0")
        if self.python is not None and not (isinstance(self.python, str) and self.python):
            raise _bad("python", self.python, "must be None (chosen on the worker) or an interpreter's path")
        if not isinstance(self.preload, tuple) or not all(isinstance(m, str) for m in self.preload):
            raise _bad("preload", self.preload, "must be a tuple of module names")
        if not isinstance(self.ro_binds, tuple) or not all(isinstance(p, str) and p.startswith("/")
                                                          for p in self.ro_binds):
            raise _bad("ro_binds", self.ro_binds, "must be a tuple of absolute paths")
        if not isinstance(self.strict, bool):
            raise _bad("strict", self.strict, "must be True or False")
        if self.cgroup is not None and not (isinstance(self.cgroup, str) and self.cgroup.startswith("/")):
            raise _bad("cgroup", self.cgroup, "must be None or the absolute path of a delegated cgroup v2 dir")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "PoolOptions":
        """Pool options from flat keywords: limit fields (``timeout_s``...) go to ``limits``."""
        limit_names = {f.name for f in fields(Limits)}
        pool_names = {f.name for f in fields(cls)}
        lim = {k: kwargs.pop(k) for k in list(kwargs) if k in limit_names}
        unknown = sorted(set(kwargs) - pool_names)
        if unknown:
            raise _bad(unknown[0], kwargs[unknown[0]],
                       f"unknown option; known: {', '.join(sorted(pool_names | limit_names))}")
        if "preload" in kwargs and isinstance(kwargs["preload"], list):
            kwargs["preload"] = tuple(kwargs["preload"])
        if "ro_binds" in kwargs and isinstance(kwargs["ro_binds"], list):
            kwargs["ro_binds"] = tuple(kwargs["ro_binds"])
        base = kwargs.pop("limits", None) or Limits()
        return cls(limits=base.merged(**lim), **kwargs)
