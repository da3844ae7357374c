"""The discrete-event simulator: the contract's world, driving a policy object.

Pure: no Dask import. One heap keyed ``(time, order, seq)``: completions
(order 0) before issues (order 1) before trajectory starts (order 2) at the
same instant, then one scheduling pass. The simulator owns the truth (true
durations, what is resident, where each trajectory's state lives) and charges
each decision its costs; the policy only ever sees hints and completions.
With ``audit=True`` an independent ledger checks every decision: no slot,
GPU, GPU memory or token is ever over-allocated, replicas exist where used.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .cluster import ClusterSpec
from .errors import FileFormatError
from .policy.base import Policy
from .policy.types import Admit, Start
from .workload import Generated

COMPLETE, ISSUE, BEGIN = 0, 1, 2


def _no_clock() -> float:
    """The simulator keeps no clock of its own: callers that want wall times inject one."""
    return 0.0


class AuditError(AssertionError):
    """A policy decision broke the contract (over-allocation, unknown replica...)."""


@dataclass
class SimResult:
    policy: str
    issue: np.ndarray
    end: np.ndarray
    ideal: np.ndarray
    step_start: list[float]
    step_end: list[float]
    ideal_step: list[float]
    model_loads: int = 0
    cold_starts: int = 0
    restores: int = 0
    busy: dict[str, float] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)
    decisions: int = 0
    policy_s: float = 0.0
    wall_s: float = 0.0
    events: int = 0


class Simulator:
    def __init__(self, gen: Generated, cluster: ClusterSpec, policy: Policy, *, audit: bool = False,
                 progress: Callable[[int, int], None] | None = None, time_policy: bool = False,
                 timer: Callable[[], float] | None = None):
        self.gen = gen
        self.cluster = cluster
        self.policy = policy
        self.audit = _Audit(cluster, gen.spec.models, policy) if audit else None
        self.progress = progress
        self.timer = timer or _no_clock
        self.time_policy = time_policy and timer is not None

    def run(self) -> SimResult:
        t_wall = self.timer()
        check_fits(self.gen, self.cluster)
        g, spec, cl, pol = self.gen, self.gen.spec, self.cluster, self.policy
        kinds = spec.kinds
        n = g.n_actions
        first = g.first.tolist()
        kind = g.kind.tolist()
        llm = g.llm.tolist()
        dur = g.duration.tolist()
        hint = g.hint.tolist()
        issue = np.zeros(n)
        end = np.zeros(n)
        n_traj_step = spec.trajectories
        traj_of = np.repeat(np.arange(g.n_trajectories), np.diff(g.first)).tolist()
        names = [f"{t // n_traj_step}/{t % n_traj_step}" for t in range(g.n_trajectories)]
        index = {name: t for t, name in enumerate(names)}
        # per kind: resource, scale(k) table, affinity/restore, ideal factor
        k_res = [k.resource for k in kinds]
        k_aff = [k.affinity == "trajectory" for k in kinds]
        k_restore = [k.restore_s for k in kinds]
        k_model = [k.model for k in kinds]
        proto = [k.spec(None, "t") for k in kinds]
        k_scale = [[p.scale(min(u, k.units_max)) if u >= k.units_min else 1.0 for u in range(max(k.units_max, 64) + 1)]
                   for p, k in zip(proto, kinds)]
        ideal_f = [p.scale(k.units_max) for p, k in zip(proto, kinds)]
        warm, cold = cl.warm_start_s, cl.cold_start_s
        slowdown = cl.cross_group_slowdown
        load_s = {m: ms.load_s for m, ms in spec.models.items()}
        ideal = np.array([dur[a] * ideal_f[kind[a]] + (warm if k_res[kind[a]] == "cpu" else 0.0) for a in range(n)])
        home: dict[int, str] = {}
        run_s = [0.0] * n
        busy = {"cpu": 0.0, "gpu": 0.0, "api": 0.0}
        loads = colds = restores = 0
        heap: list[tuple] = []
        push, pop = heapq.heappush, heapq.heappop
        seq = 0
        step_start: list[float] = []
        step_end: list[float] = []
        ideal_step: list[float] = []
        remaining = 0
        audit = self.audit
        pol_t = 0.0
        perf = self.timer
        timing = self.time_policy
        events = 0
        done = 0
        waiting: dict[int, None] = {}  # issued, not started: named if the run gets stuck
        begun = admitted = 0
        progress = self.progress
        next_report = 0

        def begin_step(s: int, now: float) -> None:
            nonlocal remaining, seq
            step_start.append(now)
            lo, hi = s * n_traj_step, (s + 1) * n_traj_step
            best = 0.0
            for t in range(lo, hi):
                a0, a1 = first[t], first[t + 1]
                best = max(best, sum(llm[a0:a1]) + float(ideal[a0:a1].sum()))
            ideal_step.append(best)
            remaining = hi - lo
            push(heap, (now, BEGIN, seq, s))
            seq += 1

        begin_step(0, 0.0)
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] == now:
                _, order, _, x = pop(heap)
                events += 1
                if order == COMPLETE:
                    a = x
                    end[a] = now
                    done += 1
                    if audit:
                        audit.finish(a)
                    if timing:
                        t0 = perf()
                        pol.finish(a, now, run_s[a])
                        pol_t += perf() - t0
                    else:
                        pol.finish(a, now, run_s[a])
                    t = traj_of[a]
                    if a + 1 == first[t + 1]:  # the reward ended: the trajectory is done
                        pol.end_trajectory(names[t], now)
                        if audit:
                            audit.end_trajectory(names[t])
                        home.pop(t, None)
                        remaining -= 1
                        if remaining == 0:
                            step_end.append(now)
                            s = len(step_end)
                            if s < spec.steps:
                                begin_step(s, now + spec.train_time_s)
                    else:
                        push(heap, (now + llm[a + 1], ISSUE, seq, a + 1))
                        seq += 1
                elif order == ISSUE:
                    a = x
                    issue[a] = now
                    waiting[a] = None
                    k = kind[a]
                    sp = proto[k].instance(hint[a], names[traj_of[a]])
                    if timing:
                        t0 = perf()
                        pol.submit(a, sp, now)
                        pol_t += perf() - t0
                    else:
                        pol.submit(a, sp, now)
                else:
                    s = x
                    begun += n_traj_step
                    for t in range(s * n_traj_step, (s + 1) * n_traj_step):
                        pol.begin_trajectory(names[t], now)
            if timing:
                t0 = perf()
                decisions = pol.schedule(now)
                pol_t += perf() - t0
            else:
                decisions = pol.schedule(now)
            for d in decisions:
                if d.__class__ is Start:
                    a = d.action
                    waiting.pop(a, None)
                    k = kind[a]
                    res = k_res[k]
                    if res == "cpu":
                        setup = warm if d.sandbox == "warm" else (cold if d.sandbox == "cold" else 0.0)
                        if d.sandbox == "cold":
                            colds += 1
                        if k_aff[k]:
                            t = traj_of[a]
                            prev = home.get(t)
                            if prev is not None and prev != d.node:
                                setup += k_restore[k]
                                restores += 1
                                if audit and not d.restore:
                                    raise AuditError(f"action {a} moved trajectory {names[t]} from {prev} to {d.node} without restore")
                            home[t] = d.node
                        r = dur[a] * k_scale[k][d.units]
                    elif res == "gpu":
                        setup = 0.0
                        if d.load:
                            setup = load_s[k_model[k]]
                            loads += 1
                        r = dur[a] * k_scale[k][d.units]
                        if d.cross_group:
                            r *= slowdown
                    else:
                        setup = 0.0
                        r = dur[a] * k_scale[k][d.units]
                    if audit:
                        audit.start(a, d, kinds[k], now)
                    run_s[a] = r
                    busy[res] += d.units * (setup + r)
                    push(heap, (now + setup + r, COMPLETE, seq, a))
                    seq += 1
                else:  # Admit
                    t = index[d.trajectory]
                    admitted += 1
                    if audit:
                        audit.admit(d)
                    if d.units:  # a sandbox bound for the trajectory's life: started cold, even if that is free
                        colds += 1
                        busy["cpu"] += d.units * d.setup_s
                    a0 = first[t]
                    push(heap, (now + d.setup_s + llm[a0], ISSUE, seq, a0))
                    seq += 1
            if progress is not None and done >= next_report:
                progress(done, n)
                next_report = done + max(1, n // 100)
        if progress is not None:
            progress(n, n)
        if done != n:
            stuck = n - done
            raise AuditError(f"{pol.name}: {stuck} of {n} actions never completed; left waiting with nothing "
                             f"running: {_stuck(waiting, kind, kinds, pol, begun - admitted)} (a policy bug, "
                             f"or a policy that cannot serve this workload on this cluster)")
        return SimResult(pol.name, issue, end, ideal, step_start, step_end, ideal_step, loads, colds, restores,
                         busy, cl.capacity(), pol.decisions, pol_t, self.timer() - t_wall, events)


def _stuck(waiting: dict[int, None], kind: list[int], kinds: tuple, pol: Policy, unadmitted: int) -> str:
    """What a stuck run left waiting, by kind: ``2 x judge (gpu, model rm: no replica resident)``."""
    count: dict[int, int] = {}
    for a in waiting:
        count[kind[a]] = count.get(kind[a], 0) + 1
    parts = []
    for i, c in sorted(count.items()):
        k = kinds[i]
        what = k.resource
        if k.resource == "gpu":
            what += f", model {k.model}" + ("" if pol.gpu.by_model.get(k.model) else ": no replica resident")
        parts.append(f"{c} x {k.kind} ({what})")
    if unadmitted:
        parts.append(f"{unadmitted} trajectories not admitted")
    return ", ".join(parts) or "nothing"


def check_fits(gen: Generated, cluster: ClusterSpec) -> None:
    """Every action kind of the run can be served by the cluster at all, whatever the policy.

    A kind that can never fit (more slots than any CPU node has, more tokens
    than the quota, a replica larger than any GPU node) would wait forever;
    this says so up front, naming the workload file and the kind's key.
    """
    spec = gen.spec
    n_tools = len(spec.tools)
    max_slots = max((n.slots for n in cluster.cpu_nodes), default=0)
    for i in sorted(set(np.unique(gen.kind).tolist())):
        k = spec.kinds[i]
        key = f"tools[{i}]" if i < n_tools else f"rewards[{i - n_tools}]"
        where = f"cluster {cluster.name!r}" + (f" ({cluster.source})" if cluster.source else "")
        if k.resource == "cpu" and k.units_min > max_slots:
            raise FileFormatError(spec.source or "<workload>", f"{key}.units.min",
                                  f"{k.kind} needs {k.units_min} sandbox slots on one CPU node; the largest "
                                  f"CPU node of {where} has {max_slots}")
        if k.resource == "api" and k.units_min > cluster.api_tokens:
            raise FileFormatError(spec.source or "<workload>", f"{key}.units.min",
                                  f"{k.kind} needs {k.units_min} API tokens; {where} has {cluster.api_tokens}")
        if k.resource == "gpu":
            m = spec.models[k.model]
            if not any(m.replica_gpus(k.units_min, n.gpu_memory_gb) <= n.gpus for n in cluster.gpu_nodes):
                raise FileFormatError(spec.source or "<workload>", f"{key}.model",
                                      f"a replica of {k.model} ({m.gpu_memory_gb:g} GB, units.min {k.units_min}) "
                                      f"fits no GPU node of {where}")


class _Audit:
    """An independent ledger: what each decision holds, checked against capacity."""

    def __init__(self, cluster: ClusterSpec, models: dict, policy: Policy):
        self.slots = {n.name: n.slots for n in cluster.cpu_nodes}
        self.used = {n.name: 0 for n in cluster.cpu_nodes}
        self.tokens = cluster.api_tokens
        self.tokens_used = 0
        self.gpu_nodes = {n.name: n for n in cluster.gpu_nodes}
        self.group_of = {n.name: n.group_of() for n in cluster.gpu_nodes}
        self.gpu_busy: dict[tuple[str, int], int] = {}
        self.mem: dict[tuple[str, int], float] = {}
        self.models = models
        self.replicas: dict[int, tuple[str, str, tuple[int, ...]]] = {}
        self.replica_busy: set[int] = set()
        self.holding: dict[int, tuple] = {}
        self.bindings: dict[str, tuple[str, int, int]] = {}
        for rid, r in policy.gpu.replicas.items():  # the resident replicas at t = 0
            self._place(rid, r.model, r.node, r.gpus)

    def _place(self, rid: int, model: str, node: str, gpus: tuple[int, ...]) -> None:
        share = self.models[model].gpu_memory_gb / len(gpus)
        cap = self.gpu_nodes[node].gpu_memory_gb
        for i in gpus:
            if not 0 <= i < self.gpu_nodes[node].gpus:
                raise AuditError(f"replica {rid} on {node} names GPU {i}, which does not exist")
            m = self.mem.get((node, i), 0.0) + share
            if m > cap + 1e-6:
                raise AuditError(f"GPU memory over-allocated on {node} GPU {i}: {m:g} GB > {cap:g} GB")
            self.mem[(node, i)] = m
        self.replicas[rid] = (model, node, gpus)

    def admit(self, d: Admit) -> None:
        self.bindings[d.trajectory] = (d.node, d.units, d.tokens)
        if d.units:
            self._take_slots(d.node, d.units)
        if d.tokens:
            self._take_tokens(d.tokens)

    def _take_slots(self, node: str, k: int) -> None:
        self.used[node] += k
        if self.used[node] > self.slots[node]:
            raise AuditError(f"CPU slots over-allocated on {node}: {self.used[node]} > {self.slots[node]}")

    def _take_tokens(self, k: int) -> None:
        self.tokens_used += k
        if self.tokens_used > self.tokens:
            raise AuditError(f"API tokens over-allocated: {self.tokens_used} > {self.tokens}")

    def start(self, a: int, d: Start, kind, now: float) -> None:
        if not (kind.units_min <= d.units) or (kind.resource != "gpu" and d.units > kind.units_max):
            raise AuditError(f"action {a} ({kind.kind}) got {d.units} units outside {kind.units_min}..{kind.units_max}")
        if kind.resource == "cpu":
            if d.sandbox != "bound":
                self._take_slots(d.node, d.units)
            self.holding[a] = ("cpu", d.node, d.units, d.sandbox == "bound")
        elif kind.resource == "api":
            if d.sandbox != "bound":
                self._take_tokens(d.units)
            self.holding[a] = ("api", d.units, d.sandbox == "bound")
        else:
            for rid in d.evict:
                if rid in self.replica_busy or rid not in self.replicas:
                    raise AuditError(f"action {a} evicts replica {rid}, which is busy or not resident")
                model, node, gpus = self.replicas.pop(rid)
                share = self.models[model].gpu_memory_gb / len(gpus)
                for i in gpus:
                    self.mem[(node, i)] -= share
            if d.load:
                if d.replica in self.replicas:
                    raise AuditError(f"action {a} loads replica {d.replica}, which is already resident")
                self._place(d.replica, kind.model, d.node, d.gpus)
            rep = self.replicas.get(d.replica)
            if rep is None or rep[0] != kind.model or rep[1] != d.node or rep[2] != d.gpus:
                raise AuditError(f"action {a} ({kind.model}) uses replica {d.replica}, which is {rep}")
            if d.replica in self.replica_busy:
                raise AuditError(f"replica {d.replica} serves two actions at once")
            if len(d.gpus) != d.units:
                raise AuditError(f"action {a}: {d.units} units on GPUs {d.gpus}")
            cross = len({self.group_of[d.node][i] for i in d.gpus}) > 1
            if cross != d.cross_group:
                raise AuditError(f"action {a}: cross_group={d.cross_group} but GPUs {d.gpus} span {cross}")
            for i in d.gpus:
                if self.gpu_busy.get((d.node, i)):
                    raise AuditError(f"GPU {i} on {d.node} runs two actions at once")
                self.gpu_busy[(d.node, i)] = 1
            self.replica_busy.add(d.replica)
            self.holding[a] = ("gpu", d.node, d.gpus, d.replica)

    def end_trajectory(self, name: str) -> None:
        node, units, tokens = self.bindings.pop(name)
        if units:
            self.used[node] -= units
        self.tokens_used -= tokens

    def finish(self, a: int) -> None:
        h = self.holding.pop(a)
        if h[0] == "cpu" and not h[3]:
            self.used[h[1]] -= h[2]
        elif h[0] == "api" and not h[2]:
            self.tokens_used -= h[1]
        elif h[0] == "gpu":
            for i in h[2]:
                self.gpu_busy[(h[1], i)] = 0
            self.replica_busy.discard(h[3])
