"""The tangram: config namespace: defaults registered, schema complete, overrides reach the plugin."""

from __future__ import annotations

import dask

from tangram_dask import config
from tangram_dask.scheduler import PluginOptions


def _leaves(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        if isinstance(v, dict) and v and k not in ("models", "replicas"):
            out |= _leaves(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def _schema_leaves(node: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.get("properties", {}).items():
        if v.get("type") == "object" and "properties" in v:
            out |= _schema_leaves(v, f"{prefix}{k}.")
        else:
            out.add(f"{prefix}{k}")
    return out


def test_schema_documents_every_default_and_nothing_else():
    assert _leaves(config.DEFAULTS) == _schema_leaves(config.SCHEMA)
    assert "tangram.scheduler.pipeline" in _leaves(config.DEFAULTS)


def test_defaults_are_registered_and_overridable():
    assert dask.config.get("tangram.scheduler.pipeline") == 2
    assert PluginOptions.from_config().pipeline == 2
    with dask.config.set({"tangram.scheduler.pipeline": 0, "tangram.scheduler.api-tokens": 7}):
        opts = PluginOptions.from_config()
        assert (opts.pipeline, opts.api_tokens) == (0, 7)
    assert PluginOptions.from_config(pipeline=3).pipeline == 3
