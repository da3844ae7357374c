"""The interface every policy implements, and the bookkeeping they share.

Pure: no Dask import. Events in, decisions out, deterministic: the same
sequence of calls gives the same decisions (no clocks, no randomness, no
iteration over unordered sets).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from ..cluster import ClusterSpec, CpuNode, GpuNode, ModelSpec
from ..spec import ActionSpec
from .feasibility import Capacity, GpuShape, never_fits
from .ledger import CpuPool, GpuPool, TokenPool
from .types import (ActionId, Admit, Decision, Load, NodeStats, PolicySnapshot, PoolStats, Reject, ReplicaId,
                    ReplicaSpec, Shortfall, Start)


@dataclass(slots=True)
class Running:
    """An action holding units."""

    spec: ActionSpec
    node: str
    units: int
    replica: ReplicaId | None
    started: float
    est_end: float


class Policy:
    """Base of ``tangram``, ``fifo`` and ``static``.

    Calls, in any order the world produces them:

    - ``begin_trajectory(t, now, expected_s=None)`` / ``end_trajectory(t, now)``; ``expected_s``: what the
      caller expects of the trajectory's length (seconds), for the gate's ``admit_long`` (the others ignore it)
    - ``submit(action_id, spec, now)``: an action is issued and waits; returns
      a :class:`Shortfall` (``never=True``) when no current node can ever hold
      it (see ``wait_unplaceable`` below), else None
    - ``finish(action_id, now, run_s)``: it ended; ``run_s`` is its observed
      run time (setup excluded), which the policy may learn from
    - ``cancel(action_id)``: forget it, free what it held
    - ``loaded(replica, now)``: a background load (a :class:`Load` decision) is over, the replica is ready
    - ``add_cpu_node`` / ``add_gpu_node`` / ``remove_node`` / ``set_api_tokens``
    - ``schedule(now) -> list[Start | Admit | Reject]``: what to start now

    Actions no current node can ever hold (:mod:`.feasibility`) never enter a
    pool, so they block nothing. With ``wait_unplaceable=False`` (the default)
    they are rejected at once, unless no node of their kind has joined at all
    (then they wait, as Dask's own tasks wait for a worker) or one that could
    hold them left less than ``lost_wait_s`` seconds ago (a nanny restarting
    a worker that died, a pod being replaced: they wait for it to come back,
    and are rejected only once that time passes with none like it back); with True (an
    autoscaler is on) they wait, listed in ``snapshot().unplaceable``, until a
    node that can hold them joins. It may also be a function of the action's
    spec (what an autoscaler could make: ``tangram_dask.adaptive``), True where
    it may wait; set to one, the actions already waiting that it refuses are
    rejected. A decision that raises rejects that one action; every counter is
    as it was before it.
    """

    name = "base"
    #: options on which this policy goes beyond WORKLOAD.md (e.g. replicas wider than its smallest k): the
    #: simulator then skips those checks and the bench names them beside its figures
    beyond_contract: tuple[str, ...] = ()

    def __init__(self, cluster: ClusterSpec, models: dict[str, ModelSpec],
                 replicas: Iterable[ReplicaSpec] = (), *, trajectory_ttl_s: float | None = None,
                 wait_unplaceable: bool | Callable[[ActionSpec], bool] = False, lost_wait_s: float = 300.0):
        self.cluster = cluster
        self._wait_unplaceable = wait_unplaceable
        self.lost_wait_s = lost_wait_s
        self.models = dict(models)
        self.cpu = CpuPool(cluster.cpu_nodes)
        self.api = TokenPool(cluster.api_tokens)
        self.gpu = GpuPool(cluster.gpu_nodes)
        self.gpu.initial(list(replicas), self.models)
        self.running: dict[ActionId, Running] = {}
        self.home: dict[str, str] = {}  # trajectory -> node of its last stateful action
        # trajectories never ended by their caller are forgotten after ttl seconds without activity
        self.trajectory_ttl_s = trajectory_ttl_s
        self._seen: OrderedDict[str, float] = OrderedDict()  # trajectory -> last activity, oldest first
        #: the trajectories the TTL ended, oldest first, for the caller to forget too (it empties the list)
        self.expired: list[str] = []
        self._ready: list[Decision] = []
        self.decisions = 0
        # waiting for a larger node: (spec, why, since, issued_at: the time it was first issued where the figures
        # that learn from issued actions counted it already, else None)
        self.unplaceable: dict[ActionId, tuple[ActionSpec, Shortfall, float, float | None]] = {}
        self.broken: dict[str, str] = {}  # models whose loads keep failing -> why their actions are rejected
        self.probing: set[str] = set()  # broken models whose next action is let through, to try them again
        # per CPU node, its running actions' expected ends, kept only where nodes take dispatch-ahead units (live)
        self.cpu_ends: dict[str, dict[ActionId, float]] = {}
        self._failed_loads: set[ReplicaId] = set()  # replicas whose load failed under the action holding them
        self.rejected = 0
        self._capacity = self._measure_capacity()
        # lost_wait_s: the CPU and GPU nodes seen since capacity last shrank for good (the largest CPU node, every
        # GPU shape), and when it shrank below them (None: it has not; NaN: it has, stamped at the next schedule)
        self._had = self._capacity
        self._lost_at: float | None = None
        self._clock = 0.0  # the latest now of submit or schedule: when a queued action began to wait for a node

    # -- trajectories --------------------------------------------------------
    def begin_trajectory(self, trajectory: str, now: float, expected_s: float | None = None) -> None:
        self._ready.append(Admit(trajectory))

    def end_trajectory(self, trajectory: str, now: float) -> None:
        self.home.pop(trajectory, None)
        self._seen.pop(trajectory, None)

    def _touch(self, trajectory: str | None, now: float) -> None:
        if self.trajectory_ttl_s is not None and trajectory is not None:
            self._seen[trajectory] = now
            self._seen.move_to_end(trajectory)

    def _expire(self, now: float) -> None:
        """End the trajectories idle for longer than the TTL: O(1) amortised, oldest first."""
        seen = self._seen
        while seen:
            t, last = next(iter(seen.items()))
            if now - last < self.trajectory_ttl_s:
                return
            self.end_trajectory(t, now)
            seen.pop(t, None)
            self.expired.append(t)

    # -- actions ----------------------------------------------------------------
    def submit(self, aid: ActionId, spec: ActionSpec, now: float, *, issued_at: float | None = None
               ) -> Shortfall | None:
        """Queue action ``aid``. ``issued_at``: it was first submitted then, and comes back unrun (its worker
        left or paused before it began): it keeps its place in the order (as issued then), and the figures that
        learn from issued actions (hints, demand, its trajectory's expected work) do not count it again."""
        self._clock = now
        if self.broken and spec.model in self.broken:
            if spec.model in self.probing:  # the one action that tries the broken model again
                self.probing.discard(spec.model)
            else:
                self._reject(aid, self.broken[spec.model])
                return None
        sf = never_fits(spec, self._capacity, self.models)
        if sf is None:
            self._submit(aid, spec, now, issued_at)
            return None
        if self._may_wait(spec):
            self.unplaceable[aid] = (spec, sf, now, issued_at)
        else:
            self._reject(aid, sf.reason, sf)
        return sf

    @property
    def lost_since(self) -> float | None:
        """When a CPU or GPU node that some actions need left and none like it came back (``lost_wait_s``);
        NaN until the next ``schedule`` stamps it; None when nothing seen is missing."""
        return self._lost_at

    @property
    def wait_unplaceable(self) -> bool | Callable[[ActionSpec], bool]:
        return self._wait_unplaceable

    @wait_unplaceable.setter
    def wait_unplaceable(self, value: bool | Callable[[ActionSpec], bool]) -> None:
        """Set it; the actions waiting for capacity that it no longer lets wait are rejected (their
        ``Reject`` goes out with the next ``schedule``)."""
        self._wait_unplaceable = value
        for aid, (spec, sf, _, _) in list(self.unplaceable.items()):
            if not self._may_wait(spec):
                del self.unplaceable[aid]
                self._reject(aid, sf.reason, sf)

    def _may_wait(self, spec: ActionSpec) -> bool:
        """An action that cannot fit waits for capacity when an autoscaler may bring it (where
        ``wait_unplaceable`` is a function, as that function says: whether a node it can bring would
        hold it), or when no node of its kind has joined yet (it may just be early); otherwise it is
        rejected."""
        w = self._wait_unplaceable
        if w is True:
            return True
        if self._lost_at is not None and spec.resource != "api" and never_fits(spec, self._had, self.models) is None:
            return True  # a node that held it left lately: it may come back (lost_wait_s)
        if callable(w):
            return bool(w(spec))
        if w:
            return True
        cap = self._capacity
        if spec.resource == "cpu":
            return cap.cpu_nodes == 0
        if spec.resource == "gpu":
            return spec.model in self.models and not cap.gpu_shapes
        return False

    def _reject(self, aid: ActionId, reason: str, shortfall: Shortfall | None = None) -> None:
        self.rejected += 1
        self._ready.append(Reject(aid, reason, shortfall))

    def _measure_capacity(self) -> Capacity:
        cpu, gp = self.cpu, self.gpu
        shapes = sorted({GpuShape(st.spec.gpus, st.spec.gpu_memory_gb) for st in gp.nodes.values()})
        return Capacity(max(cpu.limit.values(), default=0), len(cpu.limit), self.api.total, tuple(shapes))

    def _nodes_changed(self, models_changed: bool = False) -> None:
        """Capacity changed: actions that now fit leave the unplaceable set; queued ones that never can go there.

        The queued actions are looked at only when capacity may have shrunk (a node left, the quota fell,
        a model grew): a node joining, the common case under adaptive scaling, costs O(unplaceable).
        """
        old, self._capacity = self._capacity, self._measure_capacity()
        cap = self._capacity
        self._track_lost(cap, old)
        if self.unplaceable:
            for aid, (spec, _, t, issued_at) in list(self.unplaceable.items()):
                sf = never_fits(spec, cap, self.models)
                if sf is None:
                    del self.unplaceable[aid]
                    self._submit(aid, spec, t, issued_at)
                elif self._may_wait(spec):
                    self.unplaceable[aid] = (spec, sf, t, issued_at)
                else:  # it waited because no node of its kind had joined; one has, and cannot hold it
                    del self.unplaceable[aid]
                    self._reject(aid, sf.reason, sf)
        shrunk = (models_changed or cap.cpu_largest < old.cpu_largest or cap.api_tokens < old.api_tokens
                   or not set(old.gpu_shapes) <= set(cap.gpu_shapes))
        for aid, spec in (self._queued_specs() if shrunk else ()):
            sf = never_fits(spec, cap, self.models)
            if sf is not None and self._drop_pending(aid):
                if self._may_wait(spec):  # (issued_at 0: counted when it was issued; first in line when back)
                    self.unplaceable[aid] = (spec, sf, self._clock, 0.0)
                else:
                    self._reject(aid, sf.reason, sf)
        self._capacity_changed()

    def _track_lost(self, cap: Capacity, old: Capacity) -> None:
        """``lost_wait_s``: keep the largest CPU node and the GPU shapes seen; note when capacity fell below them
        (a CPU or GPU node left), and forget the note once it is back. A node that leaves while an earlier one is
        waited for starts the wait again: what only it could hold gets the whole of ``lost_wait_s`` too."""
        had = self._had
        shapes = set(had.gpu_shapes)
        if cap.cpu_largest >= had.cpu_largest and shapes <= set(cap.gpu_shapes):
            self._had, self._lost_at = cap, None  # nothing seen is missing (or more joined)
            return
        if not self.lost_wait_s:
            self._had = cap
            return
        if cap.cpu_largest > had.cpu_largest or not set(cap.gpu_shapes) <= shapes:  # more joined beside what left
            self._had = Capacity(max(had.cpu_largest, cap.cpu_largest), max(had.cpu_nodes, cap.cpu_nodes),
                                 cap.api_tokens, tuple(sorted(shapes | set(cap.gpu_shapes))))
        if self._lost_at is None or cap.cpu_largest < old.cpu_largest or not set(old.gpu_shapes) <= set(cap.gpu_shapes):
            self._lost_at = math.nan  # stamped by the next schedule(now)

    def _lost_waited(self, now: float) -> None:
        """A node left: once ``lost_wait_s`` passed with no node like it back, the actions that only it could
        hold are rejected (they wait no longer, and new ones like them are rejected at once)."""
        if self._lost_at != self._lost_at:  # NaN: the shrink came after the last schedule
            self._lost_at = now
            return
        if now - self._lost_at < self.lost_wait_s:
            return
        self._had, self._lost_at = self._capacity, None
        for aid, (spec, sf, _, _) in list(self.unplaceable.items()):
            if not self._may_wait(spec):
                del self.unplaceable[aid]
                self._reject(aid, f"{sf.reason} (a worker that could hold it left over {self.lost_wait_s:g} s ago "
                                  f"and none like it has come back)", sf)

    def finish(self, aid: ActionId, now: float, run_s: float | None = None) -> None:
        r = self.running.pop(aid, None)
        if r is None:
            return
        self._end_of(aid, r)
        self._release(r, now)
        if self.trajectory_ttl_s is not None:  # (_touch's own test, read here: once per action)
            self._touch(r.spec.trajectory, now)
        self._finished(aid, r, now, run_s)

    def cancel(self, aid: ActionId, now: float = 0.0) -> bool:
        """Forget a pending action, or free what a running one holds. Safe twice."""
        r = self.running.pop(aid, None)
        if r is not None:
            self._end_of(aid, r)
            self._release(r, now)
            return True
        if self.unplaceable.pop(aid, None) is not None:
            return True
        return self._drop_pending(aid)

    def forget(self, aid: ActionId, spec: ActionSpec) -> None:
        """``aid`` (cancelled, or ended) will not come back: what the policy kept of it in case it did (its
        expected work in its trajectory's figures) goes. Safe for an action it never knew."""

    def loaded(self, replica: ReplicaId, now: float) -> None:
        """A background load (:class:`Load`) ended: the replica is ready. Safe for an unknown replica."""
        if self.gpu.loaded(replica, now):
            self._replica_ready(replica, now)

    def _replica_ready(self, replica: ReplicaId, now: float) -> None:
        pass

    def schedule(self, now: float) -> list[Decision]:
        self._clock = now
        if self._seen:
            self._expire(now)
        if self._lost_at is not None:
            self._lost_waited(now)
        out = self._ready
        self._ready = []
        self._schedule(now, out)
        if self._ready:  # rejections made while scheduling
            out.extend(self._ready)
            self._ready = []
        self.decisions += len(out)
        return out

    # -- nodes --------------------------------------------------------------------
    def add_cpu_node(self, node: CpuNode, ahead: int = 0) -> None:
        """A CPU node joined. ``ahead``: units it may hold beyond its slots (dispatch-ahead)."""
        self.cpu.add(node.name, node.slots, ahead)
        self._nodes_changed()

    def add_gpu_node(self, node: GpuNode, replicas: Iterable[ReplicaSpec] = ()) -> None:
        self.gpu.add(node)
        self.gpu.initial(list(replicas), self.models)
        self._nodes_changed()

    def set_model(self, model: ModelSpec) -> None:
        """A model was registered, or its memory or load time measured: later decisions use it, and its
        replicas in the ledger take the measured memory. A model marked broken is no longer."""
        self.model_mended(model.name)
        self.models[model.name] = model
        self.gpu.resize(model.name, model.gpu_memory_gb)
        self._nodes_changed(models_changed=True)

    def model_broken(self, model: str, reason: str) -> None:
        """``model``'s loads keep failing (its loader raises, or never returns): its waiting actions, and those
        submitted later, are rejected with ``reason`` until :meth:`model_mended` or :meth:`set_model` (one
        action at a time is let through after :meth:`model_probe`)."""
        self.broken[model] = reason
        self.probing.discard(model)
        for aid, spec in self._queued_specs():
            if spec.model == model and self._drop_pending(aid):
                self._reject(aid, reason)
        for aid, (spec, _, _, _) in list(self.unplaceable.items()):
            if spec.model == model:
                del self.unplaceable[aid]
                self._reject(aid, reason)

    def hold_gpu_memory(self, key: Hashable, node: str, gpus: Iterable[int], gb: float) -> bool:
        """``gb`` on each of ``gpus`` of ``node`` is taken outside the ledger's replicas (a load given up on
        whose loader runs on): no load goes into it until :meth:`release_gpu_memory` with ``key``."""
        return self.gpu.hold_memory(key, node, tuple(int(g) for g in gpus), float(gb))

    def release_gpu_memory(self, key: Hashable) -> bool:
        """What :meth:`hold_gpu_memory` took under ``key`` is free again."""
        if not self.gpu.release_memory(key):
            return False
        self._capacity_changed()  # a load may fit there now
        return True

    def model_mended(self, model: str) -> None:
        """``model`` is no longer broken (its actions are no longer rejected); safe if it was not broken."""
        self.broken.pop(model, None)
        self.probing.discard(model)

    def model_probe(self, model: str) -> None:
        """A broken ``model``'s next action is let through, to try it again (a circuit breaker's half-open
        state); the others are still rejected. Its outcome decides: :meth:`model_mended`, or it stays broken."""
        if model in self.broken:
            self.probing.add(model)

    def load_failed(self, replica: ReplicaId, now: float) -> None:
        """The worker could not load ``replica`` and holds nothing for it: it leaves the ledger, at once
        where no action holds it, else when the action that held it (and got the load's error) ends.
        Safe for an unknown replica."""
        r = self.gpu.replicas.get(replica)
        if r is None:
            return
        if r.busy and not r.loading:
            self._failed_loads.add(replica)
            return
        self.gpu.loaded(replica, now)  # a background load: its GPUs are free again
        self._drop_failed(replica, now)

    def _drop_failed(self, replica: ReplicaId, now: float) -> None:
        """A replica whose load failed leaves the ledger (idle now)."""
        self.gpu.evict(replica)
        self._replica_gone(replica, now)

    def _replica_gone(self, replica: ReplicaId, now: float) -> None:
        """A replica left the ledger other than by this policy's own eviction (its load failed)."""

    def rehome(self, trajectory: str, node: str) -> None:
        """A trajectory's state was moved to ``node`` (e.g. off a worker being retired)."""
        if trajectory in self.home:
            self.home[trajectory] = node

    def homes_on(self, node: str) -> list[str]:
        """The trajectories whose state lives on ``node``."""
        return [t for t, n in self.home.items() if n == node]

    def set_api_tokens(self, tokens: int) -> None:
        self.api.resize(tokens)
        self._nodes_changed()

    def remove_node(self, name: str) -> list[ActionId]:
        """The node left: returns the actions that were running there (lost; resubmit them)."""
        lost = [aid for aid, r in self.running.items() if r.node == name]
        for aid in lost:
            r = self.running.pop(aid)
            self._end_of(aid, r)
            self._lost(r)
        self.cpu_ends.pop(name, None)
        if name in self.cpu.capacity:
            self.cpu.remove(name)
        elif name in self.gpu.nodes:
            self.gpu.remove(name)
        for t in [t for t, n in self.home.items() if n == name]:
            del self.home[t]
        self._nodes_changed()
        return lost

    def cordon(self, name: str, now: float) -> bool:
        """Node ``name`` takes no new action or load (its worker paused) until :meth:`uncordon`; what runs
        there goes on and releases as usual. False if the node is unknown or already cordoned."""
        done = self.cpu.cordon(name) or self.gpu.cordon(name)
        if done:
            self._cordoned(name, now)
        return done

    def uncordon(self, name: str, now: float) -> bool:
        """Node ``name`` takes work again. False if it was not cordoned."""
        done = self.cpu.uncordon(name) or self.gpu.uncordon(name)
        if done:
            self._capacity_changed()
            self._uncordoned(name)
        return done

    def cordoned(self) -> list[str]:
        """The cordoned nodes, in no set order."""
        gpu = self.gpu
        return [*self.cpu.held, *(n for n, st in gpu.nodes.items() if st.cordon is not None)] if gpu.cordoned_nodes \
            else list(self.cpu.held)

    # -- for subclasses -----------------------------------------------------------
    def _lost(self, r: Running) -> None:
        """A running action was lost with its node (:meth:`remove_node`): what the subclass counts for it."""

    def _cordoned(self, name: str, now: float) -> None:
        """Node ``name`` was cordoned: what the subclass keeps for it (a reservation) goes elsewhere."""

    def _uncordoned(self, name: str) -> None:
        """Node ``name`` takes work again: what waits for it (actions at their home) may start."""
    def _submit(self, aid: ActionId, spec: ActionSpec, now: float, issued_at: float | None = None) -> None:
        raise NotImplementedError

    def _queued_specs(self) -> list[tuple[ActionId, ActionSpec]]:
        """Every waiting action (for re-checking feasibility when a node leaves)."""
        return []

    def _schedule(self, now: float, out: list[Decision]) -> None:
        raise NotImplementedError

    def _drop_pending(self, aid: ActionId) -> bool:
        raise NotImplementedError

    def _finished(self, aid: ActionId, r: Running, now: float, run_s: float | None) -> None:
        pass

    def _capacity_changed(self) -> None:
        pass

    def _end_of(self, aid: ActionId, r: Running) -> None:
        """``aid`` (running ``r``) ends: out of its node's expected ends (``cpu_ends``)."""
        if self.cpu_ends:
            ends = self.cpu_ends.get(r.node)
            if ends:
                ends.pop(aid, None)

    def _release(self, r: Running, now: float) -> None:
        res = r.spec.resource
        if res == "cpu":
            self.cpu.give(r.node, r.units)
        elif res == "api":
            self.api.give(r.units)
        else:
            self.gpu.release(r.replica, now)
            if self._failed_loads and r.replica in self._failed_loads:  # its load failed while it held it
                self._failed_loads.discard(r.replica)
                if r.replica in self.gpu.replicas:
                    self._drop_failed(r.replica, now)

    def _start_cpu(self, aid: ActionId, spec: ActionSpec, node: str, k: int, now: float,
                   est_s: float = 0.0, taken: bool = False) -> Start:
        if not taken:
            self.cpu.take(node, k)
        if self.trajectory_ttl_s is not None:
            self._touch(spec.trajectory, now)
        restore = False
        prev = None
        if spec.affinity == "trajectory":
            prev = self.home.get(spec.trajectory)
            restore = prev is not None and prev != node
            self.home[spec.trajectory] = node
        self.running[aid] = Running(spec, node, k, None, now, now + est_s)
        if self.cpu.ahead:  # (the live plugin's dispatch-ahead: where a slot is expected to free soonest)
            self.cpu_ends.setdefault(node, {})[aid] = now + est_s
        return Start(aid, node, k, restore=restore, restore_from=prev if restore else "")

    def _start_api(self, aid: ActionId, spec: ActionSpec, k: int, now: float, est_s: float = 0.0) -> Start:
        self.api.take(k)
        self.running[aid] = Running(spec, "api", k, None, now, now + est_s)
        return Start(aid, "api", k)

    def _start_gpu(self, aid: ActionId, spec: ActionSpec, rid: ReplicaId, now: float, est_s: float = 0.0,
                   load: bool = False, evict: tuple[ReplicaId, ...] = ()) -> Start:
        self.gpu.acquire(rid, now)
        rep = self.gpu.replicas[rid]
        rep.busy_until = now + est_s
        self.running[aid] = Running(spec, rep.node, len(rep.gpus), rid, now, now + est_s)
        return Start(aid, rep.node, len(rep.gpus), rep.gpus, rid, load, evict, cross_group=rep.cross_group)

    def _load(self, model: str, node: str, gpus: tuple[int, ...], evict: Iterable[ReplicaId], now: float) -> ReplicaId:
        for rid in evict:
            self.gpu.evict(rid)
        return self.gpu.place(model, node, gpus, self.models[model].gpu_memory_gb, now)

    def _load_ahead(self, model: str, node: str, gpus: tuple[int, ...], evict: Iterable[ReplicaId],
                    now: float) -> Load:
        """A background load: the replica is resident and loading (its GPUs held) until ``loaded``."""
        evict = tuple(evict)
        rid = self._load(model, node, gpus, evict, now)
        self.gpu.begin_load(rid, now)
        return Load(node, tuple(gpus), model, rid, evict, self.gpu.replicas[rid].cross_group)

    def _pool_stats(self) -> list[PoolStats]:
        """One entry per resource; subclasses add queue figures and per-model pools."""
        run = {"cpu": 0, "api": 0, "gpu": 0}
        for r in self.running.values():
            run[r.spec.resource] += 1
        q = self._queued()
        return [
            PoolStats("cpu", self.cpu.slots, self.cpu.slots_free, q.get("cpu", 0), run["cpu"], pool="cpu"),
            PoolStats("gpu", self.gpu.total, self.gpu.idle, q.get("gpu", 0), run["gpu"], pool="gpu"),
            PoolStats("api", self.api.total, self.api.total_free, q.get("api", 0), run["api"], pool="api"),
        ]

    def _node_stats(self) -> tuple[NodeStats, ...]:
        running: dict[str, int] = {}
        for r in self.running.values():
            running[r.node] = running.get(r.node, 0) + 1
        homes: dict[str, int] = {}
        for n in self.home.values():
            homes[n] = homes.get(n, 0) + 1
        waiting = self._models_waiting()
        out = []
        cpu = self.cpu
        for name in cpu.order:
            real_free = cpu.free[name] - (cpu.capacity[name] - cpu.limit[name])
            out.append(NodeStats(name, "cpu", cpu.limit[name], max(real_free, 0), running.get(name, 0),
                                 homes.get(name, 0)))
        gp = self.gpu
        for name, st in gp.nodes.items():
            reps = [r for r in gp.replicas.values() if r.node == name]
            out.append(NodeStats(name, "gpu", st.spec.gpus, sum(1 for g in st.gpus if not g.busy),
                                 running.get(name, 0), 0, len(reps), sum(1 for r in reps if r.model in waiting)))
        return tuple(out)

    def _models_waiting(self) -> set[str]:
        return set()

    def snapshot(self) -> PolicySnapshot:
        reps = tuple((r.model, r.node, r.gpus, r.busy) for r in self.gpu.replicas.values())
        return PolicySnapshot(self.name, tuple(self._pool_stats()), reps, self.decisions, self._snapshot_extra(),
                              tuple(x[1] for x in self.unplaceable.values()),
                              self._admission_waiting(), self._node_stats(), self.gpu_waiting())

    def _snapshot_extra(self) -> dict:
        return {"rejected": self.rejected, "cordoned": sorted(self.cordoned()), "broken": sorted(self.broken)}

    def gpu_waiting(self) -> tuple[tuple[str, str, int], ...]:
        """``(model, reason, actions)`` for each model whose GPU actions wait (``GPU_WAIT_REASONS``); none here."""
        return ()

    def _admission_waiting(self) -> int:
        return 0

    def _queued(self) -> dict[str, int]:
        return {}
