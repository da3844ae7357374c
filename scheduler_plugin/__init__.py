"""Preload module: ``dask scheduler --preload scheduler_plugin`` installs the tangram plugin.

This is how a scheduler pod (Kubernetes, dask-gateway) loads it. Options
come from the ``tangram.scheduler`` dask config (for example
``DASK_TANGRAM__SCHEDULER__API_TOKENS=8``) or from these flags:

    dask scheduler --preload scheduler_plugin --tangram-policy fifo --tangram-api-tokens 8
    dask scheduler --preload scheduler_plugin --tangram-option admission-knee=0.9 --tangram-option grow=1

Installing it again (a second preload, ``client.register_plugin``) is a no-op.
"""

from __future__ import annotations

from typing import Any

import click

from tangram_dask.dashboard import register_bokeh_apps

# Preloads are imported before the Scheduler builds its Bokeh server: the Tangram page joins
# distributed's dashboard applications now, so the server serves it like its own pages.
register_bokeh_apps()


def _knobs(ctx: Any, param: Any, value: tuple[str, ...]) -> tuple[str, ...]:
    """Check ``--tangram-option`` while ``dask scheduler`` reads its command line, so that a misspelt knob stops
    the scheduler there, as a bad ``--tangram-policy`` does. Checked only in ``dask_setup``, it made distributed
    log "Failed to start preload" and serve on without the plugin (before session 34)."""
    if value:
        from tangram_dask.errors import ConfigError
        from tangram_dask.options import knob_pairs, policy_options

        try:
            policy_options(knob_pairs(value, "--tangram-option"), "--tangram-option")
        except ConfigError as e:
            raise click.BadParameter(str(e)) from None
    return value


@click.command()
@click.option("--tangram-policy", default=None, type=click.Choice(["tangram", "fifo"]),
              help="scheduling policy (default: tangram.scheduler.policy, else tangram)")
@click.option("--tangram-api-tokens", default=None, type=int, help="API quota tokens held by the scheduler")
@click.option("--tangram-pipeline", default=None, type=int, help="extra units per CPU node to dispatch ahead")
@click.option("--tangram-option", "tangram_options", multiple=True, metavar="KNOB=VALUE", callback=_knobs,
              help="a knob of the tangram policy (repeatable), e.g. --tangram-option grow=1 "
                   "(default: tangram.scheduler.policy-options)")
def dask_setup(scheduler: Any, tangram_policy: str | None = None, tangram_api_tokens: int | None = None,
               tangram_pipeline: int | None = None, tangram_options: tuple[str, ...] = ()) -> None:
    from tangram_dask.options import knob_pairs
    from tangram_dask.scheduler import TangramSchedulerPlugin

    knobs = knob_pairs(tangram_options, "--tangram-option") if tangram_options else None
    plugin = TangramSchedulerPlugin(tangram_policy, api_tokens=tangram_api_tokens, pipeline=tangram_pipeline,
                                    policy_options=knobs)
    scheduler.add_plugin(plugin, name=plugin.name, idempotent=True)
