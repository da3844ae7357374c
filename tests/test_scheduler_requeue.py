"""Actions that come back unrun (granted to a worker that leaves or pauses before Dask sent them there, released from
a worker that dies, or waiting for an input lost with one) are queued again: once, in their first place, with
nothing of the old grant left behind. The first tests run on the stand-in scheduler of
tests/test_scheduler_grant_index.py (the case needs a grant caught in ``no-worker`` at the moment its worker leaves,
which a real cluster gives only by chance); the last two on a LocalCluster whose workers are killed. Each test failed
before session 33's fixes (the last four were found by a helper's review of the first fix)."""
from __future__ import annotations

import os
import signal
import time
from types import SimpleNamespace

from distributed import Client

import pytest
from distributed.core import Status

import tangram_dask
from tangram_dask import make_spec
from tangram_dask.cluster import CpuNode
from tangram_dask.messages import GRANT_KEY, WorkerDeclaration
from tangram_dask.policy import TangramPolicy
from tangram_dask.scheduler import GRANTED, PENDING, Action, TangramSchedulerPlugin

from test_scheduler_faults import _wait_for_line, record_then_sleep
from test_scheduler_grant_index import Sched
from test_scheduler_plugin import _cpu_worker, start_cluster, wait_nodes


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


def _issued(pol, traj="t0"):
    """What the figures that learn from issued actions counted: (actions seen by the turn figures, the
    trajectory's actions)."""
    return pol.turn_time.n, pol.traj_work[traj][4]


def test_an_action_back_unrun_that_fits_nowhere_is_counted_once_when_a_node_joins():
    """The only CPU node leaves with one action running and one queued: both fit nowhere and wait (unplaceable);
    when a node joins they start, counted once (before: counted again on the way out of the unplaceable set)."""
    from tangram_dask.cluster import ClusterSpec

    pol = TangramPolicy(ClusterSpec("t"), {}, ())
    pol.add_cpu_node(CpuNode("a", 1))
    spec = make_spec("tool", "cpu", 1, hint_s=1.0, trajectory="t0")
    pol.submit("x0", spec, 0.0)
    pol.submit("x1", spec, 0.0)
    pol.schedule(0.0)
    before = _issued(pol)
    for aid in pol.remove_node("a"):
        pol.submit(aid, spec, 1.0, issued_at=0.0)
    assert sorted(pol.unplaceable) == ["x0", "x1"]
    pol.add_cpu_node(CpuNode("b", 2))
    assert sorted(d.action for d in pol.schedule(2.0)) == ["x0", "x1"]
    assert _issued(pol) == before


@pytest.mark.parametrize("how", ["cancel", "remove_node"])
def test_a_requeued_actions_run_time_replaces_its_estimate_in_its_trajectorys_figures(how):
    """Hinted 1 s, it ran 9 s after coming back unrun: its trajectory's figures (which the gate learns from) read
    9 s, as for an action that never came back (before: 1 s after a cancel, the hint kept)."""
    from tangram_dask.cluster import ClusterSpec

    def run(requeue):
        pol = TangramPolicy(ClusterSpec("t"), {}, ())
        pol.add_cpu_node(CpuNode("a", 1))
        pol.add_cpu_node(CpuNode("b", 1))
        spec = make_spec("tool", "cpu", 1, hint_s=1.0, trajectory="t0")
        pol.submit("x0", spec, 0.0)
        [d] = pol.schedule(0.0)
        if requeue == "cancel":  # _revoke, processing -> released
            pol.cancel("x0", 0.5)
        elif requeue == "remove_node":  # remove_worker
            pol.remove_node(d.node)
        if requeue:
            pol.submit("x0", spec, 0.5, issued_at=0.0)
        pol.schedule(0.5)
        pol.finish("x0", 10.0, 9.0)
        return round(pol.traj_work["t0"][3], 3), pol.traj_work["t0"][4]

    assert run(how) == run(None) == (9.0, 1.0)


def _counts(client, plugin):
    tot = client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.plugins["tangram-monitor"].stats.totals())
    pol = {k: w.n for k, w in plugin.policy.ests.items()}
    dash = {k: v["submitted"] for k, v in tot.items()}
    print("issued, by the policy's figures:", pol, "| submitted, by the dashboard:", dash)
    return pol, dash


def first(x):
    return x + 1


def dep(x):
    return x * 2


def test_live_the_last_worker_dies_mid_action_and_its_action_is_counted_once(tmp_path):
    """One CPU worker, killed mid-action: Dask queues the action again before the plugin hears the worker left; no
    CPU node is left, so it waits until the nanny's new worker joins, and is counted once."""
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    with start_cluster(plugin, {"cpu-0": _cpu_worker("cpu-0", 1, 1)}) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_nodes(plugin, 1)
        log = tmp_path / "log"
        with tangram_dask.action(kind="hold", resource="cpu", units=1, hint_s=5.0):
            c = client.submit(record_then_sleep, str(log), 1.0, pure=False)
        os.kill(int(_wait_for_line(log, "start").split()[1]), signal.SIGKILL)
        c.result(timeout=60)
        pol, dash = _counts(client, plugin)
        assert pol["hold"] == 1 and dash["hold"] == 1


def test_live_an_action_whose_input_is_lost_with_a_worker_is_counted_once(tmp_path):
    """Two CPU workers of one slot, both busy; ``dep`` waits for a slot, and its input lives on a worker that dies:
    Dask releases it, computes its input again, and it waits again: counted once by the policy and the dashboard
    (before: its record was dropped on the release, and it came back as new)."""
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    ws = {"cpu-0": _cpu_worker("cpu-0", 1, 1), "cpu-1": _cpu_worker("cpu-1", 1, 1)}
    with start_cluster(plugin, ws) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        with tangram_dask.action(kind="first", resource="cpu", units=1, hint_s=0.1):
            a = client.submit(first, 1, pure=False)
        a.result(timeout=30)
        (home,) = client.who_has(a)[a.key]
        holds = []
        for i in range(2):
            with tangram_dask.action(kind="hold", resource="cpu", units=1, hint_s=5.0):
                holds.append(client.submit(record_then_sleep, str(tmp_path / f"l{i}"), 3.0, pure=False))
        for i in range(2):
            _wait_for_line(tmp_path / f"l{i}", "start")
        with tangram_dask.action(kind="dep", resource="cpu", units=1, hint_s=1.0):
            b = client.submit(dep, a, pure=False)
        deadline = time.monotonic() + 20
        while not (plugin.actions.get(b.key) is not None and plugin.actions[b.key].state == PENDING):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(client.run(os.getpid, workers=[home])[home], signal.SIGKILL)
        assert b.result(timeout=60) == 4 and all(h.result(timeout=60) for h in holds)
        pol, dash = _counts(client, plugin)
        assert pol["hold"] == 2 and pol["dep"] == 1 and dash["dep"] == 1


def test_fifo_puts_an_action_back_unrun_before_those_waiting():
    """fifo: x0 was granted, then its worker left before it ran; x1 waits. x0 comes back first (before session 33 it
    went to the back; found by a helper's review)."""
    from tangram_dask.cluster import ClusterSpec
    from tangram_dask.policy import FifoPolicy

    pol = FifoPolicy(ClusterSpec("t"), {}, ())
    pol.add_cpu_node(CpuNode("a", 1))
    pol.add_cpu_node(CpuNode("b", 1))
    spec = make_spec("tool", "cpu", 1, hint_s=1.0)
    pol.submit("x0", spec, 0.0)
    pol.submit("y", spec, 0.0)
    starts = {d.action: d.node for d in pol.schedule(0.0)}
    pol.submit("x1", spec, 0.5)
    for aid in pol.remove_node(starts["x0"]):
        pol.submit(aid, spec, 1.0, issued_at=0.0)
    pol.finish("y", 2.0, 2.0)
    assert [d.action for d in pol.schedule(2.0)] == ["x0"]


def test_live_actions_only_a_dead_worker_could_hold_wait_for_its_restart(tmp_path):
    """The only worker of 4 slots dies running an action of (3, 4) slots, with another queued (the other worker
    has 2): both wait for the nanny's new worker and run there. Before session 34 both erred at once with
    PlacementError ("the largest CPU worker has 2 slots"), a second before the worker came back (a helper's
    review found it)."""
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    ws = {"big": _cpu_worker("big", 4, 4), "small": _cpu_worker("small", 2, 2)}
    with start_cluster(plugin, ws) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        with tangram_dask.action(kind="wide", resource="cpu", units=(3, 4), hint_s=1.0):
            fs = [client.submit(record_then_sleep, str(tmp_path / f"l{i}"), 1.0, pure=False) for i in range(2)]
        deadline = time.monotonic() + 20
        while not any(p.exists() and p.read_text() for p in tmp_path.iterdir()):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (started,) = [p for p in tmp_path.iterdir() if p.read_text()]  # one at a time: 4 slots, 3 each
        os.kill(int(_wait_for_line(started, "start").split()[1]), signal.SIGKILL)
        assert all(f.result(timeout=90) for f in fs)
        assert plugin.policy.lost_since is None and not plugin.policy.unplaceable


def test_live_actions_cancelled_before_they_run_leave_their_trajectorys_figures():
    """Five actions of one trajectory on one slot; four cancelled while they wait. Once they are forgotten, the
    policy keeps nothing of them: its trajectory's expected work is the one that ran. Before session 34 the four
    stayed in ``_issued_work`` and counted their expected work in ``traj_work`` until the trajectory ended (a
    helper's review)."""
    plugin = TangramSchedulerPlugin("tangram", pipeline=0)
    with start_cluster(plugin, {"a": _cpu_worker("a", 1, 1)}) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        wait_nodes(plugin, 1)
        with tangram_dask.action(kind="k", resource="cpu", units=1, hint_s=1.0, trajectory="t"):
            fs = [client.submit(time.sleep, 0.5, pure=False) for _ in range(5)]
        deadline = time.monotonic() + 20
        while sum(a.state == GRANTED for a in plugin.actions.values()) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        client.cancel(fs[1:])
        fs[0].result(timeout=30)
        deadline = time.monotonic() + 20
        while plugin.actions or plugin.policy._issued_work.get("t"):
            assert time.monotonic() < deadline, (len(plugin.actions), plugin.policy._issued_work)
            time.sleep(0.02)
        acc = plugin.policy.traj_work["t"]
        assert acc[4] == 5 and acc[3] < 1.5  # 5 issued; the seconds of one that ran (0.5 s), not 5 expected
