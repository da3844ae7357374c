"""The small messages between the tangram scheduler plugin, its workers and clients.

Pure: no Dask import. Each message is a frozen dataclass with a plain-dict
wire form (``to_msg`` / ``from_msg``) because Dask's comms carry msgpack.

- :class:`WorkerDeclaration`: worker -> scheduler, what a worker has
  (sandbox slots, GPUs with their topology groups and memory, API calls).
- :class:`Grant`: scheduler -> worker, inside the task's ``tangram``
  annotation (key ``"grant"``): what the policy granted to one action.
- :class:`EndTrajectory`: client -> scheduler, a trajectory is over (its
  stateful actions have no home to return to any more).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping

#: Scheduler RPC handlers the plugin installs (one spelling: snake_case).
DECLARE_HANDLER = "tangram_declare"
END_TRAJECTORY_HANDLER = "tangram_end_trajectory"
BEGIN_TRAJECTORY_HANDLER = "tangram_begin_trajectory"
SNAPSHOT_HANDLER = "tangram_snapshot"


@dataclass(frozen=True, slots=True)
class WorkerDeclaration:
    """What one worker offers. A worker is a GPU node if ``gpus`` > 0, else a
    CPU node if ``slots`` > 0; ``api`` > 0 says it may run API calls (that many
    at once). ``source`` says where the GPU facts came from: ``"nvml"``,
    ``"config"`` or ``"resources"``."""

    slots: int = 0
    gpus: int = 0
    gpu_memory_gb: float = 0.0
    groups: tuple[int, ...] = ()
    api: int = 0
    source: str = "resources"
    device_ids: tuple[int, ...] = ()  # device index of each policy GPU (NVML may reorder)

    def __post_init__(self) -> None:
        if self.gpus and sum(self.groups) != self.gpus:
            raise ValueError(f"GPU groups {list(self.groups)} must sum to gpus = {self.gpus}")

    @property
    def role(self) -> str:
        return "gpu" if self.gpus else ("cpu" if self.slots else ("api" if self.api else "none"))

    def to_msg(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = list(self.groups)
        d["device_ids"] = list(self.device_ids)
        return d

    @classmethod
    def from_msg(cls, d: Mapping[str, Any]) -> "WorkerDeclaration":
        return cls(int(d.get("slots", 0)), int(d.get("gpus", 0)), float(d.get("gpu_memory_gb", 0.0)),
                   tuple(int(g) for g in d.get("groups", ())), int(d.get("api", 0)), str(d.get("source", "")),
                   tuple(int(i) for i in d.get("device_ids", ())))


@dataclass(frozen=True, slots=True)
class Grant:
    """What the policy granted to one action (a :class:`~tangram_dask.policy.Start`, resolved
    to a Dask worker). ``setup_s`` is the scheduler's estimate of the setup the
    action pays before its work (sandbox start, state restore, model load), in
    workload seconds; the observed run time handed back to the policy excludes it."""

    units: int
    node: str
    worker: str = ""
    gpus: tuple[int, ...] = ()
    replica: int | None = None
    load: bool = False
    evict: tuple[int, ...] = ()
    restore: bool = False
    cross_group: bool = False
    sandbox: str = "warm"
    setup_s: float = 0.0
    device_ids: tuple[int, ...] = ()  # what CUDA_VISIBLE_DEVICES names (= gpus unless NVML reordered)
    restore_from: str = ""  # with restore: the worker that holds the trajectory's state

    def to_msg(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = list(self.gpus)
        d["evict"] = list(self.evict)
        d["device_ids"] = list(self.device_ids)
        return d

    @classmethod
    def from_msg(cls, d: Mapping[str, Any]) -> "Grant":
        return cls(int(d["units"]), str(d.get("node", "")), str(d.get("worker", "")),
                   tuple(int(g) for g in d.get("gpus", ())), d.get("replica"), bool(d.get("load", False)),
                   tuple(int(r) for r in d.get("evict", ())), bool(d.get("restore", False)),
                   bool(d.get("cross_group", False)), str(d.get("sandbox", "warm")), float(d.get("setup_s", 0.0)),
                   tuple(int(i) for i in d.get("device_ids", ())), str(d.get("restore_from", "")))


@dataclass(frozen=True, slots=True)
class EndTrajectory:
    trajectory: str

    def to_msg(self) -> dict[str, Any]:
        return {"trajectory": self.trajectory}
