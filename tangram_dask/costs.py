"""What an action costs on what it was granted: the one cost model.

Pure: no Dask import. The simulator charges every ``Start`` with it, the
scheduler plugin writes the setup it predicts into the grant with it (and
subtracts it from the observed run time the policy learns from), and the
live benchmark's actions sleep what it says. So the three cannot drift.

- **setup**: a warm sandbox (``warm_start_s``) or a cold one
  (``cold_start_s``) for a CPU action, plus ``restore_s`` when a stateful
  trajectory's working dir is restored on another node; a model load
  (``load_s``) for a GPU action that loads its replica; nothing for API
  calls or bound sandboxes.
- **run**: the true duration on ``units.min`` times Amdahl's factor for the
  granted units (capped at ``units.max``), times ``cross_group_slowdown``
  for a GPU replica that spans topology groups.
- **ideal**: each action alone on ``units.max`` with a warm sandbox
  (WORKLOAD.md's ideal ACT).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .spec import ActionSpec


@dataclass(frozen=True)
class CostModel:
    warm_start_s: float = 0.0
    cold_start_s: float = 0.0
    cross_group_slowdown: float = 1.0
    load_s: Mapping[str, float] = field(default_factory=dict)  # model -> seconds to load a replica

    @classmethod
    def of(cls, cluster, models: Mapping) -> "CostModel":
        """From a :class:`~tangram_dask.cluster.ClusterSpec` (or anything with its cost fields) and models."""
        return cls(cluster.warm_start_s, cluster.cold_start_s, cluster.cross_group_slowdown,
                   {name: m.load_s for name, m in models.items()})

    def setup_s(self, spec: ActionSpec, *, sandbox: str = "warm", restore: bool = False,
                load: bool = False) -> float:
        """Seconds an action pays before its work starts."""
        if spec.resource == "cpu":
            s = self.warm_start_s if sandbox == "warm" else (self.cold_start_s if sandbox == "cold" else 0.0)
            return s + (spec.restore_s if restore else 0.0)
        if spec.resource == "gpu" and load:
            return self.load_time_s(spec.model or "")
        return 0.0

    def load_time_s(self, model: str) -> float:
        """Seconds a replica of ``model`` takes to load (a ``Start`` with ``load`` or a background ``Load``)."""
        return self.load_s.get(model, 0.0)

    def run_s(self, spec: ActionSpec, units: int, duration_s: float, cross_group: bool = False) -> float:
        """Seconds of work on ``units`` units, for an action of true ``duration_s`` on ``units.min``."""
        r = duration_s * spec.scale(min(units, spec.units_max))
        if cross_group and spec.resource == "gpu":
            r *= self.cross_group_slowdown
        return r

    def ideal_s(self, spec: ActionSpec, duration_s: float) -> float:
        """Alone on ``units.max`` with a warm sandbox."""
        return duration_s * spec.scale(spec.units_max) + (self.warm_start_s if spec.resource == "cpu" else 0.0)
