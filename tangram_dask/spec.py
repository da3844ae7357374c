"""The spec of one action: what it needs, validated where it is written.

Pure: no Dask import. The Dask side (``tangram_dask.action``) builds an
:class:`ActionSpec` at the call, so a wrong spec raises there, before
anything reaches the scheduler.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .errors import SpecError

RESOURCES = ("cpu", "gpu", "api")
AFFINITIES = (None, "trajectory")


def amdahl(k: float, parallel_fraction: float) -> float:
    """Amdahl's speedup S(k) = 1 / ((1 - p) + p / k)."""
    return 1.0 / ((1.0 - parallel_fraction) + parallel_fraction / k)


@dataclass(frozen=True, slots=True)
class ActionSpec:
    """What one action needs.

    ``units`` is ``(min, max)``: the action runs on any k in between, and
    takes ``t(min) * S(min) / S(k)`` on k units (Amdahl, ``parallel_fraction``).
    ``hint_s`` is the caller's guess of its duration on ``units_min``;
    ``None`` means "no idea" (the scheduler uses what it observed of the kind).
    """

    kind: str
    resource: str
    units_min: int = 1
    units_max: int = 1
    parallel_fraction: float = 0.0
    hint_s: float | None = None
    trajectory: str | None = None
    model: str | None = None
    affinity: str | None = None
    restore_s: float = 0.0
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not self.kind:
            raise SpecError("kind", self.kind, "must be a non-empty string naming the action kind")
        if self.resource not in RESOURCES:
            raise SpecError("resource", self.resource, f"must be one of {', '.join(RESOURCES)}")
        for name in ("units_min", "units_max"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(name.replace("_", "."), v, "must be a whole number >= 1")
        if self.units_max < self.units_min:
            raise SpecError("units.max", self.units_max, f"is below units.min = {self.units_min}")
        pf = self.parallel_fraction
        if isinstance(pf, bool) or not isinstance(pf, (int, float)) or not 0.0 <= pf <= 1.0 or math.isnan(pf):
            raise SpecError("speedup.parallel_fraction", pf, "must be a number in [0, 1]")
        _check_seconds("hint_s", self.hint_s, allow_zero=True)
        _check_seconds("timeout_s", self.timeout_s, allow_zero=False)
        _check_seconds("restore_s", self.restore_s, allow_zero=True, optional=False)
        if self.trajectory is not None and not isinstance(self.trajectory, str):
            raise SpecError("trajectory", self.trajectory, "must be a string id (or None)")
        if self.resource == "gpu":
            if not isinstance(self.model, str) or not self.model:
                raise SpecError("model", self.model, "a gpu action needs the name of its model")
        elif self.model is not None:
            raise SpecError("model", self.model, f"only gpu actions name a model, this one is {self.resource!r}")
        if self.affinity not in AFFINITIES:
            raise SpecError("affinity", self.affinity, "must be 'trajectory' or None")
        if self.affinity == "trajectory" and self.trajectory is None:
            raise SpecError("trajectory", None, "affinity='trajectory' needs the trajectory id")

    # -- elastic model ---------------------------------------------------
    def scale(self, k: int) -> float:
        """Factor by which running on k units changes the duration on units_min."""
        p = self.parallel_fraction
        if p == 0.0 or k == self.units_min:
            return 1.0
        return amdahl(self.units_min, p) / amdahl(k, p)

    def instance(self, hint_s: float | None, trajectory: str | None) -> "ActionSpec":
        """A copy with another hint and trajectory, without re-validating the kind's fields.

        For callers that validated this spec once (the simulator issues ~1M
        actions of a handful of kinds); ``hint_s`` must be a number >= 0 or None.
        """
        o = _new(ActionSpec)
        for name in _FIELDS:
            _set(o, name, getattr(self, name))
        _set(o, "hint_s", hint_s)
        _set(o, "trajectory", trajectory)
        return o

    # -- wire form (a Dask annotation is a plain dict) -------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ActionSpec":
        """Build from the annotation dict; unknown keys are an error naming them."""
        if not isinstance(d, Mapping):
            raise SpecError("tangram", d, "the annotation must be a mapping of action-spec fields")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(unknown[0], d[unknown[0]], f"unknown field; known fields are {', '.join(sorted(known))}")
        return cls(**d)


_new = object.__new__
_set = object.__setattr__
_FIELDS = tuple(ActionSpec.__dataclass_fields__)


def make_spec(
    kind: str,
    resource: str = "cpu",
    units: int | tuple[int, int] = 1,
    *,
    speedup: float = 0.0,
    hint_s: float | None = None,
    trajectory: str | None = None,
    model: str | None = None,
    affinity: str | None = None,
    restore_s: float = 0.0,
    timeout_s: float | None = None,
) -> ActionSpec:
    """The user-facing spelling: ``units=(1, 8)`` or ``units=2``, ``speedup=p``."""
    if isinstance(units, int) and not isinstance(units, bool):
        lo = hi = units
    elif isinstance(units, (tuple, list)) and len(units) == 2:
        lo, hi = units
    else:
        raise SpecError("units", units, "must be a whole number or a (min, max) pair")
    return ActionSpec(
        kind=kind, resource=resource, units_min=lo, units_max=hi,
        parallel_fraction=speedup, hint_s=hint_s, trajectory=trajectory, model=model,
        affinity=affinity, restore_s=restore_s, timeout_s=timeout_s,
    )


def _check_seconds(name: str, v: object, *, allow_zero: bool, optional: bool = True) -> None:
    if v is None and optional:
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < 0 or (v == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise SpecError(name, v, f"must be a finite number of seconds {need}")
