"""The plugin's pure parts: declarations, grants, topology groups, options, annotation parsing."""

from __future__ import annotations

import logging
import pickle

import pytest

from tangram_dask import SpecError
from tangram_dask.allocation import Allocation
from tangram_dask.cluster import ModelSpec
from tangram_dask.messages import Grant, WorkerDeclaration
from tangram_dask.scheduler import PluginOptions, TangramSchedulerPlugin, parse_annotation
from tangram_dask.workers import declare, groups_from_links


def _links(pairs):
    s = {tuple(sorted(p)) for p in pairs}
    return lambda i, j: (i, j) in s


@pytest.mark.parametrize("name, n, pairs, groups, order", [
    ("no links: one group each", 2, [], (1, 1), (0, 1)),
    ("two NVLink islands", 4, [(0, 1), (2, 3)], (2, 2), (0, 1, 2, 3)),
    ("interleaved islands are renumbered", 4, [(0, 2), (1, 3)], (2, 2), (0, 2, 1, 3)),
    ("all linked", 4, [(0, 1), (1, 2), (2, 3)], (4,), (0, 1, 2, 3)),
])
def test_groups_from_links(name, n, pairs, groups, order):
    assert groups_from_links(n, _links(pairs)) == (groups, order)


def test_declare_falls_back_to_config_with_a_log_line(caplog):
    cfg = {"nvml": True, "gpus": 4, "gpu-groups": [2, 2], "gpu-memory-gb": 40}
    with caplog.at_level(logging.INFO, logger="tangram_dask.workers"):
        d = declare({"gpus": 4}, cfg)
    assert (d.gpus, d.groups, d.gpu_memory_gb, d.source) == (4, (2, 2), 40.0, "config")
    assert "declared from config" in caplog.text  # this machine has no NVML


@pytest.mark.parametrize("name, resources, cfg, role, slots, api", [
    ("cpu from --resources", {"slots": 8}, {"nvml": False}, "cpu", 8, 0),
    ("cpu from config", {}, {"nvml": False, "slots": 4}, "cpu", 4, 0),
    ("api worker", {"api": 3}, {"nvml": False}, "api", 0, 3),
    ("underscored env keys", {}, {"nvml": False, "gpus": 2, "gpu_groups": [1, 1], "gpu_memory_gb": 80},
     "gpu", 0, 0),
])
def test_declare_roles(name, resources, cfg, role, slots, api):
    d = declare(resources, cfg)
    assert (d.role, d.slots, d.api) == (role, slots, api)


def test_messages_round_trip():
    d = WorkerDeclaration(slots=0, gpus=4, gpu_memory_gb=80, groups=(2, 2), source="nvml", device_ids=(0, 2, 1, 3))
    assert WorkerDeclaration.from_msg(d.to_msg()) == d
    g = Grant(2, "tcp://a:1", "tcp://a:1", (2, 3), 7, True, (1,), False, False, "warm", 10.0, (1, 3))
    assert Grant.from_msg(g.to_msg()) == g
    moved = Grant(1, "tcp://b:1", "tcp://b:1", restore=True, restore_from="tcp://a:1")
    assert Grant.from_msg(moved.to_msg()) == moved
    assert Allocation.from_annotation({"grant": moved.to_msg()}).restore_from == "tcp://a:1"
    with pytest.raises(ValueError, match="sum to gpus"):
        WorkerDeclaration(gpus=4, groups=(2, 1))


def test_allocation_reads_the_grant():
    g = Grant(2, "tcp://a:1", "tcp://a:1", (2, 3), 7, load=True, setup_s=10.0)
    a = Allocation.from_annotation({"kind": "judge", "resource": "gpu", "model": "rm", "grant": g.to_msg()})
    assert (a.units, a.gpus, a.replica, a.load, a.setup_s) == (2, (2, 3), 7, True, 10.0)
    assert a.cuda_visible_devices == "2,3"
    assert a.env() == {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def test_parse_annotation_ignores_the_grant_and_names_bad_fields():
    spec = parse_annotation({"kind": "x", "resource": "cpu", "grant": {"units": 1}})
    assert spec.kind == "x"
    with pytest.raises(SpecError, match="units.min"):
        parse_annotation({"kind": "x", "resource": "cpu", "units_min": 0})
    with pytest.raises(SpecError, match="mapping"):
        parse_annotation("oops")


def test_options_reject_what_the_live_plugin_cannot_run():
    with pytest.raises(ValueError, match="static"):
        PluginOptions(policy="static")
    with pytest.raises(ValueError, match="time-scale"):
        PluginOptions(time_scale=0)


def test_options_from_dask_config():
    import dask
    with dask.config.set({"tangram.scheduler.api-tokens": 3, "tangram.scheduler.policy": "fifo",
                          "tangram.scheduler.models": {"rm": {"gpu_memory_gb": 16, "load_s": 5}}}):
        o = PluginOptions.from_config()
    assert (o.api_tokens, o.policy, o.models["rm"]) == (3, "fifo", ModelSpec("rm", 16, 5))


def test_the_plugin_pickles_as_its_options():
    p = TangramSchedulerPlugin("fifo", api_tokens=2)
    q = pickle.loads(pickle.dumps(p))
    assert q.options == p.options and q.scheduler is None and q.actions == {}


def test_grant_wire_form_is_a_compact_tuple_and_round_trips():
    """The grant travels as a tuple of its fields (Dask logs recent compute-task messages; a dict cost
    ~700 B per action there); the parser also reads the fields by name, and a short tuple takes defaults."""
    g = Grant(2, "n", "tcp://w:1", (0, 1), 3, True, (4,), True, True, "cold", 1.5, (1, 0), "tcp://v:2")
    msg = g.to_msg()
    assert isinstance(msg, tuple) and len(msg) == 13
    assert Grant.from_msg(msg) == g
    assert Grant.from_msg(list(msg)) == g  # what msgpack delivers
    assert Grant.from_msg({"units": 2, "node": "n", "gpus": [0, 1], "replica": 3}) == Grant(2, "n", gpus=(0, 1),
                                                                                              replica=3)
    assert Grant.from_msg((1, "n")) == Grant(1, "n")
    with pytest.raises(ValueError, match="units"):
        Grant.from_msg({"node": "n"})


def test_granted_reads_the_grant_beside_the_spec():
    from tangram_dask.messages import GRANT_KEY, granted
    g = Grant(1, "n", "tcp://w:1")
    assert granted({"tangram": {"kind": "k"}, GRANT_KEY: g.to_msg()}) == g
    assert granted({"tangram": {"kind": "k"}}) is None and granted(None) is None
    a = Allocation.from_annotation({"kind": "k", "resource": "cpu"}, g.to_msg())
    assert (a.units, a.worker, a.kind) == (1, "tcp://w:1", "k")
