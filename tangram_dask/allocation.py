"""What the scheduler granted to the action that is running now.

The scheduler plugin writes the grant into the task's annotations (key
``"tangram-grant"``, beside the user's ``tangram`` spec; a
:class:`tangram_dask.messages.Grant`) before the task
reaches its worker; inside the running task :func:`current_allocation` reads
it back: units, GPU ids (and ``CUDA_VISIBLE_DEVICES``), the replica, whether
the model was loaded or the trajectory restored for it. Outside an action it
returns None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .messages import GRANT_KEY, Grant


@dataclass(frozen=True, slots=True)
class Allocation:
    """The units granted to one running action."""

    kind: str
    resource: str
    units: int
    node: str = ""
    gpus: tuple[int, ...] = ()
    replica: int | None = None  # the policy's replica id
    model: str | None = None
    trajectory: str | None = None
    affinity: str | None = None
    timeout_s: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    # what the scheduler plugin decided besides the units (see tangram_dask.messages.Grant)
    worker: str = ""
    load: bool = False
    restore: bool = False
    cross_group: bool = False
    sandbox: str = "warm"
    setup_s: float = 0.0
    device_ids: tuple[int, ...] = ()
    restore_from: str = ""  # with restore: the worker that held the trajectory's state
    evict: tuple[int, ...] = ()  # replicas (policy ids) to evict before loading this one

    @property
    def cuda_visible_devices(self) -> str:
        """The ``CUDA_VISIBLE_DEVICES`` value for this action ("" for a non-GPU action)."""
        return ",".join(str(i) for i in (self.device_ids or self.gpus))

    def env(self) -> dict[str, str]:
        """Environment for a subprocess or server the action starts (names its GPUs, numbered as NVML
        numbers them: PCI bus order)."""
        if not self.gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": self.cuda_visible_devices, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

    @classmethod
    def from_annotation(cls, ann: Mapping[str, Any], grant_msg: Any = None) -> "Allocation":
        """From a task's ``tangram`` annotation (the user's spec fields) and the scheduler's grant
        (``grant_msg``, the task's ``"tangram-grant"`` annotation; else a ``grant`` key in ``ann``), parsed
        by :meth:`tangram_dask.messages.Grant.from_msg` (the one parser of the grant's wire form)."""
        g = grant_msg if grant_msg is not None else ann.get("grant")
        grant = Grant.from_msg(g) if g else Grant(int(ann.get("units_min", 1)), "")
        return cls(
            kind=ann.get("kind", ""),
            resource=ann.get("resource", "cpu"),
            units=grant.units,
            node=grant.node,
            gpus=grant.gpus,
            replica=grant.replica,
            model=ann.get("model"),
            trajectory=ann.get("trajectory"),
            affinity=ann.get("affinity"),
            timeout_s=ann.get("timeout_s"),
            worker=grant.worker,
            load=grant.load,
            restore=grant.restore,
            cross_group=grant.cross_group,
            sandbox=grant.sandbox,
            setup_s=grant.setup_s,
            device_ids=grant.device_ids,
            restore_from=grant.restore_from,
            evict=grant.evict,
        )


def current_allocation() -> Allocation | None:
    """The allocation of the action running in this thread, or None outside one."""
    try:
        from distributed import get_worker
        from distributed.worker import thread_state
    except ImportError:  # pragma: no cover - distributed is a dependency
        return None
    key = getattr(thread_state, "key", None)
    if key is None:
        return None
    try:
        worker = get_worker()
    except ValueError:
        return None
    ts = worker.state.tasks.get(key)
    anns = (ts.annotations or {}) if ts is not None else {}
    ann = anns.get("tangram")
    if not ann:
        return None
    return Allocation.from_annotation(ann, anns.get(GRANT_KEY))
