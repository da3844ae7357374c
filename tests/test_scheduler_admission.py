"""Trajectory admission through the live scheduler: begin_trajectory returns once admitted."""

from __future__ import annotations

import threading
import time

import dask
import pytest
from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.policy import TangramOptions


def _cluster(plugin) -> LocalCluster:
    return LocalCluster(n_workers=2, threads_per_worker=1, resources={"slots": 1}, processes=True,
                        dashboard_address=":0", scheduler_kwargs={"plugins": [plugin]})


def test_admission_holds_a_trajectory_until_capacity_frees():
    """Admission on, nothing learned yet: one trajectory per slot (2). The third waits until one ends."""
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        assert tangram_dask.begin_trajectory(client, "t1") == {"status": "OK"}
        assert tangram_dask.begin_trajectory(client, "t2") == {"status": "OK"}
        admitted = threading.Event()
        answer: list = []
        waiter = threading.Thread(target=lambda: (answer.append(tangram_dask.begin_trajectory(client, "t3")),
                                                  admitted.set()))
        waiter.start()
        deadline = time.monotonic() + 10
        while "t3" not in plugin.policy.admission_queue:  # it asked, and the gate holds it
            assert time.monotonic() < deadline and not admitted.is_set()
            time.sleep(0.01)
        time.sleep(0.3)  # (scheduling passes go on meanwhile)
        assert not admitted.is_set() and "t3" not in plugin._admitted  # held: the pool is full
        # asking again for an admitted one returns at once
        assert tangram_dask.begin_trajectory(client, "t2") == {"status": "OK"}
        tangram_dask.end_trajectory(client, "t1")
        assert admitted.wait(10)
        waiter.join(5)
        assert answer == [{"status": "OK"}] and "t3" in plugin._admitted  # admitted, not let go as "ended"
        for t in ("t2", "t3"):
            tangram_dask.end_trajectory(client, t)


def test_without_admission_every_trajectory_begins_at_once():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for i in range(20):  # no gate: each is admitted by the next scheduling pass
            assert tangram_dask.begin_trajectory(client, f"t{i}") == {"status": "OK"}
        assert plugin.policy.admission_queue == {} and len(plugin._admitted) == 20
        assert tangram_dask.end_trajectory(client, "t0") == []  # no sandboxes here: nothing to remove
        assert "t0" not in plugin._admitted


def test_expected_s_travels_to_the_gate_and_admits_the_long_one_first():
    """admit_long on: with both places taken, a trajectory expected to run 100 s that asked after
    one expected 1 s is admitted first when a place frees."""
    plugin = tangram_dask.TangramSchedulerPlugin(
        "tangram", tangram=TangramOptions(admission=1.0, admit_long=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        tangram_dask.begin_trajectory(client, "t1", expected_s=10.0)
        tangram_dask.begin_trajectory(client, "t2")
        admitted = {name: threading.Event() for name in ("short", "long")}
        waiters = []
        for name, expected in (("short", 1.0), ("long", 100.0)):
            waiters.append(threading.Thread(target=lambda n=name, e=expected: (
                tangram_dask.begin_trajectory(client, n, expected_s=e), admitted[n].set())))
            waiters[-1].start()
            deadline = time.monotonic() + 10
            while name not in plugin.policy.admission_queue and time.monotonic() < deadline:
                time.sleep(0.01)  # asked, in this order
        assert list(plugin.policy.admission_queue) == ["short", "long"]
        tangram_dask.end_trajectory(client, "t1")
        assert admitted["long"].wait(10)
        assert not admitted["short"].is_set()
        tangram_dask.end_trajectory(client, "t2")
        assert admitted["short"].wait(10)
        for w in waiters:
            w.join(5)


def test_a_bad_expected_s_is_refused_by_name_and_changes_nothing():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for bad in (-1.0, float("nan"), float("inf"), "10", True, [5]):
            with pytest.raises(tangram_dask.TrajectoryError, match="expected_s"):
                tangram_dask.begin_trajectory(client, "t", expected_s=bad)
            # a raw call that skips the client's check: refused by the scheduler, which goes on
            out = client.sync(client.scheduler.tangram_begin_trajectory, trajectory="t", expected_s=bad)
            assert out["status"] == "error" and "expected_s" in out["message"], bad
            assert "t" not in plugin.policy.admission_queue and "t" not in plugin._admitted
        assert tangram_dask.begin_trajectory(client, "t", expected_s=3) == {"status": "OK"}


def test_a_bad_trajectory_id_is_refused_by_name_and_changes_nothing():
    """An id no action could name (not a string, or empty) is refused by begin_trajectory and end_trajectory,
    and by the scheduler when a raw call skips the client's check. Before session 31 None, 5 and "" were
    admitted, each holding a place in the gate until the TTL; a dict erred with a bare TypeError."""
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for bad in (None, 5, "", 2.5, {"a": 1}):
            for call in (tangram_dask.begin_trajectory, tangram_dask.end_trajectory):
                with pytest.raises(tangram_dask.TrajectoryError, match="must be a non-empty string"):
                    call(client, bad)
            for handler in (client.scheduler.tangram_begin_trajectory, client.scheduler.tangram_end_trajectory):
                out = client.sync(handler, trajectory=bad)
                assert out["status"] == "error" and "trajectory id" in out["message"], (bad, out)
            assert not plugin.policy.admission_queue and not plugin._admitted and not plugin.policy.admitted
        with pytest.raises(tangram_dask.TrajectoryError, match="a name is empty"):
            tangram_dask.expect_trajectories(client, {"": 1.0})
        assert tangram_dask.begin_trajectory(client, "t") == {"status": "OK"}


def test_a_trajectory_the_ttl_ended_asks_the_gate_again():
    """trajectory_ttl_s ends a trajectory idle that long in the policy; the plugin forgets it too, so beginning
    the id again asks the gate (before session 31 the plugin still held it admitted and let it in at once,
    past the gate's limit, and kept every such id for good)."""
    with dask.config.set({"tangram.scheduler.trajectory-ttl-s": 0.5}):
        plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    assert plugin.options.trajectory_ttl_s == 0.5
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        assert tangram_dask.begin_trajectory(client, "a") == {"status": "OK"}
        assert "a" in plugin._admitted
        deadline = time.monotonic() + 20
        while "a" in plugin._admitted:  # expired on a later pass (the plugin's 1 s tick asks for one)
            assert time.monotonic() < deadline, "the TTL never ended it"
            time.sleep(0.05)
        assert "a" not in plugin.policy.admitted
        assert tangram_dask.begin_trajectory(client, "a") == {"status": "OK"}  # through the gate again
        assert "a" in plugin.policy.admitted and "a" in plugin._admitted


def test_expect_trajectories_queues_a_step_at_once_so_the_gate_orders_all_of_it():
    """Six trajectories queued in one call on 2 slots (2 in flight before anything is learned), with
    admit_long=1.5: the mean expectation given is 60 s, so the two over 90 s are admitted first, longest
    first, although they were named after others; begin_trajectory then returns at once for them and
    waits for the others, which go in the order named."""
    plugin = tangram_dask.TangramSchedulerPlugin(
        "tangram", tangram=TangramOptions(admission=1.0, admit_long=1.5), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        expected = {"a": 10.0, "b": 10.0, "c": 100.0, "d": 60.0, "e": 120.0, "f": None}
        assert tangram_dask.expect_trajectories(client, expected) == {"status": "OK", "queued": 6}
        deadline = time.monotonic() + 10
        while len(plugin._admitted) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert plugin._admitted == {"c", "e"}
        assert list(plugin.policy.admission_queue) == ["a", "b", "d", "f"]
        assert tangram_dask.begin_trajectory(client, "e") == {"status": "OK"}  # admitted already: at once
        # named again (even with another expectation): its place is kept
        assert tangram_dask.expect_trajectories(client, {"a": 500.0, "c": 1.0}) == {"status": "OK", "queued": 0}
        admitted = threading.Event()
        waiter = threading.Thread(target=lambda: (tangram_dask.begin_trajectory(client, "a"), admitted.set()))
        waiter.start()
        time.sleep(0.3)
        assert not admitted.is_set()  # waits for its admission
        tangram_dask.end_trajectory(client, "c")
        assert admitted.wait(10)
        waiter.join(5)
        assert plugin._admitted == {"a", "e"}
        # each admission is counted and logged (topic "tangram"), with how long it waited
        events = [m for _, m in client.get_events("tangram") if m["action"] == "tangram-admission"]
        assert [m["trajectory"] for m in events] == ["e", "c", "a"]
        assert events[0]["waited_s"] < events[2]["waited_s"]  # a waited for c to end
        monitor = cluster.scheduler.plugins["tangram-monitor"]
        assert monitor.counters.admissions == 3
        assert monitor.counters.admission_wait_s == pytest.approx(sum(m["waited_s"] for m in events), abs=1e-5)


def test_a_bad_expect_trajectories_names_the_entry_and_queues_nothing():
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as client:
        client.wait_for_workers(2)
        for bad, words in (([("a", 1.0)], "must be a mapping"), ({"a": 1.0, "b": -2}, "trajectory 'b'"),
                           ({"a": 1.0, 7: 2.0}, "the name 7 is not a string"), ({"a": "soon"}, "expected_s")):
            with pytest.raises(tangram_dask.TrajectoryError, match=words):
                tangram_dask.expect_trajectories(client, bad)
            # a raw call that skips the client's check: refused whole by the scheduler, which goes on
            out = client.sync(client.scheduler.tangram_expect_trajectories, trajectories=bad)
            assert out["status"] == "error" and words in out["message"], bad
            assert not plugin.policy.admission_queue and not plugin._admitted and not plugin._admissions
        assert tangram_dask.expect_trajectories(client, {"a": 1.0}) == {"status": "OK", "queued": 1}


def _begin_in_thread(client, t):
    th = threading.Thread(target=tangram_dask.begin_trajectory, args=(client, t), daemon=True)
    th.start()
    return th


def test_a_client_that_leaves_takes_its_trajectories_out_of_the_gate():
    """A trainer crashes: its admitted trajectories (no action in flight) and those it queued end when its client
    leaves, so a new client's trajectory is admitted at once on the idle cluster. Before session 34 they held the
    gate for the TTL (1 h) each, one after the other (a helper's review found it). A trajectory whose actions
    another client still wants stays, and is that client's from then on."""
    plugin = tangram_dask.TangramSchedulerPlugin("tangram", tangram=TangramOptions(admission=1.0), pipeline=0)
    with _cluster(plugin) as cluster, Client(cluster) as keeper:
        keeper.wait_for_workers(2)
        crashed = Client(cluster)
        for t in ("a0", "a1"):
            assert tangram_dask.begin_trajectory(crashed, t) == {"status": "OK"}
        tangram_dask.expect_trajectories(crashed, {"a3": None})
        waiter = _begin_in_thread(crashed, "a2")
        deadline = time.monotonic() + 10
        while "a2" not in plugin.policy.admission_queue:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with tangram_dask.action(kind="k", resource="cpu", units=1, hint_s=1.0, trajectory="a1"):
            held = keeper.submit(time.sleep, 3.0, pure=False)  # another client wants an action of a1
        while held.key not in plugin.actions:  # (the scheduler has it: its graph is materialised off the loop)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        crashed.close()
        waiter.join(10)
        assert not waiter.is_alive()  # let go: its trajectory ended
        assert sorted(plugin.policy.admitted) == ["a1"] and "a3" not in plugin.policy.admission_queue
        assert plugin._clients_of == {"a1": {keeper.id}}
        again = _begin_in_thread(keeper, "b0")
        again.join(10)
        assert not again.is_alive() and "b0" in plugin.policy.admitted
        held.result(timeout=30)
        tangram_dask.end_trajectory(keeper, "a1")
        tangram_dask.end_trajectory(keeper, "b0")
        assert plugin._clients_of == {} and plugin._trajectories_of == {}
