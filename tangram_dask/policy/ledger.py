"""The resource ledger every policy decides against. Pure: no Dask import.

It knows what is free and what is resident, and nothing about priorities:

- :class:`CpuPool`: sandbox slots per CPU node, with an index by free count,
  so "the node with the most free slots" costs O(1) amortised, not O(nodes).
- :class:`TokenPool`: the API quota.
- :class:`GpuPool`: GPUs per node in topology groups, each with its free memory
  and whether it runs an action; model replicas resident on them, and per
  model the ordered set of replicas ready to serve now.

Every ``take`` is checked (no over-allocation ever); ``give`` undoes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..cluster import CpuNode, GpuNode
from .types import ReplicaId, ReplicaSpec

EPS = 1e-9


class OverAllocation(AssertionError):
    """A policy tried to take what is not free: a bug in the policy."""


class CpuPool:
    """Sandbox slots on CPU nodes.

    A node may take ``ahead`` units beyond its slots: actions dispatched ahead
    wait on the worker (which enforces its real slots) for a slot to free,
    which hides the scheduler round trip. ``limit[node]`` (its real slots) caps
    what any one action is granted there.
    """

    def __init__(self, nodes: tuple[CpuNode, ...] = ()):
        self.capacity: dict[str, int] = {}
        self.limit: dict[str, int] = {}
        self.free: dict[str, int] = {}
        self.order: dict[str, int] = {}
        self._buckets: list[dict[str, None]] = [{}]
        self._top = 0
        self.total = 0
        self.total_free = 0
        self.ahead = 0
        # cordoned nodes (a paused worker): the cordon holds every unit that is or comes free there, so no
        # placement, home or reservation finds room on it; the units running there go back to the hold
        self.held: dict[str, int] = {}
        self.held_ahead = 0  # the dispatch-ahead units of the cordoned nodes
        self._open_largest = -1  # open_largest, recomputed when membership or a cordon changes
        for n in nodes:
            self.add(n.name, n.slots)

    # -- membership ---------------------------------------------------------
    def add(self, name: str, slots: int, ahead: int = 0) -> None:
        if name in self.capacity:
            raise ValueError(f"CPU node {name!r} is already known")
        if slots < 1 or ahead < 0:
            raise ValueError(f"CPU node {name!r}: slots must be >= 1 and ahead >= 0, got {slots}, {ahead}")
        self.limit[name] = slots
        self._open_largest = -1
        self.ahead += ahead
        slots += ahead
        self.capacity[name] = slots
        self.free[name] = slots
        self.order[name] = len(self.order)
        while len(self._buckets) <= slots:
            self._buckets.append({})
        self._buckets[slots][name] = None
        self._top = max(self._top, slots)
        self.total += slots
        self.total_free += slots

    def remove(self, name: str) -> None:
        if self.held.pop(name, None) is not None:
            self.held_ahead -= self.capacity[name] - self.limit[name]
        self._open_largest = -1
        f = self.free.pop(name)
        del self._buckets[f][name]
        cap = self.capacity.pop(name)
        self.total -= cap
        self.ahead -= cap - self.limit.pop(name)
        self.total_free -= f
        self.order.pop(name)

    # -- queries --------------------------------------------------------------
    @property
    def slots(self) -> int:
        """Real slots (without dispatch-ahead units)."""
        return self.total - self.ahead

    @property
    def slots_free(self) -> int:
        f = self.total_free - self.ahead + self.held_ahead  # a cordoned node's ahead units are in its hold
        return f if f > 0 else 0  # max(0, f)

    @property
    def open_largest(self) -> int:
        """The most slots of one node not cordoned (0 if none)."""
        if self._open_largest < 0:
            held = self.held
            self._open_largest = max((v for n, v in self.limit.items() if n not in held), default=0)
        return self._open_largest

    @property
    def max_free(self) -> int:
        b = self._buckets
        while self._top > 0 and not b[self._top]:
            self._top -= 1
        return self._top

    def most_free(self) -> str | None:
        """The node with the most free slots (ties: the one there longest), or None."""
        top = self.max_free
        if top == 0:
            return None
        return next(iter(self._buckets[top]))

    def first_fit(self, need: int) -> str | None:
        """The first node in join order with ``need`` free slots (fifo's rule)."""
        if self.max_free < need:
            return None
        for name in self.order:
            if self.free[name] >= need and self.limit[name] >= need:
                return name
        return None

    def room(self, name: str) -> int:
        """Real free slots on ``name`` (dispatch-ahead units excluded; may be <= 0 while it is busy)."""
        return self.free[name] - (self.capacity[name] - self.limit[name])

    def fit_node(self, need: int, skip: "dict[str, object] | None" = None) -> str | None:
        """The node with the most free units that can take ``need`` now (its slots >= need), not in ``skip``.

        O(1) when the most-free node qualifies (the common case); otherwise a
        scan, which only an action larger than some node, or a reserved
        most-free node, pays.
        """
        top = self.max_free
        if top < need:
            return None
        name = next(iter(self._buckets[top]))
        if self.limit[name] >= need and (skip is None or name not in skip):
            return name
        best = None
        for name in self.order:
            f = self.free[name]
            if f >= need and self.limit[name] >= need and (skip is None or name not in skip) \
                    and (best is None or f > self.free[best]):
                best = name
        return best

    def with_free(self, need: int, most: int):
        """Up to ``most`` nodes that have ``need`` free units and at least ``need`` slots, the most free first."""
        b = self._buckets
        found = 0
        for f in range(self.max_free, need - 1, -1):
            for name in b[f]:
                if self.limit[name] >= need:
                    yield name
                    found += 1
                    if found >= most:
                        return

    # -- changes ---------------------------------------------------------------
    def take(self, name: str, k: int) -> None:
        f = self.free[name]
        if k < 1 or k > f:
            raise OverAllocation(f"take {k} slots on {name}: only {f} free")
        if k > self.limit[name]:
            raise OverAllocation(f"take {k} slots on {name}: the node has {self.limit[name]} slots")
        self._move(name, f, f - k)

    def give(self, name: str, k: int) -> None:
        f = self.free.get(name)
        if f is None:  # node left while the action ran
            return
        h = self.held.get(name)
        if f + (h or 0) + k > self.capacity[name]:
            raise OverAllocation(f"give {k} slots back on {name}: would exceed capacity {self.capacity[name]}")
        if h is not None:
            self.held[name] = h + k
            return
        self._move(name, f, f + k)

    # -- cordon ----------------------------------------------------------------------
    def cordon(self, name: str) -> bool:
        """No new units on ``name`` (its worker paused): its free units, and those freed later, are held.
        False if it is unknown or already cordoned."""
        if name not in self.free or name in self.held:
            return False
        f = self.free[name]
        self.held[name] = f
        self.held_ahead += self.capacity[name] - self.limit[name]
        self._open_largest = -1
        self._move(name, f, 0)
        return True

    def uncordon(self, name: str) -> bool:
        """``name`` takes units again: what the cordon held is free. False if it was not cordoned."""
        h = self.held.pop(name, None)
        if h is None:
            return False
        self.held_ahead -= self.capacity[name] - self.limit[name]
        self._open_largest = -1
        if h:
            f = self.free[name]
            self._move(name, f, f + h)
        return True

    def _move(self, name: str, old: int, new: int) -> None:
        del self._buckets[old][name]
        self._buckets[new][name] = None
        self.free[name] = new
        self.total_free += new - old
        if new > self._top:
            self._top = new


class TokenPool:
    """API quota tokens held by the scheduler."""

    def __init__(self, tokens: int = 0):
        self.total = tokens
        self.total_free = tokens

    def resize(self, tokens: int) -> None:
        self.total_free += tokens - self.total
        self.total = tokens

    def take(self, k: int) -> None:
        if k < 1 or k > self.total_free:
            raise OverAllocation(f"take {k} API tokens: only {self.total_free} free")
        self.total_free -= k

    def give(self, k: int) -> None:
        self.total_free = min(self.total, self.total_free + k)


@dataclass(slots=True)
class Replica:
    id: ReplicaId
    model: str
    node: str
    gpus: tuple[int, ...]
    share_gb: float
    busy: bool = False
    last_used: float = 0.0
    cross_group: bool = False
    loading: bool = False  # a background load (``Load``): busy, its GPUs held, until ``loaded``
    busy_until: float = math.inf  # while it serves an action: that action's expected end (set by the policy)


@dataclass(slots=True)
class Gpu:
    memory_gb: float
    mem_free: float
    group: int
    busy: bool = False
    replicas: dict[ReplicaId, None] = field(default_factory=dict)


@dataclass(slots=True)
class GpuNodeState:
    spec: GpuNode
    gpus: list[Gpu]
    idle_in_group: list[int]
    most_idle: int = 0  # max(idle_in_group), kept by acquire and release: the load site search reads it per node
    # cordoned (its worker paused): the GPUs the cordon holds busy, those idle then and those freed since; None if not
    cordon: set[int] | None = None


class GpuPool:
    """GPUs in topology groups, resident replicas and which of them can serve now."""

    def __init__(self, nodes: tuple[GpuNode, ...] = ()):
        self.nodes: dict[str, GpuNodeState] = {}
        self.replicas: dict[ReplicaId, Replica] = {}
        self.by_model: dict[str, dict[ReplicaId, None]] = {}
        self.ready: dict[str, dict[ReplicaId, None]] = {}  # idle replica on idle GPUs
        self.loading: dict[str, int] = {}  # per model: its replicas in a background load (loading_of)
        self.widest: dict[str, int] = {}  # per model: the most GPUs a replica of it has had (a bound, never lowered)
        # the nodes with an idle GPU, and every node's place in ``nodes``: a load's site search visits those
        # only, in node order, where they are few (a busy cluster of many nodes), not every node
        self.idle_nodes: dict[str, None] = {}
        self.order: dict[str, int] = {}
        self.cordoned_nodes = 0
        # memory on GPUs that no replica of the ledger holds (a worker's load given up on, whose loader runs on)
        self.mem_holds: dict[object, tuple[str, tuple[int, ...], float]] = {}
        self.total = 0
        self.idle = 0
        self._next_id = 0
        self._next_node = 0
        for n in nodes:
            self.add(n)

    def add(self, spec: GpuNode) -> None:
        if spec.name in self.nodes:
            raise ValueError(f"GPU node {spec.name!r} is already known")
        gpus = [Gpu(spec.gpu_memory_gb, spec.gpu_memory_gb, g) for g in spec.group_of()]
        self.nodes[spec.name] = GpuNodeState(spec, gpus, list(spec.groups), max(spec.groups, default=0))
        self.order[spec.name] = self._next_node
        self._next_node += 1
        if spec.gpus:
            self.idle_nodes[spec.name] = None
        self.total += spec.gpus
        self.idle += spec.gpus

    def remove(self, name: str) -> list[ReplicaId]:
        st = self.nodes.pop(name)
        for key in [k for k, h in self.mem_holds.items() if h[0] == name]:
            del self.mem_holds[key]
        if st.cordon is not None:
            self.cordoned_nodes -= 1
        self.order.pop(name)
        self.idle_nodes.pop(name, None)
        gone = [rid for rid, r in self.replicas.items() if r.node == name]
        for rid in gone:
            r = self.replicas.pop(rid)
            if r.loading:
                self.loading[r.model] -= 1
            self.by_model[r.model].pop(rid, None)
            self.ready[r.model].pop(rid, None)
        self.total -= st.spec.gpus
        self.idle -= sum(1 for g in st.gpus if not g.busy)
        return gone

    # -- replicas --------------------------------------------------------------
    def place(self, model: str, node: str, gpus: tuple[int, ...], model_gb: float, now: float = 0.0) -> ReplicaId:
        """Make a replica resident (its memory taken on each GPU)."""
        st = self.nodes[node]
        share = model_gb / len(gpus)
        for i in gpus:
            if st.gpus[i].mem_free + EPS < share:
                raise OverAllocation(f"replica of {model} on {node} GPUs {gpus}: GPU {i} has "
                                     f"{st.gpus[i].mem_free:g} GB free, needs {share:g}")
        rid = ReplicaId(self._next_id)
        self._next_id += 1
        groups = {st.gpus[i].group for i in gpus}
        r = Replica(rid, model, node, tuple(gpus), share, last_used=now, cross_group=len(groups) > 1)
        self.replicas[rid] = r
        for i in gpus:
            st.gpus[i].mem_free -= share
            st.gpus[i].replicas[rid] = None
        self.by_model.setdefault(model, {})[rid] = None
        self.ready.setdefault(model, {})
        if len(gpus) > self.widest.get(model, 0):
            self.widest[model] = len(gpus)
        self._refresh(r)
        return rid

    def evict(self, rid: ReplicaId) -> None:
        r = self.replicas[rid]
        if r.busy:
            raise OverAllocation(f"evict replica {rid} of {r.model}: it is serving an action")
        st = self.nodes[r.node]
        for i in r.gpus:
            st.gpus[i].mem_free += r.share_gb
            del st.gpus[i].replicas[rid]
        del self.replicas[rid]
        del self.by_model[r.model][rid]
        self.ready[r.model].pop(rid, None)

    def resize(self, model: str, model_gb: float) -> None:
        """``model``'s memory was measured: each of its replicas' share becomes ``model_gb`` over its GPUs. Where
        the declared share was smaller, a GPU's free memory may go below 0: nothing more is placed there until
        replicas leave (the worker holds only what fits, so the ledger again matches it once they do)."""
        for rid in self.by_model.get(model, ()):
            r = self.replicas[rid]
            share = model_gb / len(r.gpus)
            st = self.nodes.get(r.node)
            if st is not None:
                for i in r.gpus:
                    st.gpus[i].mem_free += r.share_gb - share
            r.share_gb = share

    def initial(self, replicas: list[ReplicaSpec], models: dict) -> None:
        for rs in replicas:
            if rs.node in self.nodes:
                self.place(rs.model, rs.node, rs.gpus, models[rs.model].gpu_memory_gb)

    # -- running -----------------------------------------------------------------
    def acquire(self, rid: ReplicaId, now: float) -> None:
        """The replica serves an action: it and its GPUs are busy."""
        r = self.replicas[rid]
        st = self.nodes[r.node]
        if r.busy or any(st.gpus[i].busy for i in r.gpus):
            raise OverAllocation(f"replica {rid} of {r.model} on {r.node} GPUs {r.gpus} is not free")
        r.busy = True
        r.last_used = now
        self.ready[r.model].pop(rid, None)
        for i in r.gpus:
            g = st.gpus[i]
            g.busy = True
            st.idle_in_group[g.group] -= 1
            for other in g.replicas:
                self.ready[self.replicas[other].model].pop(other, None)
        st.most_idle = max(st.idle_in_group)
        if not st.most_idle:
            self.idle_nodes.pop(r.node, None)
        self.idle -= len(r.gpus)

    def release(self, rid: ReplicaId, now: float) -> None:
        r = self.replicas.get(rid)
        if r is None or not r.busy:
            return
        r.busy = False
        r.last_used = now
        st = self.nodes.get(r.node)
        if st is None:
            return
        if st.cordon is not None:  # its GPUs stay busy, held by the cordon: nothing new starts there
            st.cordon.update(r.gpus)
            return
        touched: dict[ReplicaId, None] = {}
        for i in r.gpus:
            g = st.gpus[i]
            g.busy = False
            st.idle_in_group[g.group] += 1
            touched.update(g.replicas)
        st.most_idle = max(st.idle_in_group)
        self.idle_nodes[r.node] = None
        self.idle += len(r.gpus)
        for other in touched:
            self._refresh(self.replicas[other])

    # -- memory held outside the ledger's replicas -------------------------------------------
    def hold_memory(self, key: object, node: str, gpus: tuple[int, ...], gb: float) -> bool:
        """``gb`` on each of ``gpus`` of ``node`` is taken by something no replica here stands for: no load is
        placed into it until :meth:`release_memory`. False if the node or a GPU is unknown, or ``key`` is held."""
        st = self.nodes.get(node)
        if st is None or key in self.mem_holds or not gpus or any(not 0 <= i < len(st.gpus) for i in gpus):
            return False
        for i in gpus:
            st.gpus[i].mem_free -= gb  # (below 0 if it must: nothing more goes there until it is back)
        self.mem_holds[key] = (node, tuple(gpus), gb)
        return True

    def release_memory(self, key: object) -> bool:
        """What :meth:`hold_memory` took under ``key`` is free again. False if nothing is held under it."""
        h = self.mem_holds.pop(key, None)
        if h is None:
            return False
        st = self.nodes.get(h[0])
        if st is not None:
            for i in h[1]:
                st.gpus[i].mem_free += h[2]
        return True

    # -- cordon ----------------------------------------------------------------------
    def open_replicas(self, model: str) -> int:
        """Replicas of ``model`` not on a cordoned node."""
        reps = self.by_model.get(model, ())
        if not self.cordoned_nodes:
            return len(reps)
        return sum(1 for rid in reps if self.nodes[self.replicas[rid].node].cordon is None)

    def cordon(self, name: str) -> bool:
        """No new action or load on node ``name`` (its worker paused): its idle GPUs, and those freed later, are
        held busy, so none of its replicas is ready and no load site is found there; what runs there goes on.
        False if it is unknown or already cordoned."""
        st = self.nodes.get(name)
        if st is None or st.cordon is not None:
            return False
        st.cordon = set()
        self.cordoned_nodes += 1
        for i, g in enumerate(st.gpus):
            if g.busy:
                continue
            g.busy = True
            st.cordon.add(i)
            st.idle_in_group[g.group] -= 1
            self.idle -= 1
            for other in g.replicas:
                self.ready[self.replicas[other].model].pop(other, None)
        st.most_idle = 0
        self.idle_nodes.pop(name, None)
        return True

    def uncordon(self, name: str) -> bool:
        """Node ``name`` takes work again: the GPUs the cordon held are idle. False if it was not cordoned."""
        st = self.nodes.get(name)
        if st is None or st.cordon is None:
            return False
        held, st.cordon = st.cordon, None
        self.cordoned_nodes -= 1
        touched: dict[ReplicaId, None] = {}
        for i in held:
            g = st.gpus[i]
            g.busy = False
            st.idle_in_group[g.group] += 1
            self.idle += 1
            touched.update(g.replicas)
        st.most_idle = max(st.idle_in_group, default=0)
        if st.most_idle:
            self.idle_nodes[name] = None
        for other in touched:
            self._refresh(self.replicas[other])
        return True

    def begin_load(self, rid: ReplicaId, now: float) -> None:
        """A background load: the replica and its GPUs are held (not ready) until :meth:`loaded`."""
        self.acquire(rid, now)
        r = self.replicas[rid]
        r.loading = True
        self.loading[r.model] = self.loading.get(r.model, 0) + 1

    def loaded(self, rid: ReplicaId, now: float) -> bool:
        """The background load of ``rid`` is over: it is ready. False if it was not loading (or is gone)."""
        r = self.replicas.get(rid)
        if r is None or not r.loading:
            return False
        r.loading = False
        self.loading[r.model] -= 1
        self.release(rid, now)
        return True

    def loading_of(self, model: str) -> int:
        """Replicas of ``model`` in a background load."""
        return self.loading.get(model, 0)

    def _refresh(self, r: Replica) -> None:
        st = self.nodes[r.node]
        if not r.busy and not any(st.gpus[i].busy for i in r.gpus):
            self.ready[r.model][r.id] = None

    # -- queries -----------------------------------------------------------------
    def eviction_plan(self, node: str, gpus: tuple[int, ...], share: float,
                      order: list[ReplicaId]) -> list[ReplicaId] | None:
        """Replicas to evict (taken from ``order``, first first) so each GPU has ``share`` free; None if impossible."""
        st = self.nodes[node]
        free = {i: st.gpus[i].mem_free for i in gpus}
        plan: list[ReplicaId] = []
        for rid in order:
            if all(free[i] + EPS >= share for i in gpus):
                break
            r = self.replicas[rid]
            if r.busy or not any(i in free and free[i] + EPS < share for i in r.gpus):
                continue
            plan.append(rid)
            for i in r.gpus:
                if i in free:
                    free[i] += r.share_gb
        if all(free[i] + EPS >= share for i in gpus):
            return plan
        return None
