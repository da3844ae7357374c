"""``tangram-dask k8s-scale``: every DaskWorkerGroup of a tangram cluster sized from its kind's target.

dask-kubernetes' operator scales only a cluster's default worker group, from
the total of ``/api/v1/adaptive_target``. This scaler reads the per-kind
targets (the scheduler's ``tangram_targets`` RPC, the same figures as
``/api/v1/tangram/targets``) and sets each managed ``DaskWorkerGroup``'s
replicas through its ``scale`` subresource, with the operator's own rules
(:func:`plan_scale`): the target clamped to the group's minimum and maximum,
at most 25% fewer workers at a time (at least 1), and no change during a
15 s cooldown after the last one (annotation
``kubernetes.dask.org/cooldown-until`` on the group, as the operator keeps it
on its ``DaskAutoscaler``).

Before lowering a group it asks the scheduler (``tangram_drain``) to empty
that many of the kind's workers: their trajectory state moves to workers that
stay, and only workers that may leave are offered; the operator then retires
exactly those (its ``/api/v1/retire_workers`` asks ``workers_to_close``, which
offers only them) and deletes their pods.

Which group is which kind: the group's annotation ``tangram.dask.org/kind``,
else the kind whose ``group`` (``tangram.adaptive.kinds`` on the scheduler)
is the group's name. Bounds: the group's annotations
``tangram.dask.org/minimum`` and ``tangram.dask.org/maximum``, else
``--minimum``/``--maximum``. A default group that a ``DaskAutoscaler`` also
scales is left to the operator (two scalers would fight): the scaler logs it
and manages the other groups.

:func:`plan_scale` is pure (tests/test_kubernetes_scaler.py holds its table);
kr8s and distributed are imported inside the functions that talk to the
Kubernetes API and to the scheduler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import click

logger = logging.getLogger("tangram_dask.k8s")

API_VERSION = "kubernetes.dask.org/v1"
COOLDOWN_ANNOTATION = "kubernetes.dask.org/cooldown-until"  # the operator's own key
KIND_ANNOTATION = "tangram.dask.org/kind"
MIN_ANNOTATION = "tangram.dask.org/minimum"
MAX_ANNOTATION = "tangram.dask.org/maximum"
COOLDOWN_S = 15.0  # the operator's
INTERVAL_S = 5.0  # the operator's autoscaler timer


# -- pure ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ScalePlan:
    group: str
    kind: str
    current: int
    target: int
    desired: int
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


def plan_scale(group: str, kind: str, current: int, target: int, minimum: int, maximum: int, now: float,
               cooldown_until: float = 0.0) -> ScalePlan:
    """The operator's ``daskautoscaler_adapt`` rules for one group. Pure."""
    if now < cooldown_until:
        return ScalePlan(group, kind, current, target, current, f"cooldown for {cooldown_until - now:.0f}s")
    desired = min(max(target, minimum), maximum)
    reason = f"target {target}" + (f" clamped to [{minimum}, {maximum}]" if desired != target else "")
    if current > 0 and desired < current:
        step = max(int(current * 0.25), 1)
        if current - step > desired:
            desired = current - step
            reason += f", down by at most {step} at a time"
    return ScalePlan(group, kind, current, target, desired, reason)


def _annotation(annotations: Mapping[str, str], key: str, default: Any, convert: Callable[[Any], Any], what: str):
    """``convert`` of the annotation ``key`` (``default`` where absent), else ValueError naming it."""
    v = annotations.get(key, default)
    try:
        return convert(v)
    except (TypeError, ValueError):
        raise ValueError(f"annotation {key}={v!r} is not {what}") from None


def bounds_of(annotations: Mapping[str, str], minimum: int, maximum: int) -> tuple[int, int]:
    lo = _annotation(annotations, MIN_ANNOTATION, minimum, int, "a whole number")
    hi = _annotation(annotations, MAX_ANNOTATION, maximum, int, "a whole number")
    if lo < 0 or hi < lo:
        raise ValueError(f"group bounds ({MIN_ANNOTATION}, {MAX_ANNOTATION}) must satisfy 0 <= minimum <= maximum, "
                         f"got [{lo}, {hi}]")
    return lo, hi


def kind_of_group(name: str, annotations: Mapping[str, str], kinds: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The kind a worker group holds: its annotation, else the kind whose ``group`` is its name."""
    k = annotations.get(KIND_ANNOTATION)
    if k:
        return k if k in kinds else None
    for kname, kt in kinds.items():
        if (kt.get("group") or kname) == name:
            return kname
    return None


# -- the Dask side -------------------------------------------------------------------------------
async def read_targets(scheduler: str) -> dict[str, Any]:
    """The per-kind targets, from the scheduler's ``tangram_targets`` RPC."""
    from distributed.core import rpc
    async with rpc(scheduler) as s:
        return await s.tangram_targets()


async def drain(scheduler: str, kind: str, n: int) -> dict[str, Any]:
    """Ask the scheduler to empty up to ``n`` workers of ``kind``; returns the names that may leave."""
    from distributed.core import rpc
    async with rpc(scheduler) as s:
        return await s.tangram_drain(kind=kind, n=n)


# -- the Kubernetes side -------------------------------------------------------------------------
async def _groups(api: Any, cluster: str, namespace: str) -> list[dict[str, Any]]:
    async with api.call_api("GET", version=API_VERSION, url="daskworkergroups", namespace=namespace,
                            params={"labelSelector": f"dask.org/cluster-name={cluster}"}) as r:
        items = r.json().get("items", [])
    return [g for g in items if g.get("spec", {}).get("cluster") == cluster]


async def _autoscaled(api: Any, cluster: str, namespace: str) -> bool:
    async with api.call_api("GET", version=API_VERSION, url="daskautoscalers", namespace=namespace) as r:
        return any(a.get("spec", {}).get("cluster") == cluster for a in r.json().get("items", []))


async def _scale(api: Any, namespace: str, group: str, replicas: int) -> None:
    """Set a group's replicas through its ``scale`` subresource."""
    async with api.call_api("PATCH", version=API_VERSION, url=f"daskworkergroups/{group}/scale",
                            namespace=namespace, content=json.dumps({"spec": {"replicas": replicas}}),
                            headers={"Content-Type": "application/merge-patch+json"}):
        pass


async def _annotate(api: Any, namespace: str, group: str, annotations: Mapping[str, str]) -> None:
    async with api.call_api("PATCH", version=API_VERSION, url=f"daskworkergroups/{group}", namespace=namespace,
                            content=json.dumps({"metadata": {"annotations": dict(annotations)}}),
                            headers={"Content-Type": "application/merge-patch+json"}):
        pass


async def scale_once(api: Any, cluster: str, namespace: str, scheduler: str, *, minimum: int = 0,
                     maximum: int = 10, now: Callable[[], float] = time.time,
                     cooldown_s: float = COOLDOWN_S) -> list[ScalePlan]:
    """One pass: read the targets, plan every managed group, drain, scale, annotate the cooldown."""
    targets = await read_targets(scheduler)
    kinds = targets["kinds"]
    default = f"{cluster}-default"
    operator_scales_default = await _autoscaled(api, cluster, namespace)
    plans: list[ScalePlan] = []
    for g in await _groups(api, cluster, namespace):
        meta = g.get("metadata", {})
        name = meta.get("name", "")
        ann = meta.get("annotations") or {}
        kind = kind_of_group(name, ann, kinds)
        if kind is None:
            continue
        if name == default and operator_scales_default:
            logger.warning("tangram k8s-scale: %s is scaled by a DaskAutoscaler (the operator); leaving it to "
                           "it. Delete the DaskAutoscaler to have every group sized per kind.", name)
            continue
        current = int(g.get("spec", {}).get("worker", {}).get("replicas", 0))
        try:
            lo, hi = bounds_of(ann, minimum, maximum)
            cooldown_until = _annotation(ann, COOLDOWN_ANNOTATION, 0.0, float, "a time")
        except ValueError as e:  # one group's bad annotation: that group is left as it is, the others scale
            logger.error("tangram k8s-scale: group %s is not scaled: %s", name, e)
            continue
        t = now()
        plan = plan_scale(name, kind, current, int(kinds[kind]["target"]), lo, hi, t, cooldown_until)
        if plan.changes and plan.desired < current:
            out = await drain(scheduler, kind, current - plan.desired)
            may_go = len(out.get("workers", ()))
            if may_go < current - plan.desired:
                desired = current - may_go
                plan = ScalePlan(name, kind, current, plan.target, desired,
                                 plan.reason + f"; only {may_go} workers may leave now")
        if plan.changes:
            await _scale(api, namespace, name, plan.desired)
            await _annotate(api, namespace, name, {COOLDOWN_ANNOTATION: str(now() + cooldown_s)})
            logger.info("tangram k8s-scale: %s (%s) %d -> %d: %s", name, kind, current, plan.desired, plan.reason)
        plans.append(plan)
    return plans


async def run(cluster: str, namespace: str, scheduler: str, *, interval: float = INTERVAL_S, minimum: int = 0,
              maximum: int = 10, once: bool = False, api: Any = None) -> None:
    import kr8s.asyncio
    api = api if api is not None else await kr8s.asyncio.api()
    while True:
        try:
            await scale_once(api, cluster, namespace, scheduler, minimum=minimum, maximum=maximum)
        except Exception:
            if once:
                raise
            logger.exception("tangram k8s-scale: a pass failed; trying again in %gs", interval)
        if once:
            return
        await asyncio.sleep(interval)


@click.command("k8s-scale")
@click.option("--cluster", required=True, help="the DaskCluster's name")
@click.option("--namespace", default="default", show_default=True)
@click.option("--scheduler", default=None,
              help="the scheduler's comm address (default tcp://CLUSTER-scheduler.NAMESPACE:8786)")
@click.option("--interval", default=INTERVAL_S, show_default=True, type=float, help="seconds between passes")
@click.option("--minimum", default=0, show_default=True, type=int,
              help=f"workers per group when the group has no {MIN_ANNOTATION} annotation")
@click.option("--maximum", default=10, show_default=True, type=int,
              help=f"workers per group when the group has no {MAX_ANNOTATION} annotation")
@click.option("--once", is_flag=True, help="one pass, then exit")
def k8s_scale(cluster: str, namespace: str, scheduler: str | None, interval: float, minimum: int, maximum: int,
              once: bool) -> None:
    """Size every DaskWorkerGroup of a tangram cluster from the scheduler's per-kind targets."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    scheduler = scheduler or f"tcp://{cluster}-scheduler.{namespace}:8786"
    asyncio.run(run(cluster, namespace, scheduler, interval=interval, minimum=minimum, maximum=maximum, once=once))
