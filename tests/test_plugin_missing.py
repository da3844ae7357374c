"""Actions sent to a scheduler without the tangram plugin: a clear PluginMissingError with the fix.

Without the plugin Dask would run annotated tasks as plain tasks (no
placement, no grant) and say nothing. The check is one scheduler RPC per
client and scheduler; a positive answer is cached by scheduler address.
"""

from __future__ import annotations

import asyncio
import logging

import dask
import pytest
from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask import annotate
from tangram_dask.errors import PluginMissingError, TangramError
from tangram_dask.scheduler import TangramSchedulerPlugin

FIX = ("dask scheduler --preload scheduler_plugin", "client.register_plugin(tangram_dask.TangramSchedulerPlugin())")


def _cluster(**scheduler_kwargs) -> LocalCluster:
    return LocalCluster(n_workers=1, threads_per_worker=1, processes=False, resources={"slots": 1},
                        dashboard_address=":0", scheduler_kwargs=scheduler_kwargs)


@pytest.fixture
def plain():
    """A LocalCluster whose scheduler has no tangram plugin, and a client on it."""
    with _cluster() as cluster, Client(cluster) as client:
        yield client


def _with_action(client: Client):
    with tangram_dask.action(kind="k", resource="cpu"):
        return client.submit(abs, -1, pure=False)


def _with_submit_action(client: Client):
    return tangram_dask.submit_action(client, abs, -1, kind="k", pure=False)


def _with_check_plugin(client: Client):
    return tangram_dask.check_plugin(client)


CALLS = [("action", _with_action), ("submit_action", _with_submit_action), ("check_plugin", _with_check_plugin)]


@pytest.mark.parametrize("call", [c[1] for c in CALLS], ids=[c[0] for c in CALLS])
def test_no_plugin_raises_with_the_fix_and_submits_nothing(plain, call, monkeypatch):
    submitted = []
    real_submit = plain.submit
    monkeypatch.setattr(plain, "submit", lambda *a, **kw: submitted.append(a) or real_submit(*a, **kw))
    with pytest.raises(PluginMissingError) as info:
        call(plain)
    assert submitted == []  # refused before anything was submitted (the scheduler's view below may lag)
    msg = str(info.value)
    assert plain.scheduler.address in msg
    assert all(fix in msg for fix in FIX), msg
    assert isinstance(info.value, TangramError)
    assert plain.scheduler_info()["id"] and not plain.run_on_scheduler(lambda dask_scheduler: dask_scheduler.tasks)


def test_the_check_leaves_no_traceback_in_the_scheduler_log(plain, caplog):
    # asked by calling the handler, a scheduler without it logged distributed's "No handler tangram_snapshot
    # found" with a KeyError traceback on every annotated submit; the handler table is read instead
    with caplog.at_level(logging.DEBUG, logger="distributed"):
        for _ in range(2):
            with pytest.raises(PluginMissingError):
                _with_action(plain)
    noisy = [r.getMessage() for r in caplog.records if "No handler" in r.getMessage() or r.exc_info]
    assert noisy == []


def test_where_run_on_scheduler_fails_the_handler_is_asked(plain, caplog, monkeypatch):
    # a scheduler that will not run the function (distributed once let pickling be turned off): the check calls
    # the handler, as before, and answers the same
    async def refused(*args, **kwargs):
        raise ValueError("Cannot run function as the scheduler has been explicitly disallowed from pickle")

    monkeypatch.setattr(plain, "_run_on_scheduler", refused)
    with caplog.at_level(logging.WARNING, logger="distributed.core"):
        with pytest.raises(PluginMissingError):
            _with_action(plain)
    assert any("No handler tangram_snapshot" in r.getMessage() for r in caplog.records)
    plain.register_plugin(TangramSchedulerPlugin("fifo"))
    assert _with_action(plain).result(timeout=30) == 1


def test_with_the_plugin_actions_run_and_the_answer_is_cached(monkeypatch):
    asked = []
    real = annotate._scheduler_has_plugin

    async def counting(client):
        asked.append(client.scheduler.address)
        return await real(client)

    monkeypatch.setattr(annotate, "_scheduler_has_plugin", counting)
    with _cluster(plugins=[TangramSchedulerPlugin("fifo")]) as cluster, Client(cluster) as client:
        futs = [_with_action(client), _with_submit_action(client), _with_action(client)]
        assert [f.result(timeout=30) for f in futs] == [1, 1, 1]
        assert asked == [client.scheduler.address]  # one RPC for three actions
        assert client.scheduler.address in annotate._HAS_PLUGIN


def test_a_plugin_registered_after_the_first_refusal_is_found(plain):
    with pytest.raises(PluginMissingError):
        _with_action(plain)
    plain.register_plugin(TangramSchedulerPlugin("fifo"))
    assert _with_action(plain).result(timeout=30) == 1


def test_a_preload_that_failed_to_start_is_reported_at_the_first_action(caplog):
    # a bad config makes the preload fail; distributed only logs "Failed to start preload" and serves on
    with dask.config.set({"tangram.scheduler.polcy": "fifo"}), \
            caplog.at_level(logging.ERROR, logger="distributed.preloading"):
        with _cluster(preload=["scheduler_plugin"]) as cluster, Client(cluster) as client:
            assert "tangram" not in cluster.scheduler.plugins
            # the preload did fail, for the bad key (not: it never ran, or installed nothing)
            failed = [r for r in caplog.records if "Failed to start preload" in r.getMessage()]
            assert failed and failed[0].exc_info and "tangram.scheduler.polcy" in str(failed[0].exc_info[1]), \
                [r.getMessage() for r in caplog.records]
            with pytest.raises(PluginMissingError, match="Failed to start preload") as info:
                _with_action(client)
            assert client.scheduler.address in str(info.value)


def test_an_asynchronous_client_awaits_the_check():
    async def main():
        async with LocalCluster(n_workers=0, processes=False, asynchronous=True, dashboard_address=":0") as cluster:
            async with Client(cluster, asynchronous=True) as client:
                with pytest.raises(PluginMissingError):
                    await tangram_dask.check_plugin(client)
                await client.register_plugin(TangramSchedulerPlugin("fifo"))
                assert await tangram_dask.check_plugin(client) is None

    asyncio.run(main())


def test_without_any_client_the_annotation_is_made_unchecked():
    from distributed.client import _get_global_client

    assert _get_global_client() is None
    with tangram_dask.action(kind="k") as spec:
        assert dask.get_annotations()["tangram"] == spec.to_dict()
