"""pytest plugin (``-p tangram_preload``): distributed's own tests with the tangram plugin in every scheduler.

It stands in for distributed's own conftest.py (its fixtures, ``--runslow``), so that this
directory holds no conftest.py and the project's own test run collects nothing here.

``DASK_DISTRIBUTED__SCHEDULER__PRELOAD=["scheduler_plugin"]`` (set by the caller) makes every
Scheduler load the preload. This plugin imports ``distributed.utils_test`` *before* tangram_dask, as
distributed's own conftest does, so its config snapshot (which every test resets dask's config to)
holds no ``tangram:`` defaults: the preload must run on the shipped defaults alone. It counts the
plugin's starts and the preloads that failed, and writes them to ``$TANGRAM_SUITE_REPORT`` (JSON)
at the end, so the caller can check the plugin really ran.
"""

from __future__ import annotations

import json
import logging
import os

import pytest

import distributed.utils_test  # noqa: F401  (first: its config snapshot must not hold tangram's defaults)
from distributed.utils_test import *  # noqa: F401,F403  (distributed's fixtures, as its conftest.py gives them)

COUNTS = {"starts": 0, "preload_failures": 0, "snapshot_had_tangram": None}


class _FailedPreloads(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if "Failed to start preload" in record.getMessage():
            COUNTS["preload_failures"] += 1


def pytest_addoption(parser) -> None:
    parser.addoption("--runslow", action="store_true", help="run slow tests")


def pytest_collection_modifyitems(config, items) -> None:  # as distributed's conftest.py
    if config.getoption("--runslow"):
        return
    skip_slow = pytest.mark.skip(reason="need --runslow option to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


def pytest_configure(config) -> None:
    from distributed.utils_test import original_config

    config.addinivalue_line("markers", "slow: distributed's slow tests (run with --runslow)")

    COUNTS["snapshot_had_tangram"] = "tangram" in original_config
    logging.getLogger("distributed.preloading").addHandler(_FailedPreloads(level=logging.ERROR))

    from tangram_dask.scheduler import TangramSchedulerPlugin

    start = TangramSchedulerPlugin.start

    async def counting_start(self, scheduler):
        COUNTS["starts"] += 1
        return await start(self, scheduler)

    TangramSchedulerPlugin.start = counting_start


def pytest_sessionfinish(session, exitstatus) -> None:
    path = os.environ.get("TANGRAM_SUITE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(COUNTS, f)
