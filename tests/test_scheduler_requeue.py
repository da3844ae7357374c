"""Actions granted to a worker that leaves (or pauses) before Dask sent them there are queued again: once, in
their first place, with nothing of the old grant left behind. On the stand-in scheduler of
tests/test_scheduler_grant_index.py (no Dask cluster: the case needs a grant caught in ``no-worker`` at the moment
its worker leaves, which a real cluster gives only by chance). Each test failed before session 33's fix."""
from __future__ import annotations

import time
from types import SimpleNamespace

from distributed.core import Status

from tangram_dask import make_spec
from tangram_dask.cluster import CpuNode
from tangram_dask.messages import GRANT_KEY, WorkerDeclaration
from tangram_dask.policy import TangramPolicy
from tangram_dask.scheduler import GRANTED, PENDING, Action, TangramSchedulerPlugin

from test_scheduler_grant_index import Sched


class Timer:
    def __init__(self):
        self.cancelled = False

    def cancel(self):
        self.cancelled = True


class Loop:
    def __init__(self):
        self.timers: list[Timer] = []

    def add_callback(self, *a, **k):
        pass

    def call_later(self, *a, **k):
        t = Timer()
        self.timers.append(t)
        return t


def _worker(s, p, name):
    s.workers[name] = SimpleNamespace(resources={"slots": 1}, nthreads=1, status=Status.running, address=name,
                                      name=name)
    p._join(name, WorkerDeclaration(slots=1))


def _setup(n: int = 2):
    """A tangram plugin with workers w1 and w2 of one slot each; ``n`` timed actions, granted, the first on w1."""
    p = TangramSchedulerPlugin(policy="tangram", pipeline=0)  # (no dispatch-ahead: one action per worker)
    s = Sched()
    s.loop = Loop()
    s.plugin, p.scheduler = p, s
    p.policy = p.build_policy()
    _worker(s, p, "w1")
    _worker(s, p, "w2")
    spec = make_spec("tool", "cpu", 1, hint_s=1.0, trajectory="t0", timeout_s=30.0)
    user = {"tangram": {}, "mine": 1}
    keys = [f"k{i}" for i in range(n)]
    for k in keys:
        s.tasks[k] = SimpleNamespace(state="no-worker", annotations=dict(user), worker_restrictions=None,
                                     resource_restrictions=None, processing_on=None, loose_restrictions=False)
        p.actions[k] = Action(spec)
        p.transition(k, "waiting", "no-worker")
    p._flush()
    assert all(p.actions[k].state == GRANTED for k in keys)
    return p, s, keys


def _on(p, worker):
    return [k for k, a in p.actions.items() if a.state == GRANTED and a.grant.worker == worker]


def test_a_grant_caught_in_no_worker_when_its_worker_leaves_is_queued_once_with_nothing_of_the_old_grant():
    p, s, keys = _setup()
    pol = p.policy
    assert isinstance(pol, TangramPolicy)
    (k,) = _on(p, "w1")
    s.tasks[k].state = "no-worker"  # granted, not sent: the worker left first
    timer = p._timers[k]
    issued = (pol.turn_time.n, pol.traj_work["t0"][4], pol.pools["cpu"].rmin)
    print("before:", issued, s.tasks[k].annotations.keys())
    del s.workers["w1"]
    p.remove_worker(s, "w1")
    a = p.actions[k]
    print("after:", (pol.turn_time.n, pol.traj_work["t0"][4], pol.pools["cpu"].rmin), s.tasks[k].annotations.keys(),
          a.state, k in p._timers, timer.cancelled)
    assert a.state == PENDING and a.grant is None
    assert GRANT_KEY not in s.tasks[k].annotations and s.tasks[k].annotations["mine"] == 1
    assert k not in p._timers and timer.cancelled
    # counted once: the trajectory's actions and the turn figures as before; its units no longer held
    assert (pol.turn_time.n, pol.traj_work["t0"][4]) == issued[:2] and pol.pools["cpu"].rmin == issued[2] - 1
    # it starts on w2 once w2's action ends, and when it ends no grant stays on the task
    (other,) = _on(p, "w2")
    s.tasks[other].state = "memory"
    p.transition(other, "processing", "memory")
    p._flush()
    assert p.actions[k].state == GRANTED and p.actions[k].grant.worker == "w2"
    s.tasks[k].state = "memory"
    p.transition(k, "processing", "memory")
    print("finished:", s.tasks[k].annotations)
    assert GRANT_KEY not in s.tasks[k].annotations and s.tasks[k].annotations["mine"] == 1
    assert pol.pools["cpu"].rmin == 0 and not pol.running


def test_an_action_queued_again_keeps_its_place_ahead_of_later_ones():
    """A paused worker's grant that Dask never sent goes back in its first place: before the actions issued after
    it (before: at the back, as if issued at the pause)."""
    p, s, keys = _setup(n=2)
    (k,) = _on(p, "w1")
    s.tasks[k].state = "no-worker"
    spec = make_spec("tool", "cpu", 1, hint_s=1.0, trajectory="t1")
    time.sleep(0.01)  # issued later (arrivals under 1 ms apart share a submit time)
    later = []
    for i in range(3):  # issued later, at the same hint: queued behind it
        key = f"later{i}"
        s.tasks[key] = SimpleNamespace(state="no-worker", annotations={}, worker_restrictions=None,
                                       resource_restrictions=None, processing_on=None, loose_restrictions=False)
        p.actions[key] = Action(spec)
        p.transition(key, "waiting", "no-worker")
        later.append(key)
    p._flush()
    s.workers["w1"].status = Status.paused
    p._status_changed("w1")
    assert p.actions[k].state == PENDING
    (other,) = _on(p, "w2")
    s.tasks[other].state = "memory"
    p.transition(other, "processing", "memory")
    p._flush()
    print({key: a.state for key, a in p.actions.items()})
    assert p.actions[k].state == GRANTED and all(p.actions[x].state != GRANTED for x in later)


def test_a_node_that_leaves_with_actions_running_frees_their_pool_counts():
    """The policy alone: a node leaves while it runs actions; they come back as lost, and the pool no longer counts
    them as running (before, its ``rmin`` kept them for good: the elastic sizing read a busier pool)."""
    from tangram_dask.cluster import ClusterSpec

    pol = TangramPolicy(ClusterSpec("t"), {}, ())
    for n in ("a", "b"):
        pol.add_cpu_node(CpuNode(n, 2))
    spec = make_spec("tool", "cpu", 1, hint_s=1.0)
    for i in range(4):
        pol.submit(f"x{i}", spec, 0.0)
    pol.schedule(0.0)
    assert pol.pools["cpu"].rmin == 4
    lost = pol.remove_node("a")
    assert len(lost) == 2 and pol.pools["cpu"].rmin == 2
    for aid in lost:
        pol.submit(aid, spec, 1.0, issued_at=0.0)
    for aid in [x for x in pol.running]:
        pol.finish(aid, 2.0, 1.0)
    started = [d.action for d in pol.schedule(2.0)]
    assert sorted(started) == sorted(lost)
    for aid in started:
        pol.finish(aid, 3.0, 1.0)
    assert pol.pools["cpu"].rmin == 0 and pol.pools["cpu"].qmin == 0
