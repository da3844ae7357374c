"""Marking a Dask task as an action: one annotation namespace, ``tangram``.

    with tangram_dask.action(kind="run_tests", resource="cpu", units=(1, 8),
                             hint_s=12, trajectory="t-17"):
        fut = client.submit(run_tests, repo)

or, shorter, ``tangram_dask.submit_action(client, run_tests, repo, kind=..., ...)``.
The spec is validated here, at the call, so a wrong spec never reaches the
scheduler.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import dask

from .spec import ActionSpec, check_keywords, make_spec

#: The Dask annotation key under which an action's spec travels.
ANNOTATION = "tangram"


@contextmanager
def action(kind: str, resource: str = "cpu", units: int | tuple[int, int] = 1, **fields: Any) -> Iterator[ActionSpec]:
    """Annotate every task submitted inside the block as an action of this spec.

    Fields: ``speedup`` (Amdahl parallel fraction), ``hint_s``, ``trajectory``,
    ``model`` (gpu), ``affinity`` ('trajectory'), ``restore_s``, ``timeout_s``.
    Raises :class:`tangram_dask.SpecError` at once for a wrong spec, an
    unknown field, or ``grant`` (reserved: the scheduler writes it).
    """
    check_keywords(fields)
    spec = make_spec(kind, resource, units, **fields)
    with dask.annotate(**{ANNOTATION: spec.to_dict()}):
        yield spec


def submit_action(client: Any, fn: Callable[..., Any], *args: Any, kind: str, resource: str = "cpu",
                  units: int | tuple[int, int] = 1, spec_fields: dict[str, Any] | None = None,
                  **kwargs: Any) -> Any:
    """``client.submit(fn, *args, **kwargs)`` as an action; spec fields in ``spec_fields``.

    Dask's own submit keywords (``key``, ``pure``, ``retries``...) pass through in ``kwargs``.
    """
    fields = {} if spec_fields is None else spec_fields
    check_keywords(fields)
    with action(kind, resource, units, **fields):
        return client.submit(fn, *args, **kwargs)
