"""CPU slots and API tokens: fit, place, size and reserve (docs/scheduling.md, phases 2 to 5).

- **fit** (``_drain_cpu``, ``_drain_api``): the head of a pool starts only
  if its ``units.min`` fit; if not, the pool stops, so the head keeps its
  claim on the next free units.
- **place** (``_fit_cpu``): a stateful action goes home; if home is full it
  waits there while that is expected to beat a restore (``_wait_home``).
  Others go to the node with the most free slots.
- **size** (``_units``): add a unit while the seconds it saves per extra
  unit-second beat the pool's price ``price * rho / (1 - rho)``; long
  actions weigh more, and an elephant (``_elephant``) reserves slots on one
  node rather than start small (``Reservation``, ``_reserve``); an elastic
  CPU action never starts on ``units.min`` where its node has one more free
  (``pair_floor``).

A mixin of :class:`~.tangram.TangramPolicy`, which sets up the state it
reads (pools, reservations, actions waiting at home) in ``__init__``.
"""

from __future__ import annotations

import math
from heapq import heappop, heappush

from ..spec import ActionSpec
from .queues import Pending, Pool, Reservation
from .types import ActionId, Decision

_HOME = object()  # _fit_cpu's answer: wait at the trajectory's home


class Placement:
    """Phases 2 to 5 for the CPU pool and the API pool.

    Reads the estimates (``est``, ``ests``, ``all_ests``), the slot-release rate and the ledger; changes
    the pools, the reservations (``reserved``, ``res_deadlines``, ``freed_res``) and the actions waiting
    at home (``home_wait``, ``home_deadlines``, ``freed_nodes``).
    """

    def _drain_cpu(self, pool: Pool, now: float, out: list[Decision]) -> None:
        if self.reserved:
            self._serve_reservations(now, out)
        if self.home_wait:
            self._serve_home(now, out)
        while True:
            head = pool.head()
            if head is None:
                pool.blocked = None
                return
            aid, p = head
            where = self._fit_cpu(p, now)
            if where.__class__ is tuple:
                if self.cpu.held and p.spec.units_min > self.cpu.open_largest:
                    pool.pop(aid)  # only a cordoned node can hold it: it waits aside, not as the queue's head
                    self.cordon_parked[aid] = p
                    continue
                pool.blocked = where
                return
            pool.pop(aid)
            if where is _HOME:
                self._wait_home(aid, p, self.home[p.spec.trajectory], now)
            else:
                try:  # self._guarded(aid, p, self._place_cpu, ...), inlined: once per CPU action
                    self._place_cpu(aid, p, where, now, out)
                except Exception as e:  # a policy bug must cost one action, never the pool
                    self._failed(aid, p, e)

    def _fit_cpu(self, p: Pending, now: float) -> "str | tuple | object":
        """Phase 2-3, fit and place: the node for the head, ``_HOME`` (wait at home), or why it waits
        (a ``_why`` tuple: the Shortfall is built only when a snapshot asks, not on every blocked pass)."""
        spec, cpu = p.spec, self.cpu
        need = spec.units_min
        if cpu.max_free < need:
            return ("no worker has {need} free slots", spec, cpu.max_free)
        if spec.affinity == "trajectory":
            h = self.home.get(spec.trajectory)
            if h is not None and h in cpu.free and cpu.limit[h] >= need and h not in cpu.held:
                if cpu.free[h] >= need and h not in self.reserved:
                    return self._elephant_away(p, h)
                if self._expected_wait(need, now) < spec.restore_s:
                    return _HOME
        node = cpu.fit_node(need, self.reserved or None)
        if node is None:
            return ("no unreserved worker with {need} slots has them free", spec, cpu.max_free)
        if cpu.ahead and self.opt.ahead_wait and cpu.room(node) < need:
            return self._ahead_node(p, now)
        return node

    def _ahead_node(self, p: Pending, now: float) -> "str | tuple":
        """``ahead_wait``: every node is full, so the action would be sent ahead of a free slot, to wait on its
        worker for one. Of up to 8 nodes with dispatch-ahead units free, the most free first, the first where a
        running action is expected to end within ``ahead_wait`` s; if none, it waits here, for the first slot to
        free anywhere. (By join order, a short action went to wait behind a 30 s one while another worker's slot
        freed within a second: of four 0.5 s actions two ended at 30.5 s.)"""
        spec, cpu = p.spec, self.cpu
        need = spec.units_min
        until = now + self.opt.ahead_wait
        for name in cpu.with_free(need, 8):
            if self.reserved and name in self.reserved:
                continue
            if cpu.room(name) >= need:
                return name
            ends = self.cpu_ends.get(name)
            if not ends or min(ends.values()) <= until:  # (nothing of its own known running there: as any)
                return name
        return ("no worker has {need} free slots (nor one expected to free soon, to send it ahead to)", spec,
                cpu.max_free)

    def _elephant_away(self, p: Pending, home: str) -> str:
        """An elephant leaves a home with little room for the node with the most, when the
        seconds its extra units save exceed the restore it pays there (its state moves once)."""
        spec, cpu = p.spec, self.cpu
        if not self.opt.elephant_move or not self._elephant(spec, p.est):
            return home
        want = min(spec.units_max, cpu.limit[home])
        r_home = max(cpu.room(home), 0)
        if r_home >= want:
            return home
        other = cpu.fit_node(spec.units_min, self.reserved or None)
        if other is None or other == home:
            return home
        r_other = min(max(cpu.room(other), 0), spec.units_max)
        if r_other <= r_home:
            return home
        saved = p.est * (spec.scale(max(r_home, spec.units_min)) - spec.scale(r_other))
        return other if saved > spec.restore_s else home

    def _place_cpu(self, aid: ActionId, p: Pending, node: str, now: float, out: list[Decision]) -> None:
        """Phases 4-5, size and reserve: an elephant may collect slots; others start sized."""
        spec, cpu, pool = p.spec, self.cpu, self.pools["cpu"]
        need = spec.units_min
        room = cpu.room(node)  # real free slots: dispatch-ahead units never change sizing
        if room < 0:  # max(room, 0)
            room = 0
        want = spec.units_max
        if cpu.limit[node] < want:
            want = cpu.limit[node]  # min(units.max, the node's slots)
        # the elephant test last: it matters only where the room falls short of what an elephant would want
        if want > room and room >= need and node not in self.reserved and self._elephant(spec, p.est):
            if self._reserve(aid, p, node, room, want, now):
                return
        if (room == need and want > need and self.opt.pair_floor and spec.parallel_fraction > 0.0
                and node not in self.reserved and self._reserve(aid, p, node, room, need + 1, now)):
            return  # pair_floor: one slot free where a second would save more than the wait for it
        k = self._size(spec, room, now, p.est)
        out.append(self._start_cpu(aid, spec, node, k, now, p.est * spec.scale(k)))
        pool.rmin += need

    def _reserve(self, aid: ActionId, p: Pending, node: str, room: int, want: int, now: float) -> bool:
        """Take the ``room`` free slots of ``node`` for ``p`` and collect freed ones there until it has
        ``want``, when the seconds the wider start saves exceed ``reserve_gain`` x the expected wait for
        the slots it lacks; it starts anyway at the deadline that saving allows. False if not worth it."""
        spec = p.spec
        wait = self._expected_wait(want - room, now)
        gain = p.est * (spec.scale(room) - spec.scale(want))
        if gain <= self.opt.reserve_gain * wait:
            return False
        self.cpu.take(node, room)
        self.pools["cpu"].rmin += spec.units_min
        deadline = now + gain / self.opt.reserve_gain
        self.reserved[node] = Reservation(aid, p, node, room, want, deadline)
        heappush(self.res_deadlines, (deadline, self._seq, node, aid))
        self._seq += 1
        return True

    def _wait_home(self, aid: ActionId, p: Pending, node: str, now: float) -> None:
        """Park a stateful action on its home node until a slot frees there or restore_s passes."""
        self.home_wait.setdefault(node, {})[aid] = p
        self.pools["cpu"].queued(p)
        heappush(self.home_deadlines, (now + p.spec.restore_s, self._seq, aid, node))
        self._seq += 1

    def _serve_home(self, now: float, out: list[Decision]) -> None:
        cpu, pool = self.cpu, self.pools["cpu"]
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
                pool.unqueued(p)
                self._guarded(aid, p, self._start_waiting, node, now, out)
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
            pool.unqueued(p)
            other = cpu.fit_node(p.spec.units_min, self.reserved or None)
            if other is None:
                self._requeue(aid, p)
            else:
                self._guarded(aid, p, self._start_waiting, other, now, out)

    def _start_waiting(self, aid: ActionId, p: Pending, node: str, now: float, out: list[Decision]) -> None:
        """A stateful action that waited at home starts on ``node``: phases 4-5 as for any CPU start.

        (Sized by the price alone, an elephant issued early, while the queue's minimum exceeded the free
        slots, started on 1 slot of 8 and ran 3,117 s: the step 1.8x static's.)"""
        if self.opt.home_reserve:
            self._place_cpu(aid, p, node, now, out)
            return
        spec = p.spec
        k = self._size(spec, max(self.cpu.room(node), 0), now, p.est)
        out.append(self._start_cpu(aid, spec, node, k, now, p.est * spec.scale(k)))
        self.pools["cpu"].rmin += spec.units_min

    def _elephant(self, spec: ActionSpec, est: float) -> bool:
        """In the top tail of its kind (its estimate, or its hint among the kind's hints): long enough to set
        the step's end on its own.

        With ``elephant_tail``, also an action expected to run longer than half a mean trajectory on
        ``units.min`` once every trajectory of the step is admitted: the step then ends with the last of
        those in flight, and an action that long, started on the one slot it finds, sets that end. Where
        a kind's spread is wide (heavy tails, hint sigma 1.5+) its top tail starts far above that: on
        ``tail-tight-b`` (seed 1065) a test run estimated at 139 s (true 328 s on 1 slot) was not in its
        kind's tail, started on 1 slot of 8 at t = 3,814 s with no trajectory waiting and ran 329 s: the
        mean step was 1.29x static's. Reserving slots for such actions, it is 0.60x.
        """
        if spec.units_max == spec.units_min or est <= 0:
            return False
        t = self.opt.elephant_tail
        if t and self.traj_n >= 8 and not self.admission_queue and est > t * self.traj_sum / self.traj_n:
            return True
        w = self.ests.get(spec.kind)
        if w is None or w.n < 8:
            w = self.all_ests  # too few of its kind yet: against every estimate made so far
            if w.n < 8:
                return False
        if math.log(est) > w.mean + self.opt.elephant_z * math.sqrt(w.m2 / (w.n - 1)):  # w.var, inlined
            return True
        # The estimate leans on the kind's history where hints are noisy, so an extreme hint is shrunk to a
        # moderate estimate (xst312: hinted 6,106 s, estimated 329 s, run on 1 slot for 3,277 s while its
        # step's other trajectories had ended). The hint's own place among the kind's hints still says it.
        z = self.opt.elephant_hint
        return bool(z) and self.est.hint_in_tail(spec, z)

    def _expected_wait(self, slots: int, now: float) -> float:
        """Seconds until ``slots`` more slots free up on one node, from the observed release rate."""
        rate = self.release_rate.rate(now) / max(len(self.cpu.capacity), 1)
        return slots / rate if rate > 0 else math.inf

    def _requeue(self, aid: ActionId, p: Pending) -> None:
        self._enqueue(aid, p.spec, p.est, p.key)  # the same key: issued and est are what they were

    def _serve_reservations(self, now: float, out: list[Decision]) -> None:
        """Reservations on nodes where slots were freed, or whose deadline passed: never a walk over all."""
        cpu, pool = self.cpu, self.pools["cpu"]
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
                pool.rmin -= rv.p.spec.units_min
                self._requeue(rv.aid, rv.p)
                continue
            extra = min(max(cpu.room(node), 0), rv.want - rv.held)  # want <= limit[node]
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

    def _size(self, spec: ActionSpec, room: int, now: float, est: float) -> int:
        """Phase 4 for a CPU action: ``room`` real free slots on its node; spare after the queue's minimum.

        ``pair_floor``: an elastic action starts on at least ``units.min + 1`` units where its node has
        them free. The spare cap holds every start to ``units.min`` while the queue's minimum covers the
        free slots; under a backlog each test run then starts on one slot, runs up to 1.8x longer
        (parallel fraction 0.9), holds its slot longer, and the backlog stays. On ``tail-h2.0`` drawn on
        seed 1127 a test run hinted 156 s that took 1355 s started on one slot at t = 18 s (static's
        two: 745 s) and set the step, 1.48x static's.
        """
        cpu, pool = self.cpu, self.pools["cpu"]
        # rho counts the action itself among the running (as it will be once started) and in the demand
        k = self._units(spec, room, cpu.slots_free - pool.qmin - spec.units_min, cpu.slots, pool, now, est,
                        spec.units_min)
        if self.opt.pair_floor and k == spec.units_min and spec.parallel_fraction > 0.0 and spec.units_max > k < room:
            k += 1
        return k

    def _drain_api(self, pool: Pool, now: float, out: list[Decision]) -> None:
        api = self.api
        while True:
            head = pool.head()
            if head is None:
                pool.blocked = None
                return
            aid, p = head
            if api.total_free < p.spec.units_min:
                pool.blocked = ("API tokens in use", p.spec, api.total_free)
                return
            pool.pop(aid)
            try:  # self._guarded(aid, p, self._place_api, ...), inlined: once per API action
                self._place_api(aid, p, pool, now, out)
            except Exception as e:  # a policy bug must cost one action, never the pool
                self._failed(aid, p, e)

    def _place_api(self, aid: ActionId, p: Pending, pool: Pool, now: float, out: list[Decision]) -> None:
        spec, api = p.spec, self.api
        k = self._units(spec, api.total_free, api.total_free - pool.qmin - spec.units_min, api.total, pool, now,
                        p.est)
        out.append(self._start_api(aid, spec, k, now, p.est * spec.scale(k)))
        pool.rmin += spec.units_min

    def _units(self, spec: ActionSpec, room: int, spare: int, capacity: int, pool: Pool, now: float,
               est: float, starting: int = 0) -> int:
        """Elastic size: add a unit while the seconds it saves, per extra unit-second it
        costs, exceed the pool's price (zero when idle, unbounded when saturated)."""
        lo = spec.units_min
        hi = lo + spare if spare > 0 else lo  # min(units.max, room, lo + max(spare, 0)), without the calls
        if room < hi:
            hi = room
        if spec.units_max < hi:
            hi = spec.units_max
        if hi <= lo or spec.parallel_fraction == 0.0:
            return lo
        rho = (pool.rmin + starting + pool.qmin + lo) / (capacity if capacity > 1 else 1)  # min-unit demand / capacity
        if rho >= 1.0:
            return lo
        price = self.opt.price * rho / (1.0 - rho)
        if self.opt.makespan:
            price /= 1.0 + self.opt.makespan * est / self._t_ref(now)
        k, s_k = lo, 1.0
        p = spec.parallel_fraction
        q = 1.0 - p
        s_lo = 1.0 / (q + p / lo)
        while k < hi:
            s_next = s_lo / (1.0 / (q + p / (k + 1)))  # spec.scale(k + 1), inlined (k + 1 > lo)
            saved = s_k - s_next                     # seconds saved per second of work on lo units
            extra = (k + 1) * s_next - k * s_k       # extra unit-seconds per second of work
            if extra > 0 and saved < price * extra:
                break
            k, s_k = k + 1, s_next
        return k
