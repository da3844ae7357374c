"""The ``tangram:`` dask config namespace: defaults from tangram.yaml, checked against tangram-schema.yaml.

Importing this module registers the shipped defaults with dask. Code that
reads the config goes through :func:`validate` (or :func:`effective`), never
``dask.config.get("tangram...")`` alone: dask's config may have been reset
to a snapshot taken before tangram_dask was imported (distributed's test
harness does that before every test), and then only the shipped defaults in
:data:`DEFAULTS` say what a key's value is.

    validate("scheduler")  # -> the effective tangram.scheduler dict, or ConfigError naming key and value
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any, Mapping

import dask.config
import jsonschema
import yaml

from .errors import ConfigError, _show

HERE = Path(__file__).parent
DEFAULTS: dict[str, Any] = yaml.safe_load((HERE / "tangram.yaml").read_text())
SCHEMA: dict[str, Any] = yaml.safe_load((HERE / "tangram-schema.yaml").read_text())
SECTIONS: tuple[str, ...] = tuple(DEFAULTS["tangram"])

dask.config.update_defaults(DEFAULTS)

_VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
_TYPE_WORDS = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
               "object": "a mapping", "array": "a list", "null": "null"}


def _plain(value: Any) -> Any:
    """A deep copy with tuples as lists (YAML's and JSON schema's arrays) and mappings as dicts."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _normalise(section: str, user: Any) -> Any:
    """Keys of one section spelled as tangram.yaml spells them (``api_tokens`` -> ``api-tokens``).

    dask does this itself when it merges a key into a config that has the
    default; after a reset to a snapshot without tangram's defaults it cannot.
    """
    if not isinstance(user, Mapping):
        return user
    known = DEFAULTS["tangram"].get(section, {})
    out: dict[Any, Any] = {}
    for k, v in user.items():
        alt = k.replace("_", "-") if isinstance(k, str) else k
        out[alt if alt in known else k] = v
    return out


def effective(section: str | None = None) -> dict[str, Any]:
    """The config in force: the shipped defaults with dask's ``tangram:`` config merged over them.

    ``section`` is ``"scheduler"`` or ``"worker"`` (that section's dict), or
    None for the whole ``tangram`` mapping. Not validated: see :func:`validate`.
    """
    if section is not None and section not in SECTIONS:
        raise ConfigError(f"tangram.{section}", section, f"no such config section; the sections are "
                                                         f"{', '.join(SECTIONS)}")
    user = dask.config.get("tangram", default=None)
    merged: dict[str, Any] = copy.deepcopy(DEFAULTS["tangram"])
    if user is None:
        pass
    elif not isinstance(user, Mapping):
        merged = user  # validate() names it
    else:
        for name, value in user.items():
            value = _normalise(name, value)
            if isinstance(value, Mapping) and isinstance(merged.get(name), dict):
                for k, v in value.items():
                    merged[name][k] = copy.deepcopy(v)
            else:
                merged[name] = copy.deepcopy(value)
    merged = _plain(merged)
    if section is None:
        return merged
    return merged[section] if isinstance(merged, dict) else merged


def _path(error: jsonschema.ValidationError) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".")


def _problem(error: jsonschema.ValidationError) -> tuple[str, Any, str]:
    """(key path, value, problem) for one schema violation, in words."""
    path, value, v = _path(error), error.instance, error.validator
    if v == "additionalProperties" and isinstance(value, Mapping):
        allowed = set(error.schema.get("properties", {}))
        extra = sorted((k for k in value if k not in allowed), key=str)
        if extra and error.schema.get("additionalProperties") is False:
            where = f"{path}.{extra[0]}"
            known = ", ".join(sorted(allowed)) or "none"
            return where, value[extra[0]], f"unknown key (known keys: {known})"
    if v == "type":
        want = error.validator_value
        words = " or ".join(_TYPE_WORDS.get(t, t) for t in ([want] if isinstance(want, str) else want))
        return path, value, f"{_show(value)} is not {words}"
    if v == "enum":
        return path, value, f"{_show(value)} is not one of {', '.join(map(str, error.validator_value))}"
    if v == "minimum":
        return path, value, f"{_show(value)} is below the minimum {error.validator_value}"
    if v == "exclusiveMinimum":
        return path, value, f"{_show(value)} must be greater than {error.validator_value}"
    if v == "required":
        return path, value, f"{error.message} (a model needs gpu_memory_gb and load_s)"
    return path, value, f"{_show(value)}: {error.message}"


def _non_finite(value: Any, path: str) -> tuple[str, Any] | None:
    """The first float that is nan or infinite, or int beyond 64 bits, under ``value``."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
        return path, value
    if isinstance(value, Mapping):
        for k, v in value.items():
            if (found := _non_finite(v, f"{path}.{k}")) is not None:
                return found
    if isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _non_finite(v, f"{path}[{i}]")) is not None:
                return found
    return None


_FIX = " (every key is documented in tangram_dask/tangram-schema.yaml)"


def validate(section: str | None = None) -> dict[str, Any]:
    """The effective ``tangram.<section>`` config (or all of ``tangram``), checked against the schema.

    Raises :class:`~tangram_dask.errors.ConfigError` naming the key path and
    the value of the first problem found (``tangram.scheduler.polcy: unknown
    key``; ``tangram.worker.slots: 'eight' is not an integer``).
    """
    cfg = effective(section)
    doc = {"tangram": {section: cfg} if section is not None else cfg}
    found = _non_finite(doc["tangram"], "tangram")  # first: jsonschema's messages cannot show a huge int
    if found is not None:
        raise ConfigError(found[0], found[1], f"{_show(found[1])} is not a finite number (within 64 bits)" + _FIX)
    errors = sorted(_VALIDATOR.iter_errors(doc), key=lambda e: (len(e.absolute_path), _path(e), e.validator))
    if errors:
        key, value, problem = _problem(errors[0])
        raise ConfigError(key, value, problem + _FIX)
    return cfg


