"""The worker's residency ledger when a load is given up on or its replica dropped while it loads (found by a
helper's review of session 32's load deadline; each test failed before its fix): bytes are given back once, and a
load beside a stalled loader is not measured with what that loader allocates."""
from __future__ import annotations

import threading
import time

import pytest

from tangram_dask.errors import ModelError
from tangram_dask.models import ModelEntry, Residency
from tangram_dask.models.builtin import NumpyLoader
from test_residency import ledger, weights


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weights")
    return {m: weights(tmp, m, rows) for m, rows in (("small", 1000), ("mid", 2000), ("big", 3000))}


class Gate:
    """A loader that blocks until ``go`` is set, then raises or loads."""

    def __init__(self, path, go, fail=False):
        self.inner, self.go, self.fail = NumpyLoader(path), go, fail
        self.started = threading.Event()

    def __call__(self, devices):
        self.started.set()
        self.go.wait(30)
        if self.fail:
            raise OSError("download failed")
        return self.inner(devices)


def _wait(pred, t=10):
    dl = time.monotonic() + t
    while not pred():
        assert time.monotonic() < dl
        time.sleep(0.01)


def test_a_hung_load_of_a_replica_dropped_under_a_reused_id_frees_its_bytes_once(files):
    """Replica 0 loads ahead and stalls; a grant names replica 0 as another model (a stale id, after a scheduler
    restart), so it is dropped while loading; at the deadline and when the stalled loader returns, its bytes are
    not given back again (before: `used` went negative)."""
    go = threading.Event()
    _, big = files["big"]
    _, small = files["small"]
    stall = Gate(files["big"][0], go)
    res = ledger(files, [600_000], timeout_s=0.5, loaders={"big": stall})
    res.load_ahead(0, "big", (0,))
    assert stall.started.wait(5)
    assert res.used == [big]
    res.prepare("k", 0, "small", (0,))          # the same id, another model: the loading replica is dropped
    assert res.get("k", timeout=10).score([("x", "x")])
    _wait(lambda: res._hung)                   # the old load's deadline passed: its estimate "stays counted"
    print("after deadline: used", res.used, "hung", res._hung)
    go.set()
    _wait(lambda: not res._hung)
    print("after the stalled loader returned: used", res.used)
    res.close()
    assert res.used == [small]


def test_a_loader_that_raises_after_its_replica_was_dropped_frees_its_bytes_once(files):
    """The same without a deadline: a loader that raises after its replica was dropped gives nothing back twice."""
    go = threading.Event()
    _, small = files["small"]
    bad = Gate(files["big"][0], go, fail=True)
    res = ledger(files, [600_000, 600_000], loaders={"big": bad})
    res.load_ahead(0, "big", (0,))
    assert bad.started.wait(5)
    res.prepare("k", 0, "small", (1,))
    assert res.get("k", timeout=10).score([("x", "x")])
    go.set()
    _wait(lambda: res.stats.failures == 1)
    print("used", res.used, "expected", [0, small])
    res.close()
    assert res.used == [0, small]


class FakeCuda:
    """A probe over one fake device counter (what torch.cuda.memory_allocated would say)."""

    name = "cuda"

    def __init__(self):
        self.allocated = 0
        self.lock = threading.Lock()

    def before(self, devices):
        return self.allocated

    def after(self, devices, token):
        return [max(0, self.allocated - token)]

    def freed(self, devices):
        pass


def test_a_load_beside_a_hung_loader_is_measured_by_its_parameter_bytes(files):
    """After a deadline the GPU lock is released while the given-up loader runs on; a load beside it does not
    trust CUDA's counters (they mix the two) and counts its parameter bytes instead (before: counted at 3x)."""
    probe = FakeCuda()
    go_hung, hung_allocated = threading.Event(), threading.Event()
    OWN, STALLED = 100_000, 200_000

    class Scorer:
        def __init__(self, n):
            self.param_bytes = n

        def score(self, batch):
            return [0.0] * len(batch)

    def stalled(devices):
        go_hung.wait(30)
        probe.allocated += STALLED  # the download resumed: weights go to the GPU
        hung_allocated.set()
        return Scorer(STALLED)

    def next_loader(devices):
        probe.allocated += OWN
        hung_allocated.wait(10)  # the stalled loader allocates while this load is measured
        return Scorer(OWN)

    entries = {"big": ModelEntry("big", stalled, 200_000, 0.3), "small": ModelEntry("small", next_loader, 100_000, 5)}
    res = Residency([1_000_000], entries.__getitem__, lambda g: ("cuda:0",) * len(g), probe=probe)
    res.prepare("a", 0, "big", (0,))
    with pytest.raises(ModelError, match="did not return"):
        res.get("a", timeout=5)
    res.unpin("a")
    res.prepare("b", 1, "small", (0,))
    threading.Timer(0.2, go_hung.set).start()
    res.get("b", timeout=10)
    _wait(lambda: not res._hung)
    probe.allocated -= STALLED  # what the stalled loader returned was dropped: its memory is freed
    print("replica 1 counted at", res.replicas[1].bytes_per_gpu, "its own size", OWN, "used", res.used,
          "real", probe.allocated)
    res.close()
    assert res.replicas[1].bytes_per_gpu == OWN
