"""Bad input cannot stop the live plugin: a small run of benchmarks/fuzz_actions.py, with assertions.

One real LocalCluster (2 worker processes, 2 slots each, the plugin with its
defaults). ~100 malformed hand-written ``tangram`` annotations, valid actions,
plain tasks and three oversized valid actions (units.min = slots + 1,
slots + pipeline, 10**6), all submitted while both workers are busy. Each
check of the benchmark is one test case; the run is shared.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


BENCH = str(ROOT / "benchmarks")


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_actions", Path(BENCH) / "fuzz_actions.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_actions"] = mod
    spec.loader.exec_module(mod)
    return mod


fuzz = _load_fuzz()


@pytest.fixture(scope="module")
def result():
    logging.getLogger("tangram_dask").setLevel(logging.CRITICAL)  # one ERROR line per erred action, by design
    # the worker processes unpickle the benchmark's functions by module name: they are spawned with
    # this process's sys.path, so benchmarks/ is on it only while the cluster starts
    sys.path.insert(0, BENCH)
    try:
        cluster, client = fuzz.start_cluster()
    finally:
        sys.path.remove(BENCH)
    try:
        yield fuzz.run_fuzz(client, n=100, seed=7, deadline_s=12.0)
    finally:
        client.close()
        cluster.close()
        logging.getLogger("tangram_dask").setLevel(logging.NOTSET)


def test_the_run_had_every_category(result):
    n = result.n_cases
    assert n["malformed"] == 100 and n["valid"] >= 40 and n["plain"] >= 20 and n["oversized"] == 3
    assert result.elastic_before == 2, "a (1,2) p=1.0 action on the idle cluster gets both units"


@pytest.mark.parametrize("check", [
    pytest.param("no worker lost", id="no-worker-lost"),
    pytest.param("malformed all err naming the field", id="malformed-err-naming-field"),
    pytest.param("valid and plain all complete with the right value", id="valid-and-plain-complete"),
    pytest.param("nothing pending at the deadline", id="nothing-waits-forever"),
    pytest.param("oversized err naming units and the largest worker", id="oversized-err-clearly"),
    pytest.param("elastic sizing unchanged", id="elastic-sizing-unchanged"),
])
def test_check(result, check):
    assert check in result.checks
    assert result.checks[check], (
        f"{check}: malformed unnamed {result.malformed_unnamed_examples}, not erred "
        f"{result.malformed_completed_examples}; valid failed {result.valid_bad_examples}; pending "
        f"{result.pending_at_deadline}; oversized {result.oversized}; elastic {result.elastic_before} -> "
        f"{result.elastic_after}; state after {result.state_after}")


@pytest.mark.parametrize("message, fields, named", [
    pytest.param("PlacementError: malformed tangram annotation on task 'k': action spec field 'units.min' = 0: "
                 "must be a whole number >= 1", ("units_min", "units.min"), True, id="specerror-dotted"),
    pytest.param("PlacementError: malformed tangram annotation on task 'k': TypeError: ActionSpec.__init__() "
                 "missing 1 required positional argument: 'kind'", ("kind",), True, id="missing-kind"),
    pytest.param("PlacementError: malformed tangram annotation on task 'hint_s': OverflowError: int too large",
                 ("hint_s",), False, id="field-only-in-task-key"),
    pytest.param("PlacementError: malformed tangram annotation on task 'k': action spec field 'zz' = 1: unknown "
                 "field; known fields are affinity, hint_s, kind", ("hint_s",), False, id="only-in-known-list"),
    pytest.param("action spec field 'units.max' = 3", ("units",), False, id="prefix-is-not-the-field"),
])
def test_names_field(message, fields, named):
    """The harness's own judge: a field counts as named outside the task key and the known-fields list."""
    assert fuzz.names_field(message, fields) is named


@pytest.mark.parametrize("message, units, clear", [
    pytest.param("action needs 3 slots on one worker; the largest worker has 2 slots", 3, True, id="clear"),
    pytest.param("the tangram tangram policy failed: OverAllocation: take 3 slots on w: the node has 2 slots", 3,
                 False, id="policy-crash-is-not-clear"),
    pytest.param("action needs 1000000 slots; no worker has that many", 10**6, False, id="no-largest-worker"),
])
def test_oversized_clear(message, units, clear):
    assert fuzz.oversized_clear(message, units) is clear
