"""The scheduler plugin's options: one frozen dataclass, one field per ``tangram.scheduler`` key.

The fields are the keys of ``tangram.scheduler`` in tangram.yaml with ``-``
spelled ``_`` (a test holds the three together: this class, tangram.yaml and
tangram-schema.yaml), plus ``tangram``, the tangram policy's knobs as a
``TangramOptions``, which only code passes; the config gives the same knobs
by name (``policy-options``), and the two are not given together.
:meth:`PluginOptions.from_config` validates the effective config
(``tangram_dask.config.validate("scheduler")``) and reads every key with the
shipped default beneath it, so the plugin starts with the right options even
where dask's config was reset to a snapshot taken before tangram_dask was
imported.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from .cluster import ModelSpec, parse_models
from .config import SCHEMA, validate
from .errors import ConfigError
from .policy import TangramOptions

#: The policies the live plugin runs (static binds whole trajectories: the simulator runs it).
LIVE_POLICIES = ("tangram", "fifo")
#: Fields that are not keys of ``tangram.scheduler`` (only code sets them).
CODE_ONLY = frozenset({"tangram"})

_KEYS = SCHEMA["properties"]["tangram"]["properties"]["scheduler"]["properties"]


def key_of(name: str) -> str:
    """The config key of a field: ``api_tokens`` -> ``api-tokens``."""
    return name.replace("_", "-")


@dataclass(frozen=True)
class PluginOptions:
    """Everything the plugin is configured with; ``from_config`` reads ``tangram.scheduler``.

    ``replicas`` maps a GPU worker's *name* to the model replicas resident on
    it when it joins: ``{"gpu-0": (("rm-small", (0,)),)}``. ``time_scale``
    makes the policy see ``wall seconds / time_scale`` (benchmarks that run a
    workload faster than real time). ``pipeline`` overbooks each CPU node by
    that many units so the scheduler can hand a worker its next action before
    the current one ends (see docs/placement.md, "Pipelining"). ``policy_options``
    names knobs of the tangram policy (``{"grow": 1.0}``); ``__post_init__`` makes
    them the ``tangram`` options, every other knob at its default.
    """

    policy: str = "tangram"
    models: Mapping[str, ModelSpec] = field(default_factory=dict)
    api_tokens: int = 0
    replicas: Mapping[str, tuple[tuple[str, tuple[int, ...]], ...]] = field(default_factory=dict)
    time_scale: float = 1.0
    pipeline: int = 2
    warm_start_s: float = 0.0
    cold_start_s: float = 0.0
    cross_group_slowdown: float = 1.0
    trajectory_ttl_s: float = 3600.0
    wait_for_capacity: bool = False
    lost_wait_s: float = 300.0
    policy_options: Mapping[str, float] = field(default_factory=dict)
    tangram: TangramOptions | None = None

    def __post_init__(self) -> None:
        if self.policy not in LIVE_POLICIES:
            raise ConfigError("tangram.scheduler.policy", self.policy,
                              f"{self.policy!r}: the live plugin runs {' or '.join(LIVE_POLICIES)} "
                              f"(static binds whole trajectories; simulate it)")
        for f in fields(self):
            if f.name not in CODE_ONLY and f.name not in ("policy", "models", "replicas", "policy_options"):
                _check_field(f.name, getattr(self, f.name))
        if not isinstance(self.models, Mapping) or not all(isinstance(m, ModelSpec) for m in self.models.values()):
            raise ConfigError("tangram.scheduler.models", self.models,
                              "must map model names to ModelSpec (from_config parses the config's dicts)")
        if not isinstance(self.replicas, Mapping):
            raise ConfigError("tangram.scheduler.replicas", self.replicas,
                              "must map GPU worker names to [[model, [gpu, ...]], ...]")
        if self.tangram is not None and not isinstance(self.tangram, TangramOptions):
            raise ConfigError("tangram", self.tangram, "must be a TangramOptions (the tangram policy's knobs)")
        knobs = policy_options(self.policy_options)
        object.__setattr__(self, "policy_options", knobs)
        if knobs:
            named = TangramOptions(**knobs)
            if self.tangram is not None and self.tangram != named:  # (equal: dataclasses.replace of these options)
                raise ConfigError("tangram.scheduler.policy-options", dict(knobs),
                                  "the tangram policy's knobs are given twice, and differ: by this key and by "
                                  "tangram= (a TangramOptions, from code); give one")
            object.__setattr__(self, "tangram", named)

    @classmethod
    def from_config(cls, **overrides: Any) -> PluginOptions:
        """The effective ``tangram.scheduler`` config, validated, with ``overrides`` (None: not given) on top.

        Raises :class:`~tangram_dask.errors.ConfigError` naming the key and
        the value for an unknown key or a bad value.
        """
        cfg = validate("scheduler")
        unknown = sorted(k for k in overrides if k not in cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(unknown[0], overrides[unknown[0]],
                              f"not an option of the scheduler plugin (options: {', '.join(cls.__dataclass_fields__)})")
        kw: dict[str, Any] = {f.name: cfg[key_of(f.name)] for f in fields(cls) if f.name not in CODE_ONLY}
        kw.update({k: v for k, v in overrides.items() if v is not None})
        for name, value in kw.items():  # the schema's integers are ints, its numbers floats
            want = _KEYS.get(key_of(name), {}).get("type")
            if want in ("integer", "number") and _is_number(value) and math.isfinite(value):
                kw[name] = int(value) if want == "integer" and float(value).is_integer() else (
                    float(value) if want == "number" else value)
        models = kw["models"] or {}
        if not all(isinstance(m, ModelSpec) for m in models.values()):
            models = parse_models(models, "dask config", "tangram.scheduler.models")
        kw["models"] = dict(models)
        kw["replicas"] = _replicas(kw["replicas"] or {})
        return cls(**kw)


def policy_options(raw: Any, where: str = "tangram.scheduler.policy-options") -> dict[str, float]:
    """The tangram policy's knobs by name (``TangramOptions`` fields, ``-`` or ``_``), each a finite number >= 0,
    as a dict of field names to floats; a ConfigError names the first bad knob or value."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(where, raw, "must map knobs of the tangram policy to numbers, e.g. {grow: 1}")
    known = TangramOptions.__dataclass_fields__
    out: dict[str, float] = {}
    for key, value in raw.items():
        name = key.replace("-", "_") if isinstance(key, str) else key
        at = f"{where}.{key}" if where.startswith("tangram.") else f"{where} {key}"
        if name not in known:
            near = difflib.get_close_matches(str(name), list(known), n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ConfigError(at, value, f"{key!r} is not a knob of the tangram policy ({hint}knobs, with - or _: "
                                         f"{', '.join(known)})")
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise ConfigError(at, value, f"{value!r} is not a finite number >= 0")
        out[name] = float(value)
    return out


def knob_pairs(pairs: Sequence[str], where: str) -> dict[str, float]:
    """``KNOB=VALUE`` strings (the preload's ``--tangram-option``, the simulator's ``-o``) as the mapping
    :func:`policy_options` reads; a ConfigError names a pair without ``=`` or a value that is not a number."""
    out: dict[str, float] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(where, pair, f"{pair!r}: expected KEY=VALUE with KEY one of "
                                           f"{', '.join(TangramOptions.__dataclass_fields__)}")
        try:
            out[key] = float(value)
        except ValueError:
            raise ConfigError(where, pair, f"{pair!r}: {value!r} is not a number") from None
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_field(name: str, value: Any) -> None:
    """One scalar field against the schema's type and minimum, as a ConfigError naming its key."""
    key = key_of(name)
    rule = _KEYS[key]
    where = f"tangram.scheduler.{key}"
    if rule.get("type") == "boolean":
        if not isinstance(value, bool):
            raise ConfigError(where, value, f"{value!r} is not true or false")
        return
    if not _is_number(value) or not math.isfinite(value):
        raise ConfigError(where, value, f"{value!r} is not a finite number")
    if rule.get("type") == "integer" and not float(value).is_integer():
        raise ConfigError(where, value, f"{value!r} is not an integer")
    if "minimum" in rule and value < rule["minimum"]:
        raise ConfigError(where, value, f"{value!r} is below the minimum {rule['minimum']}")
    if "exclusiveMinimum" in rule and value <= rule["exclusiveMinimum"]:
        raise ConfigError(where, value, f"{value!r} must be greater than {rule['exclusiveMinimum']}")


def _replicas(raw: Mapping[str, Any]) -> dict[str, tuple[tuple[str, tuple[int, ...]], ...]]:
    out = {}
    for worker, reps in raw.items():
        try:
            out[str(worker)] = tuple((str(m), tuple(int(g) for g in gpus)) for m, gpus in reps)
        except (TypeError, ValueError):
            raise ConfigError(f"tangram.scheduler.replicas.{worker}", reps,
                              "must be a list of [model, [gpu, ...]] pairs") from None
    return out
