"""Can an action ever run on these nodes? The one check the simulator and the plugin share.

Pure: no Dask import. "Does not fit now" is the policy's business (a
:class:`~.types.Shortfall` at the head of a pool); this module answers the
other question, "can never fit on any current node", from the largest node
of each kind:

- a CPU action needs ``units.min`` slots on *one* node (dispatch-ahead
  units do not count: they are not slots);
- an API action needs ``units.min`` tokens of the quota;
- a GPU action needs a replica of its model, ``units.min`` GPUs at least and
  enough GPUs that the model's memory, split evenly, fits each of them, on
  one node.

:class:`Capacity` is the summary both callers build: the simulator from the
cluster file (:func:`Capacity.of_cluster`), the policy from its ledger as
nodes join and leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..cluster import ClusterSpec, ModelSpec
from ..spec import ActionSpec
from .types import Shortfall


@dataclass(frozen=True, slots=True, order=True)
class GpuShape:
    """A GPU node's shape; ordered by GPUs, then memory (``Capacity.gpu_shapes`` keeps them sorted)."""

    gpus: int
    gpu_memory_gb: float


@dataclass(frozen=True, slots=True)
class Capacity:
    """The largest thing each kind of node can hold."""

    cpu_largest: int = 0          # real slots of the largest CPU node
    cpu_nodes: int = 0
    api_tokens: int = 0
    gpu_shapes: tuple[GpuShape, ...] = ()  # one per distinct (gpus, memory) shape

    @classmethod
    def of_cluster(cls, cluster: ClusterSpec) -> "Capacity":
        shapes = sorted({GpuShape(n.gpus, n.gpu_memory_gb) for n in cluster.gpu_nodes})
        return cls(max((n.slots for n in cluster.cpu_nodes), default=0), len(cluster.cpu_nodes),
                   cluster.api_tokens, tuple(shapes))


def never_fits(spec: ActionSpec, cap: Capacity, models: Mapping[str, ModelSpec]) -> Shortfall | None:
    """A :class:`Shortfall` with ``never=True`` if no current node can ever hold ``spec``, else None.

    ``largest`` is what the largest node offers (0: no node of that kind has
    joined yet, in which case the action may simply be early).
    """
    need = spec.units_min
    res = spec.resource
    if res == "cpu":
        if need <= cap.cpu_largest:
            return None
        where = (f"the largest CPU worker has {cap.cpu_largest} slots" if cap.cpu_nodes
                 else "no CPU worker (sandbox slots) has joined")
        slots = "1 sandbox slot" if need == 1 else f"{need} sandbox slots"
        return Shortfall("cpu", need, 0, f"{spec.kind} asks for {slots} on one worker; {where}",
                         "cpu", cap.cpu_largest, True, spec.kind)
    if res == "api":
        if need <= cap.api_tokens:
            return None
        return Shortfall("api", need, 0, f"{spec.kind} asks for {need} API tokens; the scheduler holds "
                         f"{cap.api_tokens} (tangram.scheduler.api-tokens)", "api", cap.api_tokens, True, spec.kind)
    model = models.get(spec.model or "")
    if model is None:
        return Shortfall("gpu", need, 0, f"{spec.kind} needs model {spec.model!r}, which the policy does not know "
                         f"(known: {sorted(models)})", spec.model or "", 0, True, spec.kind)
    largest = max((s.gpus for s in cap.gpu_shapes), default=0)
    for s in cap.gpu_shapes:
        if model.replica_gpus(need, s.gpu_memory_gb) <= s.gpus:
            return None
    if not cap.gpu_shapes:
        where = "no GPU worker has joined"
    else:
        shapes = ", ".join(f"{s.gpus} x {s.gpu_memory_gb:g} GB" for s in cap.gpu_shapes)
        where = f"the GPU workers have {shapes}"
    return Shortfall("gpu", need, 0, f"{spec.kind} needs a replica of {spec.model} ({model.gpu_memory_gb:g} GB) on "
                     f"at least {need} GPUs of one worker; {where}", spec.model or "", largest, True, spec.kind)
