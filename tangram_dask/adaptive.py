"""An elastic pool: worker targets per kind from the policy's demand, and retirement that loses nothing.

Two halves in one module:

**The pure part** (no Dask import at module level): :func:`compute_targets`
turns plain data (the policy snapshot's pools, its unplaceable shortfalls,
its nodes, which kind each worker is, the worker kinds a scaler can create,
the models and the target duration) into :class:`Targets`, one
:class:`KindTarget` per worker kind. :func:`choose_to_close` says which
workers of a kind with a surplus may leave, and :func:`plan_moves` where the
trajectory state on them goes first. Tests are tables of named cases
(tests/test_adaptive_targets.py).

**The Dask glue** (:func:`install`, called once from
``TangramSchedulerPlugin.start``): it reads ``plugin.policy.snapshot()`` and
``plugin.nodes`` and decides nothing itself.

- ``scheduler.adaptive_target`` and ``scheduler.handlers["adaptive_target"]``
  return :attr:`Targets.total`, so ``cluster.adapt()``, the RPC and
  ``/api/v1/adaptive_target`` agree; ``/api/v1/tangram/targets`` and the
  ``tangram_targets`` RPC return the per-kind targets.
- A scheduler plugin (``tangram-adaptive``) implements
  ``valid_workers_downscaling``, so ``Scheduler.workers_to_close`` (and
  ``retire_workers`` and ``/api/v1/retire_workers`` through it) only offers
  workers of a kind with a surplus that run no action, hold no resident
  replica that waiting actions need and home no trajectory.
- By default a trajectory's home pins its worker until the trajectory ends or
  the policy moves it. With ``tangram.adaptive.move-state`` the
  ``workers_to_close`` RPC (what ``Adaptive`` and the dask-kubernetes
  operator's fallback call) and the ``tangram_drain`` RPC (what
  ``tangram-dask k8s-scale`` calls before lowering a group) first move the
  trajectory state off the workers chosen to leave: the destination worker
  takes the working dir from the source (the sandbox plugin's
  ``tangram_sandbox_take``/``tangram_sandbox_drop``, as a scheduler move does)
  and the policy is told (``Policy.rehome``). That races an action of the
  trajectory placed on the source meanwhile (docs/kubernetes.md), hence off.
- ``retire_workers`` re-checks each worker at the moment it is retired and
  leaves out any that became unsafe since it was chosen; the ones it retires
  leave the policy first, so nothing new is placed there.

Worker kinds come from ``kinds=`` or the dask config ``tangram.adaptive.kinds``
(a list of ``{name, slots}`` or ``{name, gpus, gpu-memory-gb, groups}``); a
worker is of the kind whose shape it declares. Without them each distinct
shape among the current workers is a kind (``cpu-4``, ``gpu-2x24``), and
so are the shapes seen before of a role no current worker has (a pool
adapted down to no worker grows again), which is enough for
``cluster.adapt()`` on a LocalCluster.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from .cluster import ModelSpec
from .policy.types import NodeStats, PoolStats, Shortfall

logger = logging.getLogger("tangram_dask.adaptive")

#: Names the glue installs.
TARGETS_HANDLER = "tangram_targets"
DRAIN_HANDLER = "tangram_drain"
TARGETS_ROUTE = "/api/v1/tangram/targets"
EXTENSION_NAME = "tangram-adaptive"


# -- the pure part -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerKind:
    """A shape of worker a scaler can create: CPU sandbox slots, or GPUs of one memory size.

    On Kubernetes each kind is one ``DaskWorkerGroup`` (``group``: its name,
    default the kind's name)."""

    name: str
    slots: int = 0
    gpus: int = 0
    gpu_memory_gb: float = 0.0
    groups: tuple[int, ...] = ()
    group: str = ""

    def __post_init__(self) -> None:
        if (self.slots > 0) == (self.gpus > 0):
            raise ValueError(f"worker kind {self.name!r}: give slots (a CPU kind) or gpus (a GPU kind), not both "
                             f"nor neither (slots={self.slots}, gpus={self.gpus})")
        if self.gpus and not self.gpu_memory_gb > 0:
            raise ValueError(f"worker kind {self.name!r}: a GPU kind needs gpu_memory_gb > 0")

    @property
    def role(self) -> str:
        return "gpu" if self.gpus else "cpu"

    def replica_gpus(self, model: ModelSpec, units_min: int) -> int | None:
        """GPUs one replica of ``model`` for actions of ``units_min`` takes here; None if it cannot fit.
        The same rule as the policy's feasibility check: on one node, memory split evenly."""
        k = model.replica_gpus(units_min, self.gpu_memory_gb)
        return k if k <= self.gpus else None

    def matches(self, slots: int, gpus: int, gpu_memory_gb: float) -> bool:
        if self.gpus:
            return gpus == self.gpus and abs(gpu_memory_gb - self.gpu_memory_gb) < 0.5
        return not gpus and slots == self.slots

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "WorkerKind":
        mem = d.get("gpu-memory-gb", d.get("gpu_memory_gb", 0.0))
        return cls(str(d["name"]), int(d.get("slots", 0)), int(d.get("gpus", 0)), float(mem or 0.0),
                   tuple(int(g) for g in d.get("groups", ()) or ()), str(d.get("group", "")))

    def to_msg(self) -> dict[str, Any]:
        d = asdict(self)
        d["groups"] = list(self.groups)
        return d


@dataclass(frozen=True, slots=True)
class KindTarget:
    """How many workers of one kind the demand asks for.

    ``current``: workers of the kind now; ``pinned``: those that may not leave
    (an action runs there, or a resident replica waiting actions need);
    ``need``: the demand in the kind's units (slots or GPUs) within the target
    duration; ``why``: in words."""

    kind: str
    role: str
    current: int
    target: int
    pinned: int = 0
    need: float = 0.0
    why: str = ""
    group: str = ""


@dataclass(frozen=True)
class Targets:
    """Per-kind targets; ``total`` is what ``adaptive_target`` returns (unmanaged workers are kept)."""

    kinds: tuple[KindTarget, ...]
    unmanaged: int = 0
    unservable: tuple[str, ...] = ()  # demand no kind can ever serve, in words

    @property
    def total(self) -> int:
        return sum(k.target for k in self.kinds) + self.unmanaged

    def of(self, kind: str) -> KindTarget | None:
        return next((k for k in self.kinds if k.kind == kind), None)

    def to_msg(self) -> dict[str, Any]:
        return {"total": self.total, "unmanaged": self.unmanaged, "unservable": list(self.unservable),
                "kinds": {k.kind: asdict(k) for k in self.kinds}}


def classify(slots: int, gpus: int, gpu_memory_gb: float, kinds: Sequence[WorkerKind]) -> str | None:
    """The kind a worker of this shape belongs to (None: no kind, so no scaler manages it)."""
    for k in kinds:
        if k.matches(slots, gpus, gpu_memory_gb):
            return k.name
    return None


def kinds_from_shapes(shapes: Iterable[tuple[int, int, float]]) -> tuple[WorkerKind, ...]:
    """One kind per distinct (slots, gpus, gpu_memory_gb) shape, CPU kinds first (largest slots first)."""
    out: dict[str, WorkerKind] = {}
    for slots, gpus, mem in shapes:
        if gpus:
            k = WorkerKind(f"gpu-{gpus}x{mem:g}", gpus=gpus, gpu_memory_gb=mem)
        elif slots:
            k = WorkerKind(f"cpu-{slots}", slots=slots)
        else:
            continue
        out.setdefault(k.name, k)
    return tuple(sorted(out.values(), key=lambda k: (k.role != "cpu", -k.slots, k.gpus, k.gpu_memory_gb)))


def _queue_units(pool: PoolStats, target_duration_s: float) -> float:
    """Units the waiting actions of a pool need to finish within the target duration (at units.min),
    never more than the sum of their units.min (a few long actions do not ask for many units)."""
    if not pool.queued:
        return 0.0
    units = pool.queued_units or pool.queued
    if pool.queued_work_s <= 0:
        return float(units)
    return min(math.ceil(pool.queued_work_s / target_duration_s - 1e-9), units)


def _smallest(kinds: Iterable[WorkerKind]) -> WorkerKind | None:
    return min(kinds, key=lambda k: (k.slots, k.gpus, k.gpu_memory_gb), default=None)


def compute_targets(pools: Sequence[PoolStats], unplaceable: Sequence[Shortfall], nodes: Sequence[NodeStats],
                    workers: Mapping[str, str | None], kinds: Sequence[WorkerKind], models: Mapping[str, ModelSpec],
                    target_duration_s: float) -> Targets:
    """Workers wanted per kind. Pure.

    - ``pools``, ``unplaceable``, ``nodes``: the policy snapshot's fields.
    - ``workers``: every worker address -> its kind's name (None: of no kind; it is kept and counted).
    - ``kinds``: the shapes a scaler can create, in order of preference (the
      first CPU kind is the one CPU demand grows).

    CPU: slots busy now + what the waiting CPU actions need within the target
    duration (``queued_work_s / target``, at most their ``queued_units``),
    divided by the kind's slots. GPU: per model, the replicas busy now plus the
    replicas the waiting actions need within the target duration, each on the
    smallest GPU kind that can hold a replica, packed ``gpus // replica`` per
    worker. API actions need one CPU worker to run on. GPU demand never grows
    a CPU kind and CPU demand never grows a GPU kind. An action no current
    worker can hold (a shortfall with ``never``) asks for one worker of the
    smallest kind that can hold it; if none can, it is listed in
    ``unservable``. A kind never goes below its pinned workers (running an
    action, or holding a replica that waiting actions need); while any
    trajectory's state lives on a node, the CPU target stays >= 1 so it has
    somewhere to go.
    """
    if not target_duration_s > 0:
        raise ValueError(f"target duration must be > 0, got {target_duration_s}")
    cpu_kinds = [k for k in kinds if k.role == "cpu"]
    gpu_kinds = [k for k in kinds if k.role == "gpu"]
    current = {k.name: 0 for k in kinds}
    unmanaged = 0
    for addr, kname in workers.items():
        if kname in current:
            current[kname] += 1
        else:
            unmanaged += 1
    pinned = {k.name: 0 for k in kinds}
    homes = 0
    cpu_busy = 0
    for n in nodes:
        kname = workers.get(n.node)
        homes += n.homes
        if n.resource == "cpu":
            cpu_busy += max(n.capacity - n.free, 0)
        if kname in pinned and (n.running > 0 or n.replicas_needed > 0):
            pinned[kname] += 1
    need = {k.name: 0.0 for k in kinds}  # in workers (fractional until the end)
    units = {k.name: 0.0 for k in kinds}
    why: dict[str, list[str]] = {k.name: [] for k in kinds}
    floor = {k.name: 0 for k in kinds}
    unservable: list[str] = []
    pool = {p.pool or p.resource: p for p in pools}

    # CPU: the first CPU kind takes the demand; the others keep their pinned workers
    cpu = pool.get("cpu")
    if cpu_kinds:
        primary = cpu_kinds[0]
        q = _queue_units(cpu, target_duration_s) if cpu is not None else 0.0
        kept = sum(pinned[k.name] * k.slots for k in cpu_kinds[1:])
        slots = max(cpu_busy + q - kept, 0.0)
        need[primary.name] = slots / primary.slots
        units[primary.name] = cpu_busy + q
        if slots:
            why[primary.name].append(f"{cpu_busy} slots busy + {q:g} for {cpu.queued if cpu else 0} waiting "
                                     f"within {target_duration_s:g}s")
        api = pool.get("api")
        if api is not None and (api.queued or api.running) and not unmanaged:
            floor[primary.name] = max(floor[primary.name], 1)
            why[primary.name].append("API actions need a worker to run on")
        if homes:
            floor[primary.name] = max(floor[primary.name], 1)
    elif cpu is not None and cpu.queued:
        unservable.append(f"{cpu.queued} CPU actions wait and no CPU worker kind is configured")

    # GPU: per model, on the smallest kind that holds a replica
    model_pools = [p for p in pools if p.resource == "gpu" and p.pool not in ("", "gpu")]
    if not model_pools and pool.get("gpu") is not None and pool["gpu"].queued:
        model_pools = []  # per-model figures missing: demand cannot be sized per model
        unservable.append(f"{pool['gpu'].queued} GPU actions wait but the snapshot has no per-model pools")
    for p in model_pools:
        model = models.get(p.pool)
        if model is None:
            if p.queued:
                unservable.append(f"{p.queued} actions of unknown model {p.pool!r}")
            continue
        u = max(1, math.ceil((p.queued_units or p.queued) / p.queued)) if p.queued else 1
        fits = [(k, k.replica_gpus(model, u)) for k in gpu_kinds]
        fits = [(k, r) for k, r in fits if r is not None]
        if not fits:
            if p.queued:
                unservable.append(f"{p.queued} actions of model {p.pool} ({model.gpu_memory_gb:g} GB, "
                                  f"{u} GPUs) fit no GPU worker kind")
            continue
        kind, r = min(fits, key=lambda kr: (kr[0].gpus, kr[0].gpu_memory_gb))
        action_s = p.queued_work_s / u if p.queued_work_s > 0 else 0.0
        wanted = min(math.ceil(action_s / target_duration_s - 1e-9), p.queued) if action_s else p.queued
        replicas = p.running + wanted
        per_worker = kind.gpus // r
        need[kind.name] += replicas / per_worker
        units[kind.name] += replicas * r
        if replicas:
            why[kind.name].append(f"{p.pool}: {p.running} replicas busy + {wanted} for {p.queued} waiting, "
                                  f"{r} GPUs each")

    # actions no current worker can hold: one worker of the smallest kind that can
    for sf in unplaceable:
        if not sf.never:
            continue
        if sf.resource == "cpu":
            k = _smallest(c for c in cpu_kinds if c.slots >= sf.requested)
        elif sf.resource == "gpu":
            model = models.get(sf.pool)
            k = _smallest(g for g in gpu_kinds if model is not None and g.replica_gpus(model, sf.requested))
        else:
            k = None  # API quota: no worker adds tokens
        if k is None:
            unservable.append(sf.reason or f"{sf.kind}: {sf.requested} {sf.resource} units fit no worker kind")
            continue
        if floor[k.name] < 1:
            why[k.name].append(f"{sf.kind or sf.resource} needs a worker with {sf.requested} "
                               f"{'slots' if sf.resource == 'cpu' else 'GPUs'}")
        floor[k.name] = max(floor[k.name], 1)

    out = []
    for k in kinds:
        t = max(math.ceil(need[k.name] - 1e-9), floor[k.name], pinned[k.name])
        out.append(KindTarget(k.name, k.role, current[k.name], t, pinned[k.name], units[k.name],
                              "; ".join(why[k.name]) or "no demand", k.group or k.name))
    return Targets(tuple(out), unmanaged, tuple(unservable))


def choose_to_close(targets: Targets, nodes: Sequence[NodeStats], workers: Mapping[str, str | None],
                    busy: Iterable[str] = ()) -> list[str]:
    """Workers that may leave: per kind with a surplus (current > target), that many of its safe
    workers (no running action, no replica waiting actions need, not ``busy`` in Dask), those with
    the fewest trajectory homes first (each home is a move). Pure."""
    stats = {n.node: n for n in nodes}
    busy = set(busy)
    out: list[str] = []
    for kt in targets.kinds:
        surplus = kt.current - kt.target
        if surplus <= 0:
            continue
        safe = []
        for addr, kname in workers.items():
            if kname != kt.kind or addr in busy:
                continue
            n = stats.get(addr)
            if n is not None and (n.running or n.replicas_needed):
                continue
            safe.append((n.homes if n is not None else 0, n.capacity - n.free if n is not None else 0, addr))
        out.extend(addr for _, _, addr in sorted(safe)[:surplus])
    return out


def plan_moves(homes: Mapping[str, Sequence[str]], leaving: Iterable[str], nodes: Sequence[NodeStats],
               ) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Where the trajectories homed on ``leaving`` nodes go: ``[(trajectory, source, destination)]``,
    and the leaving nodes that cannot be emptied (no CPU node stays). Destinations are the CPU nodes
    that stay, the one with the fewest homes per slot first. Pure."""
    leaving = list(dict.fromkeys(leaving))
    gone = set(leaving)
    stay = [n for n in nodes if n.resource == "cpu" and n.node not in gone]
    load = {n.node: float(n.homes) for n in stay}
    cap = {n.node: max(n.capacity, 1) for n in stay}
    moves: list[tuple[str, str, str]] = []
    stuck: list[str] = []
    for src in leaving:
        ts = list(homes.get(src, ()))
        if not ts:
            continue
        if not stay:
            stuck.append(src)
            continue
        for t in ts:
            dst = min(load, key=lambda a: (load[a] / cap[a], a))
            load[dst] += 1
            moves.append((t, src, dst))
    return moves, stuck


def next_kind(targets: Targets, counts: Mapping[str, int]) -> str | None:
    """The kind a new worker should be: the one furthest below its target (``counts``: workers of each
    kind there or on their way); None when every kind has its target. Pure."""
    best, gap = None, 0
    for k in targets.kinds:
        g = k.target - counts.get(k.kind, 0)
        if g > gap:
            best, gap = k.kind, g
    return best


# -- the Dask glue -------------------------------------------------------------------------------
def configured_kinds(config: Any = None) -> tuple[WorkerKind, ...]:
    """Kinds from ``tangram.adaptive.kinds`` (dask config), if set."""
    if config is None:
        import dask.config
        config = dask.config.get("tangram.adaptive.kinds", default=None)
    return tuple(WorkerKind.from_dict(d) for d in (config or ()))


async def _receive_trajectory(trajectory: str, source: str, dask_worker: Any = None) -> int:
    """Runs on the destination worker: take a trajectory's working dir from ``source`` and keep it here.
    Returns the bytes moved (0: the source had none)."""
    from .sandbox.api import PLUGIN_NAME as SANDBOX, TAKE_HANDLER

    plugin = dask_worker.plugins.get(SANDBOX)
    pool = getattr(plugin, "pool", None)
    if pool is None:
        raise RuntimeError(f"worker {dask_worker.address} has no sandbox pool to receive {trajectory}")
    from .sandbox import api

    data = await getattr(dask_worker.rpc(source), TAKE_HANDLER)(trajectory=trajectory)
    if not data:
        return 0
    await asyncio.to_thread(pool.restore_trajectory, trajectory, data)
    drop = getattr(api, "DROP_HANDLER", None)  # the source keeps its copy until the restore is confirmed
    if drop is not None:
        try:
            await getattr(dask_worker.rpc(source), drop)(trajectory=trajectory)
        except Exception as e:  # restored here all the same; the source's copy goes with the worker or its TTL
            logger.warning("tangram: %s could not drop its copy of trajectory %s (%s: %s)", source, trajectory,
                           type(e).__name__, e)
    return len(data)


def _plain(value: Any) -> Any:
    """A worker's ``run`` reply carries its result serialized."""
    from distributed.protocol import Serialized, deserialize
    if isinstance(value, Serialized):
        return deserialize(value.header, value.frames)
    return value


@dataclass
class DrainStats:
    moved: int = 0
    bytes: int = 0
    failed: int = 0
    retired: int = 0
    refused: int = 0
    log: list = field(default_factory=list)


class AdaptiveExtension:
    """The scheduler side of the elastic pool (a scheduler plugin named ``tangram-adaptive``)."""

    name = EXTENSION_NAME
    idempotent = True

    def __init__(self, plugin: Any, scheduler: Any, kinds: Sequence[WorkerKind] | None = None,
                 move_state: bool | None = None):
        self.plugin = plugin
        self.scheduler = scheduler
        self._kinds = tuple(kinds) if kinds else configured_kinds()
        if move_state is None:
            import dask.config
            move_state = bool(dask.config.get("tangram.adaptive.move-state", default=False))
        #: move trajectory state off a worker to retire it (else a trajectory's home pins its worker
        #: until the trajectory ends or the policy moves it); see "Known window" in docs/kubernetes.md
        self.move_state = move_state
        self.stats = DrainStats()
        self._drain_lock = asyncio.Lock()
        self.autoscaled = False
        #: the (slots, gpus, gpu_memory_gb) shapes of the workers seen, without configured kinds (:meth:`kinds`)
        self._seen: dict[tuple[int, int, float], None] = {}
        #: workers a scaler drained for retirement (address -> expiry, monotonic); while any is
        #: unexpired, only they are offered (so shrinking one group never retires another's worker)
        self.reserved: dict[str, float] = {}

    # -- reading the world -------------------------------------------------------------------
    def kinds(self) -> tuple[WorkerKind, ...]:
        """The configured kinds, else the shapes of the current workers, and the shapes seen before of a role
        (CPU, GPU) no current worker has: a pool adapted down to no worker (``cluster.adapt()``'s minimum is 0)
        still knows what to grow. With the current shapes only, it asked for 0 workers and waited for ever."""
        if self._kinds:
            return self._kinds
        now = dict.fromkeys((d.slots, d.gpus, d.gpu_memory_gb) for d in self.plugin.nodes.values())
        for shape in now:
            self._seen.pop(shape, None)
            self._seen[shape] = None  # the most recent last
        roles = {"gpu" if g else "cpu" for s, g, _ in now if s or g}
        gone = [shape for shape in reversed(self._seen) if shape not in now and
                ("gpu" if shape[1] else "cpu") not in roles]
        return kinds_from_shapes([*now, *gone])

    def worker_kinds(self, kinds: Sequence[WorkerKind]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for addr in self.scheduler.workers:
            d = self.plugin.nodes.get(addr)
            out[addr] = classify(d.slots, d.gpus, d.gpu_memory_gb, kinds) if d is not None else None
        return out

    def _target_duration(self, target_duration: Any = None) -> float:
        import dask.config
        from dask.utils import parse_timedelta
        if target_duration is None:
            target_duration = dask.config.get("distributed.adaptive.target-duration")
        # the policy counts work in its own seconds (real seconds / time_scale)
        return parse_timedelta(target_duration) / self.plugin.options.time_scale

    def _wait_for_capacity(self) -> None:
        """An autoscaler is watching: actions no current worker can hold wait for one instead of erring,
        where a worker of a kind it can make would hold them (``could_hold``); the others err at once.
        Before session 31 every one waited, those that ``targets`` itself lists as unservable too: an
        action of 4 slots on kinds of 1 hung its trajectory once ``cluster.adapt()`` had read a target."""
        if not self.autoscaled:
            self.autoscaled = True
            pol = self.plugin.policy
            if pol is not None and hasattr(pol, "wait_unplaceable"):
                pol.wait_unplaceable = self.could_hold  # rejects those waiting that no kind would hold
                kick = getattr(self.plugin, "_kick", None)
                if kick is not None:
                    kick()  # their errors go out now, not with the next event

    def could_hold(self, spec: Any) -> bool:
        """May a worker of a kind the scaler can make hold this action? CPU: a kind with ``units.min``
        slots; GPU: a kind on which a replica of its model fits (``WorkerKind.replica_gpus``). Where the
        kinds are not configured they are the shapes of the workers seen (what ``cluster.adapt()`` makes
        more of); none seen of the action's resource, or a model not registered yet: nobody can tell,
        it waits. API tokens: no worker adds any, it errs."""
        kinds = self.kinds()
        configured = bool(self._kinds)
        if spec.resource == "cpu":
            cpu = [k for k in kinds if k.role == "cpu"]
            return (not cpu and not configured) or any(k.slots >= spec.units_min for k in cpu)
        if spec.resource == "gpu":
            pol = self.plugin.policy
            model = pol.models.get(spec.model) if pol is not None else None
            gpu = [k for k in kinds if k.role == "gpu"]
            if model is None or (not gpu and not configured):
                return True
            return any(k.replica_gpus(model, spec.units_min) is not None for k in gpu)
        return False

    def targets(self, target_duration: Any = None) -> Targets:
        pol = self.plugin.policy
        kinds = self.kinds()
        workers = self.worker_kinds(kinds)
        if pol is None:
            return Targets(tuple(KindTarget(k.name, k.role, 0, 0) for k in kinds), len(workers))
        snap = pol.snapshot()
        return compute_targets(snap.pools, snap.unplaceable, snap.nodes, workers, kinds, pol.models,
                               self._target_duration(target_duration))

    # -- what Dask calls -----------------------------------------------------------------------
    def adaptive_target(self, target_duration: Any = None) -> int:
        self._wait_for_capacity()
        return self.targets(target_duration).total

    def handle_targets(self, target_duration: Any = None) -> dict[str, Any]:
        self._wait_for_capacity()
        return self.targets(target_duration).to_msg()

    def to_close(self, snap: Any = None) -> list[str]:
        pol = self.plugin.policy
        if pol is None:
            return []
        snap = snap if snap is not None else pol.snapshot()
        kinds = self.kinds()
        workers = self.worker_kinds(kinds)
        t = compute_targets(snap.pools, snap.unplaceable, snap.nodes, workers, kinds, pol.models,
                            self._target_duration())
        busy = [a for a, ws in self.scheduler.workers.items() if ws.processing or ws.long_running]
        return choose_to_close(t, snap.nodes, workers, busy)

    def safe(self, addr: str, snap: Any = None) -> bool:
        """May this worker leave now? Nothing runs there, no needed replica, no trajectory homed there."""
        pol = self.plugin.policy
        ws = self.scheduler.workers.get(addr)
        if ws is None:
            return True
        if ws.processing or ws.long_running:
            return False
        if pol is None:
            return True
        for n in (snap if snap is not None else pol.snapshot()).nodes:
            if n.node == addr:
                return not (n.running or n.replicas_needed or n.homes)
        return True

    def _reserved(self) -> set[str]:
        from time import monotonic
        now = monotonic()
        for a in [a for a, t in self.reserved.items() if t < now or a not in self.scheduler.workers]:
            del self.reserved[a]
        return set(self.reserved)

    def valid_workers_downscaling(self, scheduler: Any, workers: list[Any]) -> list[Any]:
        """What ``Scheduler.workers_to_close`` may offer: the workers a scaler drained, else the safe
        workers of kinds with a surplus (one policy snapshot for the whole call)."""
        pol = self.plugin.policy
        snap = pol.snapshot() if pol is not None else None
        allowed = self._reserved() or set(self.to_close(snap))
        return [ws for ws in workers if ws.address in allowed and self.safe(ws.address, snap)]

    async def drain(self, addrs: Sequence[str] | None = None) -> dict[str, Any]:
        """Move the trajectory state off the workers chosen to leave (default: :meth:`to_close`)."""
        async with self._drain_lock:
            pol = self.plugin.policy
            addrs = list(addrs) if addrs is not None else self.to_close()
            if pol is None or not addrs:
                return {"moved": 0, "stuck": []}
            snap = pol.snapshot()
            homes = {a: pol.homes_on(a) for a in addrs}
            if not self.move_state:  # homes pin their workers: nothing moves, those workers stay
                return {"moved": 0, "stuck": sorted(a for a, ts in homes.items() if ts)}
            moves, stuck = plan_moves(homes, addrs, snap.nodes)
            done = 0
            from distributed.protocol.pickle import dumps
            for t, src, dst in moves:
                if src not in self.scheduler.workers or dst not in self.scheduler.workers:
                    continue
                msg = {"op": "run", "function": dumps(_receive_trajectory),
                       "args": dumps((t, src)), "wait": True}
                try:
                    res = await self.scheduler.broadcast(msg=msg, workers=[dst], on_error="raise")
                except Exception as e:
                    self.stats.failed += 1
                    logger.warning("tangram: could not move trajectory %s from %s to %s (%s: %s); %s stays",
                                   t, src, dst, type(e).__name__, e, src)
                    stuck.append(src)
                    continue
                r = res.get(dst, {})
                if not isinstance(r, dict) or r.get("status") != "OK":
                    self.stats.failed += 1
                    logger.warning("tangram: could not move trajectory %s from %s to %s (%s); %s stays",
                                   t, src, dst, r.get("exception") if isinstance(r, dict) else r, src)
                    stuck.append(src)
                    continue
                moved = _plain(r.get("result", 0))
                still = t in pol.homes_on(src)
                self.stats.log.append((t, src, dst, int(moved or 0), still))
                if not moved:  # the source had no dir for it (an action holds it, or it is gone): stays homed
                    stuck.append(src)
                    continue
                if still:  # an action of t placed meanwhile made its own home elsewhere: leave that
                    pol.rehome(t, dst)
                self.stats.moved += 1
                self.stats.bytes += int(moved or 0)
                done += 1
                logger.info("tangram: moved trajectory %s from %s to %s (%s bytes) before retiring %s",
                            t, src, dst, moved, src)
            return {"moved": done, "stuck": sorted(set(stuck))}

    async def handle_workers_to_close(self, **kwargs: Any) -> list[str]:
        """``workers_to_close`` over RPC: empty the workers chosen to leave, then Dask's own choice
        among the safe ones."""
        await self.drain()
        return self.scheduler.workers_to_close(**kwargs)

    async def handle_drain(self, kind: str | None = None, n: int | None = None) -> dict[str, Any]:
        """Empty up to ``n`` workers of ``kind`` that may leave; returns their names (for a scaler)."""
        addrs = self.to_close()
        if kind is not None:
            kinds = self.kinds()
            wk = self.worker_kinds(kinds)
            addrs = [a for a in addrs if wk.get(a) == kind]
        if n is not None:
            addrs = addrs[:n]
        out = await self.drain(addrs)
        stuck = set(out["stuck"])
        ready = [a for a in addrs if a in self.scheduler.workers and a not in stuck and self.safe(a)]
        from time import monotonic
        for a in ready:  # offered alone to the retirement that follows (the operator's, within a minute)
            self.reserved[a] = monotonic() + 60.0
        out["workers"] = [str(self.scheduler.workers[a].name) for a in ready]
        return out

    async def handle_retire_workers(self, workers: list[str] | None = None, *, names: list | None = None,
                                    **kwargs: Any) -> dict[str, Any]:
        """``retire_workers`` that leaves out any worker that became unsafe since it was chosen; the
        others leave the policy before Dask retires them, so nothing new is placed there."""
        sched = self.scheduler
        if workers is None and names is None:
            return await sched.retire_workers(**kwargs)
        if names is not None:
            wanted = {str(n) for n in names}
            addrs = [a for a, ws in sched.workers.items() if str(ws.name) in wanted]
        else:
            addrs = [a for a in workers if a in sched.workers]
        ok = [a for a in addrs if self.safe(a)]
        refused = sorted(set(addrs) - set(ok))
        if refused:
            self.stats.refused += len(refused)
            logger.info("tangram: not retiring %s: an action, a needed replica or a trajectory's state is there",
                        refused)
        decls = {a: self.plugin.nodes.get(a) for a in ok}
        for a in ok:
            self.plugin.remove_worker(sched, a)  # the policy places nothing more there
        out = await sched.retire_workers(workers=ok, **kwargs) if ok else {}
        for a in ok:  # retirement aborted (Dask could not move its data): it serves again
            if a not in out and a in sched.workers and decls[a] is not None:
                self._rejoin(a, decls[a])
        self.stats.retired += len(out)
        return out

    def _rejoin(self, addr: str, decl: Any) -> None:
        from .messages import DECLARE_HANDLER
        if decl.gpus:
            self.scheduler.handlers[DECLARE_HANDLER](worker=addr, declaration=decl.to_msg())
        else:
            self.plugin.add_worker(self.scheduler, addr)


def _extension_class() -> type:
    """:class:`AdaptiveExtension` as a ``SchedulerPlugin`` (built here: the module level imports no Dask)."""
    global _Extension
    if _Extension is None:
        from distributed.diagnostics.plugin import SchedulerPlugin

        class TangramAdaptivePlugin(AdaptiveExtension, SchedulerPlugin):
            pass

        _Extension = TangramAdaptivePlugin
    return _Extension


_Extension: type | None = None


def _targets_handler_class() -> type:
    from distributed.http.utils import RequestHandler
    import json

    class TargetsHandler(RequestHandler):
        """``GET /api/v1/tangram/targets``: the per-kind targets, as JSON."""

        def get(self) -> None:
            self.set_header("Content-Type", "application/json")
            ext = self.server.plugins.get(EXTENSION_NAME)
            try:
                if ext is None:
                    raise RuntimeError("the tangram adaptive extension is not installed")
                self.write(json.dumps(ext.handle_targets()))
            except Exception as e:
                self.set_status(500, str(e))
                self.write(json.dumps({"Error": f"{type(e).__name__}: {e}"}))

    return TargetsHandler


def install(plugin: Any, scheduler: Any, kinds: Sequence[WorkerKind] | None = None,
            move_state: bool | None = None) -> AdaptiveExtension:
    """Install the elastic pool on a scheduler running the tangram plugin (idempotent)."""
    ext = scheduler.plugins.get(EXTENSION_NAME)
    if isinstance(ext, AdaptiveExtension) and ext.plugin is plugin:
        return ext
    ext = _extension_class()(plugin, scheduler, kinds, move_state)
    pol = plugin.policy
    if ext._kinds and pol is not None and pol.wait_unplaceable is True:
        # tangram.scheduler.wait-for-capacity with the kinds a scaler makes configured: wait where one would hold
        pol.wait_unplaceable = ext.could_hold
    scheduler.add_plugin(ext, name=EXTENSION_NAME)
    scheduler.adaptive_target = ext.adaptive_target  # what /api/v1/adaptive_target calls
    scheduler.handlers["adaptive_target"] = ext.adaptive_target
    scheduler.handlers["workers_to_close"] = ext.handle_workers_to_close
    scheduler.handlers["retire_workers"] = ext.handle_retire_workers
    scheduler.handlers[TARGETS_HANDLER] = ext.handle_targets
    scheduler.handlers[DRAIN_HANDLER] = ext.handle_drain
    app = getattr(scheduler, "http_application", None)
    if app is not None:
        app.add_handlers(r".*$", [(TARGETS_ROUTE, _targets_handler_class(), {"dask_server": scheduler})])
    return ext


# -- the local path: a cluster that grows the kind that is short -----------------------------------
def worker_kind_spec(kind: WorkerKind, *, nthreads: int | None = None, cls: Any = None,
                     **options: Any) -> dict[str, Any]:
    """A SpecCluster worker spec for one kind: ``slots`` resources for CPU kinds, ``gpus`` plus the
    ``tangram.worker`` config (no NVML) for GPU kinds."""
    from distributed import Nanny
    opts = dict(options)
    if kind.gpus:
        opts.setdefault("resources", {"gpus": kind.gpus})
        opts["config"] = {"tangram": {"worker": {"gpus": kind.gpus, "gpu-memory-gb": kind.gpu_memory_gb,
                                                 "gpu-groups": list(kind.groups or (kind.gpus,)),
                                                 "nvml": False}}}
        opts.setdefault("nthreads", nthreads or kind.gpus)
    else:
        opts.setdefault("resources", {"slots": kind.slots})
        opts.setdefault("nthreads", nthreads or kind.slots)
    return {"cls": cls or Nanny, "options": opts}


def adaptive_class() -> type:
    """``distributed.deploy.Adaptive`` that asks the tangram targets and retires only what the scheduler
    actually retired (so a worker that became busy is not closed anyway)."""
    from distributed.deploy.adaptive import Adaptive

    class TangramAdaptive(Adaptive):
        async def target(self) -> int:
            """The scheduler's total; on a cluster that grows per kind (:func:`kinds_cluster`), while a
            kind is below its target, the workers there or on their way plus what the short kinds lack
            (the total alone cannot say "one GPU worker instead of one CPU worker")."""
            msg = await self.scheduler.tangram_targets(target_duration=self.target_duration)
            setter = getattr(self.cluster, "set_targets", None)
            if setter is not None:
                setter(msg)
            counts = getattr(self.cluster, "counts", None)
            if counts is not None:
                have = counts()
                short = sum(max(0, int(k["target"]) - have.get(name, 0)) for name, k in msg["kinds"].items())
                if short:
                    return len(self.plan) + short
            return int(msg["total"])

        async def scale_down(self, workers: Iterable[str]) -> None:
            workers = list(workers)
            if not workers:
                return
            retired = await self.scheduler.retire_workers(names=workers, remove=True, close_workers=True)
            names = {str(v.get("name")) for v in retired.values()}
            gone = [w for w in workers if str(w) in names]
            if gone:
                f = self.cluster.scale_down(gone)
                if asyncio.iscoroutine(f) or isinstance(f, asyncio.Future):
                    await f

    return TangramAdaptive


def kinds_cluster(kinds: Sequence[WorkerKind], *, n_workers: Mapping[str, int] | None = None,
                  scheduler_kwargs: Mapping[str, Any] | None = None, worker_options: Mapping[str, Any] | None = None,
                  **cluster_kwargs: Any) -> Any:
    """A local SpecCluster whose new workers are of the kind furthest below its target.

    ``cluster.adapt(Adaptive=adaptive_class(), minimum=..., maximum=...)`` grows and shrinks it per kind.
    """
    from distributed import Scheduler, SpecCluster

    class KindsCluster(SpecCluster):
        def __init__(self) -> None:
            self.kinds = {k.name: k for k in kinds}
            self.targets: Targets | None = None
            self._kind_of: dict[str, str] = {}  # worker name -> kind
            self._i = 0
            workers: dict[str, Any] = {}
            for k in kinds:
                for _ in range((n_workers or {}).get(k.name, 0)):
                    name, spec = self._spec_for(k)
                    workers[name] = spec
            sk = dict(scheduler_kwargs or {})
            sk.setdefault("dashboard_address", ":0")
            super().__init__(workers=workers, scheduler={"cls": Scheduler, "options": sk},
                             worker=worker_kind_spec(next(iter(kinds)), **dict(worker_options or {})),
                             **cluster_kwargs)

        def _spec_for(self, k: WorkerKind) -> tuple[str, dict[str, Any]]:
            name = f"{k.name}-{self._i}"
            self._i += 1
            self._kind_of[name] = k.name
            return name, worker_kind_spec(k, name=name, **dict(worker_options or {}))

        def set_targets(self, msg: Mapping[str, Any]) -> None:
            self.targets = Targets(tuple(KindTarget(**v) for v in msg["kinds"].values()), msg.get("unmanaged", 0),
                                   tuple(msg.get("unservable", ())))

        def counts(self) -> dict[str, int]:
            out: dict[str, int] = {}
            for name in self.worker_spec:
                k = self._kind_of.get(str(name))
                if k is not None:
                    out[k] = out.get(k, 0) + 1
            return out

        def new_worker_spec(self) -> dict[str, Any]:
            # the kinds of workers scaled down since go (counts() reads those in worker_spec only): before, every
            # worker ever made kept its entry here, one more per scale-up for as long as the cluster ran
            for gone in [n for n in self._kind_of if n not in self.worker_spec]:
                del self._kind_of[gone]
            kname = next_kind(self.targets, self.counts()) if self.targets is not None else None
            k = self.kinds[kname] if kname is not None else next(iter(self.kinds.values()))
            name, spec = self._spec_for(k)
            return {name: spec}

    return KindsCluster()
