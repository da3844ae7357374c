"""``static``: resources tied to trajectories and tasks (WORKLOAD.md).

A trajectory is admitted only when it can bind, for its whole life, one
sandbox (paying one cold start at admission) and, where the workload has API
actions, one API token; its actions run there, on those units clamped to
their min..max. GPUs are split across reward models up front
(:func:`~tangram_dask.policy.split.static_split`); an action waits for an
idle replica of its own model, oldest first. Nothing is ever loaded or evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..spec import ActionSpec
from .base import Policy, Running
from .types import ActionId, Admit, Decision, Start


@dataclass(slots=True)
class Binding:
    node: str
    units: int
    tokens: int


class StaticPolicy(Policy):
    name = "static"

    def __init__(self, *a, sandbox_units: int = 2, api_tokens_per_trajectory: int = 1, **kw):
        super().__init__(*a, **kw)
        if sandbox_units < 1:
            raise ValueError(f"static.sandbox_units must be >= 1, got {sandbox_units}")
        self.sandbox_units = sandbox_units
        self.tokens_per = api_tokens_per_trajectory
        self.admission: OrderedDict[str, None] = OrderedDict()  # O(1) oldest first, unlike a dict
        self.bound: dict[str, Binding] = {}
        self.gpu_wait: dict[ActionId, ActionSpec] = {}
        self.cold_start_s = self.cluster.cold_start_s

    def begin_trajectory(self, trajectory: str, now: float, expected_s: float | None = None) -> None:
        self.admission[trajectory] = None

    def end_trajectory(self, trajectory: str, now: float) -> None:
        super().end_trajectory(trajectory, now)
        b = self.bound.pop(trajectory, None)
        if b is not None:
            self.cpu.give(b.node, b.units)
            if b.tokens:
                self.api.give(b.tokens)
        self.admission.pop(trajectory, None)

    def _submit(self, aid: ActionId, spec: ActionSpec, now: float, issued_at: float | None = None) -> None:
        if spec.resource == "gpu":
            self.gpu_wait[aid] = spec
            return
        b = self.bound.get(spec.trajectory)
        if b is None:
            raise ValueError(f"static: action {aid!r} of trajectory {spec.trajectory!r}, which was never admitted")
        have = b.units if spec.resource == "cpu" else b.tokens
        k = min(max(have, spec.units_min), spec.units_max)
        if k > have:
            raise ValueError(f"static: {spec.kind} needs {spec.units_min} {spec.resource} units, "
                             f"the trajectory's binding has {have}")
        self.running[aid] = Running(spec, b.node if spec.resource == "cpu" else "api", k, None, now, now)
        self._ready.append(Start(aid, self.running[aid].node, k, sandbox="bound"))

    def _release(self, r: Running, now: float) -> None:
        if r.spec.resource == "gpu":
            self.gpu.release(r.replica, now)
        # cpu and api units belong to the trajectory's binding until it ends

    def _drop_pending(self, aid: ActionId) -> bool:
        return self.gpu_wait.pop(aid, None) is not None

    def _queued_specs(self) -> list[tuple[ActionId, ActionSpec]]:
        return list(self.gpu_wait.items())

    def _admission_waiting(self) -> int:
        return len(self.admission)

    def _queued(self) -> dict[str, int]:
        return {"gpu": len(self.gpu_wait), "cpu": len(self.admission)}

    def _schedule(self, now: float, out: list[Decision]) -> None:
        tokens = self.tokens_per
        while self.admission and self.cpu.max_free >= self.sandbox_units and self.api.total_free >= tokens:
            t, _ = self.admission.popitem(last=False)
            node = self.cpu.first_fit(self.sandbox_units)
            self.cpu.take(node, self.sandbox_units)
            if tokens:
                self.api.take(tokens)
            self.bound[t] = Binding(node, self.sandbox_units, tokens)
            out.append(Admit(t, self.cold_start_s, node, self.sandbox_units, tokens))
        if self.gpu_wait and self.gpu.idle:
            gp = self.gpu
            for aid, spec in list(self.gpu_wait.items()):
                ready = gp.ready.get(spec.model)
                rid = next((r for r in ready if len(gp.replicas[r].gpus) >= spec.units_min), None) if ready else None
                if rid is not None:
                    del self.gpu_wait[aid]
                    out.append(self._start_gpu(aid, spec, rid, now))
