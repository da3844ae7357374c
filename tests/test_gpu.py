"""Real NVIDIA GPUs through NVML: runs only where NVML finds a GPU (skipped elsewhere, saying why).

The rest of the suite fakes only the device: abstract GPU workers declared by
config, and NVLink topologies given as link tables (test_scheduler_units.py).
"""

from __future__ import annotations

import pytest

from tangram_dask.workers import declare, discover_gpus

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def found():
    decl, why = discover_gpus()
    if decl is None:
        pytest.skip(f"no NVIDIA GPU through NVML here: {why}")
    return decl


def test_nvml_discovery_reports_gpus_groups_and_memory(found):
    assert found.gpus >= 1 and found.source == "nvml"
    assert sum(found.groups) == found.gpus and all(g >= 1 for g in found.groups)
    assert found.gpu_memory_gb > 1
    assert sorted(found.device_ids) == list(range(found.gpus))


def test_declare_prefers_nvml_over_config(found):
    d = declare({}, {"nvml": True, "gpus": found.gpus + 7, "gpu-groups": [found.gpus + 7], "gpu-memory-gb": 1})
    assert (d.gpus, d.source) == (found.gpus, "nvml")
