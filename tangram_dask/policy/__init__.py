"""The scheduling policies: a pure core (no Dask import), events in, decisions out.

``make_policy(name, cluster, workload)`` builds ``tangram``, ``fifo`` or
``static`` starting from the static split of reward-model replicas.
"""

from __future__ import annotations

from typing import Any

from ..cluster import ClusterSpec, ModelSpec
from .base import Policy
from .fifo import FifoPolicy
from .split import static_split
from .static import StaticPolicy
from .tangram import TangramOptions, TangramPolicy
from .types import Admit, Decision, Load, PolicySnapshot, PoolStats, ReplicaSpec, Shortfall, Start

POLICY_NAMES = ("tangram", "fifo", "static")

__all__ = ["Policy", "TangramPolicy", "TangramOptions", "FifoPolicy", "StaticPolicy", "make_policy",
           "static_split", "Start", "Admit", "Load", "Decision", "Shortfall", "PoolStats", "PolicySnapshot",
           "ReplicaSpec", "POLICY_NAMES"]


def initial_replicas(cluster: ClusterSpec, workload: Any) -> list[ReplicaSpec]:
    gpu_kinds = [(k.model, k.weight, k.duration.median, k.units_min) for k in workload.kinds if k.resource == "gpu"]
    return static_split(cluster, workload.models, gpu_kinds)


def make_policy(name: str, cluster: ClusterSpec, workload: Any, *, options: Any = None,
                models: dict[str, ModelSpec] | None = None) -> Policy:
    """A policy for ``cluster``, starting from the static split of ``workload``'s models."""
    models = models if models is not None else workload.models
    replicas = initial_replicas(cluster, workload)
    if name == "tangram":
        return TangramPolicy(cluster, models, replicas, options=options)
    if name == "fifo":
        return FifoPolicy(cluster, models, replicas)
    if name == "static":
        cpu_min = max((k.units_min for k in workload.kinds if k.resource == "cpu"), default=1)
        api_min = max((k.units_min for k in workload.kinds if k.resource == "api"), default=0)
        return StaticPolicy(cluster, models, replicas,
                            sandbox_units=max(workload.static_sandbox_units, cpu_min),
                            api_tokens_per_trajectory=api_min if workload.has_api else 0)
    raise ValueError(f"unknown policy {name!r}: choose from {', '.join(POLICY_NAMES)}")
