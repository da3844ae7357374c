"""The tangram scheduler plugin: the policy places every action inside a real Dask scheduler.

Install it any of three ways (each idempotent: a second install is a no-op):

    client.register_plugin(TangramSchedulerPlugin())
    LocalCluster(scheduler_kwargs={"plugins": [TangramSchedulerPlugin()]})
    dask scheduler --preload scheduler_plugin

How it works (docs/placement.md has the reasons):

1. **Park.** ``update_graph`` gives every task annotated ``tangram`` a strict
   worker restriction to :data:`PARK`, an address no worker ever has, so
   Dask's own ``decide_worker`` finds no valid worker and the task waits in
   ``no-worker`` once its dependencies are in memory. Work stealing skips it
   (strict restrictions, no valid thief); queuing skips it (restricted tasks
   are never root-ish).
2. **Record.** The ``transition`` hook turns Dask's transitions into policy
   events: entering ``no-worker`` is ``submit``; leaving ``processing`` is
   ``finish`` (to ``memory`` or ``erred``) or ``cancel`` (to ``released``:
   the client cancelled, the worker died, the task was rescheduled); leaving
   ``no-worker`` otherwise is ``cancel``. Workers joining and leaving update
   the policy's nodes. No hook ever transitions a task.
3. **Apply.** One coalesced loop callback (:meth:`_flush`) asks
   ``policy.schedule(now)`` and applies every ``Start`` in one batch: the
   task's restriction becomes the chosen worker, its Dask resource
   restriction the granted units (so the worker enforces the grant locally),
   the grant is written into its ``tangram`` annotation (which Dask sends to
   the worker with the task, where :func:`tangram_dask.current_allocation`
   reads it), and one ``scheduler.transitions`` call moves the batch
   ``no-worker -> processing``.

The plugin decides nothing itself: the policy object does, exactly as it
does in the simulator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, fields
from enum import Enum
from time import monotonic, perf_counter
from typing import Any, Callable, Hashable, Mapping

from distributed.core import Status
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.protocol.pickle import dumps

from . import config as _config  # noqa: F401  (registers the tangram: defaults)
from .annotate import ANNOTATION
from .costs import CostModel
from .cluster import ClusterSpec, CpuNode, GpuNode, ModelSpec
from .client import check_expectations, check_expected_s, check_trajectory
from .errors import PlacementError, SpecError, TrajectoryError
from .messages import (BEGIN_TRAJECTORY_HANDLER, DECLARE_HANDLER, END_TRAJECTORY_HANDLER, EXPECT_TRAJECTORIES_HANDLER,
                       GRANT_KEY, SNAPSHOT_HANDLER, STARTED_HANDLER, STAYED_HANDLER, UNSTARTED_HANDLER,
                       WORKER_LOAD_HANDLER, Grant, WorkerDeclaration)
from .options import LIVE_POLICIES, PluginOptions  # noqa: F401  (defined in options.py, re-exported)
from .policy import FifoPolicy, Policy, TangramOptions, TangramPolicy
from .policy.types import Load, Reject, ReplicaSpec, Start
from .spec import ActionSpec
from .models.scheduler import install_residency
from .adaptive import install as install_adaptive
from .dashboard import install_dashboard, uninstall_dashboard
from .workers import PLUGIN_NAME, TangramWorkerPlugin

logger = logging.getLogger("tangram_dask.scheduler")

#: The worker address parked actions are restricted to. No worker has it.
PARK = "tangram://parked"
#: One restriction set shared by every parked task (Dask replaces restriction sets, never mutates them):
#: a set per task would cost ~200 bytes for each of 100,000 queued actions.
PARKED = frozenset({PARK})
#: The scheduler's periodic callback that names actions waiting long for a kind of worker that has not joined.
WATCH_CALLBACK = "tangram-unplaceable"


class ActionState(str, Enum):
    """Where the plugin's record of one action stands (it is dropped once the action is done)."""

    NEW = "new"          # parsed, not yet waiting for a worker
    PENDING = "pending"  # in the policy's queues
    GRANTED = "granted"  # the policy started it: a worker, units, a grant
    DONE = "done"
    FAILED = "failed"


NEW, PENDING, GRANTED, DONE, FAILED = ActionState


@dataclass(slots=True)
class Action:
    """The plugin's record of one action task (kept to four slots, 64 bytes).

    ``grant`` (what the policy granted) and ``annotations`` (the task's own annotations while the
    granted copy is on the task) are set only together, while an action is granted: they share
    one slot.

    Records of new and queued actions are shared: the tasks of one ``dask.annotate`` block share
    one new record, and those that arrived in the same millisecond one queued record (a burst of
    100,000 queued actions holds a handful of records, not 64 bytes each). Such a record is never
    changed in place: :meth:`TangramSchedulerPlugin._own` gives a task its own copy first.
    """

    spec: ActionSpec | None
    state: ActionState = NEW
    t0: float | None = None  # policy time of its first arrival in no-worker (None: not yet), as queued
    granted: tuple[Grant | None, dict | None] | None = None  # (grant, annotations), or None for neither

    @property
    def grant(self) -> Grant | None:
        g = self.granted
        return None if g is None else g[0]

    @grant.setter
    def grant(self, grant: Grant | None) -> None:
        ann = self.annotations
        self.granted = None if grant is None and ann is None else (grant, ann)

    @property
    def annotations(self) -> dict | None:
        g = self.granted
        return None if g is None else g[1]

    @annotations.setter
    def annotations(self, ann: dict | None) -> None:
        grant = self.grant
        self.granted = None if grant is None and ann is None else (grant, ann)

    @property
    def error(self) -> str | None:
        """Why the annotation could not be read (a :class:`Malformed` record), else None."""
        return None


@dataclass(slots=True)
class Malformed(Action):
    """The record of a task whose ``tangram`` annotation is not a valid spec: it errs on arrival."""

    message: str = ""

    @property
    def error(self) -> str | None:
        return self.message


@dataclass
class PluginStats:
    submitted: int = 0
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    flushes: int = 0
    flush_s: float = 0.0
    policy_errors: int = 0
    loads_ahead: int = 0  # Load decisions sent to workers (background loads)
    revoked: int = 0  # grants taken back, or actions moved unbegun, because their worker paused


def _frozen(x: Any) -> Any:
    """A hashable form of an annotation value that compares equal only for equal values of the same
    types (``1``, ``1.0`` and ``True`` differ). TypeError for what cannot be hashed."""
    if type(x) is dict:
        return ("dict", tuple(sorted(((k, _frozen(v)) for k, v in x.items()), key=lambda kv: repr(kv[0]))))
    if type(x) in (list, tuple):
        return (type(x).__name__, tuple(_frozen(v) for v in x))
    hash(x)
    return (type(x).__name__, x)


def parse_annotation(ann: Any) -> ActionSpec:
    """The spec in a task's ``tangram`` annotation (the scheduler's ``grant`` key is not part of it)."""
    if isinstance(ann, Mapping) and "grant" in ann:
        ann = {k: v for k, v in ann.items() if k != "grant"}
    return ActionSpec.from_dict(ann)


class _LoadTimes(Mapping):
    """The policy's models' load times, read live (models may be registered or measured at run time)."""

    def __init__(self, models: Mapping[str, ModelSpec]):
        self.models = models

    def __getitem__(self, name: str) -> float:
        return self.models[name].load_s

    def __iter__(self):
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)


#: The most sandbox slots / GPUs one worker may declare; a worker over either is left out of placement
#: How many times a paused worker is asked again, 0.2 s apart, about actions it did not hold yet (on their way)
UNSTARTED_TRIES = 25
NODE_SLOTS_LIMIT = 65_536
NODE_GPUS_LIMIT = 4_096


class TangramSchedulerPlugin(SchedulerPlugin):
    """Places every ``tangram``-annotated task with a tangram policy; see the module docstring."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, policy: str | None = None, *, models: Mapping[str, ModelSpec] | None = None,
                 api_tokens: int | None = None, replicas: Mapping[str, Any] | None = None,
                 time_scale: float | None = None, pipeline: int | None = None,
                 warm_start_s: float | None = None, cold_start_s: float | None = None,
                 cross_group_slowdown: float | None = None, tangram: TangramOptions | None = None,
                 policy_options: Mapping[str, float] | None = None, options: PluginOptions | None = None):
        self.options = options or PluginOptions.from_config(
            policy=policy, models=models, api_tokens=api_tokens, replicas=replicas, time_scale=time_scale,
            pipeline=pipeline, warm_start_s=warm_start_s, cold_start_s=cold_start_s,
            cross_group_slowdown=cross_group_slowdown, tangram=tangram, policy_options=policy_options)
        self.scheduler: Any = None
        self.policy: Policy | None = None
        self.actions: dict[Hashable, Action] = {}
        #: the record that last left ``actions`` (key, record), for plugins that see the same transition later
        self.left: tuple[Hashable, Action] | None = None
        #: the action that arrived for the first time in the transition being handled (its ``t0`` was just
        #: set), else None: the monitor counts a submission there
        self.arrived: Hashable | None = None
        self._t_arrival = -1.0  # the submit time last given to an arriving action (shared within 1 ms)
        self._queued_last: Action | None = None  # the queued record last made (shared: see Action)
        #: called with each background ``Load`` decision as it is applied (no task transition shows one):
        #: the dashboard monitor counts and logs it there
        self.load_listeners: list[Callable[[Load], None]] = []
        #: called with each trajectory the policy admits and the seconds it waited since it asked (the monitor
        #: counts and logs admissions there)
        self.admit_listeners: list[Callable[[str, float], None]] = []
        self.nodes: dict[str, WorkerDeclaration] = {}
        self.stats = PluginStats()
        self._cpu_workers: dict[str, None] = {}
        self._api_workers: dict[str, None] = {}
        self._to_fail: dict[Hashable, str] = {}
        self._api_waiting: dict[Hashable, None] = {}
        self._kicked = False
        self._admissions: dict[str, asyncio.Event] = {}  # trajectories waiting to be admitted
        self._asked: dict[str, float] = {}  # the same: when each asked (policy time)
        self._admitted: set[str] = set()
        # the clients that began or queued each trajectory not yet ended, and the reverse: when the last of a
        # trajectory's clients leaves with none of its actions wanted by another, the trajectory ends
        # (remove_client). Before session 34 a crashed trainer's trajectories held the gate for the TTL (1 h)
        self._clients_of: dict[str, set[str]] = {}
        self._trajectories_of: dict[str, set[str]] = {}
        self._t0 = 0.0
        self._timers: dict[Hashable, Any] = {}  # actions with a timeout_s: their loop timer
        # CPU actions with a timeout_s on a worker that reports starts: their timer waits for the worker's word
        # that they started (STARTED_HANDLER). They may wait there: sent ahead, or behind a thread that ran past
        # its own timeout and still holds its slots (the ledger freed them)
        self._start_timed: dict[Hashable, Grant] = {}
        self._reports_starts: set[str] = set()  # the workers that report those starts
        self._restrict: dict[str, frozenset] = {}  # worker -> the shared restriction set naming it
        # (the user's annotations by value, grant wire form) -> the granted annotations: one dict shared by
        # the actions with equal annotations and equal grants (see _granted_annotations)
        self._granted: dict[tuple, dict] = {}
        self._frozen_last: tuple[Any, Any] | None = None  # (annotations, their frozen form) last frozen
        self.costs = CostModel()
        #: After this many seconds (wall) of waiting with no worker that could ever hold them, actions are
        #: named in one WARNING per reason (say, no CPU worker has joined), checked every ``_watch_every_s``.
        self.warn_unplaceable_s = 30.0
        self._hints_warned: set[str] = set()  # the action kinds whose out-of-bounds hints were logged
        self._watch_every_s = 5.0
        self._warned: set[str] = set()
        #: Set to a dict to keep every grant by key (benchmarks and tests read it).
        self.grants: dict[Hashable, Grant] | None = None
        # the keys granted on each worker ("" for API calls), and each one's worker: a pause looks at its own only
        self._granted_on: dict[str, dict[Hashable, None]] = {}
        self._grant_worker: dict[Hashable, str] = {}
        self._status_seq: dict[str, int] = {}  # worker -> status changes heard (an answer to a question is stale
        # if its worker's status changed while the question was out)

    def __getstate__(self) -> dict[str, Any]:  # what client.register_plugin sends: the options only
        return {"options": self.options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(options=state["options"])

    # -- lifecycle -------------------------------------------------------------
    def build_policy(self) -> Policy:
        o = self.options
        cluster = ClusterSpec("live", api_tokens=o.api_tokens, cold_start_s=o.cold_start_s,
                              warm_start_s=o.warm_start_s, cross_group_slowdown=o.cross_group_slowdown)
        # (trajectory-ttl-s and lost-wait-s are wall seconds, as the user reads them; the policy's clock runs at
        # 1 / time_scale: before session 34 the TTL was read in policy time, a fifth of it at time_scale 0.2)
        ttl = o.trajectory_ttl_s / o.time_scale if o.trajectory_ttl_s else None
        kw = {"trajectory_ttl_s": ttl, "wait_unplaceable": o.wait_for_capacity,
              "lost_wait_s": o.lost_wait_s / o.time_scale}
        if o.policy == "tangram":
            return TangramPolicy(cluster, dict(o.models), (), options=o.tangram, **kw)
        return FifoPolicy(cluster, dict(o.models), (), **kw)

    async def start(self, scheduler: Any) -> None:
        if self.scheduler is scheduler:
            return
        self.scheduler = scheduler
        self.policy = self.build_policy()
        c = self.policy.cluster
        self.costs = CostModel(c.warm_start_s, c.cold_start_s, c.cross_group_slowdown, _LoadTimes(self.policy.models))
        self._t0 = monotonic()
        scheduler.handlers[DECLARE_HANDLER] = self._handle_declare
        scheduler.handlers[BEGIN_TRAJECTORY_HANDLER] = self._handle_begin_trajectory
        scheduler.handlers[EXPECT_TRAJECTORIES_HANDLER] = self._handle_expect_trajectories
        scheduler.handlers[END_TRAJECTORY_HANDLER] = self._handle_end_trajectory
        scheduler.handlers[SNAPSHOT_HANDLER] = self._handle_snapshot
        scheduler.handlers[STAYED_HANDLER] = self._handle_state_stayed
        scheduler.stream_handlers[STARTED_HANDLER] = self._handle_started
        # one feature, one name: what the other parts install on this scheduler
        install_residency(self, scheduler)  # reward models: registrations, residency reports (models/)
        install_adaptive(self, scheduler)  # elastic pool: adaptive_target per kind, safe retirement
        install_dashboard(self, scheduler)  # Tangram page, /tangram/state.json, /metrics, events
        for addr in list(scheduler.workers):  # workers already there when the plugin arrived
            self.add_worker(scheduler, addr)
        from tornado.ioloop import PeriodicCallback
        pc = PeriodicCallback(self._watch_unplaceable, self._watch_every_s * 1000)
        scheduler.periodic_callbacks[WATCH_CALLBACK] = pc
        pc.start()
        await scheduler.register_worker_plugin(None, dumps(TangramWorkerPlugin()), name=PLUGIN_NAME,
                                               idempotent=True)
        logger.info("tangram: scheduler plugin started (policy %s, %d API tokens, models %s, time scale %g, "
                    "pipeline %d)", self.options.policy, self.options.api_tokens, sorted(self.options.models),
                    self.options.time_scale, self.options.pipeline)

    async def close(self) -> None:
        pc = getattr(self.scheduler, "periodic_callbacks", {}).pop(WATCH_CALLBACK, None)
        if pc is not None:
            pc.stop()
        await uninstall_dashboard(self.scheduler)

    def _watch_unplaceable(self) -> None:
        """Say so, once per reason, when actions have waited ``warn_unplaceable_s`` for a worker that could hold
        them and none has joined (the policy keeps them, as workers may be starting or scaling up): without
        this a rollout waits in silence (the demo on the H200, whose sandbox workers had joined as GPU nodes)."""
        waiting = getattr(self.policy, "unplaceable", None) or {}
        now = self.now()
        if getattr(self.policy, "lost_since", None) is not None:  # a worker left: when its wait ends, a pass says so
            self._kick()
        old: dict[str, list[str]] = {}
        cpu: set[str] = set()
        for spec, sf, t, _ in waiting.values():
            if (now - t) * self.options.time_scale >= self.warn_unplaceable_s:
                old.setdefault(sf.reason, []).append(spec.kind)
                if spec.resource == "cpu":
                    cpu.add(sf.reason)
        for reason, kinds in old.items():
            if reason in self._warned:
                continue
            self._warned.add(reason)
            hint = ""
            if reason in cpu:
                decls = [self.nodes.get(addr) for addr in self.scheduler.workers]
                bare = sum(1 for d in decls if d is None or not (d.slots or d.gpus))
                hint = ((f" {bare} connected worker{'s declare' if bare > 1 else ' declares'} no sandbox slots."
                         if bare else "") +
                        " A worker with --resources slots=N (a LocalCluster: resources={'slots': N}) and no GPUs "
                        "joins as a CPU worker; one that declares GPUs too joins as a GPU node.")
            n = len(kinds)
            one = n == 1
            logger.warning("tangram: %d %s (%s) %s waited over %g s for a worker that can hold %s: %s. "
                           "%s queued until one joins.%s", n, "action" if one else "actions",
                           ", ".join(sorted(set(kinds))), "has" if one else "have", self.warn_unplaceable_s,
                           "it" if one else "them", reason, "It stays" if one else "They stay", hint)
        self._warned &= set(old)  # a reason that cleared may warn again if it comes back
        bounded = getattr(getattr(self.policy, "est", None), "bounded", None)
        if bounded and len(bounded) > len(self._hints_warned):
            for kind, (count, given, counted) in bounded.items():
                if kind not in self._hints_warned:
                    self._hints_warned.add(kind)
                    logger.warning("tangram: action kind %r: a hint_s of %.4g s is far outside the hints of its kind "
                                   "(over %g sd from their mean, in log): the policy counted it as %.4g s (%d so far, "
                                   "in dask_tangram_hints_bounded_total). Is the code that sends it off "
                                   "(milliseconds for seconds)?", kind, given, self.policy.est.hint_bound, counted,
                                   count)

    def now(self) -> float:
        """Policy time: seconds since start, divided by ``time_scale``."""
        return (monotonic() - self._t0) / self.options.time_scale

    # -- workers -----------------------------------------------------------------
    def add_worker(self, scheduler: Any, worker: str) -> None:
        ws = scheduler.workers.get(worker)
        if ws is None or self.policy is None:
            return
        res = ws.resources
        if res.get("gpus"):
            return  # a GPU node joins with its declaration (topology and memory come from the worker)
        if res.get("slots") or res.get("api"):
            self._join(worker, WorkerDeclaration(slots=int(res.get("slots", 0)), api=int(res.get("api", 0))))

    def _handle_declare(self, worker: str, declaration: dict) -> dict:
        decl = WorkerDeclaration.from_msg(declaration)
        if self.scheduler is None or worker not in self.scheduler.workers:
            return {"status": "unknown-worker"}
        starts = bool(declaration.get("starts"))  # it reports when a timed action starts: its timer waits
        old = self.nodes.get(worker)
        if old == decl:
            if starts:
                self._reports_starts.add(worker)
            return {"status": "OK", "starts": True}
        if old is not None:
            busy = any(r.node == worker for r in self.policy.running.values())
            if busy:
                logger.warning("tangram: worker %s re-declared %s while running actions; keeping %s",
                               worker, decl, old)
                return {"status": "busy"}
            self._leave(worker)
        self._join(worker, decl)
        if starts and worker in self.nodes:
            self._reports_starts.add(worker)
        return {"status": "OK", "starts": True}

    def _join(self, addr: str, decl: WorkerDeclaration) -> None:
        ws = self.scheduler.workers[addr]
        pol = self.policy
        if decl.slots > NODE_SLOTS_LIMIT or decl.gpus > NODE_GPUS_LIMIT:
            # the ledger's index is by free count: slots=1e9 (a typo) would stall, then kill, the scheduler
            logger.error("tangram: worker %s declares %d sandbox slots and %d GPUs, over the %d slots / %d GPUs one "
                         "worker may have: it is left out of placement (no action goes there); fix its --resources "
                         "or tangram.worker config and restart it", addr, decl.slots, decl.gpus, NODE_SLOTS_LIMIT,
                         NODE_GPUS_LIMIT)
            return
        self.nodes[addr] = decl
        if decl.gpus:
            if decl.slots:
                logger.warning("tangram: worker %s declares %d sandbox slots and %d GPUs; a worker is one kind of "
                               "node, here a GPU node, so its slots are not used: run the sandboxes on a worker "
                               "of their own", addr, decl.slots, decl.gpus)
            reps = [ReplicaSpec(m, addr, tuple(g)) for m, g in self.options.replicas.get(str(ws.name), ())]
            pol.add_gpu_node(GpuNode(addr, decl.gpus, decl.gpu_memory_gb, decl.groups), replicas=reps)
        elif decl.slots:
            pol.add_cpu_node(CpuNode(addr, decl.slots), ahead=self.options.pipeline)
            self._cpu_workers[addr] = None
        if decl.api:
            self._api_workers[addr] = None
        need = max(decl.slots, decl.gpus)
        if ws.nthreads < need:
            logger.warning("tangram: worker %s declares %d %s but has %d threads: actions will wait for "
                           "threads (give it nthreads >= %d)", addr, need, "GPUs" if decl.gpus else "slots",
                           ws.nthreads, need)
        logger.info("tangram: %s joined as %s %s", addr, decl.role, decl)
        if ws.status in (Status.paused, Status.closing_gracefully):  # paused before it joined the policy
            self._status_changed(addr)
        self._kick()

    def _leave(self, addr: str) -> list[Hashable]:
        self._restrict.pop(addr, None)
        decl = self.nodes.pop(addr, None)
        self._cpu_workers.pop(addr, None)
        self._api_workers.pop(addr, None)
        self._reports_starts.discard(addr)
        if decl is None or not (decl.gpus or decl.slots):
            return []
        return self.policy.remove_node(addr)

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        if self.policy is None:
            return
        lost = self._leave(worker)
        residency = getattr(self, "residency", None)
        if residency is not None:
            residency.worker_left(worker)  # (after _leave: the policy no longer holds the worker's replicas)
        now = self.now()
        for key in lost:
            # Dask releases what was processing there before this hook runs, so the
            # policy normally has nothing left on the node; what remains was granted
            # but never reached the worker: park it again and queue it anew.
            a = self.actions.get(key)
            ts = scheduler.tasks.get(key)
            if a is None or ts is None or a.state != GRANTED:
                continue
            self._park_again(key, a, ts, now, queue=ts.state == "no-worker")
        if not self._granted_on.get(worker):
            self._granted_on.pop(worker, None)
        self._status_seq.pop(worker, None)
        self._kick()

    # -- worker status: a paused worker takes nothing new ---------------------------------
    def log_event(self, topic: Any, msg: Any) -> None:
        """Dask logs a worker's status change (``paused`` when its memory passes the pause fraction,
        ``closing_gracefully`` while it retires, ``running`` again): the policy cordons or uncordons it,
        on the loop, once the scheduler's own handler has run."""
        if (type(msg) is dict and msg.get("action") == "worker-status-change" and isinstance(topic, str)
                and self.scheduler is not None):
            self._status_seq[topic] = self._status_seq.get(topic, 0) + 1
            self.scheduler.loop.add_callback(self._status_changed, topic)

    def _status_changed(self, addr: str) -> None:
        """Dask sends no task to a worker that is not running. A grant there would wait in ``no-worker``
        until it ran again (on a worker paused for good, forever), holding its units, while the policy went
        on placing there: the node is cordoned instead, and its grants Dask has not sent are placed anew."""
        sched, pol = self.scheduler, self.policy
        ws = sched.workers.get(addr) if sched is not None else None
        if ws is None or pol is None or addr not in self.nodes:
            return
        now = self.now()
        try:
            if ws.status == Status.running:
                if pol.uncordon(addr, now):
                    logger.info("tangram: worker %s runs again: it takes actions again", addr)
            elif ws.status in (Status.paused, Status.closing_gracefully):
                if pol.cordon(addr, now):
                    logger.warning("tangram: worker %s is %s: no new action goes there until it runs again "
                                   "(its running actions go on)", addr, ws.status.name)
                self._revoke(addr, now)
        except Exception:  # a policy bug must not take the scheduler's event log down
            logger.exception("tangram: the policy failed on the status change of worker %s", addr)
            self.stats.policy_errors += 1
        self._kick()

    def _revoke(self, addr: str, now: float) -> None:
        """The grants on ``addr`` that Dask could not send (the task is still in ``no-worker``): the policy
        frees their units and queues them again, as new, for the next pass. Those Dask sent there (CPU and
        GPU actions granted ahead of a free slot, API calls) go to :meth:`_move_unstarted`."""
        tasks = self.scheduler.tasks
        sent = []
        for key in [*self._granted_on.get(addr, ()), *self._granted_on.get("", ())]:
            a = self.actions.get(key)
            g = a.grant if a is not None else None
            if a is None or a.state != GRANTED or g is None or g.worker not in (addr, ""):
                continue
            ts = tasks.get(key)
            if ts is None:
                continue
            if g.worker == "":  # an API action: it holds tokens, not this worker; move it only if Dask sent it here
                if ts.state == "processing" and ts.processing_on is not None and ts.processing_on.address == addr:
                    sent.append(key)
                continue
            if ts.state != "no-worker":
                if ts.state == "processing":
                    sent.append(key)
                continue
            self.policy.cancel(key, now)
            self._park_again(key, a, ts, now)
            self.stats.revoked += 1
        if sent:
            self.scheduler.loop.add_callback(self._move_unstarted, addr, sent, self._status_seq.get(addr, 0))

    def _park_again(self, key: Hashable, a: Action, ts: Any, now: float, queue: bool = True) -> None:
        """A grant Dask never sent (its worker paused or left first) ends: its timer, its place in the grant
        index and the grant in the task's annotations go, the task is parked again, and (``queue``: it is in
        ``no-worker``) the policy queues it anew, in its first place. Otherwise it is queued when it reaches
        ``no-worker`` (:meth:`_arrive`). Before session 33 a worker that left kept its grants' timers and
        annotations, and a re-queued action was counted as issued twice."""
        self._done(key, ts, keep=True)
        if self.grants is not None:
            self.grants.pop(key, None)
        ts.worker_restrictions = PARKED
        ts.resource_restrictions = None
        a = self._own(key, a)
        a.state, a.grant = PENDING, None
        if queue:
            self.policy.submit(key, a.spec, now, issued_at=a.t0)

    async def _move_unstarted(self, addr: str, keys: list[Hashable], seq: int, tries: int = 0) -> None:
        """The actions sent to the paused worker ``addr`` that it has not begun (dispatched ahead of a free
        slot) leave it: Dask releases them there and they wait for the policy again. A paused worker begins
        nothing, so none has run. The answer is used only if the worker's status has not changed since the
        question (a worker that ran for a moment may have begun one; the next pause asks again). Keys the
        worker does not hold yet (their task still on its way) are asked about again shortly."""
        sched = self.scheduler
        try:
            reply = await getattr(sched.rpc(addr), UNSTARTED_HANDLER)(keys=list(keys))
        except Exception as e:  # gone, or a worker plugin of an earlier release: they start once it runs again
            logger.info("tangram: could not ask paused worker %s which actions it has not begun: %s", addr, e)
            return
        ws = sched.workers.get(addr)
        if self._status_seq.get(addr, 0) != seq:
            return  # its status changed while the question was out: the answer may be stale (a later one follows)
        if ws is None or ws.status not in (Status.paused, Status.closing_gracefully):
            return  # it left (they are placed again) or runs again: they start there

        def held_here(i: Any) -> Hashable | None:
            if type(i) is not int or not 0 <= i < len(keys):
                return None
            ts = sched.tasks.get(keys[i])
            return keys[i] if ts is not None and ts.state == "processing" and ts.processing_on is ws else None

        reply = reply if isinstance(reply, dict) else {}
        recs = {k: "released" for i in reply.get("unstarted") or () if (k := held_here(i)) is not None}
        if recs:  # processing -> released -> waiting: the transition hook cancels each grant, then queues it anew
            self.stats.revoked += len(recs)
            sched.transitions(recs, f"tangram-paused-{time.time()}")
        later = [k for i in reply.get("unknown") or () if (k := held_here(i)) is not None]
        if later and tries < UNSTARTED_TRIES:
            sched.loop.call_later(0.2, lambda: sched.loop.add_callback(self._move_unstarted, addr, later, seq,
                                                                       tries + 1))

    # -- graph and transitions ------------------------------------------------------
    def update_graph(self, scheduler: Any, *, annotations: dict[str, dict[Hashable, Any]] | None = None,
                     **kwargs: Any) -> None:
        anns = (annotations or {}).get(ANNOTATION)
        if not anns:
            return
        tasks, actions = scheduler.tasks, self.actions
        # One spec per annotation object: the tasks of one dask.annotate block share their annotation dict,
        # and so share one (frozen) ActionSpec, not a copy each; likewise one ``ts.annotations`` dict for the
        # tasks whose annotations are the very same objects (Dask makes one per task; it replaces a task's
        # annotations, never changes them in place). Ids are stable here: anns and the tasks hold every object.
        specs: dict[int, Action] = {}  # one new record per annotation object, shared by its tasks (see Action)
        shared: dict[tuple, dict] = {}
        for key, ann in anns.items():
            ts = tasks.get(key)
            if ts is None or ts.state != "released" or key in actions:
                continue
            own = ts.annotations
            if own:
                same = tuple((k, id(v)) for k, v in own.items())
                ts.annotations = shared.setdefault(same, own)
            rec = specs.get(id(ann))
            if rec is not None:
                actions[key] = rec
            else:
                try:  # a fresh task: every key is the user's, so a 'grant' in it is refused (reserved)
                    spec = ActionSpec.from_dict(ann)
                except SpecError as e:
                    actions[key] = Malformed(None, message=f"malformed tangram annotation on task {key!r}: {e}")
                except Exception as e:  # anything else a hand-made annotation can hold
                    actions[key] = Malformed(None, message=f"malformed tangram annotation on task {key!r}: "
                                                      f"{type(e).__name__}: {e}")
                else:
                    actions[key] = specs[id(ann)] = Action(spec)
            ts.worker_restrictions = PARKED
            ts.loose_restrictions = False

    def _record_again(self, key: Hashable) -> Action | None:
        """An action that ran before must run again (its result was lost): its record, from its annotation.

        Records are dropped once an action finished (memory or erred: no memory
        per finished action); the annotation is what Dask keeps.
        """
        ts = self.scheduler.tasks.get(key)
        ann = (ts.annotations or {}).get(ANNOTATION) if ts is not None else None
        if ann is None:
            return None
        try:
            a = Action(parse_annotation(ann))
        except Exception as e:
            a = Malformed(None, message=f"malformed tangram annotation on task {key!r}: {type(e).__name__}: {e}")
        ts.worker_restrictions = PARKED
        ts.loose_restrictions = False
        self.actions[key] = a
        return a

    def _done(self, key: Hashable, ts: Any, keep: bool = False) -> None:
        """The action left the plugin's hands: forget its record (unless ``keep``: it was released from
        processing and may wait again), its grant and its timer. The record that just left stays readable
        as :attr:`left` until the next one leaves: the dashboard monitor, which sees the same transition
        after this plugin, reads the action's kind and submit time there."""
        a = self.actions.get(key) if keep else self.actions.pop(key, None)
        if a is not None:
            self.left = (key, a)
        self._ungranted(key)
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer.cancel()
        if self._start_timed:
            self._start_timed.pop(key, None)
        if a is not None and a.annotations is not None and ts is not None:
            ts.annotations, a.annotations = a.annotations, None  # the user's own dict back: no copy per task
            return
        ann = ts.annotations if ts is not None else None
        if ann and GRANT_KEY in ann:  # what Dask keeps per task: the user's annotations only
            ts.annotations = {k: v for k, v in ann.items() if k != GRANT_KEY}

    def _ungranted(self, key: Hashable) -> None:
        """``key``'s grant ended: out of the index of grants by worker."""
        w = self._grant_worker.pop(key, None)
        if w is not None:
            on = self._granted_on.get(w)
            if on is not None:
                on.pop(key, None)

    def transition(self, key: Hashable, start: str, finish: str, *args: Any, stimulus_id: str = "",
                   **kwargs: Any) -> None:
        self.arrived = None
        a = self.actions.get(key)
        if a is None:
            if finish != "no-worker" or self.scheduler is None:
                return
            a = self._record_again(key)
            if a is None:
                return
        try:
            if finish == "no-worker":
                if a.state != GRANTED:
                    self._arrive(key, a)
            elif start == "processing":
                ts = self.scheduler.tasks.get(key)
                if ts is not None:  # whatever happens next goes through the policy again
                    ts.worker_restrictions = PARKED
                    ts.resource_restrictions = None
                if a.state == GRANTED:
                    if finish == "memory":
                        self.policy.finish(key, self.now(), self._run_s(a, kwargs))
                        self.stats.finished += 1
                    elif finish == "erred":
                        self.policy.finish(key, self.now(), None)
                        self.stats.finished += 1
                    else:  # released: cancelled, worker lost, rescheduled
                        self.policy.cancel(key, self.now())
                        self.stats.cancelled += 1
                    self._kick()
                a = self._own(key, a)
                a.state, a.grant = DONE, None
                self._done(key, ts, keep=finish not in ("memory", "erred"))
            elif finish == "processing":
                if a.state != GRANTED:  # only the plugin moves actions to processing
                    logger.error("tangram: action %r reached processing without a grant (%s)", key, stimulus_id)
            elif start == "no-worker":  # released, erred or forgotten while waiting
                if a.state in (PENDING, GRANTED):
                    self.policy.cancel(key, self.now())
                    self.stats.cancelled += 1
                    self._kick()
                self._api_waiting.pop(key, None)
                if a.state != FAILED:
                    a = self._own(key, a)
                    a.state, a.grant = DONE, None
                # released (its input was lost with a worker): it waits again once its input is computed again,
                # keeping its first place and counted once (its record, with its submit time, is kept)
                self._done(key, self.scheduler.tasks.get(key), keep=finish == "released")
            elif finish == "erred" and a.state == NEW:
                # a dependency erred before it arrived (Dask errs it from waiting): it never reaches the policy.
                # Its record went only when the task was forgotten, and showed as waiting until then
                self._done(key, self.scheduler.tasks.get(key))
            if finish == "forgotten":
                self.actions.pop(key, None)
                if a.spec is not None and self.policy is not None:  # (cancelled ones: gone for good now)
                    self.policy.forget(key, a.spec)
                self._ungranted(key)
                self._to_fail.pop(key, None)
        except Exception as e:
            logger.exception("tangram: error handling %s -> %s of action %r", start, finish, key)
            self._fail_later(key, f"the tangram scheduler plugin failed on transition {start} -> {finish}: "
                                  f"{type(e).__name__}: {e}")

    def _arrive(self, key: Hashable, a: Action) -> None:
        now = self.now()
        t0 = a.t0
        if t0 is None:
            # The submit time the monitor measures ACT from. Arrivals less than 1 ms apart share the first
            # one's float (ACT read at most 1 ms long): a burst of 100,000 queued actions (one client.map)
            # holds a float per millisecond, not one per action (32 bytes each), and one queued record.
            t0 = self._t_arrival
            if not 0.0 <= now - t0 < 1e-3:
                t0 = self._t_arrival = now
            self.arrived = key
        if a.error is not None:
            a.t0 = t0  # a Malformed record is its task's own
            self._fail_later(key, a.error)
            return
        # back unrun (released from a worker that left, or from processing): it keeps its place, counted once
        self.policy.submit(key, a.spec, now, issued_at=a.t0)
        q = self._queued_last
        if q is None or q.spec is not a.spec or q.t0 is not t0:
            q = self._queued_last = Action(a.spec, PENDING, t0)
        self.actions[key] = q
        self.stats.submitted += 1
        self._kick()

    def _own(self, key: Hashable, a: Action) -> Action:
        """``key``'s record to change in place: a copy of its own where the record may be shared (new or
        queued, see :class:`Action`), put in ``actions``; else the record itself."""
        if a.granted is None and a.state in (NEW, PENDING) and type(a) is Action:
            a = Action(a.spec, a.state, a.t0)
            if key in self.actions:
                self.actions[key] = a
        return a

    def _run_s(self, a: Action, kw: Mapping[str, Any]) -> float | None:
        c = 0.0
        for ss in kw.get("startstops") or ():
            if ss.get("action") == "compute":
                c += ss["stop"] - ss["start"]
        if c <= 0:
            return None
        setup = a.grant.setup_s if a.grant is not None else 0.0
        return max(c / self.options.time_scale - setup, 1e-6)

    def _fail_later(self, key: Hashable, message: str) -> None:
        self._to_fail[key] = message
        self._kick()

    # -- dispatch ------------------------------------------------------------------------
    def _kick(self) -> None:
        if not self._kicked and self.scheduler is not None:
            self._kicked = True
            self.scheduler.loop.add_callback(self._flush)

    def _flush(self) -> None:
        """The one place that applies decisions: a loop callback, never inside a transition."""
        self._kicked = False
        sched = self.scheduler
        if sched is None or sched.status in (Status.closing, Status.closed):
            return
        t0 = perf_counter()
        stimulus_id = f"tangram-start-{time.time()}"
        recs: dict[Hashable, str] = {}
        fails, self._to_fail = self._to_fail, {}
        try:
            decisions = self.policy.schedule(self.now())
        except Exception:  # a bug outside any one decision: nothing is failed for it; try again shortly
            logger.exception("tangram: the %s policy failed to schedule; actions stay parked and it is asked "
                             "again in 1 s", self.options.policy)
            self.stats.policy_errors += 1
            decisions = []
            sched.loop.call_later(1.0, self._kick)
        if self.policy.expired:  # ended by the TTL: a later begin_trajectory of the id asks the gate again
            for t in self.policy.expired:
                self._admitted.discard(t)
                self._asked.pop(t, None)
                if self._clients_of:
                    self._forget_clients(t)
                ev = self._admissions.pop(t, None)
                if ev is not None:
                    ev.set()
            self.policy.expired.clear()
        for d in decisions:
            if d.__class__ is Reject:
                fails[d.action] = self._rejection(d)
                continue
            if d.__class__ is Load:  # a background load: the worker loads, no action waits inside it
                self._load(d)
                continue
            if d.__class__ is not Start:  # Admit: a trajectory may begin
                ev = self._admissions.pop(d.trajectory, None)
                if ev is not None:
                    self._admitted.add(d.trajectory)
                    ev.set()
                    self._admit_heard(d.trajectory)
                continue
            try:
                self._apply(d, recs)
            except Exception as e:
                logger.exception("tangram: could not apply %s", d)
                fails[d.action] = f"tangram could not place action {d.action!r}: {type(e).__name__}: {e}"
        if self._api_waiting and (self._api_workers or self._cpu_workers):
            for key in list(self._api_waiting):
                self._release_api(key, recs)
        for key, message in fails.items():
            self._err(key, message, recs, stimulus_id)
        if recs:
            sched.transitions(recs, stimulus_id)
        st = self.stats
        st.flushes += 1
        st.flush_s += perf_counter() - t0

    def _apply(self, d: Start, recs: dict[Hashable, str]) -> None:
        key = d.action
        a = self.actions.get(key)
        ts = self.scheduler.tasks.get(key)
        if a is None or ts is None or ts.state != "no-worker" or a.state != PENDING:
            self.policy.cancel(key, self.now())  # it left while the decision was made
            return
        spec = a.spec
        res = spec.resource
        workers = self.scheduler.workers
        resources = None
        device_ids: tuple[int, ...] = ()
        if res == "api":
            worker = ""
        else:
            ws = workers.get(d.node)
            if ws is None:
                raise PlacementError(f"the policy chose worker {d.node}, which is not connected")
            worker = d.node
            decl = self.nodes[worker]
            if res == "cpu" and ws.resources.get("slots"):
                resources = {"slots": d.units}  # the policy never grants more than the node's slots
            elif res == "gpu":
                if ws.resources.get("gpus", 0) >= d.units:
                    resources = {"gpus": d.units}
                if decl.device_ids:
                    device_ids = tuple(decl.device_ids[i] for i in d.gpus)
        grant = Grant.of_start(d, worker, device_ids, self._setup_s(d, spec))
        a = self._own(key, a)
        a.annotations = ts.annotations
        ts.annotations = self._granted_annotations(ts.annotations, grant.to_msg())
        ts.resource_restrictions = resources
        a.state, a.grant = GRANTED, grant
        self._granted_on.setdefault(worker, {})[key] = None
        self._grant_worker[key] = worker
        self.stats.started += 1
        if self.grants is not None:
            self.grants[key] = grant
        if spec.timeout_s is not None:
            if res == "cpu" and worker in self._reports_starts:
                # its run time starts when it starts on the worker (before session 31 its timeout counted from
                # here, and one that waited there for slots erred as "ran past its timeout_s" unstarted)
                self._start_timed[key] = grant
            else:
                self._arm(key, grant, spec.timeout_s)
        if res == "api":
            self._api_waiting[key] = None
            self._release_api(key, recs)
        else:
            ts.worker_restrictions = self._only(worker)
            recs[key] = "processing"

    def _load(self, d: Load) -> None:
        """A ``Load`` decision: ask its worker to load the replica ahead of any action (``tangram_worker_load``).

        The policy holds the replica's GPUs until it is ready: the worker's residency report
        (``resident`` or ``failed``, :mod:`tangram_dask.models.scheduler`) calls ``policy.loaded``.
        If the request cannot reach the worker, the replica is reported ready at once: a later
        grant names it, and the worker loads it then, as for any grant of a replica it lacks.
        """
        self.stats.loads_ahead += 1
        _tell(self.load_listeners, "load", d)
        self.scheduler.loop.add_callback(self._send_load, d)

    async def _send_load(self, d: Load) -> None:
        try:
            reply = await getattr(self.scheduler.rpc(d.node), WORKER_LOAD_HANDLER)(
                replica=int(d.replica), model=d.model, gpus=list(d.gpus), evict=[int(e) for e in d.evict])
            failed = isinstance(reply, dict) and reply.get("status") == "failed"
        except Exception as e:  # the worker left or is unreachable
            logger.warning("tangram: could not ask %s to load replica %d of %s: %s", d.node, d.replica, d.model, e)
            failed = True
        if failed and self.policy is not None:
            self.policy.loaded(d.replica, self.now())
            self._kick()

    def replica_ready(self, worker: str, replica: int) -> None:
        """A worker reported a replica resident (or its load failed): a background load is over."""
        pol = self.policy
        if pol is None:
            return
        r = pol.gpu.replicas.get(replica)
        if r is not None and r.loading and r.node == worker:
            pol.loaded(replica, self.now())
            self._kick()

    def replica_failed(self, worker: str, replica: int) -> None:
        """A worker could not load a replica (it holds nothing for it): the policy's ledger lets it go."""
        pol = self.policy
        if pol is None:
            return
        r = pol.gpu.replicas.get(replica)
        if r is not None and r.node == worker:
            try:
                pol.load_failed(replica, self.now())
            except Exception:  # a policy bug must not take the scheduler's stream down: the replica stays
                logger.exception("tangram: the policy could not drop replica %d after its failed load", replica)
                self.stats.policy_errors += 1
            self._kick()

    def _granted_annotations(self, own: dict | None, wire: tuple) -> dict:
        """The task's annotations with the grant beside the user's (whose spec dict is not copied).

        Dask keeps its recent compute-task messages, and with them each action's annotations, for up to
        ``distributed.admin.low-level-log-length`` batches per worker; so actions whose annotations are
        equal and whose grants are equal (same worker and units, no load: most of them) share one granted
        dict instead of holding a copy and a grant each (about 330 bytes per action held). Annotations
        that cannot be compared by value (an unhashable object in them) get their own copy. The cache is
        bounded: emptied when it reaches 4,096 entries.
        """
        try:
            last = self._frozen_last  # the tasks of one graph share their annotations: freeze once (~8 us)
            frozen = last[1] if last is not None and last[0] is own else _frozen(own)
            self._frozen_last = (own, frozen)
            ck = (frozen, wire)
            hit = self._granted.get(ck)
        except TypeError:
            ck, hit = None, None
        if hit is not None:
            return hit
        ann = dict(own or {})
        ann[GRANT_KEY] = wire
        if ck is not None:
            if len(self._granted) >= 4096:
                self._granted.clear()
            self._granted[ck] = ann
        return ann

    def _only(self, worker: str) -> frozenset:
        """The shared restriction set naming one worker."""
        r = self._restrict.get(worker)
        if r is None:
            r = self._restrict[worker] = frozenset((worker,))
        return r

    def _arm(self, key: Hashable, grant: Grant, timeout_s: float) -> None:
        self._timers[key] = self.scheduler.loop.call_later(
            (timeout_s + grant.setup_s) * self.options.time_scale, self._timed_out, key, grant)

    def _handle_started(self, worker: str = "", key: Any = None, **_: Any) -> None:
        """A worker started a CPU action that has a timeout_s: its timer starts now."""
        grant = self._start_timed.get(key)
        if grant is None or grant.worker != worker:  # (a late word from a worker it was granted on before)
            return
        del self._start_timed[key]
        a = self.actions.get(key)
        if a is not None and a.grant is grant and a.state == GRANTED and a.spec.timeout_s is not None:
            self._arm(key, grant, a.spec.timeout_s)

    def _timed_out(self, key: Hashable, grant: Grant) -> None:
        """``timeout_s`` of run time passed (after the grant's setup): the action errs, its units are freed."""
        self._timers.pop(key, None)
        a = self.actions.get(key)
        if a is None or a.grant is not grant or a.state != GRANTED:
            return
        self._fail_later(key, f"action {key!r} ({a.spec.kind}) ran past its timeout_s = {a.spec.timeout_s:g} s; "
                              f"it was stopped by the tangram scheduler and its units were freed (the worker "
                              f"thread may still be finishing: tangram_dask.run_code sandboxes honour the "
                              f"timeout themselves)")

    def _rejection(self, d: Reject) -> str:
        """The error an action the policy will not run gets: the reason, and what to do about it."""
        sf = d.shortfall
        msg = f"tangram cannot run action {d.action!r}: {d.reason}"
        if sf is None or not sf.never:
            return msg
        if callable(getattr(self.policy, "wait_unplaceable", None)) and sf.resource in ("cpu", "gpu"):
            return (msg + ", and no worker kind the autoscaler can make would hold it. Add such a kind to "
                    "tangram.adaptive.kinds, or lower the action's units")
        if sf.resource == "cpu":
            return (msg + f". Start a worker with --resources slots={sf.requested} or more, or set "
                    f"tangram.scheduler.wait-for-capacity (with adaptive scaling) to let it wait for one")
        if sf.resource == "api":
            return msg + ". Raise tangram.scheduler.api-tokens, or lower the action's units"
        if sf.largest == 0 and "does not know" in sf.reason:
            return (msg + ". Register the model before submitting its actions: tangram_dask.register_model, "
                    "models= to TangramSchedulerPlugin, or tangram.scheduler.models")
        return msg + ". Start a GPU worker that can hold a replica, or set tangram.scheduler.wait-for-capacity"

    def _release_api(self, key: Hashable, recs: dict[Hashable, str]) -> None:
        """An API action holds its tokens; it runs on any worker that runs API calls (else any CPU worker)."""
        allowed = self._api_workers or self._cpu_workers
        if not allowed:
            return  # stays parked, granted, until such a worker joins
        ts = self.scheduler.tasks.get(key)
        self._api_waiting.pop(key, None)
        if ts is None or ts.state != "no-worker":
            return
        ts.worker_restrictions = set(allowed)
        recs[key] = "processing"

    def _setup_s(self, d: Start, spec: ActionSpec) -> float:
        """What the action pays before its work: the simulator's cost model, on what the policy decided."""
        return self.costs.setup_s(spec, sandbox=d.sandbox, restore=d.restore, load=d.load)

    def _err(self, key: Hashable, message: str, recs: dict[Hashable, str], stimulus_id: str) -> None:
        sched = self.scheduler
        ts = sched.tasks.get(key)
        a = self.actions.get(key)
        if a is not None and a.state in (PENDING, GRANTED):
            self.policy.cancel(key, self.now())  # frees what a Start took, or drops it from the queue
        if ts is None or ts.state not in ("no-worker", "processing"):
            return
        if a is not None:
            a = self._own(key, a)
            a.state, a.grant = FAILED, None
        self.stats.failed += 1
        logger.error("tangram: action %r errs: %s", key, message)
        exc = dumps(PlacementError(message))
        recs.pop(key, None)
        recs.update(sched.transition(key, "erred", exception=exc, cause=key, stimulus_id=stimulus_id,
                                     **({"worker": ts.processing_on.address} if ts.processing_on else {})))

    # -- RPC handlers -----------------------------------------------------------------------
    async def _handle_begin_trajectory(self, trajectory: str, expected_s: Any = None,
                                       client: str | None = None) -> dict[str, str]:
        """Returns once the policy admits the trajectory (at once, unless the policy gates admission).
        A bad ``expected_s`` (the client checks it; a raw RPC may not) is refused, and nothing changes.
        ``client``: the caller's client id (its trajectories end when it leaves: :meth:`remove_client`)."""
        if self.policy is None:
            return {"status": "not-started"}
        try:
            trajectory = check_trajectory(trajectory, "begin_trajectory")
            expected = check_expected_s(expected_s)
        except TrajectoryError as e:
            return {"status": "error", "message": str(e)}
        self._client_began(client, trajectory)
        if trajectory in self._admitted:
            return {"status": "OK"}
        ev = self._admissions.get(trajectory)
        if ev is None:
            ev = self._ask(trajectory, self.now(), expected)
            self._kick()
        await ev.wait()
        return {"status": "OK" if trajectory in self._admitted else "ended"}

    def _ask(self, trajectory: str, now: float, expected: float | None) -> asyncio.Event:
        """A trajectory asks to be admitted: the event its ``begin_trajectory`` waits on, when it asked, the policy
        told."""
        ev = self._admissions[trajectory] = asyncio.Event()
        self._asked[trajectory] = now
        self.policy.begin_trajectory(trajectory, now, expected)
        return ev

    def _admit_heard(self, trajectory: str) -> None:
        waited = max(self.now() - self._asked.pop(trajectory, self.now()), 0.0)
        _tell(self.admit_listeners, "admission", trajectory, waited)

    def _client_began(self, client: Any, trajectory: str) -> None:
        if isinstance(client, str) and self.scheduler is not None and client in self.scheduler.clients:
            self._clients_of.setdefault(trajectory, set()).add(client)
            self._trajectories_of.setdefault(client, set()).add(trajectory)

    def _forget_clients(self, trajectory: str) -> None:
        for c in self._clients_of.pop(trajectory, ()):
            ts = self._trajectories_of.get(c)
            if ts is not None:
                ts.discard(trajectory)
                if not ts:
                    del self._trajectories_of[c]

    def remove_client(self, scheduler: Any, client: str) -> None:
        """A client left (closed, or its process died): each trajectory it began or queued that no other client
        began, and none of whose actions another client still wants, ends, as ``end_trajectory`` ends it
        (one waiting for admission is taken out of the queue). Dask has released the client's own tasks by
        now. A trajectory whose actions another client wants is that client's from here on."""
        mine = self._trajectories_of.pop(client, None)
        if not mine or self.policy is None:
            return
        others: dict[str, set[str]] = {}  # trajectory -> clients that want its live actions
        tasks = scheduler.tasks
        for key, a in self.actions.items():
            t = a.spec.trajectory if a.spec is not None else None
            if t in mine:
                ts = tasks.get(key)
                if ts is not None:
                    others.setdefault(t, set()).update(cs.client_key for cs in ts.who_wants or ())
        ended = waiting = 0
        for t in mine:
            left = self._clients_of.get(t, set())
            left.discard(client)
            left |= others.get(t, set()) - {client}
            if left:
                self._clients_of[t] = left
                for c in left:
                    self._trajectories_of.setdefault(c, set()).add(t)
                continue
            waiting += t in self._admissions
            ended += 1
            self._handle_end_trajectory(t)
        if ended:
            logger.info("tangram: client %s left: its %d trajectories that no other client uses ended (%d of them "
                        "waiting for admission)", client, ended, waiting)

    def _handle_expect_trajectories(self, trajectories: Any = None, client: str | None = None) -> dict[str, Any]:
        """A step's trajectories queued for admission in one pass (``expect_trajectories``), so the gate
        orders all of them; each one's ``begin_trajectory`` then waits for its admission. A bad entry
        (the client checks; a raw RPC may not) refuses the whole call, and nothing changes. ``client``: as
        for ``begin_trajectory``."""
        if self.policy is None:
            return {"status": "not-started"}
        try:
            items = check_expectations(trajectories)
        except TrajectoryError as e:
            return {"status": "error", "message": str(e)}
        now, queued = self.now(), 0
        for trajectory, expected in items:
            self._client_began(client, trajectory)
            if trajectory in self._admitted or trajectory in self._admissions:
                continue  # already waiting or admitted: its place is kept
            self._ask(trajectory, now, expected)
            queued += 1
        if queued:
            self._kick()
        return {"status": "OK", "queued": queued}

    def _handle_end_trajectory(self, trajectory: str) -> dict[str, str] | None:
        try:
            trajectory = check_trajectory(trajectory, "end_trajectory")
        except TrajectoryError as e:  # (the client checks; a raw RPC may not) nothing changes
            return {"status": "error", "message": str(e)}
        if self.policy is not None:
            self.policy.end_trajectory(trajectory, self.now())
        self._admitted.discard(trajectory)
        self._asked.pop(trajectory, None)
        if self._clients_of:
            self._forget_clients(trajectory)
        ev = self._admissions.pop(trajectory, None)
        if ev is not None:  # ended while waiting to be admitted: let its caller go
            ev.set()
        self._kick()  # ending one may admit another

    def _handle_state_stayed(self, trajectory: str = "", worker: str = "", source: str = "") -> dict[str, str]:
        """A trajectory's state could not move from ``source`` to ``worker`` (the source refused, timed out waiting
        for an action of it, or the restore failed): the action that was moved errs, and the state is still at
        ``source``, so that is its home again. Before session 34 the policy kept the destination as home, and the
        trajectory's next action ran there on an empty dir while its files stayed at the source."""
        pol = self.policy
        if pol is None or not isinstance(trajectory, str) or pol.home.get(trajectory) != worker:
            return {"status": "unchanged"}  # (it moved on since, or ended)
        if source in self.nodes:
            pol.rehome(trajectory, source)
            logger.warning("tangram: trajectory %s could not move its state from %s to %s; its home is %s again",
                           trajectory, source, worker, source)
            return {"status": "OK"}
        pol.home.pop(trajectory, None)  # the source left too: no home (its next action starts afresh anywhere)
        return {"status": "no-home"}

    def _handle_snapshot(self) -> dict[str, Any]:
        return self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        """The policy's frozen snapshot (``nodes``: the policy's view of each node) and the plugin's counters
        and worker declarations (``workers``), as plain data."""
        snap = asdict(self.policy.snapshot()) if self.policy is not None else {}
        snap["plugin"] = asdict(self.stats)
        snap["workers"] = {addr: d.to_msg() for addr, d in self.nodes.items()}  # what each worker declared
        snap["actions"] = len(self.actions)
        opt = getattr(self.policy, "opt", None)  # the tangram policy's knobs that differ from their defaults
        snap["policy_options"] = {} if opt is None else {
            f.name: getattr(opt, f.name) for f in fields(opt) if getattr(opt, f.name) != f.default}
        return snap


# -- client helpers -------------------------------------------------------------------------
def snapshot(client: Any) -> Any:
    """The scheduler's tangram snapshot (policy pools, replicas, plugin counters)."""
    return client.sync(getattr(client.scheduler, SNAPSHOT_HANDLER))


def _tell(listeners: list, what: str, *args: Any) -> None:
    """Call each observer with ``args``; an observer's error is logged and never stops what it observes."""
    for listen in listeners:
        try:
            listen(*args)
        except Exception:
            logger.exception("tangram: %s listener %r failed", what, listen)
