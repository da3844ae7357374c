"""``tangram``: action-level elastic scheduling. The algorithm: docs/scheduling.md.

Pure: no Dask import. One heap of waiting actions per pool (CPU slots, API
tokens, each model's GPU replicas); each decision goes through small phases:

1. **order** (``submit``): key = ``aging * issued_at + est``; ``est`` is the
   posterior expected work (the hint blended with the kind's history, see
   :mod:`.estimate`). Shortest expected work first; the clock term bounds
   any wait (no starvation).
2. **fit** (``_drain_*``): the head starts only if its ``units.min`` fit; if
   not, the pool stops, so the head keeps its claim on the next free units.
3. **place**: a stateful action goes home; if home is full it waits there
   while that is expected to beat a restore (``_wait_home``). Others go to the
   node with the most free slots. A GPU action takes a ready replica of its
   model inside one topology group, or a new replica when the model's backlog
   outlasts a load (``_load_site``: idle GPUs of one group, evicting idle
   replicas of models nobody waits for).
4. **size** (``_units``): add a unit while the seconds it saves per extra
   unit-second beat the pool's price ``price * rho / (1 - rho)``; long
   actions weigh more (the step ends with its longest trajectory), and an
   elephant (top tail of its kind's estimates) reserves slots on one node rather
   than start small (``Reservation``).
5. **reserve / release**: the ledger takes and returns units (:mod:`.ledger`).

Optionally (``admission > 0``) trajectories are admitted only while the
expected CPU demand (Little's law, learned) stays under a target.

Cost per decision: O(log n) in the pending actions, O(1) amortised in the
number of nodes (the ledger indexes nodes by free slots); GPU loads scan the
topology groups, and they are rare.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from heapq import heappop, heappush

from ..spec import ActionSpec
from .base import Policy, Running
from .estimate import Estimator, Welford
from .types import ActionId, Admit, Decision, ReplicaId


@dataclass(frozen=True)
class TangramOptions:
    """Knobs of the tangram policy (defaults are what docs/scheduling.md justifies)."""

    aging: float = 1.0          # priority gained per second waited, in seconds of est work
    price: float = 0.5          # price of a unit-second at occupancy rho is price * rho / (1 - rho)
    horizon_s: float = 30.0     # time constant of the observed slot-release rate
    load_patience: float = 1.0  # load a replica when the model's backlog exceeds patience x load_s
    makespan: float = 1.0       # weight of an action's length against a trajectory's (0: off)
    reserve_gain: float = 4.0   # reserve slots for an action when waiting saves > this x the expected wait
    admission: float = 1.0      # admit trajectories while expected CPU demand < this x capacity (0: all at once)
    admission_at_max: float = 0.0  # 1: measure admission demand at units.max, 0: at units.min
    admission_cycles: float = 0.0  # >0: no trajectory waits for admission longer than this many turn cycles
    elephant_z: float = 2.0     # an action is an elephant when log(est) > mean + z sd of its kind's log estimates


@dataclass(slots=True)
class Pending:
    spec: ActionSpec
    est: float
    issued: float


@dataclass(slots=True)
class Reservation:
    """An action collecting freed slots on one node until it has ``want``."""

    aid: ActionId
    p: Pending
    node: str
    held: int
    want: int
    deadline: float


class Rate:
    """EWMA of an event rate (amount per second), bias-corrected at start."""

    __slots__ = ("tau", "w", "last", "t0")

    def __init__(self, tau: float):
        self.tau = tau
        self.w = 0.0
        self.last = None
        self.t0 = 0.0

    def add(self, now: float, work: float) -> None:
        if self.last is None:
            self.last = self.t0 = now
        elif now > self.last:
            self.w *= math.exp((self.last - now) / self.tau)
            self.last = now
        self.w += work

    def rate(self, now: float) -> float:
        if self.last is None:
            return 0.0
        w = self.w * math.exp((self.last - now) / self.tau) if now > self.last else self.w
        span = self.tau * (1.0 - math.exp(-(max(now - self.t0, 1e-3)) / self.tau))
        return w / span


class TangramPolicy(Policy):
    name = "tangram"

    def __init__(self, *a, options: TangramOptions | None = None, **kw):
        super().__init__(*a, **kw)
        self.opt = options or TangramOptions()
        self.est = Estimator()
        self.pending: dict[ActionId, Pending] = {}
        self.queues: dict[str, list] = {"cpu": [], "api": []}
        self.qmin: dict[str, int] = {"cpu": 0, "api": 0}
        self.rmin: dict[str, int] = {"cpu": 0, "api": 0}  # units.min of running actions, per pool
        self.dirty: dict[str, None] = {}
        self._seq = 0
        self.traj_start: dict[str, float] = {}
        self._t0: float | None = None
        self.reserved: dict[str, Reservation] = {}  # node -> its one reservation
        self.home_wait: dict[str, dict[ActionId, Pending]] = {}  # node -> stateful actions waiting for it
        self.home_deadlines: list[tuple[float, int, ActionId, str]] = []
        self.freed_nodes: dict[str, None] = {}  # nodes with home waiters where slots were freed
        self.freed_res: dict[str, None] = {}  # reserved nodes where slots were freed
        self.res_deadlines: list[tuple[float, int, str, ActionId]] = []
        self.ests: dict[str, Welford] = {}  # per kind: log of the estimates made at submission
        # trajectory -> when it asked; an OrderedDict: a plain dict's first item costs O(deleted) to reach
        self.admission_queue: OrderedDict[str, float] = OrderedDict()
        self.admitted: set[str] = set()  # admitted through the gate and not yet ended
        self.gaps = Welford()       # LLM gap: from a trajectory's admission or last action's end to its next action
        self.turn_work = Welford()  # CPU unit-seconds per action at units.max (0 for non-CPU actions)
        self.turn_time = Welford()  # expected action time at units.max
        self.last_end: dict[str, float] = {}
        self.release_rate = Rate(self.opt.horizon_s)  # CPU slots freed per second
        self.traj_n = 0
        self.traj_sum = 0.0

    # -- events -------------------------------------------------------------
    def begin_trajectory(self, trajectory: str, now: float) -> None:
        if not self.opt.admission:
            return super().begin_trajectory(trajectory, now)
        self.admission_queue[trajectory] = now

    def end_trajectory(self, trajectory: str, now: float) -> None:
        super().end_trajectory(trajectory, now)
        self.admission_queue.pop(trajectory, None)
        self.admitted.discard(trajectory)
        self.last_end.pop(trajectory, None)
        t0 = self.traj_start.pop(trajectory, None)
        if t0 is not None:
            self.traj_n += 1
            self.traj_sum += now - t0

    @property
    def active(self) -> int:
        """Trajectories admitted through the gate and not yet ended."""
        return len(self.admitted)

    def _t_ref(self, now: float) -> float:
        """The scale of a trajectory's length: mean of those ended, else the time elapsed."""
        if self.traj_n >= 8:
            return max(self.traj_sum / self.traj_n, 1e-3)
        return max(now - self._t0, 1e-3)

    def submit(self, aid: ActionId, spec: ActionSpec, now: float) -> None:
        if self._t0 is None:
            self._t0 = now
        if spec.trajectory is not None and spec.trajectory not in self.traj_start:
            self.traj_start[spec.trajectory] = now
        self._touch(spec.trajectory, now)
        est = self.est.expected(spec)
        if self.opt.admission and spec.trajectory is not None:
            t_end = self.last_end.get(spec.trajectory)
            if t_end is not None:
                self.gaps.add(now - t_end)
            u = spec.units_max if self.opt.admission_at_max else spec.units_min
            t_u = est * spec.scale(u)
            self.turn_time.add(t_u)
            self.turn_work.add(t_u * u if spec.resource == "cpu" else 0.0)
        if est > 0:
            w = self.ests.get(spec.kind)
            if w is None:
                w = self.ests[spec.kind] = Welford()
            w.add(math.log(est))
        pool = spec.model if spec.resource == "gpu" else spec.resource
        q = self.queues.get(pool)
        if q is None:
            q = self.queues[pool] = []
            self.qmin[pool] = 0
        self.pending[aid] = Pending(spec, est, now)
        heappush(q, (self.opt.aging * now + est, self._seq, aid))
        self._seq += 1
        self.qmin[pool] += spec.units_min
        self.dirty[pool] = None

    def _finished(self, aid: ActionId, r: Running, now: float, run_s: float | None) -> None:
        if self.opt.admission and r.spec.trajectory is not None and r.spec.trajectory in self.traj_start:
            self.last_end[r.spec.trajectory] = now
        if r.spec.resource != "gpu":
            self.rmin[r.spec.resource] -= r.spec.units_min
            if r.spec.resource == "cpu":
                self.release_rate.add(now, r.units)
                self._slots_freed(r.node)
        if run_s is not None and run_s > 0:
            self.est.observe(r.spec, run_s / r.spec.scale(min(r.units, r.spec.units_max)))
        self._freed(r.spec)

    def cancel(self, aid: ActionId, now: float = 0.0) -> bool:
        r = self.running.get(aid)
        done = super().cancel(aid, now)
        if r is not None:
            if r.spec.resource != "gpu":
                self.rmin[r.spec.resource] -= r.spec.units_min
                self._slots_freed(r.node)
            self._freed(r.spec)
        return done

    def _slots_freed(self, node: str) -> None:
        if node in self.home_wait:
            self.freed_nodes[node] = None
        if node in self.reserved:
            self.freed_res[node] = None

    def _freed(self, spec: ActionSpec) -> None:
        if spec.resource == "gpu":
            for m in self.models:
                if self.queues.get(m):
                    self.dirty[m] = None
        else:
            self.dirty[spec.resource] = None

    def _drop_pending(self, aid: ActionId) -> bool:
        for node, waiting in self.home_wait.items():
            p = waiting.pop(aid, None)
            if p is not None:
                self.qmin["cpu"] -= p.spec.units_min
                return True
        for node, rv in self.reserved.items():
            if rv.aid == aid:
                del self.reserved[node]
                if rv.held:
                    self.cpu.give(node, rv.held)
                    self._slots_freed(node)
                self.rmin["cpu"] -= rv.p.spec.units_min
                self.dirty["cpu"] = None
                return True
        p = self.pending.pop(aid, None)
        if p is None:
            return False
        pool = p.spec.model if p.spec.resource == "gpu" else p.spec.resource
        self.qmin[pool] -= p.spec.units_min  # the heap entry is skipped lazily
        return True

    def _capacity_changed(self) -> None:
        for pool in self.queues:
            self.dirty[pool] = None
        self.freed_res.update(dict.fromkeys(self.reserved))  # a node may have left: look at each

    def _queued(self) -> dict[str, int]:
        out = {"cpu": 0, "api": 0, "gpu": 0}
        for p in self.pending.values():
            out[p.spec.resource] += 1
        return out

    # -- decisions --------------------------------------------------------------
    def _schedule(self, now: float, out: list[Decision]) -> None:
        if self.admission_queue:
            self._admit(now, out)
        dirty, self.dirty = self.dirty, {}
        for pool in dirty:
            if pool == "cpu":
                self._drain_cpu(now, out)
            elif pool == "api":
                self._drain_api(now, out)
            else:
                self._drain_gpu(pool, now, out)

    def _admit(self, now: float, out: list[Decision]) -> None:
        """Admit trajectories while expected CPU demand stays under target occupancy (Little's law).

        Demand of one active trajectory = CPU unit-seconds per turn (at units.max)
        / (LLM gap + action time), all learned from what was submitted so far.
        """
        cap = max(self.cpu.slots, 1)
        max_wait = math.inf
        if self.gaps.n >= 16 and self.turn_work.n >= 16:
            cycle = self.gaps.mean + self.turn_time.mean
            demand = self.turn_work.mean / max(cycle, 1e-6)
            limit = self.opt.admission * cap / max(demand, 1e-6)
            if self.opt.admission_cycles:
                max_wait = self.opt.admission_cycles * cycle
        else:
            limit = cap  # nothing learned yet: one trajectory per slot
        while self.admission_queue:
            t, asked = next(iter(self.admission_queue.items()))
            if self.active >= limit and now - asked < max_wait:
                break
            self.admission_queue.popitem(last=False)
            self.admitted.add(t)
            self.last_end[t] = now
            out.append(Admit(t))

    def _head(self, q: list) -> tuple[ActionId, Pending] | None:
        pending = self.pending
        while q:
            aid = q[0][2]
            p = pending.get(aid)
            if p is not None:
                return aid, p
            heappop(q)
        return None

    def _take_head(self, pool: str, aid: ActionId) -> Pending:
        heappop(self.queues[pool])
        p = self.pending.pop(aid)
        self.qmin[pool] -= p.spec.units_min
        return p

    def _drain_cpu(self, now: float, out: list[Decision]) -> None:
        q, cpu, home = self.queues["cpu"], self.cpu, self.home
        if self.reserved:
            self._serve_reservations(now, out)
        if self.home_wait:
            self._serve_home(now, out)
        while True:
            head = self._head(q)
            if head is None:
                return
            aid, p = head
            spec = p.spec
            need = spec.units_min
            if cpu.max_free < need:
                return
            node = None
            if spec.affinity == "trajectory":
                h = home.get(spec.trajectory)
                if h is not None and h in cpu.free and cpu.limit[h] >= need:
                    if cpu.free[h] >= need and h not in self.reserved:
                        node = h
                    elif self._expected_wait(need, now) < spec.restore_s:
                        self._take_head("cpu", aid)
                        self._wait_home(aid, p, h, now)
                        continue
            if node is None:
                node = cpu.most_free()
                if node in self.reserved:
                    node = self._unreserved_node(need)
                    if node is None:
                        return
            self._take_head("cpu", aid)
            self.rmin["cpu"] += need
            room = min(cpu.free[node], cpu.limit[node])
            want = min(spec.units_max, cpu.limit[node]) if self._elephant(spec, p.est) else 0
            if want > room and node not in self.reserved:
                wait = self._expected_wait(want - room, now)
                gain = p.est * (spec.scale(room) - spec.scale(want))
                if gain > self.opt.reserve_gain * wait:
                    cpu.take(node, room)
                    deadline = now + gain / self.opt.reserve_gain
                    self.reserved[node] = Reservation(aid, p, node, room, want, deadline)
                    heappush(self.res_deadlines, (deadline, self._seq, node, aid))
                    self._seq += 1
                    continue
            k = self._units(spec, room, cpu.total_free - self.qmin["cpu"] - need, cpu.total, "cpu", now, p.est)
            out.append(self._start_cpu(aid, spec, node, k, now, p.est * spec.scale(k)))

    def _wait_home(self, aid: ActionId, p: Pending, node: str, now: float) -> None:
        """Park a stateful action on its home node until a slot frees there or restore_s passes."""
        self.home_wait.setdefault(node, {})[aid] = p
        self.qmin["cpu"] += p.spec.units_min
        heappush(self.home_deadlines, (now + p.spec.restore_s, self._seq, aid, node))
        self._seq += 1

    def _serve_home(self, now: float, out: list[Decision]) -> None:
        cpu = self.cpu
        freed, self.freed_nodes = self.freed_nodes, {}
        for node in freed:  # only where slots were freed since the last pass
            waiting = self.home_wait.get(node)
            if waiting is None:
                continue
            if node in self.reserved:
                self.freed_nodes[node] = None  # look again once the reservation has started
                continue
            while waiting and cpu.free.get(node, 0) >= next(iter(waiting.values())).spec.units_min:
                aid, p = next(iter(waiting.items()))
                del waiting[aid]
                self._start_waiting(aid, p, node, now, out)
            if not waiting:
                del self.home_wait[node]
        dl = self.home_deadlines
        while dl and (dl[0][0] <= now or dl[0][2] not in self.home_wait.get(dl[0][3], ())):
            _, _, aid, node = heappop(dl)
            waiting = self.home_wait.get(node)
            if waiting is None or aid not in waiting:
                continue
            p = waiting.pop(aid)
            if not waiting:
                del self.home_wait[node]
            other = cpu.most_free() if cpu.max_free >= p.spec.units_min else None
            if other is None or other in self.reserved:
                self.qmin["cpu"] -= p.spec.units_min
                self._requeue(aid, p)
            else:
                self._start_waiting(aid, p, other, now, out)

    def _start_waiting(self, aid: ActionId, p: Pending, node: str, now: float, out: list[Decision]) -> None:
        spec = p.spec
        self.qmin["cpu"] -= spec.units_min
        self.rmin["cpu"] += spec.units_min
        room = min(self.cpu.free[node], self.cpu.limit[node])
        k = self._units(spec, room, self.cpu.total_free - self.qmin["cpu"] - spec.units_min, self.cpu.total, "cpu",
                        now, p.est)
        out.append(self._start_cpu(aid, spec, node, k, now, p.est * spec.scale(k)))

    def _elephant(self, spec: ActionSpec, est: float) -> bool:
        """In the top tail of its kind: long enough to set the step's end on its own."""
        w = self.ests.get(spec.kind)
        if w is None or w.n < 8 or spec.units_max == spec.units_min:
            return False
        return math.log(est) > w.mean + self.opt.elephant_z * math.sqrt(w.var)

    def _unreserved_node(self, need: int) -> str | None:
        best = None
        for name in self.cpu.order:  # rare: only when the most-free node is reserved
            f = self.cpu.free[name]
            if f >= need and name not in self.reserved and (best is None or f > self.cpu.free[best]):
                best = name
        return best

    def _expected_wait(self, slots: int, now: float) -> float:
        """Seconds until ``slots`` more slots free up on one node, from the observed release rate."""
        rate = self.release_rate.rate(now) / max(len(self.cpu.capacity), 1)
        return slots / rate if rate > 0 else math.inf

    def _requeue(self, aid: ActionId, p: Pending) -> None:
        self.pending[aid] = p
        heappush(self.queues["cpu"], (self.opt.aging * p.issued + p.est, self._seq, aid))
        self._seq += 1
        self.qmin["cpu"] += p.spec.units_min
        self.dirty["cpu"] = None

    def _serve_reservations(self, now: float, out: list[Decision]) -> None:
        """Reservations on nodes where slots were freed, or whose deadline passed: never a walk over all."""
        cpu = self.cpu
        nodes, self.freed_res = self.freed_res, {}
        dl = self.res_deadlines
        while dl and dl[0][0] <= now:
            _, _, node, aid = heappop(dl)
            rv = self.reserved.get(node)
            if rv is not None and rv.aid == aid:
                nodes[node] = None
        for node in nodes:
            rv = self.reserved.get(node)
            if rv is None:
                continue
            if node not in cpu.free:  # the node left
                del self.reserved[node]
                self.rmin["cpu"] -= rv.p.spec.units_min
                self._requeue(rv.aid, rv.p)
                continue
            extra = min(cpu.free[node], rv.want - rv.held)  # want <= limit[node]
            if extra:
                cpu.take(node, extra)
                rv.held += extra
            idle_node = cpu.capacity[node] - cpu.free[node] == rv.held  # nothing else holds units here
            if rv.held >= rv.want or idle_node or (now >= rv.deadline and rv.held >= rv.p.spec.units_min):
                del self.reserved[node]
                self._slots_freed(node)  # its home waiters may use what is left
                spec = rv.p.spec
                out.append(self._start_cpu(rv.aid, spec, node, rv.held, now, rv.p.est * spec.scale(rv.held),
                                           taken=True))

    def _drain_api(self, now: float, out: list[Decision]) -> None:
        q, api = self.queues["api"], self.api
        while True:
            head = self._head(q)
            if head is None:
                return
            aid, p = head
            spec = p.spec
            if api.total_free < spec.units_min:
                return
            self._take_head("api", aid)
            k = self._units(spec, api.total_free, api.total_free - self.qmin["api"] - spec.units_min, api.total, "api", now, p.est)
            self.rmin["api"] += spec.units_min
            out.append(self._start_api(aid, spec, k, now, p.est * spec.scale(k)))

    def _units(self, spec: ActionSpec, room: int, spare: int, capacity: int, pool: str, now: float,
               est: float) -> int:
        """Elastic size: add a unit while the seconds it saves, per extra unit-second it
        costs, exceed the pool's price (zero when idle, unbounded when saturated)."""
        lo = spec.units_min
        hi = min(spec.units_max, room, lo + max(spare, 0))
        if hi <= lo or spec.parallel_fraction == 0.0:
            return lo
        rho = (self.rmin[pool] + self.qmin[pool] + lo) / max(capacity, 1)  # min-unit demand / capacity
        if rho >= 1.0:
            return lo
        price = self.opt.price * rho / (1.0 - rho)
        if self.opt.makespan:
            price /= 1.0 + self.opt.makespan * est / self._t_ref(now)
        k, s_k = lo, 1.0
        while k < hi:
            s_next = spec.scale(k + 1)
            saved = s_k - s_next                     # seconds saved per second of work on lo units
            extra = (k + 1) * s_next - k * s_k       # extra unit-seconds per second of work
            if extra > 0 and saved < price * extra:
                break
            k, s_k = k + 1, s_next
        return k

    # -- GPUs -------------------------------------------------------------------
    def _drain_gpu(self, model: str, now: float, out: list[Decision]) -> None:
        q, gp = self.queues[model], self.gpu
        while gp.idle:
            head = self._head(q)
            if head is None:
                return
            aid, p = head
            spec = p.spec
            rid = self._ready_replica(model, spec)
            if rid is not None:
                self._take_head(model, aid)
                out.append(self._start_gpu(aid, spec, rid, now, p.est))
                continue
            if not self._should_load(model, now):
                return
            site = self._load_site(model, spec)
            if site is None:
                return
            node, gpus, evict = site
            self._take_head(model, aid)
            rid = self._load(model, node, gpus, evict, now)
            out.append(self._start_gpu(aid, spec, rid, now, p.est, load=True, evict=tuple(evict)))

    def _ready_replica(self, model: str, spec: ActionSpec) -> ReplicaId | None:
        gp = self.gpu
        best, best_k = None, 0
        for rid in gp.ready.get(model, ()):
            k = len(gp.replicas[rid].gpus)
            if spec.units_min <= k <= spec.units_max:
                return rid
            if k >= spec.units_min and (best is None or k < best_k):
                best, best_k = rid, k
        return best

    def _should_load(self, model: str, now: float) -> bool:
        reps = len(self.gpu.by_model.get(model, ()))
        if reps == 0:
            return True
        backlog = self.qmin[model] * self._mean_est(model) / reps
        return backlog > self.opt.load_patience * self.models[model].load_s

    def _mean_est(self, model: str) -> float:
        q = self.queues[model]
        if not q:
            return 0.0
        n = min(len(q), 16)
        tot = 0.0
        for _, _, aid in q[:n]:
            p = self.pending.get(aid)
            if p is not None:
                tot += p.est / p.spec.units_min
        return tot / n

    def _load_site(self, model: str, spec: ActionSpec) -> tuple[str, tuple[int, ...], list[ReplicaId]] | None:
        gp = self.gpu
        ms = self.models[model]
        waiting = {m for m in self.models if self._head(self.queues.get(m, [])) is not None}
        best = None
        for name, st in gp.nodes.items():
            k = ms.replica_gpus(spec.units_min, st.spec.gpu_memory_gb)
            share = ms.gpu_memory_gb / k
            start = 0
            for g, size in enumerate(st.spec.groups):
                if st.idle_in_group[g] >= k:
                    idle = [i for i in range(start, start + size) if not st.gpus[i].busy]
                    idle.sort(key=lambda i: -st.gpus[i].mem_free)
                    gpus = tuple(sorted(idle[:k]))
                    cands = {rid for i in gpus for rid in st.gpus[i].replicas}
                    order = sorted(cands, key=lambda rid: self._evict_rank(rid, waiting))
                    order = [rid for rid in order if self._evictable(rid, waiting)]
                    plan = gp.eviction_plan(name, gpus, share, order)
                    if plan is not None:
                        score = len(plan)
                        if best is None or score < best[0]:
                            best = (score, name, gpus, plan)
                            if score == 0:
                                return name, gpus, plan
                start += size
        if best is None:
            best = self._spanning_site(model, spec, waiting)
        return None if best is None else best[1:]

    def _spanning_site(self, model: str, spec: ActionSpec, waiting: set[str]) -> tuple | None:
        """A replica too large for any topology group spans groups (and pays the slowdown)."""
        gp = self.gpu
        ms = self.models[model]
        best = None
        for name, st in gp.nodes.items():
            k = ms.replica_gpus(spec.units_min, st.spec.gpu_memory_gb)
            if k <= max(st.spec.groups) or k > st.spec.gpus:
                continue  # fits one group (the main path's case), or never fits this node
            idle = [i for i, g in enumerate(st.gpus) if not g.busy]
            if len(idle) < k:
                continue
            idle.sort(key=lambda i: -st.gpus[i].mem_free)
            gpus = tuple(sorted(idle[:k]))
            cands = {rid for i in gpus for rid in st.gpus[i].replicas}
            order = [rid for rid in sorted(cands, key=lambda rid: self._evict_rank(rid, waiting))
                     if self._evictable(rid, waiting)]
            plan = gp.eviction_plan(name, gpus, ms.gpu_memory_gb / k, order)
            if plan is not None and (best is None or len(plan) < best[0]):
                best = (len(plan), name, gpus, plan)
        return best

    def _evict_rank(self, rid: ReplicaId, waiting: set[str]) -> tuple:
        r = self.gpu.replicas[rid]
        return (r.model in waiting, -len(self.gpu.by_model[r.model]), r.last_used, rid)

    def _evictable(self, rid: ReplicaId, waiting: set[str]) -> bool:
        r = self.gpu.replicas[rid]
        return not r.busy and not (r.model in waiting and len(self.gpu.by_model[r.model]) <= 1)
