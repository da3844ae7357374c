"""The spec of one action: what it needs, validated where it is written.

Pure: no Dask import. The Dask side (``tangram_dask.action``) builds an
:class:`ActionSpec` at the call, so a wrong spec raises there, before
anything reaches the scheduler.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from .errors import SpecError

RESOURCES = ("cpu", "gpu", "api")
AFFINITIES = (None, "trajectory")
#: The most units one action may ask for (whole numbers travel as 64-bit ints on the wire).
UNITS_LIMIT = 2**31 - 1
#: Annotation keys no user may write, and why.
RESERVED = {"grant": "reserved: the tangram scheduler writes the grant into the annotation itself; "
                     "remove 'grant' from the spec (read a running action's grant with "
                     "tangram_dask.current_allocation())"}
#: The keyword arguments of make_spec / tangram_dask.action besides kind, resource and units.
SPEC_KEYWORDS = ("speedup", "hint_s", "trajectory", "model", "affinity", "restore_s", "timeout_s")
_REQUIRED = ("kind", "resource")
#: The most seconds a field in seconds may say (about 31.7 years): a finite but huge hint (1e308) overflowed the
#: admission gate's sums to infinity and shut it for every trajectory (session 31)
SECONDS_LIMIT = 1e9
#: The fields in seconds: (name, zero allowed, None allowed).
_SECONDS = (("hint_s", True, True), ("timeout_s", False, True), ("restore_s", True, False))


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
        # Every field checked, and numbers normalised to Python int / float (numpy's too), so the spec
        # packs with msgpack and compares equal to its wire form parsed again. Each field has a fast
        # path for the exact types a well-formed annotation holds (the scheduler parses every action).
        if type(self.kind) is not str or not self.kind:
            _set(self, "kind", _name("kind", self.kind, "must be a non-empty string naming the action kind"))
        if type(self.resource) is not str or self.resource not in RESOURCES:
            if not isinstance(self.resource, str) or self.resource not in RESOURCES:
                raise SpecError("resource", self.resource, f"must be one of {', '.join(RESOURCES)}")
            _set(self, "resource", str(self.resource))
        lo, hi = self.units_min, self.units_max
        if type(lo) is not int or not 1 <= lo <= UNITS_LIMIT:
            lo = _whole("units.min", lo)
            _set(self, "units_min", lo)
        if type(hi) is not int or not 1 <= hi <= UNITS_LIMIT:
            hi = _whole("units.max", hi)
            _set(self, "units_max", hi)
        if hi < lo:
            raise SpecError("units.max", self.units_max, f"is below units.min = {lo}")
        pf = self.parallel_fraction
        if type(pf) is not float or not 0.0 <= pf <= 1.0:
            pf = _number("speedup.parallel_fraction", pf, "must be a number in [0, 1]")
            if not 0.0 <= pf <= 1.0:
                raise SpecError("speedup.parallel_fraction", self.parallel_fraction, "must be a number in [0, 1]")
            _set(self, "parallel_fraction", pf)
        for name, allow_zero, optional in _SECONDS:
            v = getattr(self, name)
            if v is None and optional:
                continue
            if type(v) is not float or not (0.0 <= v <= SECONDS_LIMIT) or (v == 0.0 and not allow_zero):
                _set(self, name, _seconds(name, v, allow_zero=allow_zero, optional=optional))
        if self.trajectory is not None and (type(self.trajectory) is not str or not self.trajectory):
            if not isinstance(self.trajectory, str) or not self.trajectory:
                raise SpecError("trajectory", self.trajectory, "must be a non-empty string id (or None)")
            _set(self, "trajectory", str(self.trajectory))
        if self.resource == "gpu":
            if type(self.model) is not str or not self.model:
                _set(self, "model", _name("model", self.model, "a gpu action needs the name of its model"))
        elif self.model is not None:
            raise SpecError("model", self.model, f"only gpu actions name a model, this one is {self.resource!r}")
        if self.affinity is not None and (type(self.affinity) is not str or self.affinity not in AFFINITIES):
            if not isinstance(self.affinity, str) or self.affinity not in AFFINITIES:
                raise SpecError("affinity", self.affinity, "must be 'trajectory' or None")
            _set(self, "affinity", str(self.affinity))
        if self.affinity == "trajectory" and self.trajectory is None:
            raise SpecError("trajectory", None, "affinity='trajectory' needs the trajectory id")

    # -- elastic model ---------------------------------------------------
    def scale(self, k: int) -> float:
        """Factor by which running on k units changes the duration on units_min."""
        p = self.parallel_fraction
        if p == 0.0 or k == self.units_min:
            return 1.0
        q = 1.0 - p  # amdahl(units_min, p) / amdahl(k, p), inlined (millions of calls in the scale run)
        return (1.0 / (q + p / self.units_min)) / (1.0 / (q + p / k))

    def instance(self, hint_s: float | None, trajectory: str | None) -> ActionSpec:
        """A copy with another hint and trajectory, without re-validating the kind's fields.

        For callers that validated this spec once (the simulator issues ~1M
        actions of a handful of kinds); ``hint_s`` must be a number >= 0 or None.
        One assignment per field, written out through the slot descriptors (no loop over the fields,
        no setattr by name; the ``_s_*`` names are set below the class). A field added to ActionSpec
        must be added here (``tests/test_spec.py`` checks every field is copied; the unpacking of the
        descriptors fails at import if the count differs).
        """
        o = _new(ActionSpec)
        _s_kind(o, self.kind)
        _s_resource(o, self.resource)
        _s_units_min(o, self.units_min)
        _s_units_max(o, self.units_max)
        _s_parallel_fraction(o, self.parallel_fraction)
        _s_hint_s(o, hint_s)
        _s_trajectory(o, trajectory)
        _s_model(o, self.model)
        _s_affinity(o, self.affinity)
        _s_restore_s(o, self.restore_s)
        _s_timeout_s(o, self.timeout_s)
        return o

    # -- wire form (a Dask annotation is a plain dict) -------------------
    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ActionSpec:
        """Build from the annotation dict; unknown, reserved or missing keys are an error naming them."""
        if not isinstance(d, Mapping):
            raise SpecError("tangram", d, "the annotation must be a mapping of action-spec fields")
        fields = cls.__dataclass_fields__
        if not all(type(k) is str and k in fields for k in d):
            _refuse_keys(d, fields)
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise SpecError(missing[0], None, f"required field is missing (required: {', '.join(_REQUIRED)})")
        return cls(**d)


def _refuse_keys(d: Mapping[Any, Any], fields: Mapping[str, Any]) -> None:
    """Raise SpecError for the first key of ``d`` that is not a field, reserved keys first."""
    for k in d:
        if isinstance(k, str) and k in RESERVED:
            raise SpecError(k, d[k], RESERVED[k])
    unknown = sorted((k for k in d if not (type(k) is str and k in fields)),
                     key=lambda k: (not isinstance(k, str), type(k).__name__, k if isinstance(k, str) else ""))
    k = unknown[0]
    raise SpecError(k if isinstance(k, str) else _safe_repr(k), d[k],
                    f"unknown field; known fields are {', '.join(sorted(fields))}")


_new = object.__new__
_set = object.__setattr__
_FIELDS = tuple(ActionSpec.__dataclass_fields__)
(_s_kind, _s_resource, _s_units_min, _s_units_max, _s_parallel_fraction, _s_hint_s, _s_trajectory, _s_model,
 _s_affinity, _s_restore_s, _s_timeout_s) = (ActionSpec.__dict__[f].__set__ for f in _FIELDS)


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
    **unknown: Any,
) -> ActionSpec:
    """The user-facing spelling: ``units=(1, 8)`` or ``units=2``, ``speedup=p``.

    Any other keyword (``grant`` is reserved) is a SpecError naming it.
    """
    if unknown:
        check_keywords(unknown)
    if isinstance(units, (tuple, list)):
        if len(units) != 2:
            raise SpecError("units", units, "must be a whole number or a (min, max) pair")
        lo, hi = units
    elif _is_whole(units):
        lo = hi = units
    else:
        raise SpecError("units", units, "must be a whole number or a (min, max) pair")
    return ActionSpec(
        kind=kind, resource=resource, units_min=lo, units_max=hi,
        parallel_fraction=speedup, hint_s=hint_s, trajectory=trajectory, model=model,
        affinity=affinity, restore_s=restore_s, timeout_s=timeout_s,
    )


def check_keywords(fields: Mapping[Any, Any]) -> None:
    """SpecError for a keyword make_spec does not take (``grant`` is reserved), before anything is built."""
    if not isinstance(fields, Mapping):
        raise SpecError("spec_fields", fields, f"must be a mapping of spec fields ({', '.join(SPEC_KEYWORDS)})")
    for k in fields:
        if isinstance(k, str) and k in RESERVED:
            raise SpecError(k, fields[k], RESERVED[k])
        if not isinstance(k, str) or k not in SPEC_KEYWORDS:
            raise SpecError(k if isinstance(k, str) else _safe_repr(k), fields[k],
                            f"unknown field; the fields besides kind, resource and units are "
                            f"{', '.join(SPEC_KEYWORDS)}")


def _safe_repr(v: object) -> str:
    try:
        return repr(v)
    except Exception:  # a huge int past Python's digit limit, an object whose repr fails
        return f"<{type(v).__name__}>"


def _is_whole(v: object) -> bool:
    if type(v) is int:
        return True
    if isinstance(v, bool):
        return False
    try:
        operator.index(v)  # numpy integers
    except TypeError:
        return False
    return True


def _whole(name: str, v: object) -> int:
    if type(v) is int:
        n = v
    elif _is_whole(v):
        n = operator.index(v)
    else:
        raise SpecError(name, v, f"must be a whole number >= 1 (at most {UNITS_LIMIT})")
    if not 1 <= n <= UNITS_LIMIT:
        raise SpecError(name, v, f"must be a whole number >= 1 (at most {UNITS_LIMIT})")
    return n


def _number(name: str, v: object, need: str) -> float:
    """``v`` as a finite Python float (ints, numpy numbers), else SpecError; never OverflowError."""
    if type(v) is float:
        f = v
    elif isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise SpecError(name, v, need)
    else:
        try:
            f = float(v)
        except (OverflowError, ValueError, TypeError):
            raise SpecError(name, v, need) from None
    if not math.isfinite(f):
        raise SpecError(name, v, need)
    return f


def _seconds(name: str, v: object, *, allow_zero: bool, optional: bool = True) -> float | None:
    if v is None and optional:
        return None
    need = f"must be a finite number of seconds {'>= 0' if allow_zero else '> 0'}, at most {SECONDS_LIMIT:g}"
    f = _number(name, v, need)
    if f < 0 or (f == 0 and not allow_zero) or f > SECONDS_LIMIT:
        raise SpecError(name, v, need)
    return f


def _name(field: str, v: object, need: str) -> str:
    if not isinstance(v, str) or not v:
        raise SpecError(field, v, need)
    return str(v)
