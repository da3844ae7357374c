"""GPU facts a worker declares: NVML discovery under CUDA_VISIBLE_DEVICES, and config without NVML.

This machine has no GPU, so NVML is replaced by :class:`FakeNvml`, a table of
GPUs answering the calls ``tangram_dask.workers.discover`` makes (the only
fake: the device). tests/test_gpu.py runs the same discovery on real NVML
where a GPU is lent.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from tangram_dask.errors import ConfigError
from tangram_dask.workers import declare, declare_facts, discover, parse_visible_devices

GB = 10**9


class FakeNvml:
    """``n`` GPUs; ``links`` NVLink pairs; ``mig`` maps a MIG UUID to (parent index, memory)."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self, n: int, links=(), mem_gb=80, mig=None):
        self.n = n
        self.uuids = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(n)]
        self.links = [[] for _ in range(n)]
        for a, b in links:
            self.links[a].append(b)
            self.links[b].append(a)
        self.mem = mem_gb
        self.mig = mig or {}
        self.inits = 0

    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.n

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        if uuid not in self.mig:
            raise LookupError("NVML_ERROR_NOT_FOUND")
        return ("mig", uuid)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h):
        return ("gpu", self.mig[h[1]][0])

    def nvmlDeviceGetUUID(self, h):
        return self.uuids[h[1]] if h[0] == "gpu" else h[1]

    def nvmlDeviceGetMemoryInfo(self, h):
        gb = self.mem if h[0] == "gpu" else self.mig[h[1]][1]
        return SimpleNamespace(total=int(gb * GB))

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=f"0000:{h[1] + 16:02x}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, h, link):
        if link >= len(self.links[h[1]]):
            raise LookupError("no such link")
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return self.nvmlDeviceGetPciInfo(("gpu", self.links[h[1]][link]))

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 50

    def nvmlDeviceGetName(self, h):
        return b"Fake H100"


def four():
    return FakeNvml(4, links=[(0, 2), (1, 3)])  # interleaved islands {0, 2} and {1, 3}


@pytest.mark.parametrize("name, visible, gpus, groups, device_ids, ordinals", [
    ("unset: every GPU, islands renumbered", None, 4, (2, 2), (0, 2, 1, 3), (0, 2, 1, 3)),
    ("indices 2,3: only those two", "2,3", 2, (1, 1), (2, 3), (0, 1)),
    ("indices 3,1: CUDA's order is the list's", "3,1", 2, (2,), (3, 1), (0, 1)),
    ("an island by index", "0,2", 2, (2,), (0, 2), (0, 1)),
    ("by UUID", "GPU-00000003-aaaa-bbbb-cccc-000000000003", 1, (1,), (3,), (0,)),
    ("by UUID prefix", "GPU-00000002", 1, (1,), (2,), (0,)),
    ("an index past the last stops the list", "1,7,2", 1, (1,), (1,), (0,)),
])
def test_discovery_honours_cuda_visible_devices(name, visible, gpus, groups, device_ids, ordinals):
    f, why = discover(visible, nvml=four(), env=False)
    assert f is not None, why
    d = f.declaration
    assert (d.gpus, d.groups, d.device_ids, f.cuda_ordinals) == (gpus, groups, device_ids, ordinals)
    assert d.device_uuids == tuple(four().uuids[i] for i in device_ids)
    assert d.source == "nvml" and d.gpu_memory_gb == 80


def test_mig_instances_are_gpus_of_their_own_with_their_own_memory():
    nv = FakeNvml(2, mig={"MIG-aaaa-1": (1, 10), "MIG-aaaa-2": (1, 20)})
    f, why = discover("MIG-aaaa-1,MIG-aaaa-2", nvml=nv, env=False)
    d = f.declaration
    assert (d.gpus, d.groups, d.device_ids, d.device_uuids) == (2, (1, 1), (1, 1), ("MIG-aaaa-1", "MIG-aaaa-2"))
    assert d.gpu_memory_gb == 10 and f.memory_bytes == (10 * GB, 20 * GB)


@pytest.mark.parametrize("name, visible, match", [
    ("not an index or a UUID", "0,gpu1", "neither a device index"),
    ("an ambiguous UUID prefix", "GPU-0000000", "matches 4"),
    ("an unknown MIG device", "MIG-nope", "not found through NVML"),
    ("a device twice", "1,1", "twice"),
])
def test_bad_cuda_visible_devices_is_a_clear_error(name, visible, match):
    with pytest.raises(ConfigError, match=match) as e:
        discover(visible, nvml=four(), env=False)
    assert e.value.key == "CUDA_VISIBLE_DEVICES"


@pytest.mark.parametrize("visible, why", [("", "names no GPU"), ("5", "names no GPU"), ("-1", "names no GPU")])
def test_cuda_visible_devices_naming_no_gpu(visible, why):
    f, reason = discover(visible, nvml=four(), env=False)
    assert f is None and why in reason


def test_parse_visible_devices():
    assert parse_visible_devices(None) is None
    assert parse_visible_devices("") == []
    assert parse_visible_devices(" 2, GPU-ab ,MIG-cd") == [2, "GPU-ab", "MIG-cd"]
    assert parse_visible_devices("0,-1,2") == [0]  # CUDA: a negative index ends the list


def test_declare_takes_nvml_facts_and_warns_on_a_resources_mismatch(caplog):
    with caplog.at_level(logging.WARNING, logger="tangram_dask.workers"):
        d, f = declare_facts({"gpus": 4}, {"nvml": True}, nvml=four(), visible="2,3")
    assert (d.gpus, d.device_ids, d.source) == (2, (2, 3), "nvml")
    assert "--resources gpus=4 but NVML finds 2" in caplog.text


@pytest.mark.parametrize("resources, cfg", [({"slots": 2}, {"nvml": True}), ({}, {"nvml": True, "slots": 4}),
                                            ({"api": 8}, {"nvml": True})])
def test_a_sandbox_or_api_worker_on_a_gpu_host_does_not_claim_the_hosts_gpus(resources, cfg, caplog):
    """Session 29 on the H200: the demo's two sandbox workers each found the GPU through NVML, so the plugin took
    three GPU nodes and no CPU node, and every code action waited for a CPU worker that never came."""
    nv = four()
    with caplog.at_level(logging.INFO, logger="tangram_dask.workers"):
        d, f = declare_facts(resources, cfg, nvml=nv, visible="0,1,2,3")
    assert (d.gpus, d.slots, d.api, d.source, f) == (0, resources.get("slots", cfg.get("slots", 0)),
                                                     resources.get("api", 0), "resources", None)
    assert nv.inits == 0 and "a CPU worker" in caplog.text and "NVML is not asked" in caplog.text
    # the same host's GPU worker, and one that says it has both, still find them
    assert declare_facts({"gpus": 4}, {"nvml": True}, nvml=four(), visible="0,1,2,3")[0].gpus == 4
    assert declare_facts({"slots": 2, "gpus": 4}, {"nvml": True}, nvml=four(), visible="0,1,2,3")[0].gpus == 4
    assert declare_facts({}, {"nvml": True}, nvml=four(), visible="0,1,2,3")[0].gpus == 4


@pytest.mark.parametrize("cfg, gb", [({}, 72.0), ({"gpu-memory-fraction": 0.5}, 40.0),
                                     ({"gpu-memory-fraction": 1}, 80.0)])
def test_models_may_hold_a_fraction_of_an_nvml_gpus_memory(cfg, gb):
    """The rest is the process's: the CUDA context, cuBLAS's workspace (33 MiB on an H200), activations."""
    d, f = declare_facts({}, {"nvml": True, **cfg}, nvml=four(), visible="0")
    assert d.gpu_memory_gb == gb and f.memory_bytes == (80 * GB,)


@pytest.mark.parametrize("frac", [0, 1.5, -0.1])
def test_a_gpu_memory_fraction_outside_0_1_is_a_clear_error(frac):
    with pytest.raises(ConfigError, match="tangram.worker.gpu-memory-fraction"):
        declare_facts({}, {"nvml": True, "gpu-memory-fraction": frac}, nvml=four(), visible="0")


# -- without NVML (the cases) --------------------------------------------------------
def test_resources_gpus_without_nvml_declares_them():
    d = declare({"gpus": 2}, {"nvml": False, "gpus": 0, "gpu-memory-gb": 40})
    assert (d.gpus, d.gpu_memory_gb, d.groups, d.source) == (2, 40.0, (2,), "resources")


@pytest.mark.parametrize("name, resources, cfg, key", [
    ("config gpus without memory (None, the shipped default)", {}, {"nvml": False, "gpus": 2,
                                                                    "gpu-memory-gb": None},
     "tangram.worker.gpu-memory-gb"),
    ("--resources gpus without memory", {"gpus": 2}, {"nvml": False}, "tangram.worker.gpu-memory-gb"),
    ("memory not a number", {}, {"nvml": False, "gpus": 1, "gpu-memory-gb": "lots"}, "tangram.worker.gpu-memory-gb"),
    ("memory zero", {}, {"nvml": False, "gpus": 1, "gpu-memory-gb": 0}, "tangram.worker.gpu-memory-gb"),
    ("groups that do not sum", {}, {"nvml": False, "gpus": 4, "gpu-memory-gb": 8, "gpu-groups": [2, 1]},
     "tangram.worker.gpu-groups"),
])
def test_gpu_config_errors_name_the_key(name, resources, cfg, key):
    with pytest.raises(ConfigError) as e:
        declare(resources, cfg)
    assert e.value.key == key and "tangram.worker" in str(e.value)


class NoNvml:
    def nvmlInit(self):
        raise RuntimeError("NVML Shared Library Not Found")


def test_nvml_absent_falls_back_to_config_saying_why(caplog):
    with caplog.at_level(logging.INFO, logger="tangram_dask.workers"):
        d = declare({}, {"nvml": True, "gpus": 2, "gpu-memory-gb": 24}, nvml=NoNvml())
    assert (d.gpus, d.source) == (2, "config")
    assert "NVML is not available (RuntimeError)" in caplog.text and "declared from config" in caplog.text


@pytest.mark.parametrize("count, declared, warns", [
    (lambda: 1, 2, True),    # the H200 machine: 2 abstract GPUs, 1 real one
    (lambda: 4, 2, False),   # the ids are real devices
    (lambda: 0, 2, False),   # NVML (or distributed's monitor) off: nothing reads them but the action
    (lambda: 1 / 0, 2, False),
])
def test_abstract_gpus_beyond_what_nvml_sees_are_named_in_a_warning(count, declared, warns):
    from tangram_dask.workers import abstract_gpus_warning
    d = declare({}, {"nvml": False, "gpus": declared, "gpu-memory-gb": 1})
    why = abstract_gpus_warning(d, count)
    assert (why is not None) == warns
    if warns:
        assert "2 GPUs declared by config" in why and "NVML sees 1" in why and "distributed.diagnostics.nvml" in why
    nvml_found = declare_facts({}, {"nvml": True}, nvml=four(), visible="0")[0]
    assert abstract_gpus_warning(nvml_found, lambda: 1) is None  # NVML's own ids always exist
