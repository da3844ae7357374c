"""A paused worker (Dask pauses one whose memory passes ``distributed.worker.memory.pause``) takes no new action:
the policy cordons it, and the actions granted there that it has not begun go elsewhere. Real worker processes,
paused the way Dask's memory monitor pauses them (``worker.status = Status.paused``)."""

from __future__ import annotations

import os
import time

import pytest
from distributed import Client

import tangram_dask
from tangram_dask.scheduler import TangramSchedulerPlugin

from test_scheduler_plugin import _cpu_worker, start_cluster, wait_nodes


def _until(path: str, limit: float = 60.0) -> str:
    """Run until ``path`` exists (or ``limit`` seconds); the worker's name."""
    from distributed import get_worker
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return get_worker().name


def _where(s: float = 0.0) -> str:
    from distributed import get_worker
    time.sleep(s)
    return get_worker().name


def _set_status(status: str, dask_worker=None) -> None:
    from distributed.core import Status
    dask_worker.status = Status[status]  # what the memory monitor does (it also tells the scheduler)


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


@pytest.fixture
def cluster():
    plugin = TangramSchedulerPlugin("tangram")  # as shipped: dispatch-ahead of 2 units per node
    assert plugin.options.pipeline == 2
    workers = {"cpu-0": _cpu_worker("cpu-0", 1, 1), "cpu-1": _cpu_worker("cpu-1", 1, 1)}
    with start_cluster(plugin, workers) as c, Client(c) as client:
        client.wait_for_workers(2)
        wait_nodes(plugin, 2)
        addr = {w["name"]: a for a, w in client.scheduler_info()["workers"].items()}
        yield client, plugin, addr


def _results(futures) -> list:
    return [f.result(timeout=30) for f in futures]


def _status(plugin, addr: str) -> str:
    return plugin.scheduler.workers[addr].status.name


def test_a_paused_worker_takes_nothing_new_and_what_waits_there_moves(cluster, tmp_path):
    client, plugin, addr = cluster
    go = {name: tmp_path / f"go-{name}" for name in addr}
    with tangram_dask.action(kind="block", resource="cpu", units=1, hint_s=5.0):
        blockers = [client.submit(_until, str(go[n]), pure=False, key=f"block-{n}") for n in addr]
    _wait(lambda: len(plugin.policy.running) == 2, "both blockers granted")
    on = {r.node: aid for aid, r in plugin.policy.running.items()}
    assert set(on) == set(addr.values())  # one per worker (the most free first)
    paused = addr["cpu-0"]
    go_paused = go[on[paused].removeprefix("block-")]  # the go file of the blocker that runs there
    go_other = go[on[addr["cpu-1"]].removeprefix("block-")]
    with tangram_dask.action(kind="short", resource="cpu", units=1, hint_s=0.2):
        shorts = [client.submit(_where, 0.05, pure=False) for _ in range(4)]
    # dispatched ahead: two wait on each worker for its one slot
    _wait(lambda: len(plugin.policy.running) == 6, "the shorts granted ahead")
    assert sorted(r.node for r in plugin.policy.running.values()).count(paused) == 3
    client.run(_set_status, "paused", workers=[paused])
    _wait(lambda: paused in plugin.policy.cordoned(), "the paused worker cordoned")
    go_other.touch()  # the other worker's slot frees; the paused one's blocker runs on
    assert _results(shorts) == ["cpu-1"] * 4  # none waits on the paused worker
    assert plugin.stats.revoked == 2  # the two it held, unbegun
    assert not blockers[0].done() or not blockers[1].done()  # the paused worker's blocker still runs there
    assert _status(plugin, paused) == "paused"
    with tangram_dask.action(kind="short", resource="cpu", units=1, hint_s=0.2):
        more = [client.submit(_where, 0.05, pure=False) for _ in range(3)]
    assert _results(more) == ["cpu-1"] * 3

    # running again: it takes work again
    client.run(_set_status, "running", workers=[paused])
    _wait(lambda: not plugin.policy.cordoned(), "uncordoned")
    go_paused.touch()
    assert sorted(_results(blockers)) == ["cpu-0", "cpu-1"]
    _wait(lambda: not plugin.policy.running, "nothing running")
    with tangram_dask.action(kind="pair", resource="cpu", units=1, hint_s=1.0):
        pair = [client.submit(_where, 1.0, pure=False) for _ in range(2)]
    assert sorted(_results(pair)) == ["cpu-0", "cpu-1"]  # one on each: the most free first
    assert plugin.policy.cpu.slots_free == 2 and plugin.stats.policy_errors == 0


def test_grants_made_before_the_pause_was_heard_are_placed_again(cluster):
    """The status change reaches the plugin as an event it handles on the loop: the grants the policy made to
    the worker before that (Dask sends none to a paused worker: they wait in ``no-worker``) go back to the
    queue. Held off here by muting the event, then delivered."""
    client, plugin, addr = cluster
    paused = addr["cpu-0"]
    plugin.log_event = lambda *a, **k: None  # the event is late
    try:
        client.run(_set_status, "paused", workers=[paused])
        _wait(lambda: _status(plugin, paused) == "paused", "Dask saw the pause")
        with tangram_dask.action(kind="short", resource="cpu", units=1, hint_s=0.2):
            shorts = [client.submit(_where, 0.05, pure=False) for _ in range(4)]

        def stuck() -> list:
            tasks = plugin.scheduler.tasks
            return [f.key for f in shorts if (ts := tasks.get(f.key)) is not None and ts.state == "no-worker"
                    and (a := plugin.actions.get(f.key)) and a.grant is not None and a.grant.worker == paused]
        _wait(lambda: stuck(), "a grant on the paused worker, waiting in no-worker")
        time.sleep(0.5)
        assert stuck()  # still there: Dask will not send it
    finally:
        del plugin.log_event
    plugin.scheduler.loop.add_callback(plugin._status_changed, paused)  # the event arrives
    assert _results(shorts) == ["cpu-1"] * 4
    assert plugin.stats.revoked >= 1 and paused in plugin.policy.cordoned()
    client.run(_set_status, "running", workers=[paused])
    _wait(lambda: not plugin.policy.cordoned(), "uncordoned")
