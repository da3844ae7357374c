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
    plugin = TangramSchedulerPlugin("tangram", api_tokens=4)  # as shipped: dispatch-ahead of 2 units per node
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
    with tangram_dask.action(kind="block", resource="cpu", units=1, hint_s=0.5):  # (hinted short: sent ahead to)
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


def _log_run(path: str, s: float) -> str:
    from distributed import get_worker
    name = get_worker().name
    with open(path, "a") as f:
        f.write(name + "\n")
    time.sleep(s)
    return name


def _flap_on_reply(go_path, dask_worker=None):
    """The memory monitor flaps while the scheduler's question is in flight: the worker answers while paused,
    runs again for a moment (it begins what waited), and pauses again before the answer lands."""
    import asyncio
    from distributed.core import Status
    orig = dask_worker.handlers["tangram_unstarted"]

    async def flapping(keys=()):
        ans = orig(keys=keys)
        dask_worker.handlers["tangram_unstarted"] = orig  # once
        open(go_path, "w").close()  # the blocker there ends about now
        await asyncio.sleep(0.1)
        dask_worker.status = Status.running  # tells the scheduler; the worker begins the task that waited
        await asyncio.sleep(0.5)
        dask_worker.status = Status.paused   # and pauses again; the answer above is now stale
        await asyncio.sleep(0.2)
        return ans
    dask_worker.handlers["tangram_unstarted"] = flapping


def test_an_answer_made_stale_by_a_flap_moves_nothing_and_nothing_runs_twice(cluster, tmp_path):
    """The worker answers which actions it has not begun, runs again for a moment (it begins the victim), and
    pauses again before the answer lands: the answer is dropped (the worker's status changed while it was out),
    and the victim runs once. Found by the review of session 32: the answer moved the running victim, which
    then ran on both workers."""
    client, plugin, addr = cluster
    go = {i: tmp_path / f"go-{i}" for i in range(2)}
    with tangram_dask.action(kind="block", resource="cpu", units=1, hint_s=0.5):  # (hinted short: sent ahead to)
        blockers = [client.submit(_until, str(go[i]), 8.0, pure=False, key=f"block-{i}") for i in range(2)]
    _wait(lambda: len(plugin.policy.running) == 2, "both blockers granted")
    runs = tmp_path / "runs"
    with tangram_dask.action(kind="short", resource="cpu", units=1, hint_s=0.2):
        f = client.submit(_log_run, str(runs), 1.0, pure=False, key="victim")
    _wait(lambda: "victim" in plugin.policy.running, "victim granted ahead")
    victim_on = plugin.policy.running["victim"].node
    # the victim's worker's blocker must end for the victim to begin in the flap: let that one go via its file
    block_on = {r.node: aid for aid, r in plugin.policy.running.items() if aid.startswith("block")}
    mine = go[int(block_on[victim_on][-1])]
    theirs = go[1 - int(block_on[victim_on][-1])]
    client.run(_flap_on_reply, str(mine), workers=[victim_on])
    trace = []
    orig_sc, orig_mu = plugin._status_changed, plugin._move_unstarted
    def sc(a):
        trace.append(("status", plugin.scheduler.workers[a].status.name, time.monotonic()))
        return orig_sc(a)
    async def mu(a, keys, *rest):
        trace.append(("ask", list(keys), time.monotonic()))
        r = await orig_mu(a, keys, *rest)
        ts = plugin.scheduler.tasks.get("victim")
        trace.append(("answered", ts.state if ts else None, plugin.stats.revoked, time.monotonic()))
        return r
    plugin._status_changed, plugin._move_unstarted = sc, mu
    client.run(_set_status, "paused", workers=[victim_on])
    _wait(lambda: victim_on in plugin.policy.cordoned(), "cordoned")
    theirs.touch()  # the other worker frees its slot: the moved victim can run there
    assert f.result(timeout=30) in ("cpu-0", "cpu-1")
    time.sleep(2.0)
    lines = runs.read_text().split()
    assert trace[0][:2] == ("status", "paused") and any(t[0] == "answered" for t in trace)
    assert len(lines) == 1, f"the action ran {len(lines)} times: {lines}"
    assert sorted(_results(blockers)) == ["cpu-0", "cpu-1"]


def test_api_calls_sent_to_a_paused_worker_run_elsewhere(cluster, tmp_path):
    """API actions are granted tokens, not a worker: Dask sends each to a CPU worker, where it waits for a thread.
    Those waiting on the worker that pauses are moved, and run on the other (found by the review of session 32:
    they waited there, holding their tokens, until it ran again)."""
    client, plugin, addr = cluster
    go = {i: tmp_path / f"go-{i}" for i in range(2)}
    with tangram_dask.action(kind="block", resource="cpu", units=1, hint_s=0.5):  # (hinted short: sent ahead to)
        blockers = [client.submit(_until, str(go[i]), 60.0, pure=False, key=f"block-{i}") for i in range(2)]
    _wait(lambda: len(plugin.policy.running) == 2, "both blockers granted")
    with tangram_dask.action(kind="search", resource="api", units=1, hint_s=0.1):
        calls = [client.submit(time.sleep, 0.05, pure=False, key=f"call-{i}") for i in range(4)]
    sched = plugin.scheduler
    _wait(lambda: all((ts := sched.tasks.get(f"call-{i}")) is not None and ts.state == "processing"
                      for i in range(4)), "the calls sent to workers")
    where = {f"call-{i}": sched.tasks[f"call-{i}"].processing_on.address for i in range(4)}
    paused = addr["cpu-0"]
    assert paused in where.values()
    client.run(_set_status, "paused", workers=[paused])
    _wait(lambda: paused in plugin.policy.cordoned(), "cordoned")
    for i in range(2):
        go[i].touch()  # both blockers end: cpu-1 is idle, cpu-0 paused
    try:
        assert [c.result(timeout=20) for c in calls] == [None] * 4
        assert plugin.stats.revoked == 2 and plugin.policy.api.total_free == 4
        assert sorted(_results(blockers)) == ["cpu-0", "cpu-1"]
    finally:
        client.run(_set_status, "running", workers=[paused])


def test_an_action_still_on_its_way_to_the_worker_when_it_pauses_moves_once_it_arrives(cluster, tmp_path):
    """The victim's compute-task message is still on the scheduler's batched stream (held 1 s here, as batching
    and a busy loop can) when the question reaches the paused worker: the worker does not hold the key yet, so
    the plugin asks again, and moves it once it has arrived. Found by the review of session 32: it was not named
    unstarted, arrived, and waited there for as long as the worker stayed paused."""
    client, plugin, addr = cluster
    sched = plugin.scheduler
    go = {i: tmp_path / f"go-{i}" for i in range(2)}
    with tangram_dask.action(kind="block", resource="cpu", units=1, hint_s=0.5):  # (hinted short: sent ahead to)
        blockers = [client.submit(_until, str(go[i]), 60.0, pure=False, key=f"block-{i}") for i in range(2)]
    _wait(lambda: len(plugin.policy.running) == 2, "both blockers granted")
    _wait(lambda: all(sched.tasks[f"block-{i}"].state == "processing" for i in range(2)), "blockers sent")
    time.sleep(0.5)

    def delay_compute(bs):
        orig = bs.send

        def send(*msgs):
            if any(isinstance(m, dict) and m.get("op") == "compute-task" for m in msgs):
                sched.loop.call_later(1.0, orig, *msgs)
            else:
                orig(*msgs)
        bs.send = send
    for a in addr.values():
        sched.loop.add_callback(delay_compute, sched.stream_comms[a])
    time.sleep(0.2)
    with tangram_dask.action(kind="short", resource="cpu", units=1, hint_s=0.2):
        f = client.submit(_where, 0.05, pure=False, key="victim")
    _wait(lambda: "victim" in plugin.policy.running, "victim granted ahead")
    victim_on = plugin.policy.running["victim"].node
    client.run(_set_status, "paused", workers=[victim_on])
    _wait(lambda: victim_on in plugin.policy.cordoned(), "cordoned")
    for i in range(2):
        go[i].touch()
    try:
        ran_on = f.result(timeout=20)
        assert addr[ran_on] != victim_on and plugin.stats.revoked == 1
        assert len(_results(blockers)) == 2
    finally:
        client.run(_set_status, "running", workers=[victim_on])
