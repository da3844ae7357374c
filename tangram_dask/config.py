"""The ``tangram:`` dask config namespace: defaults from tangram.yaml (schema: tangram-schema.yaml)."""

from __future__ import annotations

from pathlib import Path

import dask.config
import yaml

HERE = Path(__file__).parent
DEFAULTS = yaml.safe_load((HERE / "tangram.yaml").read_text())
SCHEMA = yaml.safe_load((HERE / "tangram-schema.yaml").read_text())

dask.config.update_defaults(DEFAULTS)
