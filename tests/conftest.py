"""Helpers to build tiny workloads, clusters and hand-written runs for the pure core's tests.

Workloads and clusters are written as the dicts a YAML file would hold and go
through ``parse_workload`` / ``parse_cluster``, so every test also exercises
the file format. ``hand_run`` builds a :class:`~tangram_dask.workload.Generated`
by hand (exact kinds, LLM delays and durations per trajectory) for cases whose
answer is worked out on paper; ``simulate`` runs any of them under audit and
records every decision the policy made. ``wait_on_scheduler`` is for the live
tests: it waits until what a client submitted has reached the scheduler;
``stop_workers_then_scheduler`` tears down ``dask scheduler`` / ``dask worker``
processes a test started.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any, Hashable, Sequence

import numpy as np
import pytest

from tangram_dask.cluster import ClusterSpec, parse_cluster
from tangram_dask.metrics import act_floor, summarize
from tangram_dask.policy import make_policy
from tangram_dask.policy.base import Policy
from tangram_dask.policy.types import Admit, Start
from tangram_dask.sim import SimResult, Simulator
from tangram_dask.workload import Generated, WorkloadSpec, generate, parse_workload


def const(value: float) -> dict[str, Any]:
    return {"dist": "constant", "value": value}


def kind(name: str, resource: str = "cpu", dur: float = 1.0, *, units: tuple[int, int] = (1, 1),
         p: float | None = None, weight: float = 1.0, **extra: Any) -> dict[str, Any]:
    """One action kind of a workload file, with a constant duration unless ``duration_s`` is given."""
    d: dict[str, Any] = {"kind": name, "weight": weight, "resource": resource,
                         "units": {"min": units[0], "max": units[1]}, "duration_s": const(dur)}
    if p is not None:
        d["speedup"] = {"model": "amdahl", "parallel_fraction": p}
    d.update(extra)
    return d


def workload_dict(tools: list[dict] | None = None, rewards: list[dict] | None = None, *,
                  trajectories: int = 1, turns: int | dict = 1, llm: float | dict = 1.0, hint_sigma: float = 0.0,
                  **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": "hand", "seed": 0, "trajectories": trajectories,
        "turns": turns if isinstance(turns, dict) else const(turns),
        "llm_time_s": llm if isinstance(llm, dict) else const(llm), "hint_sigma": hint_sigma,
        "tools": tools if tools is not None else [kind("tool", dur=1.0)],
        "rewards": rewards if rewards is not None else [kind("reward", dur=1.0)],
    }
    d.update(extra)
    return d


def make_workload(tools: list[dict] | None = None, rewards: list[dict] | None = None, **kw: Any) -> WorkloadSpec:
    return parse_workload(workload_dict(tools, rewards, **kw), "<test workload>")


def cluster_dict(*, cpu: list[dict] | None = None, gpu: list[dict] | None = None, tokens: int | None = None,
                 cold: float = 0.0, warm: float = 0.0, slowdown: float = 2.0) -> dict[str, Any]:
    d: dict[str, Any] = {"name": "hand", "sandbox": {"cold_start_s": cold, "warm_start_s": warm}}
    if cpu is not None:
        d["cpu"] = {"nodes": cpu}
    if gpu is not None:
        d["gpu"] = {"nodes": gpu, "cross_group_slowdown": slowdown}
    if tokens is not None:
        d["api"] = {"tokens": tokens}
    return d


def make_cluster(**kw: Any) -> ClusterSpec:
    return parse_cluster(cluster_dict(**kw), "<test cluster>")


def hand_run(spec: WorkloadSpec, trajectories: list[list[tuple[float, str, float]]]) -> Generated:
    """A run written out by hand: per trajectory, ``(llm_delay, kind, true_duration)`` per action.

    The last action of each trajectory is its reward (its LLM delay must be 0,
    as the contract issues it as soon as the last tool action ends). Hints
    equal the true durations. ``spec.trajectories * spec.steps`` must equal
    the number of trajectories given.
    """
    assert len(trajectories) == spec.trajectories * spec.steps
    names = [k.kind for k in spec.kinds]
    first, kinds, llm, dur = [0], [], [], []
    for actions in trajectories:
        assert actions[-1][0] == 0.0, "a reward is issued with no LLM delay"
        assert spec.kinds[names.index(actions[-1][1])] in spec.rewards
        for delay, name, d in actions:
            kinds.append(names.index(name))
            llm.append(delay)
            dur.append(d)
        first.append(len(kinds))
    dur_a = np.asarray(dur, dtype=float)
    return Generated(spec, np.asarray(first, dtype=np.int64), np.asarray(kinds, dtype=np.int16),
                     np.asarray(llm, dtype=float), dur_a, dur_a.copy())


@dataclass
class Run:
    """One simulated run: the raw result, the contract's metrics and every decision, with its time."""

    result: SimResult
    metrics: dict[str, Any]
    decisions: list[tuple[float, Start | Admit]]
    policy: Policy

    @property
    def act(self) -> np.ndarray:
        return self.result.end - self.result.issue

    def starts(self) -> dict[int, tuple[float, Start]]:
        """Action id -> (time, its Start decision)."""
        return {d.action: (t, d) for t, d in self.decisions if isinstance(d, Start)}

    def admits(self) -> list[tuple[float, Admit]]:
        return [(t, d) for t, d in self.decisions if isinstance(d, Admit)]


def record(policy: Policy) -> list[tuple[float, Start | Admit]]:
    """Record every decision ``policy.schedule`` returns, with the time it was asked at."""
    log: list[tuple[float, Start | Admit]] = []
    inner = policy.schedule

    def schedule(now: float):
        out = inner(now)
        log.extend((now, d) for d in out)
        return out

    policy.schedule = schedule  # type: ignore[method-assign]
    return log


def simulate(gen: Generated | WorkloadSpec, cluster: ClusterSpec, policy: str, *, audit: bool = True,
             options: Any = None) -> Run:
    """Run ``policy`` on ``gen`` (or on ``generate(spec)``) under audit, recording its decisions."""
    if isinstance(gen, WorkloadSpec):
        gen = generate(gen)
    pol = make_policy(policy, cluster, gen.spec, options=options)
    log = record(pol)
    res = Simulator(gen, cluster, pol, audit=audit).run()
    metrics = summarize(gen, policy=policy, issue=res.issue, end=res.end, ideal=res.ideal,
                        step_start=res.step_start, step_end=res.step_end, ideal_step=res.ideal_step,
                        model_loads=res.model_loads, cold_starts=res.cold_starts, restores=res.restores,
                        busy=res.busy, capacity=res.capacity, floor=act_floor(gen, cluster))
    return Run(res, metrics, log, pol)


# -- hand-made cases shared by several policies' tests -------------------------------------------
def standard_on_tight(trajectories: int = 128) -> tuple[WorkloadSpec, ClusterSpec]:
    """The standard workload file with ``trajectories`` on the tight cluster file: the bad-input tests' run, in
    which one action or trajectory is changed and the others' step compared with the same run's without it."""
    import dataclasses
    from pathlib import Path

    from tangram_dask.cluster import load_cluster
    from tangram_dask.workload import load_workload

    root = Path(__file__).resolve().parents[1] / "resources" / "bench"
    return (dataclasses.replace(load_workload(root / "standard.yaml"), trajectories=trajectories),
            load_cluster(root / "cluster-tight.yaml"))


def lru_case() -> tuple[Generated, ClusterSpec]:
    """One 80 GB GPU, three 40 GB models (two fit at once), A resident at t = 0 (most demand).

    One trajectory, LLM 1 s between turns, 1 s actions, load 10 s:
    t=1 B: not resident, fits beside A, no eviction: ACT 10 + 1, ends 12 (B last used 12)
    t=13 A: resident and idle: ACT 1, ends 14 (A last used 14)
    t=15 C: needs room: evicts the least recently used, B (12 < 14): ACT 11, ends 26
    t=26 reward B: evicts A (14 < 26, C used later): ACT 11, ends 37.
    """
    wl = make_workload(
        [kind("tool"), kind("gA", "gpu", model="A", weight=1.0), kind("gB", "gpu", model="B", weight=0.1),
         kind("gC", "gpu", model="C", weight=0.1)],
        [kind("rB", "gpu", model="B", weight=0.1)],
        models={m: {"gpu_memory_gb": 40, "load_s": 10} for m in ("A", "B", "C")})
    gen = hand_run(wl, [[(1.0, "gB", 1.0), (1.0, "gA", 1.0), (1.0, "gC", 1.0), (0.0, "rB", 1.0)]])
    return gen, make_cluster(cpu=[{"slots": 1}], gpu=[{"gpus": 1, "gpu_memory_gb": 80}])


def topology_case() -> tuple[Generated, ClusterSpec]:
    """One node of 4 GPUs in groups [1, 3]; rm S (10 GB) dominates demand, L (100 GB) needs 2 GPUs.

    Static split at t = 0: S on GPU 0 (group 0), L on GPUs 1,2 (group 1), S on GPU 3.
    Two trajectories: a 1 s tool, then an L reward of 4 s, both issued at t = 2.
    """
    wl = make_workload([kind("tool")],
                       [kind("rS", "gpu", dur=10.0, model="S", weight=0.9),
                        kind("rL", "gpu", dur=4.0, model="L", units=(2, 2), weight=0.1)],
                       trajectories=2, models={"S": {"gpu_memory_gb": 10, "load_s": 5},
                                               "L": {"gpu_memory_gb": 100, "load_s": 30}})
    gen = hand_run(wl, [[(1.0, "tool", 1.0), (0.0, "rL", 4.0)]] * 2)
    cl = make_cluster(cpu=[{"slots": 2}], gpu=[{"gpus": 4, "gpu_memory_gb": 80, "groups": [1, 3]}], slowdown=2.0)
    return gen, cl


def approx(x: Any) -> Any:
    return pytest.approx(x, rel=1e-12, abs=1e-12)


def deep(d: dict) -> dict:
    return copy.deepcopy(d)


def bwrap_or_skip() -> str:
    """The bwrap sandbox backend, or skip the test saying why bubblewrap cannot run here."""
    from tangram_dask.sandbox import bwrap_available

    ok, why = bwrap_available()
    if not ok:
        pytest.skip(f"bubblewrap unusable here: {why}")
    return "bwrap"


# -- live clusters -----------------------------------------------------------------------------------------
def _task_states(dask_scheduler: Any, keys: list) -> list[str | None]:
    tasks = dask_scheduler.tasks
    return [tasks[k].state if k in tasks else None for k in keys]


def wait_on_scheduler(client: Any, keys: Sequence[Hashable], *, timeout: float = 30.0,
                      what: str = "") -> list[str | None]:
    """Wait, with a deadline, until every key has reached the scheduler.

    The client sends its submissions in batches, and the scheduler builds the graph partly off its event
    loop: a key just submitted may not be in ``scheduler.tasks`` yet (KeyError, or a state read as None).
    Read on the scheduler's event loop (``run_on_scheduler``), a task is seen either not at all or with its
    ``update-graph`` fully applied (parked, queued...), never half-added, as a read from the test's own
    thread could see it. Returns each key's state, in the order of ``keys``.
    """
    keys = list(keys)
    deadline = time.monotonic() + timeout
    while True:
        states = client.run_on_scheduler(_task_states, keys=keys)
        if None not in states:
            return states
        assert time.monotonic() < deadline, \
            f"timed out after {timeout:g} s waiting for {what or 'the tasks to reach the scheduler'}: " \
            f"{dict(zip(keys, states))}"
        time.sleep(0.02)


def stop_workers_then_scheduler(scheduler: subprocess.Popen, workers: Sequence[subprocess.Popen],
                                timeout: float = 20.0) -> None:
    """SIGTERM the workers and wait for them, then the scheduler: a worker's nanny whose scheduler is already
    gone retries it for up to 20 s before it exits (the manifest test took 26 s for that). What is still
    running after ``timeout`` is killed, with its process group where it leads one (``start_new_session``)."""
    for group in (list(workers), [scheduler]):
        for p in group:
            if p.poll() is None:
                p.terminate()
        for p in group:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    if os.getpgid(p.pid) == p.pid:
                        os.killpg(p.pid, signal.SIGKILL)
                    else:
                        p.kill()
                except ProcessLookupError:
                    pass
                p.wait()
