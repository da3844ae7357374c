"""``emit``: tangram decisions as Dask events, on a real scheduler (no workers needed)."""

from __future__ import annotations

import asyncio
import time

import pytest
from distributed import Client, Scheduler

from tangram_dask.dashboard import EVENT_KINDS, EVENT_TOPIC, emit


def test_emit_logs_under_tangram_and_all_but_placements_and_admissions_for_the_events_page():
    async def main() -> None:
        async with Scheduler(dashboard_address=":0", port=0) as s, \
                Client(s.address, asynchronous=True) as c:
            got: list = []
            c.subscribe_topic(EVENT_TOPIC, got.append)
            # the subscription travels on the client's batched stream; an event emitted before the scheduler
            # registered it is never sent to the client (got stays empty): wait for it, not a fixed 0.1 s
            deadline = time.monotonic() + 30
            while c.id not in s._broker._topics[EVENT_TOPIC].subscribers:
                assert time.monotonic() < deadline, "the scheduler never registered the client's subscription"
                await asyncio.sleep(0.01)
            emit(s, "placement", key=("work", 3), kind="code_exec", worker="tcp://w:1", units=2, gpus=[])
            emit(s, "eviction", key="k", worker="tcp://w:2", replicas=[4])
            emit(s, "admission", trajectory="t-7", waited_s=1.5)
            tangram = [m for _, m in await c.get_events(EVENT_TOPIC)]
            assert tangram == [
                {"action": "tangram-placement", "key": "('work', 3)", "kind": "code_exec", "worker": "tcp://w:1",
                 "units": 2, "gpus": ()},
                {"action": "tangram-eviction", "key": "k", "worker": "tcp://w:2", "replicas": (4,)},  # msgpack: tuples
                {"action": "tangram-admission", "trajectory": "t-7", "waited_s": 1.5}]
            # not placements nor admissions: of ours, only the eviction is there
            on_all = [m.get("action") for _, m in await c.get_events("all") if isinstance(m, dict)]
            assert [a for a in on_all if str(a).startswith("tangram-")] == ["tangram-eviction"]
            for _ in range(50):
                if len(got) == 3:
                    break
                await asyncio.sleep(0.05)
            assert [m["action"] for _, m in got] == ["tangram-placement", "tangram-eviction", "tangram-admission"]
            with pytest.raises(ValueError, match="must be one of placement, load, eviction, rejection, error, admis"):
                emit(s, "placed")
    asyncio.run(main())
    assert EVENT_KINDS == ("placement", "load", "eviction", "rejection", "error", "admission")
