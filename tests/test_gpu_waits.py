"""benchmarks/gpu_waits.py: the GPU actions' waiting under tangram, classified, adds up to what they waited."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tangram_dask.cluster import load_cluster
from tangram_dask.policy.types import GPU_WAIT_REASONS
from tangram_dask.workload import generate, load_workload

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_waits import gpu_waits  # noqa: E402


def test_the_classes_add_up_to_the_gpu_actions_waiting():
    """On the GPU-bound file (four models sharing 12 GPUs, loads under way) every second a GPU action waited,
    start - issue, is in exactly one class: the sum over classes equals the sum over actions."""
    w = gpu_waits(generate(load_workload("resources/variants/gpu-bound.yaml")),
                  load_cluster("resources/variants/cluster-gpu-mixed.yaml"))
    assert w["waited"] > 0
    assert sum(w["seconds"].values()) == pytest.approx(w["waited"], rel=1e-9)
    assert {c for c, _ in w["seconds"]} <= set(GPU_WAIT_REASONS)
    assert {"gpu_shared", "busy"} <= {c for c, _ in w["seconds"]}  # the process reward model's replicas share GPUs


def test_on_the_standard_cluster_only_busy_replicas_make_actions_wait():
    """On the standard files no two replicas share a GPU (a 140 GB judge's 70 GB share leaves no room for the
    16 GB judge) and nothing is loaded: a GPU action waits only while every replica of its model serves."""
    w = gpu_waits(generate(load_workload("resources/bench/standard.yaml")),
                  load_cluster("resources/bench/cluster-standard.yaml"))
    assert w["waited"] > 0
    assert {c for c, _ in w["seconds"]} == {"busy"}
    assert sum(w["seconds"].values()) == pytest.approx(w["waited"], rel=1e-9)


def test_the_script_prints_a_family():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_waits.py"), "--family", "gpu",
                          "--over", "1.6"], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    heads = [line for line in out.splitlines() if not line.startswith(" ")]
    ratios = [float(h.split("ACT/ideal ")[1].split(";")[0]) for h in heads]
    assert heads and all(r > 1.6 for r in ratios), out  # --over keeps only those
    assert all("GPU waiting" in h for h in heads)
