"""The live benchmark: a generated workload replayed on a real LocalCluster through the plugin.

    run_live(workload_spec, cluster_spec, policies=("tangram", "fifo"), time_scale=0.2) -> list[dict]

One worker process per node of the cluster file (CPU node: ``slots`` threads
and resource; GPU node: abstract GPUs declared by config, no device is
touched) plus one worker that runs API calls (``api`` threads and resource);
the API tokens are held by the scheduler plugin. The same draws as the
simulator (``workload.generate``): each trajectory is an asyncio task that
sleeps its scaled LLM delay, submits its action annotated with the
generated hint, awaits it, and so on. An action sleeps, scaled, the setup and
the true duration on its granted units, charged exactly as ``sim.py``
charges a ``Start`` (warm or cold sandbox, restore, model load, Amdahl
scaling, cross-group slowdown). Every time the policy sees is
``wall / time_scale``; the report is rescaled the same way, with the same
JSON keys as :func:`tangram_dask.bench.simulate`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import dask
import numpy as np
from distributed import Client, LocalCluster, Nanny, wait

from .annotate import ANNOTATION
from .cluster import ClusterSpec
from .costs import CostModel
from .messages import Grant, granted
from .metrics import act_floor, act_ideal, summarize
from .policy import TangramOptions, initial_replicas
from .messages import EXPECT_TRAJECTORIES_HANDLER
from .policy.types import Load
from .scheduler import BEGIN_TRAJECTORY_HANDLER, END_TRAJECTORY_HANDLER, TangramSchedulerPlugin, parse_annotation
from .sim import trajectory_hints as _hints
from .spec import ActionSpec
from .workload import Generated, WorkloadSpec, generate

API_WORKER = "api"


def charge(spec: ActionSpec, grant: Grant, duration_s: float,
           cross_group_slowdown: float) -> tuple[float, float]:
    """``(setup, run)`` in workload seconds for an action of true ``duration_s`` on ``grant``: the
    simulator's cost model (the plugin already put the setup it predicts, by that model, in
    ``grant.setup_s``)."""
    run = CostModel(cross_group_slowdown=cross_group_slowdown).run_s(spec, grant.units, duration_s,
                                                                      grant.cross_group)
    return grant.setup_s, run


def play_action(duration_s: float, time_scale: float, slowdown: float) -> None:
    """The action body: sleep (setup + run) x time_scale on what was granted."""
    from distributed import get_worker
    from distributed.worker import thread_state

    ts = get_worker().state.tasks[thread_state.key]
    grant = granted(ts.annotations)
    spec = parse_annotation(ts.annotations[ANNOTATION])
    setup, run = charge(spec, grant, duration_s, slowdown)
    time.sleep((setup + run) * time_scale)


def worker_specs(cluster: ClusterSpec) -> dict[str, dict[str, Any]]:
    """One Nanny per node of the cluster file, plus an API worker when the cluster has tokens."""
    specs: dict[str, dict[str, Any]] = {}
    base = {"memory_limit": 0, "dashboard_address": None, "silence_logs": 40}
    for n in cluster.cpu_nodes:
        specs[n.name] = {"cls": Nanny, "options": {**base, "name": n.name, "nthreads": n.slots,
                                                   "resources": {"slots": n.slots}}}
    for n in cluster.gpu_nodes:
        cfg = {"tangram": {"worker": {"nvml": False, "gpus": n.gpus, "gpu-groups": list(n.groups),
                                      "gpu-memory-gb": n.gpu_memory_gb}}}
        specs[n.name] = {"cls": Nanny, "options": {**base, "name": n.name, "nthreads": n.gpus,
                                                   "resources": {"gpus": n.gpus}, "config": cfg}}
    if cluster.api_tokens:
        specs[API_WORKER] = {"cls": Nanny, "options": {**base, "name": API_WORKER, "nthreads": cluster.api_tokens,
                                                       "resources": {"api": cluster.api_tokens}}}
    return specs


class LivePlugin(TangramSchedulerPlugin):
    """The shipped plugin, but a background load (a ``Load`` decision) is played as actions are: its GPUs are
    abstract and no model is registered on them, so instead of asking the worker to load a replica (which
    would fail: nothing to load), the replica is reported ready after the model's ``load_s``, scaled, as
    ``sim.py`` makes it. A ``Start`` with a load is charged in the action's sleep (:func:`charge`)."""

    async def _send_load(self, d: Load) -> None:
        pol = self.policy
        spec = pol.models.get(d.model) if pol is not None else None
        await asyncio.sleep((spec.load_s if spec is not None else 0.0) * self.options.time_scale)
        self.replica_ready(d.node, d.replica)


def make_plugin(spec: WorkloadSpec, cluster: ClusterSpec, policy: str, time_scale: float,
                pipeline: int | None = None, options: TangramOptions | None = None) -> TangramSchedulerPlugin:
    """The plugin (:class:`LivePlugin`) with the workload's models and the cluster's costs; every other option
    is the shipped default (``pipeline=None``: the plugin's dispatch-ahead as shipped)."""
    reps: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for r in initial_replicas(cluster, spec):
        reps.setdefault(r.node, []).append((r.model, tuple(r.gpus)))
    return LivePlugin(policy, models=spec.models, api_tokens=cluster.api_tokens,
                      replicas={k: tuple(v) for k, v in reps.items()}, time_scale=time_scale,
                      pipeline=pipeline, warm_start_s=cluster.warm_start_s, cold_start_s=cluster.cold_start_s,
                      cross_group_slowdown=cluster.cross_group_slowdown, tangram=options)


async def _run_one(gen: Generated, cluster: ClusterSpec, policy: str, time_scale: float, pipeline: int | None,
                   progress: Callable[[str, int, int], None] | None, low_latency: bool,
                   options: TangramOptions | None = None, hint_sigma: float | None = None) -> dict[str, Any]:
    spec = gen.spec
    kinds = spec.kinds
    n = gen.n_actions
    first, kind = gen.first.tolist(), gen.kind.tolist()
    llm, dur, hint = gen.llm.tolist(), gen.duration.tolist(), gen.hint.tolist()
    per_step = spec.trajectories
    issue, end = np.zeros(n), np.zeros(n)
    busy = {"cpu": 0.0, "gpu": 0.0, "api": 0.0}
    counts = {"loads": 0, "colds": 0, "restores": 0, "done": 0}
    step_start: list[float] = []
    step_end: list[float] = []
    slowdown = cluster.cross_group_slowdown
    plugin = make_plugin(spec, cluster, policy, time_scale, pipeline, options if policy == "tangram" else None)
    plugin.grants = grants = {}
    specs = worker_specs(cluster)
    async with LocalCluster(n_workers=0, processes=True, asynchronous=True, dashboard_address=None,
                            scheduler_kwargs={"plugins": [plugin]}, silence_logs=40) as lc:
        lc.worker_spec.update(specs)
        await lc._correct_state()
        async with Client(lc, asynchronous=True) as client:
            await client.wait_for_workers(len(specs))
            want = len(cluster.cpu_nodes) + len(cluster.gpu_nodes) + (1 if cluster.api_tokens else 0)
            while len(plugin.nodes) < want:  # GPU nodes join with their declaration
                await asyncio.sleep(0.01)
            if low_latency:
                await _low_latency(lc.scheduler, client)
            loop = asyncio.get_running_loop()
            t0 = loop.time()

            def now() -> float:
                return (loop.time() - t0) / time_scale

            async def trajectory(t: int) -> None:
                name = f"{t // per_step}/{t % per_step}"
                await getattr(client.scheduler, BEGIN_TRAJECTORY_HANDLER)(trajectory=name)
                for a in range(first[t], first[t + 1]):
                    if llm[a] > 0:
                        await asyncio.sleep(llm[a] * time_scale)
                    k = kinds[kind[a]]
                    aspec = k.spec(hint[a], name)
                    issue[a] = now()
                    key = f"{k.kind}-{a}"
                    with dask.annotate(**{ANNOTATION: aspec.to_dict()}):
                        fut = client.submit(play_action, dur[a], time_scale, slowdown, pure=False, key=key)
                    await wait(fut)  # completion only: fetching the (empty) result costs a round trip
                    end[a] = now()
                    if fut.status != "finished":
                        await fut  # raises the action's error
                    g = grants.pop(key)
                    setup, run = charge(aspec, g, dur[a], slowdown)
                    busy[k.resource] += g.units * (setup + run)
                    counts["loads"] += g.load
                    counts["colds"] += g.sandbox == "cold"
                    counts["restores"] += g.restore
                    counts["done"] += 1
                    if progress is not None:
                        progress(policy, counts["done"], n)
                await getattr(client.scheduler, END_TRAJECTORY_HANDLER)(trajectory=name)

            hints = None if hint_sigma is None else _hints(gen, _ideal(gen, cluster)[0], hint_sigma).tolist()
            for s in range(spec.steps):
                if s:
                    await asyncio.sleep(spec.train_time_s * time_scale)
                step_start.append(now())
                if hints is not None:  # the step queued whole, with its hints, as the simulator begins it
                    await getattr(client.scheduler, EXPECT_TRAJECTORIES_HANDLER)(trajectories={
                        f"{t // per_step}/{t % per_step}": hints[t] for t in range(s * per_step, (s + 1) * per_step)})
                await asyncio.gather(*(trajectory(t) for t in range(s * per_step, (s + 1) * per_step)))
                step_end.append(now())
            snap = plugin.snapshot()
    ideal, ideal_step = _ideal(gen, cluster)
    out = summarize(gen, policy=policy, issue=issue, end=end, ideal=ideal, step_start=step_start,
                    step_end=step_end, ideal_step=ideal_step, model_loads=counts["loads"] + plugin.stats.loads_ahead,
                    cold_starts=counts["colds"], restores=counts["restores"], busy=busy,
                    capacity=cluster.capacity(), floor=act_floor(gen, cluster))
    out["cluster"] = cluster.name
    if plugin.policy.beyond_contract:  # as the simulator's bench says it (wider replicas than WORKLOAD.md's)
        out["beyond_contract"] = list(plugin.policy.beyond_contract)
    if hint_sigma is not None:
        out["trajectory_hints"] = hint_sigma
    out["live"] = True
    out["time_scale"] = time_scale
    out["decisions"] = snap.get("decisions", 0)
    out["dispatch_us_per_action"] = round(snap["plugin"]["flush_s"] / max(snap["plugin"]["started"], 1) * 1e6, 1)
    return out


def _set_interval(dask_worker: Any, seconds: float) -> None:
    dask_worker.batched_stream.interval = seconds


async def _low_latency(scheduler: Any, client: Client, seconds: float = 0.001) -> None:
    """Shorten Dask's message batching (10 ms client, 5 and 2 ms scheduler, 2 ms worker: tuned for
    throughput) to 1 ms. At time scale 0.05 each 5 ms of batching is 0.1 s of workload time
    added to every action, which the simulator does not have."""
    client.scheduler_comm.interval = seconds
    for bs in [*scheduler.stream_comms.values(), *scheduler.client_comms.values()]:
        bs.interval = seconds
    await client.run(_set_interval, seconds=seconds)


def _ideal(gen: Generated, cluster: ClusterSpec) -> tuple[np.ndarray, list[float]]:
    """Each action alone on units.max with a warm sandbox (the cost model's ideal); each step's longest
    trajectory (as sim.py)."""
    ideal = act_ideal(gen, cluster)
    per_step = gen.spec.trajectories
    first = gen.first.tolist()
    steps = []
    for s in range(gen.spec.steps):
        best = 0.0
        for t in range(s * per_step, (s + 1) * per_step):
            a0, a1 = first[t], first[t + 1]
            best = max(best, float(gen.llm[a0:a1].sum()) + float(ideal[a0:a1].sum()))
        steps.append(best)
    return ideal, steps


def run_live(workload_spec: WorkloadSpec, cluster_spec: ClusterSpec, policies: tuple[str, ...] = ("tangram", "fifo"),
             time_scale: float = 0.2, *, pipeline: int | None = None, low_latency: bool = True,
             progress: Callable[[str, int, int], None] | None = None,
             options: TangramOptions | None = None, trajectory_hints: float | None = None) -> list[dict[str, Any]]:
    """Replay ``generate(workload_spec)`` live for each policy; the metrics of ``bench.simulate``, rescaled.

    ``time_scale``: wall seconds per workload second. Each millisecond Dask takes to dispatch an action
    reads as ``1 / time_scale`` ms of workload time, so the default (0.2: 5 ms) keeps the host's own
    latency out of the comparison with the simulator; at 0.05 a loaded 2-core machine read tangram's
    ACT 10-16% above the simulator's, at 0.2 2-5% (docs/placement.md).
    ``low_latency`` shortens Dask's message batching to 1 ms for the run (see :func:`_low_latency`);
    ``pipeline`` is the plugin's CPU dispatch-ahead (None: as shipped; it pipelines, never changes sizing);
    ``options`` are the tangram policy's knobs, as in the simulator; ``trajectory_hints`` (a sigma, beyond
    WORKLOAD.md) queues each step whole with the simulator's hints (``expect_trajectories``).
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale = {time_scale!r}: must be > 0")
    gen = generate(workload_spec)
    return [asyncio.run(_run_one(gen, cluster_spec, p, time_scale, pipeline, progress, low_latency, options,
                                 trajectory_hints))
            for p in policies]
