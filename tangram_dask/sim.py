"""The discrete-event simulator: the contract's world, driving a policy object.

Pure: no Dask import. One heap keyed ``(time, order, seq)``: completions
(order 0) before issues (order 1) before trajectory starts (order 2) at the
same instant, then one scheduling pass. The simulator owns the truth (true
durations, what is resident, where each trajectory's state lives) and charges
each decision its costs; the policy only ever sees hints and completions.
With ``audit=True`` an independent ledger checks every decision: no slot,
GPU, GPU memory or token is ever over-allocated, replicas exist where used.
Always (audit or not), a replica is loaded on the contract's number of GPUs
(the smallest k >= units.min whose share fits a GPU), unless the policy names
the options that take it beyond (``Policy.beyond_contract``).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .cluster import ClusterSpec
from .costs import CostModel
from .errors import FileFormatError
from .metrics import act_ideal
from .policy.base import Policy
from .policy.feasibility import Capacity, never_fits
from .policy.types import Admit, Load, Reject, Start
from .workload import Generated

COMPLETE, ISSUE, BEGIN, LOADED = 0, 1, 2, 3


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
    spans: list[tuple[float, float, str, int]] | None = None  # with trace=True: (start, end, resource, units)


class _Timed:
    """The policy, with the time spent inside each call added up (``time_policy``)."""

    def __init__(self, pol: Policy, timer: Callable[[], float]):
        self.pol, self.timer, self.s = pol, timer, 0.0

    def __getattr__(self, name: str):
        f = getattr(self.pol, name)
        if not callable(f):
            return f

        def timed(*a):
            t0 = self.timer()
            try:
                return f(*a)
            finally:
                self.s += self.timer() - t0
        return timed


def trajectory_hints(gen: Generated, ideal: np.ndarray, sigma: float) -> np.ndarray:
    """Beyond WORKLOAD.md (opt-in): what an RL framework may know of each trajectory's length before it
    starts (the same prompt's rollouts in earlier epochs): its ideal length (LLM delays plus ``ideal``,
    each action's ideal time) x exp(sigma x N(0, 1)), drawn from a stream of its own, so every other draw
    stays. The simulator and the live benchmark give the same hints."""
    length = np.add.reduceat(gen.llm + ideal, gen.first[:-1]) if gen.n_actions else np.zeros(0)
    noise = np.random.default_rng((gen.spec.seed, 0x68696E74)).standard_normal(gen.n_trajectories)
    return length * np.exp(sigma * noise)


class Simulator:
    """One heap of ``(time, order, seq, payload)``; three handlers; one scheduling pass per instant.

    The simulator owns the truth (true durations, where each trajectory's state
    lives) and charges every decision through :class:`~tangram_dask.costs.CostModel`,
    the same model the live plugin writes into grants.
    """

    def __init__(self, gen: Generated, cluster: ClusterSpec, policy: Policy, *, audit: bool = False,
                 progress: Callable[[int, int], None] | None = None, time_policy: bool = False,
                 timer: Callable[[], float] | None = None, trace: bool = False,
                 trajectory_hint_sigma: float | None = None):
        self.gen = gen
        self.hint_sigma = trajectory_hint_sigma
        self.trace = trace
        self.cluster = cluster
        self.policy = policy
        self.audit = _Audit(cluster, gen.spec.models, policy) if audit else None
        self.progress = progress
        self.timer = timer or _no_clock
        self.time_policy = time_policy and timer is not None
        self.costs = CostModel.of(cluster, gen.spec.models)

    # -- the core -------------------------------------------------------------------
    def run(self) -> SimResult:
        t_wall = self.timer()
        check_fits(self.gen, self.cluster)
        self._setup()
        pol = _Timed(self.policy, self.timer) if self.time_policy else self.policy
        self.pol = pol
        heap, pop = self.heap, heapq.heappop
        handlers = (self._complete, self._issue, self._begin, self._loaded)
        apply = {Start: self._start, Admit: self._admit, Reject: self._rejected, Load: self._load}
        progress, next_report, n = self.progress, 0, self.n
        schedule = pol.schedule
        self._begin_step(0, 0.0)
        events = 0
        while heap:
            now = heap[0][0]
            while heap and heap[0][0] == now:
                _, order, _, x = pop(heap)
                events += 1
                handlers[order](x, now)
            for d in schedule(now):
                apply[d.__class__](d, now)
            if progress is not None and self.done >= next_report:
                progress(self.done, n)
                next_report = self.done + max(1, n // 100)
        self.events += events
        if progress is not None:
            progress(n, n)
        if self.done != n:
            raise AuditError(f"{self.policy.name}: {n - self.done} of {n} actions never completed; left waiting with "
                             f"nothing running: {self._stuck()} (a policy bug, or a policy that cannot serve this "
                             f"workload on this cluster)")
        return SimResult(self.policy.name, self.issue, self.end, self.ideal, self.step_start, self.step_end,
                         self.ideal_step, self.loads, self.colds, self.restores, self.busy, self.cluster.capacity(),
                         self.policy.decisions, pol.s if self.time_policy else 0.0, self.timer() - t_wall,
                         self.events, self.spans)

    def _push(self, t: float, order: int, x: int) -> None:
        heapq.heappush(self.heap, (t, order, self.seq, x))
        self.seq += 1

    def _setup(self) -> None:
        g, spec = self.gen, self.gen.spec
        kinds = spec.kinds
        self.n = n = g.n_actions
        self.first = g.first.tolist()
        self.kind = g.kind.tolist()
        self.llm = g.llm.tolist()
        self.dur = g.duration.tolist()
        self.hint = g.hint.tolist()
        self.issue = np.full(n, np.nan)  # NaN: not issued yet (named by _stuck with run_s < 0: not started)
        self.end = np.zeros(n)
        self.per_step = spec.trajectories
        self.traj_of = np.repeat(np.arange(g.n_trajectories), np.diff(g.first)).tolist()
        self.names = [f"{t // self.per_step}/{t % self.per_step}" for t in range(g.n_trajectories)]
        self.index = {name: t for t, name in enumerate(self.names)}
        self.proto = [k.spec(None, "t") for k in kinds]
        self.stateful = [k.affinity == "trajectory" for k in kinds]
        self.ideal = act_ideal(g, self.cluster)
        self.traj_hint = (trajectory_hints(g, self.ideal, self.hint_sigma).tolist()
                          if self.hint_sigma is not None else None)
        self.home: dict[int, str] = {}
        self._cost_of: dict[tuple, tuple[float, float]] = {}
        self.run_s = [-1.0] * n  # set when it starts
        self.busy = {"cpu": 0.0, "gpu": 0.0, "api": 0.0}
        self.loads = self.colds = self.restores = 0
        self.heap: list[tuple] = []
        self.seq = self.events = self.done = self.remaining = 0
        self.step_start: list[float] = []
        self.step_end: list[float] = []
        self.ideal_step: list[float] = []
        self.spans = [] if self.trace else None  # what each start holds, when: opt-in (plots)
        self.begun = self.admitted = 0
        self.gpu_memory = {n.name: n.gpu_memory_gb for n in self.cluster.gpu_nodes}
        self.units_min: dict[str, tuple[int, ...]] = {}  # per model: the units.min of its kinds (_check_size)
        for kd in kinds:
            if kd.resource == "gpu" and kd.model:
                self.units_min[kd.model] = (*self.units_min.get(kd.model, ()), kd.units_min)

    # -- handlers -------------------------------------------------------------------
    def _begin_step(self, s: int, now: float) -> None:
        self.step_start.append(now)
        lo, hi = s * self.per_step, (s + 1) * self.per_step
        first, llm, ideal = self.first, self.llm, self.ideal
        self.ideal_step.append(max(sum(llm[first[t]:first[t + 1]]) + float(ideal[first[t]:first[t + 1]].sum())
                                   for t in range(lo, hi)))
        self.remaining = hi - lo
        self._push(now, BEGIN, s)

    def _begin(self, s: int, now: float) -> None:
        self.begun += self.per_step
        hints = self.traj_hint
        for t in range(s * self.per_step, (s + 1) * self.per_step):
            self.pol.begin_trajectory(self.names[t], now, None if hints is None else hints[t])

    def _issue(self, a: int, now: float) -> None:
        self.issue[a] = now
        self.pol.submit(a, self.proto[self.kind[a]].instance(self.hint[a], self.names[self.traj_of[a]]), now)

    def _complete(self, a: int, now: float) -> None:
        self.end[a] = now
        self.done += 1
        if self.audit:
            self.audit.finish(a)
        self.pol.finish(a, now, self.run_s[a])
        t = self.traj_of[a]
        if a + 1 < self.first[t + 1]:
            heapq.heappush(self.heap, (now + self.llm[a + 1], ISSUE, self.seq, a + 1))  # _push, inlined
            self.seq += 1
            return
        name = self.names[t]  # the reward ended: the trajectory is done
        self.pol.end_trajectory(name, now)
        if self.audit:
            self.audit.end_trajectory(name)
        self.home.pop(t, None)
        self.remaining -= 1
        if self.remaining == 0:
            self.step_end.append(now)
            s = len(self.step_end)
            if s < self.gen.spec.steps:
                self._begin_step(s, now + self.gen.spec.train_time_s)

    def _start(self, d: Start, now: float) -> None:
        a = d.action
        k = self.kind[a]
        spec = self.proto[k]
        restore = False
        if self.stateful[k]:  # the truth: where the trajectory's state is
            t = self.traj_of[a]
            prev = self.home.get(t)
            restore = prev is not None and prev != d.node
            if restore and self.audit and not d.restore:
                raise AuditError(f"action {a} moved trajectory {self.names[t]} from {prev} to {d.node} without "
                                 f"restore")
            self.home[t] = d.node
        key = (k, d.sandbox, restore, d.load, d.units, d.cross_group)
        sf = self._cost_of.get(key)
        if sf is None:  # the cost model, asked once per shape: setup, and the run time's factor (linear in
            # the true duration)
            sf = self._cost_of[key] = (self.costs.setup_s(spec, sandbox=d.sandbox, restore=restore, load=d.load),
                                       self.costs.run_s(spec, d.units, 1.0, d.cross_group))
        setup, f = sf
        r = self.dur[a] * f
        self.restores += restore
        self.colds += d.sandbox == "cold"
        self.loads += d.load
        if d.load:
            self._check_size(spec.model, d.node, d.gpus, (spec.units_min,), f"action {a} ({spec.kind})")
        if self.audit:
            self.audit.start(a, d, self.gen.spec.kinds[k], now)
        self.run_s[a] = r
        self.busy[spec.resource] += d.units * (setup + r)
        if self.spans is not None:
            self.spans.append((now, now + setup + r, spec.resource, d.units))
        heapq.heappush(self.heap, (now + setup + r, COMPLETE, self.seq, a))  # _push, inlined
        self.seq += 1

    def _load(self, d: Load, now: float) -> None:
        """A background load: the replica is ready after the cost model's ``load_s``; no action waits in it."""
        load_s = self.costs.load_time_s(d.model)
        self.loads += 1
        self._check_size(d.model, d.node, d.gpus, self.units_min[d.model], f"load of replica {d.replica}")
        if self.audit:
            self.audit.load(d)
        self.busy["gpu"] += len(d.gpus) * load_s
        if self.spans is not None:
            self.spans.append((now, now + load_s, "gpu", len(d.gpus)))
        self._push(now + load_s, LOADED, d.replica)

    def _check_size(self, model: str, node: str, gpus: tuple[int, ...], units_min: tuple[int, ...], who: str) -> None:
        """WORKLOAD.md: "A replica is loaded on the smallest k >= units.min whose share gpu_memory_gb / k fits a
        GPU" (``units_min``: of the action it is loaded for; for a background load, of any kind of its model)."""
        if self.policy.beyond_contract:
            return
        mem = self.gpu_memory[node]
        ks = {self.gen.spec.models[model].replica_gpus(u, mem) for u in units_min}
        if len(gpus) not in ks:
            raise AuditError(f"{who}: a replica of {model} on {len(gpus)} GPUs of {node}, where WORKLOAD.md loads one "
                             f"on {' or '.join(map(str, sorted(ks)))} (the smallest k >= units.min whose share of "
                             f"its {self.gen.spec.models[model].gpu_memory_gb:g} GB fits one GPU of {mem:g} GB)")

    def _loaded(self, rid: int, now: float) -> None:
        if self.audit:
            self.audit.loaded(rid)
        self.pol.loaded(rid, now)

    def _admit(self, d: Admit, now: float) -> None:
        t = self.index[d.trajectory]
        self.admitted += 1
        if self.audit:
            self.audit.admit(d)
        if d.units:  # a sandbox bound for the trajectory's life: started cold, even if that is free
            self.colds += 1
            self.busy["cpu"] += d.units * d.setup_s
            if self.spans is not None:
                self.spans.append((now, now + d.setup_s, "cpu", d.units))
        a0 = self.first[t]
        self._push(now + d.setup_s + self.llm[a0], ISSUE, a0)

    def _rejected(self, d: Reject, now: float) -> None:
        raise AuditError(f"{self.policy.name} rejected action {d.action}: {d.reason}")

    def _stuck(self) -> str:
        """What a stuck run left waiting, by kind: ``2 x judge (gpu, model rm: no replica resident)``."""
        count: dict[int, int] = {}
        waiting = np.flatnonzero(~np.isnan(self.issue) & (np.asarray(self.run_s) < 0))  # issued, not started
        for a in waiting.tolist():
            count[self.kind[a]] = count.get(self.kind[a], 0) + 1
        parts = []
        kinds = self.gen.spec.kinds
        for i, c in sorted(count.items()):
            k = kinds[i]
            what = k.resource
            if k.resource == "gpu":
                what += f", model {k.model}" + ("" if self.policy.gpu.by_model.get(k.model) else
                                                ": no replica resident")
            parts.append(f"{c} x {k.kind} ({what})")
        if self.begun - self.admitted:
            parts.append(f"{self.begun - self.admitted} trajectories not admitted")
        return ", ".join(parts) or "nothing"


def check_fits(gen: Generated, cluster: ClusterSpec) -> None:
    """Every action kind of the run can be served by the cluster at all, whatever the policy.

    The same check the policy applies live (:func:`~tangram_dask.policy.feasibility.never_fits`),
    made up front for the kinds the run uses, naming the workload file and the kind's key.
    """
    spec = gen.spec
    n_tools = len(spec.tools)
    cap = Capacity.of_cluster(cluster)
    where = f"cluster {cluster.name!r}" + (f" ({cluster.source})" if cluster.source else "")
    for i in sorted(set(np.unique(gen.kind).tolist())):
        k = spec.kinds[i]
        sf = never_fits(k.spec(None, "t"), cap, spec.models)
        if sf is not None:
            key = f"tools[{i}]" if i < n_tools else f"rewards[{i - n_tools}]"
            field_ = "model" if k.resource == "gpu" else "units.min"
            raise FileFormatError(spec.source or "<workload>", f"{key}.{field_}",
                                  f"{sf.reason} (on {where})")


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
                self._evict(rid, f"action {a}")
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

    def _evict(self, rid: int, who: str) -> None:
        if rid in self.replica_busy or rid not in self.replicas:
            raise AuditError(f"{who} evicts replica {rid}, which is busy or not resident")
        model, node, gpus = self.replicas.pop(rid)
        share = self.models[model].gpu_memory_gb / len(gpus)
        for i in gpus:
            self.mem[(node, i)] -= share

    def load(self, d: Load) -> None:
        """A background load holds its replica and GPUs (nothing else may run on them) until ``loaded``."""
        who = f"load of replica {d.replica} ({d.model})"
        for rid in d.evict:
            self._evict(rid, who)
        if d.replica in self.replicas:
            raise AuditError(f"{who}: the replica is already resident")
        self._place(d.replica, d.model, d.node, d.gpus)
        cross = len({self.group_of[d.node][i] for i in d.gpus}) > 1
        if cross != d.cross_group:
            raise AuditError(f"{who}: cross_group={d.cross_group} but GPUs {d.gpus} span {cross}")
        for i in d.gpus:
            if self.gpu_busy.get((d.node, i)):
                raise AuditError(f"{who}: GPU {i} on {d.node} is running an action")
            self.gpu_busy[(d.node, i)] = 1
        self.replica_busy.add(d.replica)

    def loaded(self, rid: int) -> None:
        model, node, gpus = self.replicas[rid]
        for i in gpus:
            self.gpu_busy[(node, i)] = 0
        self.replica_busy.discard(rid)

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
