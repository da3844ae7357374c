"""``fifo``: what plain Dask worker resources give (WORKLOAD.md).

Action-level, first come first served: the oldest waiting action that fits
starts (one that does not fit does not block younger ones, as in Dask), on
``units.min``, on the first worker that fits; blind to GPU topology groups;
reward models loaded on demand with LRU eviction.
"""

from __future__ import annotations

from collections import OrderedDict

from ..spec import ActionSpec
from .base import Policy
from .types import ActionId, Decision


class FifoPolicy(Policy):
    name = "fifo"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.waiting: dict[str, OrderedDict[ActionId, ActionSpec]] = {
            "cpu": OrderedDict(), "api": OrderedDict(), "gpu": OrderedDict()}

    def _submit(self, aid: ActionId, spec: ActionSpec, now: float, issued_at: float | None = None) -> None:
        q = self.waiting[spec.resource]
        q[aid] = spec
        if issued_at is not None:  # back unrun (its worker left or paused first): it came before those waiting
            q.move_to_end(aid, last=False)

    def _queued_specs(self) -> list[tuple[ActionId, ActionSpec]]:
        return [item for q in self.waiting.values() for item in q.items()]

    def _models_waiting(self) -> set[str]:
        return {spec.model for spec in self.waiting["gpu"].values()}

    def _drop_pending(self, aid: ActionId) -> bool:
        return any(q.pop(aid, None) is not None for q in self.waiting.values())

    def _queued(self) -> dict[str, int]:
        return {k: len(q) for k, q in self.waiting.items()}

    def _schedule(self, now: float, out: list[Decision]) -> None:
        q = self.waiting["cpu"]
        if q and self.cpu.max_free:
            for aid, spec in list(q.items()):
                node = self.cpu.first_fit(spec.units_min)
                if node is not None:
                    del q[aid]
                    out.append(self._start_cpu(aid, spec, node, spec.units_min, now))
                    if not self.cpu.max_free:
                        break
        q = self.waiting["api"]
        if q and self.api.total_free:
            for aid, spec in list(q.items()):
                if spec.units_min <= self.api.total_free:
                    del q[aid]
                    out.append(self._start_api(aid, spec, spec.units_min, now))
        q = self.waiting["gpu"]
        if q and self.gpu.idle:
            for aid, spec in list(q.items()):
                d = self._place_gpu(aid, spec, now)
                if d is not None:
                    del q[aid]
                    out.append(d)
                    if not self.gpu.idle:
                        break

    def _place_gpu(self, aid: ActionId, spec: ActionSpec, now: float) -> Decision | None:
        gp = self.gpu
        ready = [gp.replicas[r] for r in gp.ready.get(spec.model, ()) if len(gp.replicas[r].gpus) >= spec.units_min]
        if ready:
            order = {n: i for i, n in enumerate(gp.nodes)}
            rep = min(ready, key=lambda r: (order[r.node], r.gpus[0]))
            return self._start_gpu(aid, spec, rep.id, now)
        model = self.models[spec.model]
        for name, st in gp.nodes.items():
            k = model.replica_gpus(spec.units_min, st.spec.gpu_memory_gb)
            idle = [i for i, g in enumerate(st.gpus) if not g.busy]
            if len(idle) < k:
                continue
            gpus = tuple(idle[:k])
            resident = {rid for i in gpus for rid in st.gpus[i].replicas}
            lru = sorted(resident, key=lambda rid: (gp.replicas[rid].last_used, rid))
            plan = gp.eviction_plan(name, gpus, model.gpu_memory_gb / k, lru)
            if plan is None:
                continue
            rid = self._load(spec.model, name, gpus, plan, now)
            return self._start_gpu(aid, spec, rid, now, load=True, evict=tuple(plan))
        return None
