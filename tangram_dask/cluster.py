"""The cluster's abstract resources: CPU sandbox slots, GPU topology groups, API quota.

Pure: no Dask import. Built from a cluster file (format v1) or, live, from
the workers that join the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .errors import FileFormatError
from .formats import Reader, load_yaml, number, text, whole


@dataclass(frozen=True, slots=True)
class CpuNode:
    """A node of ``slots`` sandbox slots (one CPU each)."""

    name: str
    slots: int


@dataclass(frozen=True, slots=True)
class GpuNode:
    """A node of GPUs split into topology groups (NVLink islands, PCIe switches).

    ``groups`` are the group sizes, in GPU-index order: ``(4, 4)`` means GPUs
    0-3 form group 0 and 4-7 group 1.
    """

    name: str
    gpus: int
    gpu_memory_gb: float
    groups: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.groups) != self.gpus:
            raise ValueError(f"GPU node {self.name}: groups {list(self.groups)} must sum to gpus = {self.gpus}")

    def group_of(self) -> tuple[int, ...]:
        """The group index of each GPU."""
        out: list[int] = []
        for g, size in enumerate(self.groups):
            out.extend([g] * size)
        return tuple(out)

    def group_gpus(self) -> tuple[tuple[int, ...], ...]:
        out, i = [], 0
        for size in self.groups:
            out.append(tuple(range(i, i + size)))
            i += size
        return tuple(out)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A reward model: memory of one replica (split over its GPUs) and its load time."""

    name: str
    gpu_memory_gb: float
    load_s: float

    def replica_gpus(self, units_min: int, gpu_memory_gb: float) -> int:
        """Smallest k >= units_min whose share gpu_memory_gb / k fits one GPU."""
        k = units_min if units_min > 1 else 1  # max(1, units_min), as below: no builtin call (it parses
        c = math.ceil(self.gpu_memory_gb / gpu_memory_gb - 1e-9)  # keywords; ~1 call per action scheduled)
        return c if c > k else k


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    cpu_nodes: tuple[CpuNode, ...] = ()
    gpu_nodes: tuple[GpuNode, ...] = ()
    cross_group_slowdown: float = 1.0
    api_tokens: int = 0
    cold_start_s: float = 0.0
    warm_start_s: float = 0.0
    source: str = field(default="", compare=False)

    @property
    def cpu_slots(self) -> int:
        return sum(n.slots for n in self.cpu_nodes)

    @property
    def gpu_count(self) -> int:
        return sum(n.gpus for n in self.gpu_nodes)

    def capacity(self) -> dict[str, int]:
        return {"cpu": self.cpu_slots, "gpu": self.gpu_count, "api": self.api_tokens}

    def scaled(self, f: float) -> "ClusterSpec":
        """The cluster at fraction f (parity search): slots per CPU node and API
        tokens scaled and rounded up; GPU nodes keep their shape, their count
        scaled and rounded up."""
        cpu = tuple(replace(n, slots=max(1, math.ceil(n.slots * f - 1e-9))) for n in self.cpu_nodes)
        keep = math.ceil(len(self.gpu_nodes) * f - 1e-9) if self.gpu_nodes else 0
        gpu = self.gpu_nodes[:max(1, keep) if self.gpu_nodes else 0]
        tokens = math.ceil(self.api_tokens * f - 1e-9) if self.api_tokens else 0
        return replace(self, name=f"{self.name}@{f:g}", cpu_nodes=cpu, gpu_nodes=gpu,
                       api_tokens=max(tokens, 1 if self.api_tokens else 0))


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster file; errors name the file and the key."""
    path = str(path)
    return parse_cluster(load_yaml(path), path)


def parse_cluster(data: Any, path: str = "<cluster>") -> ClusterSpec:
    if isinstance(data, dict) and "tools" in data and "cpu" not in data and "gpu" not in data:
        raise FileFormatError(path, "cpu", "this looks like a workload file (tools, no cpu or gpu nodes): the workload "
                                           "comes first, then the cluster (resources/bench/WORKLOAD.md)")
    r = Reader(path, data)
    name = r.get("name", text)
    cpu_nodes: list[CpuNode] = []
    gpu_nodes: list[GpuNode] = []
    slowdown = 1.0
    cpu = r.child("cpu", None)
    if cpu is not None:
        for item in cpu.items("nodes"):
            count = item.get("count", whole(1), 1)
            slots = item.get("slots", whole(1))
            item.done()
            base = len(cpu_nodes)
            cpu_nodes.extend(CpuNode(f"cpu-{base + i}", slots) for i in range(count))
        cpu.done()
    gpu = r.child("gpu", None)
    if gpu is not None:
        for item in gpu.items("nodes"):
            count = item.get("count", whole(1), 1)
            gpus = item.get("gpus", whole(1))
            mem = item.get("gpu_memory_gb", number(0, open_lo=True))
            groups = item.get("groups", _groups, [gpus])
            if sum(groups) != gpus:
                raise item.fail("groups", f"sizes {groups} must sum to gpus = {gpus}")
            item.done()
            base = len(gpu_nodes)
            gpu_nodes.extend(GpuNode(f"gpu-{base + i}", gpus, mem, tuple(groups)) for i in range(count))
        slowdown = gpu.get("cross_group_slowdown", number(1.0), 1.0)
        gpu.done()
    api = r.child("api", None)
    tokens = 0
    if api is not None:
        tokens = api.get("tokens", whole(0))
        api.done()
    sandbox = r.child("sandbox", None)
    cold = warm = 0.0
    if sandbox is not None:
        cold = sandbox.get("cold_start_s", number(0), 0.0)
        warm = sandbox.get("warm_start_s", number(0), 0.0)
        sandbox.done()
    r.done()
    return ClusterSpec(name, tuple(cpu_nodes), tuple(gpu_nodes), slowdown, tokens, cold, warm, source=path)


def _groups(v: Any, _: str) -> list[int]:
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1
                                                   for x in v):
        raise ValueError(f"must be a list of whole numbers >= 1, got {v!r}")
    return v


def parse_models(data: Any, path: str, where: str = "models") -> dict[str, ModelSpec]:
    if not isinstance(data, Mapping):
        raise FileFormatError(path, where, f"must be a mapping of model name to spec, got {type(data).__name__}")
    out = {}
    for name, spec in data.items():
        m = Reader(path, spec, f"{where}.{name}")
        out[str(name)] = ModelSpec(str(name), m.get("gpu_memory_gb", number(0, open_lo=True)),
                                   m.get("load_s", number(0)))
        m.done()
    return out
