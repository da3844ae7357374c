"""The tangram policy's queues and rates: plain state, no decision.

``Pool`` is one queue (CPU slots, API tokens, or one model's GPU replicas)
with its heap of ``Pending`` entries and its counters; ``Reservation`` is an
action collecting freed slots on one node; ``Rate`` is the EWMA of an event
rate that the residency rules and the gate read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from heapq import heappop, heappush
from operator import itemgetter

from .types import ActionId


class Pending(tuple):
    """A waiting action, which is also its own heap entry: ``(key, seq, aid, spec, est)``.

    Heaps compare entries by ``key`` (``aging * issued + est``: the issue time is in it, and a
    requeued action keeps its key) then ``seq`` (unique: FIFO among equal keys), never further.
    One object per queued action instead of a heap tuple and a record (40 bytes less each: the
    scheduler may hold 100,000 queued actions).
    """

    __slots__ = ()
    key = property(itemgetter(0))
    seq = property(itemgetter(1))
    aid = property(itemgetter(2))
    spec = property(itemgetter(3))
    est = property(itemgetter(4))


_pending = partial(tuple.__new__, Pending)  # _pending((key, seq, aid, spec, est))


class Pool:
    """One queue of the policy: CPU slots, API tokens, or one model's GPU replicas.

    It owns its heap (key ``aging * issued + est``: shortest expected work
    first, with aging), its waiting actions and its counters: ``qmin`` (the
    ``units.min`` of actions waiting, including CPU actions waiting at home),
    ``rmin`` (of actions holding units, including reservations) and
    ``qwork`` (their expected unit-seconds). Every counter changes here and
    nowhere else. ``blocked`` is why the head waits (``(reason, spec, free)``, made a Shortfall by
    ``TangramPolicy._shortfall`` for snapshots), or None.
    """

    __slots__ = ("name", "resource", "heap", "waiting", "qmin", "rmin", "qwork", "blocked", "demand", "arrivals")

    def __init__(self, name: str, resource: str, horizon_s: float = 30.0):
        self.name = name
        self.resource = resource
        self.heap: list[Pending] = []
        self.waiting: dict[ActionId, Pending] = {}
        self.qmin = 0
        self.rmin = 0
        self.qwork = 0.0
        self.blocked: tuple | None = None
        # expected work submitted per second (seconds of work on units.min): the pool's recent demand
        # (kept for GPU pools, where the residency rules read it)
        self.demand = Rate(horizon_s, settled=True)
        self.arrivals = Rate(horizon_s, settled=True)  # actions submitted per second (load_ahead, evict_wait)

    def push(self, p: Pending) -> None:
        self.waiting[p[2]] = p
        heappush(self.heap, p)
        self.queued(p)

    def queued(self, p: Pending) -> None:
        self.qmin += p.spec.units_min
        self.qwork += p.est * p.spec.units_min

    def unqueued(self, p: Pending) -> None:
        self.qmin -= p.spec.units_min
        w = self.qwork - p.est * p.spec.units_min
        self.qwork = (0.0 if 0.0 > w else w) if self.qmin else 0.0  # max(w, 0.0), without the call

    def head(self) -> tuple[ActionId, Pending] | None:
        q, waiting = self.heap, self.waiting
        while q:
            p = q[0]
            if waiting.get(p[2]) is p:  # not dropped (nor queued again under a newer entry)
                return p[2], p
            heappop(q)
        return None

    def pop(self, aid: ActionId) -> Pending:
        """Take the head (``aid``) out of the queue."""
        heappop(self.heap)
        p = self.waiting.pop(aid)
        self.unqueued(p)
        return p

    def drop(self, aid: ActionId) -> Pending | None:
        """Forget a waiting action anywhere in the queue (its heap entry is skipped lazily)."""
        p = self.waiting.pop(aid, None)
        if p is not None:
            self.unqueued(p)
        return p


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
    """EWMA of an event rate (amount per second), bias-corrected at start unless ``settled``.

    A ``settled`` rate divides by the full time constant from the first event
    on: a burst counts as demand only once it has lasted about ``tau``.
    """

    __slots__ = ("tau", "w", "last", "t0", "settled")

    def __init__(self, tau: float, settled: bool = False):
        self.tau = tau
        self.w = 0.0
        self.last = None
        self.t0 = 0.0
        self.settled = settled

    def add(self, now: float, work: float) -> None:
        if self.last is None:
            self.last = self.t0 = now
        elif now > self.last:
            self.w *= math.exp((self.last - now) / self.tau)
            self.last = now
        self.w += work

    def retau(self, tau: float) -> None:
        """A new time constant, the rate as it read at the last event kept (settled: the weight scales with tau)."""
        if self.settled and self.tau > 0:
            self.w *= tau / self.tau
        self.tau = tau

    def rate(self, now: float) -> float:
        if self.last is None:
            return 0.0
        w = self.w * math.exp((self.last - now) / self.tau) if now > self.last else self.w
        if self.settled:
            return w / self.tau
        span = self.tau * (1.0 - math.exp(-(max(now - self.t0, 1e-3)) / self.tau))
        return w / span
