"""Plain data in and out of a policy. Pure: no Dask import.

A policy is driven by events (``submit``, ``finish``, ``begin_trajectory``,
``end_trajectory``, nodes joining and leaving) and answers ``schedule(now)``
with decisions: :class:`Start` (run this action here, on this many units),
:class:`Admit` (a trajectory may begin) and :class:`Load` (load a replica in
the background; the world answers ``loaded`` when it is ready). "Nothing fits now" is a value,
:class:`Shortfall`, never an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, NewType

ActionId = Hashable
NodeId = NewType("NodeId", str)
ReplicaId = NewType("ReplicaId", int)
TrajectoryId = NewType("TrajectoryId", str)


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A replica of a model resident on ``gpus`` of one GPU node."""

    model: str
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True, init=False)
class Start:
    """Start ``action`` on ``node`` with ``units`` units.

    GPU actions name the GPUs and the replica; ``load`` means the replica is
    loaded first (after evicting ``evict``). ``restore`` means the
    trajectory's state is restored from another node first; ``cross_group``
    that the GPUs span topology groups (``restore_from`` names the node the
    state comes from). ``sandbox`` says how a CPU action
    gets its sandbox: ``"warm"`` from the node's pool, ``"cold"`` started
    for it, ``"bound"`` the trajectory's own, already running.
    """

    action: ActionId
    node: str
    units: int
    gpus: tuple[int, ...] = ()
    replica: ReplicaId | None = None
    load: bool = False
    evict: tuple[ReplicaId, ...] = ()
    restore: bool = False
    cross_group: bool = False
    sandbox: str = "warm"
    restore_from: str = ""  # with restore: the node that holds the trajectory's state

    def __init__(self, action: ActionId, node: str, units: int, gpus: tuple[int, ...] = (),
                 replica: ReplicaId | None = None, load: bool = False, evict: tuple[ReplicaId, ...] = (),
                 restore: bool = False, cross_group: bool = False, sandbox: str = "warm", restore_from: str = ""):
        # dataclass's own __init__ for a frozen class sets each field with object.__setattr__ by name; the
        # slot descriptors set them 3x faster (a Start per action: about a million in the scale run)
        _s_action(self, action)
        _s_node(self, node)
        _s_units(self, units)
        _s_gpus(self, gpus)
        _s_replica(self, replica)
        _s_load(self, load)
        _s_evict(self, evict)
        _s_restore(self, restore)
        _s_cross_group(self, cross_group)
        _s_sandbox(self, sandbox)
        _s_restore_from(self, restore_from)


(_s_action, _s_node, _s_units, _s_gpus, _s_replica, _s_load, _s_evict, _s_restore, _s_cross_group, _s_sandbox,
 _s_restore_from) = (Start.__dict__[f].__set__ for f in Start.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class Admit:
    """Trajectory ``trajectory`` may begin, after ``setup_s`` (a cold sandbox start).

    A policy that binds resources to the trajectory for its whole life names
    them: ``units`` slots on ``node`` and ``tokens`` API tokens.
    """

    trajectory: str
    setup_s: float = 0.0
    node: str = ""
    units: int = 0
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class Reject:
    """The policy will not run ``action``: no current node can ever hold it
    (``shortfall.never``), or deciding it failed (``reason``). Nothing is held
    for it any more; every other action is unaffected."""

    action: ActionId
    reason: str
    shortfall: Shortfall | None = None


@dataclass(frozen=True, slots=True)
class Load:
    """Load a replica of ``model`` on ``gpus`` of ``node`` in the background (after evicting ``evict``).

    No action waits inside it: the replica is loading (its GPUs held, not ready)
    until the world reports it ready (``Policy.loaded(replica, now)``), after
    ``load_s`` in the simulator. Actions of the model queued meanwhile wait for
    whichever replica is ready first. Only a policy with ``background_load``
    makes it.
    """

    node: str
    gpus: tuple[int, ...]
    model: str
    replica: ReplicaId
    evict: tuple[ReplicaId, ...] = ()
    cross_group: bool = False


Decision = Start | Admit | Reject | Load


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why an action waits, as data (never an exception).

    ``requested`` units of ``resource`` (in pool ``pool``: ``"cpu"``, ``"api"``
    or a model's name) were asked; ``free`` are free now where the action could
    go; ``largest`` is what the largest current node (or the whole quota) could
    ever give it. ``never`` is true when no current node can ever hold it
    (``requested > largest``): it waits only for a larger node to join (an
    autoscaler reads this), or errs at once.
    """

    resource: str
    requested: int
    free: int
    reason: str = ""
    pool: str = ""
    largest: int = 0
    never: bool = False
    kind: str = ""


@dataclass(frozen=True)
class PoolStats:
    """One pool of the policy: CPU slots, API tokens, or one model's GPUs.

    ``queued_units`` is the sum of ``units.min`` over waiting actions and
    ``queued_work_s`` the sum of their expected work in unit-seconds at
    ``units.min`` (estimate x units.min): what an autoscaler needs to size a
    target. ``head`` says why the first waiting action waits.
    """

    resource: str
    capacity: int
    free: int
    queued: int
    running: int
    head: Shortfall | None = None
    pool: str = ""
    queued_units: int = 0
    queued_work_s: float = 0.0


@dataclass(frozen=True)
class NodeStats:
    """One node as the policy sees it (for the dashboard and for retiring workers safely).

    ``homes``: trajectories whose stateful working dir lives there;
    ``replicas_needed``: resident replicas of models that waiting actions need.
    """

    node: str
    resource: str  # "cpu" | "gpu"
    capacity: int
    free: int
    running: int
    homes: int = 0
    replicas: int = 0
    replicas_needed: int = 0


@dataclass(frozen=True)
class PolicySnapshot:
    """A frozen view for dashboards, metrics and the autoscaler.

    ``pools``: one :class:`PoolStats` per resource (``pool == resource``:
    "cpu", "gpu", "api"), then one per model with waiting or running actions
    (``resource == "gpu"``, ``pool`` the model's name). ``unplaceable``: the
    actions no current node can ever hold, each as a :class:`Shortfall` with
    ``never=True``. ``admission_queue``: trajectories waiting to be admitted.
    ``gpu_waiting``: ``(model, reason, actions)`` for each model whose actions wait,
    the reason one of :data:`GPU_WAIT_REASONS` (:meth:`TangramPolicy.gpu_waiting`).
    """

    policy: str
    pools: tuple[PoolStats, ...]
    replicas: tuple[tuple[str, str, tuple[int, ...], bool], ...] = ()  # model, node, gpus, busy
    decisions: int = 0
    extra: dict = field(default_factory=dict)
    unplaceable: tuple[Shortfall, ...] = ()
    admission_queue: int = 0
    nodes: tuple[NodeStats, ...] = ()
    gpu_waiting: tuple[tuple[str, str, int], ...] = ()


# Why a model's GPU actions wait, from the state of its replicas, the first that holds:
GPU_WAIT_REASONS = (
    "idle",         # one replica is idle on idle GPUs: the policy holds it (a claim, a larger head first)
    "gpu_shared",   # one replica is idle, but its GPUs serve another model's action (one action per GPU)
    "gpu_loading",  # one replica is idle, but its GPUs are held by another replica's load
    "loading",      # one replica is loading
    "busy",         # every replica serves this model's actions
    "paused",       # its idle replicas are on paused workers (cordoned: they take nothing new)
    "no_replica",   # the model has no replica
)
