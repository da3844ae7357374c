"""The standard bench files shipped in resources/bench/ are the shared ones, byte for byte.

In CI the repository is cloned with ``shared/`` beside it (``../shared/bench``);
a user's clone has no such folder, and then there is nothing to compare.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "resources" / "bench"
SHARED = ROOT.parent / "shared" / "bench"

needs_shared = pytest.mark.skipif(
    not SHARED.is_dir(), reason=f"no shared bench files at {SHARED} (only CI clones have ../shared beside the repo)")


@needs_shared
def test_same_set_of_files():
    shipped = sorted(p.name for p in SHIPPED.iterdir() if p.is_file())
    shared = sorted(p.name for p in SHARED.iterdir() if p.is_file())
    assert shipped == shared


@needs_shared
@pytest.mark.parametrize("name", sorted(p.name for p in SHIPPED.iterdir() if p.is_file()))
def test_shipped_file_is_byte_identical_to_shared(name):
    shared = SHARED / name
    assert shared.is_file(), f"{name} is shipped but not in {SHARED}"
    assert (SHIPPED / name).read_bytes() == shared.read_bytes(), f"resources/bench/{name} differs from {shared}"


def test_the_contract_and_standard_files_are_shipped():
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"WORKLOAD.md", "standard.yaml", "small.yaml", "cluster-standard.yaml", "cluster-laptop.yaml"} <= names


@pytest.mark.parametrize("name", sorted(p.name for p in SHIPPED.glob("*.yaml")))
def test_shipped_yaml_files_parse(name):
    from tangram_dask.cluster import load_cluster
    from tangram_dask.workload import load_workload

    path = SHIPPED / name
    if name.startswith("cluster-"):
        assert load_cluster(path).cpu_slots > 0
    else:
        assert load_workload(path).trajectories > 0
