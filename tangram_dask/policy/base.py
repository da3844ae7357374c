"""The interface every policy implements, and the bookkeeping they share.

Pure: no Dask import. Events in, decisions out, deterministic: the same
sequence of calls gives the same decisions (no clocks, no randomness, no
iteration over unordered sets).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable

from ..cluster import ClusterSpec, CpuNode, GpuNode, ModelSpec
from ..spec import ActionSpec
from .ledger import CpuPool, GpuPool, TokenPool
from .types import ActionId, Admit, Decision, PolicySnapshot, PoolStats, ReplicaId, ReplicaSpec, Start


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

    - ``begin_trajectory(t, now)`` / ``end_trajectory(t, now)``
    - ``submit(action_id, spec, now)``: an action is issued and waits
    - ``finish(action_id, now, run_s)``: it ended; ``run_s`` is its observed
      run time (setup excluded), which the policy may learn from
    - ``cancel(action_id)``: forget it, free what it held
    - ``add_cpu_node`` / ``add_gpu_node`` / ``remove_node`` / ``set_api_tokens``
    - ``schedule(now) -> list[Start | Admit]``: what to start now
    """

    name = "base"

    def __init__(self, cluster: ClusterSpec, models: dict[str, ModelSpec],
                 replicas: Iterable[ReplicaSpec] = (), *, trajectory_ttl_s: float | None = None):
        self.cluster = cluster
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
        self._ready: list[Decision] = []
        self.decisions = 0

    # -- trajectories --------------------------------------------------------
    def begin_trajectory(self, trajectory: str, now: float) -> None:
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

    # -- actions ----------------------------------------------------------------
    def submit(self, aid: ActionId, spec: ActionSpec, now: float) -> None:
        raise NotImplementedError

    def finish(self, aid: ActionId, now: float, run_s: float | None = None) -> None:
        r = self.running.pop(aid, None)
        if r is None:
            return
        self._release(r, now)
        self._touch(r.spec.trajectory, now)
        self._finished(aid, r, now, run_s)

    def cancel(self, aid: ActionId, now: float = 0.0) -> bool:
        """Forget a pending action, or free what a running one holds. Safe twice."""
        r = self.running.pop(aid, None)
        if r is not None:
            self._release(r, now)
            return True
        return self._drop_pending(aid)

    def schedule(self, now: float) -> list[Decision]:
        if self._seen:
            self._expire(now)
        out = self._ready
        self._ready = []
        self._schedule(now, out)
        self.decisions += len(out)
        return out

    # -- nodes --------------------------------------------------------------------
    def add_cpu_node(self, node: CpuNode, ahead: int = 0) -> None:
        """A CPU node joined. ``ahead``: units it may hold beyond its slots (dispatch-ahead)."""
        self.cpu.add(node.name, node.slots, ahead)
        self._capacity_changed()

    def add_gpu_node(self, node: GpuNode, replicas: Iterable[ReplicaSpec] = ()) -> None:
        self.gpu.add(node)
        self.gpu.initial(list(replicas), self.models)
        self._capacity_changed()

    def set_model(self, model: ModelSpec) -> None:
        """A model was registered, or its memory or load time measured: later decisions use it."""
        self.models[model.name] = model
        self._capacity_changed()

    def rehome(self, trajectory: str, node: str) -> None:
        """A trajectory's state was moved to ``node`` (e.g. off a worker being retired)."""
        if trajectory in self.home:
            self.home[trajectory] = node

    def homes_on(self, node: str) -> list[str]:
        """The trajectories whose state lives on ``node``."""
        return [t for t, n in self.home.items() if n == node]

    def set_api_tokens(self, tokens: int) -> None:
        self.api.resize(tokens)
        self._capacity_changed()

    def remove_node(self, name: str) -> list[ActionId]:
        """The node left: returns the actions that were running there (lost; resubmit them)."""
        lost = [aid for aid, r in self.running.items() if r.node == name]
        for aid in lost:
            del self.running[aid]
        if name in self.cpu.capacity:
            self.cpu.remove(name)
        elif name in self.gpu.nodes:
            self.gpu.remove(name)
        for t in [t for t, n in self.home.items() if n == name]:
            del self.home[t]
        self._capacity_changed()
        return lost

    # -- for subclasses -----------------------------------------------------------
    def _schedule(self, now: float, out: list[Decision]) -> None:
        raise NotImplementedError

    def _drop_pending(self, aid: ActionId) -> bool:
        raise NotImplementedError

    def _finished(self, aid: ActionId, r: Running, now: float, run_s: float | None) -> None:
        pass

    def _capacity_changed(self) -> None:
        pass

    def _release(self, r: Running, now: float) -> None:
        res = r.spec.resource
        if res == "cpu":
            self.cpu.give(r.node, r.units)
        elif res == "api":
            self.api.give(r.units)
        else:
            self.gpu.release(r.replica, now)

    def _start_cpu(self, aid: ActionId, spec: ActionSpec, node: str, k: int, now: float,
                   est_s: float = 0.0, taken: bool = False) -> Start:
        if not taken:
            self.cpu.take(node, k)
        self._touch(spec.trajectory, now)
        restore = False
        prev = None
        if spec.affinity == "trajectory":
            prev = self.home.get(spec.trajectory)
            restore = prev is not None and prev != node
            self.home[spec.trajectory] = node
        self.running[aid] = Running(spec, node, k, None, now, now + est_s)
        return Start(aid, node, k, restore=restore, restore_from=prev if restore else "")

    def _start_api(self, aid: ActionId, spec: ActionSpec, k: int, now: float, est_s: float = 0.0) -> Start:
        self.api.take(k)
        self.running[aid] = Running(spec, "api", k, None, now, now + est_s)
        return Start(aid, "api", k)

    def _start_gpu(self, aid: ActionId, spec: ActionSpec, rid: ReplicaId, now: float, est_s: float = 0.0,
                   load: bool = False, evict: tuple[ReplicaId, ...] = ()) -> Start:
        self.gpu.acquire(rid, now)
        rep = self.gpu.replicas[rid]
        self.running[aid] = Running(spec, rep.node, len(rep.gpus), rid, now, now + est_s)
        return Start(aid, rep.node, len(rep.gpus), rep.gpus, rid, load, evict, cross_group=rep.cross_group)

    def _load(self, model: str, node: str, gpus: tuple[int, ...], evict: Iterable[ReplicaId], now: float) -> ReplicaId:
        for rid in evict:
            self.gpu.evict(rid)
        return self.gpu.place(model, node, gpus, self.models[model].gpu_memory_gb, now)

    def _pool_stats(self, queued: dict[str, int]) -> tuple[PoolStats, ...]:
        run = {"cpu": 0, "api": 0, "gpu": 0}
        for r in self.running.values():
            run[r.spec.resource] += 1
        return (
            PoolStats("cpu", self.cpu.slots, self.cpu.slots_free, queued.get("cpu", 0), run["cpu"]),
            PoolStats("gpu", self.gpu.total, self.gpu.idle, queued.get("gpu", 0), run["gpu"]),
            PoolStats("api", self.api.total, self.api.total_free, queued.get("api", 0), run["api"]),
        )

    def snapshot(self) -> PolicySnapshot:
        reps = tuple((r.model, r.node, r.gpus, r.busy) for r in self.gpu.replicas.values())
        return PolicySnapshot(self.name, self._pool_stats(self._queued()), reps, self.decisions)

    def _queued(self) -> dict[str, int]:
        return {}
