"""The small messages between the tangram scheduler plugin, its workers and clients.

Pure: no Dask import. Each message is a frozen dataclass with a msgpack-able
wire form (``to_msg`` / ``from_msg``) because Dask's comms carry msgpack.

- :class:`WorkerDeclaration`: worker -> scheduler, what a worker has
  (sandbox slots, GPUs with their topology groups and memory, API calls).
- :class:`Grant`: scheduler -> worker, in the task's annotation
  ``"tangram-grant"`` (:data:`GRANT_KEY`, beside the user's ``tangram``
  spec; :func:`granted` reads it): what the policy granted to one action.
- :class:`EndTrajectory`: client -> scheduler, a trajectory is over (its
  stateful actions have no home to return to any more).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

#: Scheduler RPC handlers the plugin installs (one spelling: snake_case).
DECLARE_HANDLER = "tangram_declare"
END_TRAJECTORY_HANDLER = "tangram_end_trajectory"
BEGIN_TRAJECTORY_HANDLER = "tangram_begin_trajectory"
EXPECT_TRAJECTORIES_HANDLER = "tangram_expect_trajectories"
SNAPSHOT_HANDLER = "tangram_snapshot"
#: Reward-model residency (tangram_dask.models): client -> scheduler, worker -> scheduler, scheduler -> worker.
REGISTER_MODEL_HANDLER = "tangram_register_model"
MODELS_HANDLER = "tangram_models"
RESIDENCY_HANDLER = "tangram_residency"  # a worker's stream message: a replica's state changed
WORKER_MODEL_HANDLER = "tangram_worker_model"  # the scheduler hands a worker a registration
WORKER_EVICT_HANDLER = "tangram_worker_evict"  # the scheduler asks a worker to evict an idle replica
STAYED_HANDLER = "tangram_state_stayed"  # a worker: a trajectory's state could not move here; it stays at the source
STARTED_HANDLER = "tangram_started"  # a worker's stream message: an action with a timeout_s starts executing
WORKER_LOAD_HANDLER = "tangram_worker_load"  # the scheduler asks a worker to load a replica ahead of its actions
UNSTARTED_HANDLER = "tangram_unstarted"  # the scheduler asks a paused worker which of its actions have not started


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
    device_uuids: tuple[str, ...] = ()  # NVML UUID (GPU-... or MIG-...) of each policy GPU, where known

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
        d["device_uuids"] = list(self.device_uuids)
        return d

    @classmethod
    def from_msg(cls, d: Mapping[str, Any]) -> "WorkerDeclaration":
        return cls(int(d.get("slots", 0)), int(d.get("gpus", 0)), float(d.get("gpu_memory_gb", 0.0)),
                   tuple(int(g) for g in d.get("groups", ())), int(d.get("api", 0)), str(d.get("source", "")),
                   tuple(int(i) for i in d.get("device_ids", ())), tuple(str(u) for u in d.get("device_uuids", ())))


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

    @classmethod
    def of_start(cls, start: Any, worker: str, device_ids: tuple[int, ...], setup_s: float) -> "Grant":
        """The one place a policy's ``Start`` becomes a grant: resolved to a Dask worker, with the
        device ids ``CUDA_VISIBLE_DEVICES`` names and the setup the cost model predicts."""
        return cls(start.units, start.node, worker, tuple(start.gpus), start.replica, start.load, tuple(start.evict),
                   start.restore, start.cross_group, start.sandbox, setup_s, tuple(device_ids), start.restore_from)

    def to_msg(self) -> tuple:
        """The wire form: the fields in order, a tuple (msgpack sends it as a list). Compact on
        purpose: Dask keeps recent compute-task messages (each batch of them, up to
        ``distributed.admin.low-level-log-length`` batches per worker), and a dict here cost
        about 700 bytes per action in that log."""
        return (self.units, self.node, self.worker, self.gpus, self.replica, self.load, self.evict, self.restore,
                self.cross_group, self.sandbox, self.setup_s, self.device_ids, self.restore_from)

    @classmethod
    def from_msg(cls, m: "Sequence[Any] | Mapping[str, Any]") -> "Grant":
        """The one parser of a grant's wire form (a sequence of the fields in order; a mapping of
        them by name is read too)."""
        if isinstance(m, Mapping):
            m = tuple(m.get(f, d) for f, d in _GRANT_FIELDS)
            if m[0] is None:
                raise ValueError("a grant needs 'units'")
        (units, node, worker, gpus, replica, load, evict, restore, cross_group, sandbox, setup_s, device_ids,
         restore_from) = tuple(m) + tuple(d for _, d in _GRANT_FIELDS[len(m):])
        return cls(int(units), str(node), str(worker), tuple(int(g) for g in gpus),
                   None if replica is None else int(replica), bool(load), tuple(int(r) for r in evict),
                   bool(restore), bool(cross_group), str(sandbox), float(setup_s),
                   tuple(int(i) for i in device_ids), str(restore_from))


#: Grant's fields in wire order, with the default a missing one takes (units has none).
_GRANT_FIELDS = (("units", None), ("node", ""), ("worker", ""), ("gpus", ()), ("replica", None), ("load", False),
                 ("evict", ()), ("restore", False), ("cross_group", False), ("sandbox", "warm"), ("setup_s", 0.0),
                 ("device_ids", ()), ("restore_from", ""))

#: The task annotation the scheduler plugin writes a grant under, beside the user's ``tangram`` spec (so the
#: spec dict, often one object shared by every task of a ``dask.annotate`` block, is never copied).
GRANT_KEY = "tangram-grant"


def granted(annotations: "Mapping[str, Any] | None") -> "Grant | None":
    """The grant in a task's annotations (None if the scheduler wrote none)."""
    m = annotations.get(GRANT_KEY) if annotations else None
    return Grant.from_msg(m) if m else None


@dataclass(frozen=True, slots=True)
class EndTrajectory:
    trajectory: str

    def to_msg(self) -> dict[str, Any]:
        return {"trajectory": self.trajectory}


@dataclass(frozen=True, slots=True)
class ModelRegistration:
    """client -> scheduler -> every worker: a reward model and how to load it.

    ``loader`` is the pickled ``(devices) -> scorer`` callable; ``memory_gb``
    is the declared memory of one replica (all its GPUs together) and
    ``load_s`` the declared load time, both replaced by what the first load
    measured; ``units`` is the (min, max) GPUs of one replica."""

    name: str
    loader: bytes
    memory_gb: float
    units: tuple[int, int] = (1, 1)
    load_s: float = 1.0

    def to_msg(self) -> dict[str, Any]:
        return {"name": self.name, "loader": self.loader, "memory_gb": self.memory_gb,
                "units": list(self.units), "load_s": self.load_s}

    @classmethod
    def from_msg(cls, d: Mapping[str, Any]) -> "ModelRegistration":
        lo, hi = d.get("units", (1, 1))
        return cls(str(d["name"]), bytes(d["loader"]), float(d["memory_gb"]), (int(lo), int(hi)),
                   float(d.get("load_s", 1.0)))


@dataclass(frozen=True, slots=True)
class ResidencyReport:
    """worker -> scheduler, each time one replica changes state (not on the heartbeat).

    ``state``: ``loading``, ``resident``, ``evicted`` or ``failed``; ``stalled`` after a load given up on
    at its deadline (its loader runs on, and may hold ``bytes_per_gpu`` on each of ``gpus``: load ``hold`` of
    the worker), ``unstalled`` once that loader returned and what it held is free.
    ``bytes_per_gpu``: what the replica holds on each of its GPUs, as
    ``measured_by`` says (``cuda``: CUDA's allocated memory, before and after
    the load; ``params``: the model's parameter bytes, split over its GPUs).
    For ``failed``: what the load measured it took though it did not fit (0
    where the load failed before it was measured).
    ``param_bytes`` is the parameter bytes of the whole replica either way.
    ``free_bytes``: each of the worker's GPUs' free memory after the change.
    ``first``: this was the worker process's first load of the model, so
    ``load_s`` includes what only a first load pays (the framework's import,
    the process's first CUDA use, a file read from cold storage): an upper
    bound on what loading it again costs."""

    replica: int
    model: str
    state: str
    gpus: tuple[int, ...] = ()
    bytes_per_gpu: int = 0
    param_bytes: int = 0
    measured_by: str = ""
    load_s: float = 0.0
    error: str = ""
    free_bytes: tuple[int, ...] = ()
    first: bool = False
    hold: int = 0  # "stalled" / "unstalled": which given-up load holds (or no longer holds) bytes_per_gpu

    def to_msg(self) -> dict[str, Any]:
        d = asdict(self)
        d["gpus"] = list(self.gpus)
        d["free_bytes"] = list(self.free_bytes)
        return d

    @classmethod
    def from_msg(cls, d: Mapping[str, Any]) -> "ResidencyReport":
        return cls(int(d["replica"]), str(d["model"]), str(d["state"]), tuple(int(g) for g in d.get("gpus", ())),
                   int(d.get("bytes_per_gpu", 0)), int(d.get("param_bytes", 0)), str(d.get("measured_by", "")),
                   float(d.get("load_s", 0.0)), str(d.get("error", "")),
                   tuple(int(b) for b in d.get("free_bytes", ())), bool(d.get("first", False)),
                   int(d.get("hold", 0)))
