"""Workload files (format v1) and the deterministic generation of one run.

Pure: no Dask import. ``generate(spec)`` draws every random quantity from one
``numpy.random.default_rng(seed)`` in the order WORKLOAD.md fixes, so the
simulator and the live benchmark see the same trajectories, turns, delays,
kinds, true durations and hints.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from functools import partial
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .cluster import ModelSpec, parse_models
from .errors import FileFormatError
from .formats import Reader, choice, load_yaml, number, text, whole
from .spec import ActionSpec


@dataclass(frozen=True, slots=True)
class Dist:
    """A distribution of the format: lognormal, geometric, constant or uniform."""

    dist: str
    a: float = 0.0  # median | mean | value | low
    b: float = 0.0  # sigma  | max (0 = none) | - | high

    def draw(self, rng: np.random.Generator) -> float:
        d = self.dist
        if d == "lognormal":
            return self.a * math.exp(self.b * rng.standard_normal())
        if d == "constant":
            return self.a
        if d == "uniform":
            return float(rng.uniform(self.a, self.b))
        # geometric: whole numbers >= 1
        n = int(rng.geometric(1.0 / self.a))
        return float(min(n, int(self.b)) if self.b else n)

    @property
    def median(self) -> float:
        d = self.dist
        if d in ("lognormal", "constant"):
            return self.a
        if d == "uniform":
            return (self.a + self.b) / 2
        p = 1.0 / self.a
        med = max(1.0, math.ceil(-math.log(2) / math.log1p(-p)) if p < 1 else 1.0)
        return min(med, self.b) if self.b else med

    @property
    def mean(self) -> float:
        d = self.dist
        if d == "lognormal":
            return self.a * math.exp(self.b ** 2 / 2)
        if d == "constant":
            return self.a
        if d == "uniform":
            return (self.a + self.b) / 2
        return self.a


@dataclass(frozen=True, slots=True)
class ActionKind:
    """One kind of action of a workload (a tool or a reward)."""

    kind: str
    weight: float
    resource: str
    units_min: int
    units_max: int
    parallel_fraction: float
    duration: Dist
    model: str | None = None
    affinity: str | None = None
    restore_s: float = 0.0

    def spec(self, hint_s: float | None, trajectory: str | None) -> ActionSpec:
        return ActionSpec(self.kind, self.resource, self.units_min, self.units_max, self.parallel_fraction,
                          hint_s, trajectory, self.model, self.affinity, self.restore_s)


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    seed: int
    trajectories: int
    turns: Dist
    llm_time_s: Dist
    tools: tuple[ActionKind, ...]
    rewards: tuple[ActionKind, ...]
    models: dict[str, ModelSpec]
    steps: int = 1
    train_time_s: float = 0.0
    hint_sigma: float = 1.0
    static_sandbox_units: int = 2
    source: str = ""

    @property
    def kinds(self) -> tuple[ActionKind, ...]:
        """Tools then rewards; an action's kind index points in here."""
        return self.tools + self.rewards

    @property
    def has_api(self) -> bool:
        return any(k.resource == "api" for k in self.kinds)


@dataclass(frozen=True)
class Generated:
    """Every draw of a run, as flat arrays.

    Trajectory ``j`` of step ``s`` is ``tid = s * trajectories + j``; its
    actions are ``first[tid] .. first[tid + 1] - 1`` in issue order, the last
    one being its reward. ``llm[a]`` is the LLM delay before action ``a``
    (0 for rewards, which are issued as soon as the last tool action ends).
    """

    spec: WorkloadSpec
    first: np.ndarray  # int64, len n_traj + 1
    kind: np.ndarray   # int16 index into spec.kinds
    llm: np.ndarray    # float64
    duration: np.ndarray
    hint: np.ndarray

    @property
    def n_actions(self) -> int:
        return len(self.kind)

    @property
    def n_trajectories(self) -> int:
        return len(self.first) - 1


def generate(spec: WorkloadSpec, *, batched: bool = True) -> Generated:
    """The workload's actions, drawn as WORKLOAD.md "Details" orders the draws. ``batched`` (where every
    duration is lognormal) takes consecutive normal draws in one call: the same arrays, faster."""
    rng = np.random.default_rng(spec.seed)
    tools, rewards = spec.tools, spec.rewards
    cum_t = _cumulative(tools)
    cum_r = _cumulative(rewards)
    if batched and all(d.dist == "lognormal" for d in (spec.llm_time_s, *(k.duration for k in tools + rewards))):
        return _generate_lognormal(spec, rng, cum_t, cum_r)
    n_tools = len(tools)
    sigma = spec.hint_sigma
    first = [0]
    kind: list[int] = []
    llm: list[float] = []
    dur: list[float] = []
    hint: list[float] = []
    normal, random_, exp = rng.standard_normal, rng.random, math.exp
    turns_d = spec.turns
    llm_draw = _sampler(spec.llm_time_s, rng)
    tool_d = [_sampler(k.duration, rng) for k in tools]
    rew_d = [_sampler(k.duration, rng) for k in rewards]
    for _step in range(spec.steps):
        for _j in range(spec.trajectories):
            turns = max(1, int(round(turns_d.draw(rng))))
            for _t in range(turns):
                llm.append(llm_draw())
                i = min(bisect_right(cum_t, random_()), n_tools - 1)
                d = tool_d[i]()
                kind.append(i)
                dur.append(d)
                hint.append(d * exp(sigma * normal()))
            i = min(bisect_right(cum_r, random_()), len(rewards) - 1)
            d = rew_d[i]()
            kind.append(n_tools + i)
            llm.append(0.0)
            dur.append(d)
            hint.append(d * exp(sigma * normal()))
            first.append(len(kind))
    return Generated(spec, np.asarray(first, dtype=np.int64), np.asarray(kind, dtype=np.int16),
                     np.asarray(llm), np.asarray(dur), np.asarray(hint))


def _generate_lognormal(spec: WorkloadSpec, rng: np.random.Generator, cum_t: list[float],
                        cum_r: list[float]) -> Generated:
    """:func:`generate` where the LLM delay and every duration are lognormal (the scale run's million
    actions): the same draws in the same order, so the same workload to the bit, with the normal draws
    that follow one another taken in one call (a turn's duration, its hint and the next turn's LLM delay:
    ``standard_normal(3)`` gives what three calls give)."""
    n_tools, n_rewards = len(spec.tools), len(spec.rewards)
    sigma = spec.hint_sigma
    tool_ab = [(k.duration.a, k.duration.b) for k in spec.tools]
    rew_ab = [(k.duration.a, k.duration.b) for k in spec.rewards]
    la, lb = spec.llm_time_s.a, spec.llm_time_s.b
    first = [0]
    kind: list[int] = []
    llm: list[float] = []
    dur: list[float] = []
    hint: list[float] = []
    normal, random_, exp, turns_d = rng.standard_normal, rng.random, math.exp, spec.turns
    for _step in range(spec.steps):
        for _j in range(spec.trajectories):
            turns = max(1, int(round(turns_d.draw(rng))))
            z = normal()  # the first turn's LLM delay
            for t in range(turns):
                llm.append(la * exp(lb * z))
                i = min(bisect_right(cum_t, random_()), n_tools - 1)
                if t + 1 < turns:
                    zd, zh, z = normal(3).tolist()
                else:
                    zd, zh = normal(2).tolist()
                a, b = tool_ab[i]
                d = a * exp(b * zd)
                kind.append(i)
                dur.append(d)
                hint.append(d * exp(sigma * zh))
            i = min(bisect_right(cum_r, random_()), n_rewards - 1)
            zd, zh = normal(2).tolist()
            a, b = rew_ab[i]
            d = a * exp(b * zd)
            kind.append(n_tools + i)
            llm.append(0.0)
            dur.append(d)
            hint.append(d * exp(sigma * zh))
            first.append(len(kind))
    return Generated(spec, np.asarray(first, dtype=np.int64), np.asarray(kind, dtype=np.int16),
                     np.asarray(llm), np.asarray(dur), np.asarray(hint))


def _sampler(d: Dist, rng: np.random.Generator) -> Callable[[], float]:
    """``d.draw(rng)`` as a call of no arguments; a lognormal written out (the same draws, in the same
    order: the workload is the same to the bit), the others through ``draw``. A million draws in the
    scale run: no method lookup or dispatch on the name per draw."""
    if d.dist == "lognormal":
        a, b, normal, exp = d.a, d.b, rng.standard_normal, math.exp
        return lambda: a * exp(b * normal())
    return partial(d.draw, rng)


def _cumulative(kinds: tuple[ActionKind, ...]) -> list[float]:
    total = sum(k.weight for k in kinds)
    out, acc = [], 0.0
    for k in kinds:
        acc += k.weight
        out.append(acc / total)
    return out


# -- reading -----------------------------------------------------------------
def load_workload(path: str | Path) -> WorkloadSpec:
    """Read a workload file; errors name the file and the key."""
    path = str(path)
    return parse_workload(load_yaml(path), path)


def parse_workload(data: Any, path: str = "<workload>") -> WorkloadSpec:
    if isinstance(data, dict) and ("cpu" in data or "gpu" in data) and "tools" not in data:
        raise FileFormatError(path, "tools", "this looks like a cluster file (cpu/gpu nodes, no tools): the workload "
                                             "comes first, then the cluster (resources/bench/WORKLOAD.md)")
    r = Reader(path, data)
    name = r.get("name", text)
    seed = r.get("seed", whole(0))
    steps = r.get("steps", whole(1), 1)
    train = r.get("train_time_s", number(0), 0.0)
    n = r.get("trajectories", whole(1))
    turns = _dist(r, "turns", integer=True)
    llm = _dist(r, "llm_time_s")
    sigma = r.get("hint_sigma", number(0), 1.0)
    static = r.child("static", None)
    sandbox_units = 2
    if static is not None:
        sandbox_units = static.get("sandbox_units", whole(1), 2)
        static.done()
    models_raw = r.get("models", lambda v, _: v, {})
    models = parse_models(models_raw, path)
    tools = tuple(_kind(item, models) for item in r.items("tools"))
    rewards = tuple(_kind(item, models) for item in r.items("rewards"))
    if not tools:
        raise FileFormatError(path, "tools", "needs at least one tool kind")
    if not rewards:
        raise FileFormatError(path, "rewards", "needs at least one reward kind")
    names = [k.kind for k in tools + rewards]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise FileFormatError(path, "tools/rewards", f"kind {dup[0]!r} is defined twice")
    r.done()
    return WorkloadSpec(name, seed, n, turns, llm, tools, rewards, models, steps, train, sigma, sandbox_units, path)


def _dist(r: Reader, name: str, *, integer: bool = False) -> Dist:
    d = r.child(name)
    kind = d.get("dist", choice("lognormal", "geometric", "constant", "uniform"))
    if kind == "lognormal":
        out = Dist(kind, d.get("median", number(0, open_lo=True)), d.get("sigma", number(0)))
    elif kind == "geometric":
        mean = d.get("mean", number(1))
        mx = d.get("max", whole(1), 0)
        out = Dist(kind, mean, float(mx))
    elif kind == "constant":
        out = Dist(kind, d.get("value", number(1 if integer else 0)))
    else:
        lo = d.get("low", number(0))
        hi = d.get("high", number(0))
        if hi < lo:
            raise d.fail("high", f"must be >= low = {lo}, got {hi}")
        out = Dist(kind, lo, hi)
    d.done()
    return out


def _kind(r: Reader, models: dict[str, ModelSpec]) -> ActionKind:
    kind = r.get("kind", text)
    weight = r.get("weight", number(0, open_lo=True))
    resource = r.get("resource", choice("cpu", "gpu", "api"))
    u = r.child("units", None)
    lo = hi = 1
    if u is not None:
        lo = u.get("min", whole(1), 1)
        hi = u.get("max", whole(1), lo)
        if hi < lo:
            raise u.fail("max", f"must be >= units.min = {lo}, got {hi}")
        u.done()
    pf = 0.0
    sp = r.child("speedup", None)
    if sp is not None:
        sp.get("model", choice("amdahl"), "amdahl")
        pf = sp.get("parallel_fraction", number(0, 1))
        sp.done()
    duration = _dist(r, "duration_s")
    model = r.get("model", text, None)
    if resource == "gpu":
        if model is None:
            raise r.fail("model", "required for gpu actions")
        if model not in models:
            raise r.fail("model", f"{model!r} is not defined under models (defined: {', '.join(models) or 'none'})")
    elif model is not None:
        raise r.fail("model", f"only gpu actions name a model; this one is {resource}")
    affinity = r.get("affinity", choice("trajectory"), None)
    restore = r.get("restore_s", number(0), 0.0)
    if affinity and resource != "cpu":
        raise r.fail("affinity", "only cpu actions can keep state on a node")
    r.done()
    return ActionKind(kind, weight, resource, lo, hi, pf, duration, model, affinity, restore)
