"""The static split of GPUs across reward models (WORKLOAD.md, "The static split").

Pure: no Dask import. Every policy starts from these resident replicas;
``static`` keeps them for good.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ..cluster import ClusterSpec, ModelSpec
from .types import ReplicaSpec


def static_split(cluster: ClusterSpec, models: dict[str, ModelSpec],
                 gpu_kinds: Iterable[tuple[str, float, float, int]]) -> list[ReplicaSpec]:
    """Replicas of ``units.min`` GPUs within one group, in proportion to demand.

    ``gpu_kinds``: (model, weight, median duration, units_min) per GPU action kind.
    Demand per model = sum of weight x median; replica size = the largest
    units_min of its kinds, grown until its share fits a GPU of the node it
    goes to. First one replica per model in descending demand, then
    repeatedly one for the model furthest below its share of all GPUs
    (among those that still fit), each in the smallest group it fits
    (fewest free GPUs, then node and group order), until none fits.
    """
    gpu_kinds = list(gpu_kinds)
    demand: dict[str, float] = {}
    for model, weight, median, _ in gpu_kinds:
        demand[model] = demand.get(model, 0.0) + weight * median
    size = replica_sizes((model, umin) for model, _, _, umin in gpu_kinds)
    if not demand or not cluster.gpu_nodes:
        return []
    total = sum(demand.values())
    n_gpus = cluster.gpu_count
    # no expected demand at all (every median 0): an equal share each, not a division by zero
    share = {m: (demand[m] / total if total > 0 else 1 / len(demand)) * n_gpus for m in demand}
    groups = Groups(cluster, models, size)
    given = {m: 0 for m in demand}

    def place(m: str) -> bool:
        k = groups.place(m)
        given[m] += k
        return k > 0

    order: Sequence[str] = sorted(demand, key=lambda m: (-demand[m], m))
    for m in order:
        place(m)
    fits = set(order)
    while fits:
        m = max(sorted(fits), key=lambda x: share[x] - given[x])
        if not place(m):
            fits.discard(m)
    return groups.placed


def replica_sizes(kinds: Iterable[tuple[str, int]]) -> dict[str, int]:
    """GPUs per replica of each model before memory grows it: the largest ``units_min`` among its kinds
    (``kinds``: (model, units_min) per GPU action kind)."""
    size: dict[str, int] = {}
    for model, umin in kinds:
        size[model] = max(size.get(model, 1), umin)
    return size


class Groups:
    """The free GPUs of each topology group, and the replicas placed on them so far (``placed``): a replica of
    ``size[model]`` GPUs (grown until its share of the model's memory fits a GPU of the node) goes whole into
    the group with the fewest free GPUs that fits it (ties: node, then group order), no two on a GPU."""

    def __init__(self, cluster: ClusterSpec, models: dict[str, ModelSpec], size: dict[str, int]):
        self.cluster, self.models, self.size = cluster, models, size
        # free GPUs per (node index, group index), as lists of GPU indices
        self.free: list[list[list[int]]] = [[list(g) for g in n.group_gpus()] for n in cluster.gpu_nodes]
        self.placed: list[ReplicaSpec] = []

    def place(self, m: str) -> int:
        """Place one replica of ``m``: the GPUs it took, 0 where no group fits it."""
        best = None
        for ni, groups in enumerate(self.free):
            # grown per node: a node with smaller GPUs needs more of them for the same model
            k = self.models[m].replica_gpus(self.size[m], self.cluster.gpu_nodes[ni].gpu_memory_gb)
            for gi, g in enumerate(groups):
                if len(g) >= k and (best is None or len(g) < best[0]):
                    best = (len(g), ni, gi, k)
        if best is None:
            return 0
        _, ni, gi, k = best
        g = self.free[ni][gi]
        gpus, self.free[ni][gi] = tuple(g[:k]), g[k:]
        self.placed.append(ReplicaSpec(m, self.cluster.gpu_nodes[ni].name, gpus))
        return k
