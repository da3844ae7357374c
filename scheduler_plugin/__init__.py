"""Preload module: ``dask scheduler --preload scheduler_plugin`` installs the tangram plugin.

This is how a scheduler pod (Kubernetes, dask-gateway) loads it. Options
come from the ``tangram.scheduler`` dask config (for example
``DASK_TANGRAM__SCHEDULER__API_TOKENS=8``) or from these flags:

    dask scheduler --preload scheduler_plugin --tangram-policy fifo --tangram-api-tokens 8

Installing it again (a second preload, ``client.register_plugin``) is a no-op.
"""

from __future__ import annotations

from typing import Any

import click

from tangram_dask.dashboard import register_bokeh_apps

# Preloads are imported before the Scheduler builds its Bokeh server: the Tangram page joins
# distributed's dashboard applications now, so the server serves it like its own pages.
register_bokeh_apps()


@click.command()
@click.option("--tangram-policy", default=None, type=click.Choice(["tangram", "fifo"]),
              help="scheduling policy (default: tangram.scheduler.policy, else tangram)")
@click.option("--tangram-api-tokens", default=None, type=int, help="API quota tokens held by the scheduler")
@click.option("--tangram-pipeline", default=None, type=int, help="extra units per CPU node to dispatch ahead")
def dask_setup(scheduler: Any, tangram_policy: str | None = None, tangram_api_tokens: int | None = None,
               tangram_pipeline: int | None = None) -> None:
    from tangram_dask.scheduler import TangramSchedulerPlugin

    plugin = TangramSchedulerPlugin(tangram_policy, api_tokens=tangram_api_tokens, pipeline=tangram_pipeline)
    scheduler.add_plugin(plugin, name=plugin.name, idempotent=True)
