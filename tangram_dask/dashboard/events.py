"""Tangram's decisions as Dask events.

``emit(scheduler, what, **fields)`` logs ``{"action": "tangram-<what>", **fields}``
under the topic ``"tangram"`` (``client.get_events("tangram")``,
``client.subscribe_topic("tangram", handler)``). Loads, evictions, rejections
and errors also go to ``"all"``, what the dashboard's events page shows (by the
``action`` field); placements (one per action) and admissions (one per
trajectory) do not: they would flood that page, and a second topic doubles the
cost of each (about 10 us per topic).
``what`` is one of :data:`KINDS`. Fields must be msgpack-serializable; a task key is sent as its
string form.
"""

from __future__ import annotations

from typing import Any

#: The decisions that are logged.
KINDS = ("placement", "load", "eviction", "rejection", "error", "admission")
TOPIC = "tangram"
_TOPICS = [TOPIC, "all"]
_QUIET = ("placement", "admission")  # one per action or per trajectory: the topic "tangram" alone


def emit(scheduler: Any, what: str, **fields: Any) -> None:
    """Log one tangram decision on ``scheduler`` (see the module docstring)."""
    if what not in KINDS:
        raise ValueError(f"tangram event {what!r}: must be one of {', '.join(KINDS)}")
    if "key" in fields:
        fields["key"] = str(fields["key"])
    scheduler.log_event(TOPIC if what in _QUIET else _TOPICS, {"action": f"tangram-{what}", **fields})
