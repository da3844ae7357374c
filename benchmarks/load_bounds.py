"""How much of the GPU-bound gap do model loads make? tangram's ACT/ideal in worlds kinder than WORKLOAD.md's.

Each draw of ``benchmarks/reseed.py`` (the named variants of each family on other seeds) is simulated at the
default options in WORKLOAD.md's world, then in worlds it does not describe, with the same policy code:

- ``no-block``: a background load holds only its own replica; the other models' replicas on its GPUs go on
  serving (WORKLOAD.md: the load holds its GPUs, and "a GPU runs one action at a time");
- ``fast-open``: a background load begun in the first ``--open`` seconds takes 1 s; the policy is not told
  (its rules still read each model's ``load_s``);
- ``fast``: every background load takes 1 s; the policy is not told;
- ``told``: every model's ``load_s`` is 1 s in the workload itself, so the policy plans with it.

Rough bounds, not targets, read over many draws: what a better site or timing for loads could take back is
about what ``no-block`` gives, and what the load time itself costs about what ``fast`` gives (one draw can go
either way: the policy's later decisions change with the world). Prints, per family, the mean ACT/ideal and
the draws over 1.5x ideal (the GPU-bound target) in each world.

    python benchmarks/load_bounds.py [--family gpu,gpux,small] [--k 12] [--open 60] [-j 2]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.reseed import draws  # noqa: E402
from tangram_dask.cluster import parse_cluster  # noqa: E402
from tangram_dask.policy import ledger, make_policy  # noqa: E402
from tangram_dask.sim import Simulator  # noqa: E402
from tangram_dask.workload import generate, parse_workload  # noqa: E402

WORLDS = ("contract", "no-block", "fast-open", "fast", "told")
FAST_S = 1.0


class _FastLoads(Simulator):
    """The simulator, with background loads begun before ``until`` taking ``FAST_S`` (the policy not told)."""

    def __init__(self, *a, until: float, **kw):
        super().__init__(*a, **kw)
        self.until = until

    def _load(self, d, now: float) -> None:
        real = self.costs
        if now < self.until:
            self.costs = dataclasses.replace(real, load_s={m: FAST_S for m in real.load_s})
        try:
            super()._load(d, now)
        finally:
            self.costs = real


def _begin_load(self, rid, now: float) -> None:
    """``no-block``'s GpuPool.begin_load: the replica is held (busy, loading), its GPUs are not."""
    r = self.replicas[rid]
    r.busy = True
    r.last_used = now
    self.ready[r.model].pop(rid, None)
    r.loading = True
    self.loading[r.model] = self.loading.get(r.model, 0) + 1


def _loaded(self, rid, now: float) -> bool:
    """``no-block``'s GpuPool.loaded: the replica is ready where its GPUs are free."""
    r = self.replicas.get(rid)
    if r is None or not r.loading:
        return False
    r.loading = False
    self.loading[r.model] -= 1
    r.busy = False
    r.last_used = now
    self._refresh(r)
    return True


@contextlib.contextmanager
def _no_block():
    pool = ledger.GpuPool
    saved = pool.begin_load, pool.loaded
    pool.begin_load, pool.loaded = _begin_load, _loaded
    try:
        yield
    finally:
        pool.begin_load, pool.loaded = saved


def act_ratio(wd: dict, cd: dict, world: str, open_s: float) -> float:
    """tangram's mean ACT over the mean ideal ACT on one draw, in ``world``."""
    if world == "told":
        wd = copy.deepcopy(wd)
        for m in wd["models"].values():
            m["load_s"] = FAST_S
    gen = generate(parse_workload(wd, wd["name"]))
    cl = parse_cluster(cd, cd["name"])
    pol = make_policy("tangram", cl, gen.spec)
    if world in ("fast-open", "fast"):
        sim = _FastLoads(gen, cl, pol, timer=time.perf_counter, until=open_s if world == "fast-open" else float("inf"))
    else:
        sim = Simulator(gen, cl, pol, timer=time.perf_counter)
    with _no_block() if world == "no-block" else contextlib.nullcontext():
        res = sim.run()
    return float((res.end - res.issue).mean() / res.ideal.mean())


def _draw(args: tuple[tuple[str, dict, dict], float]) -> tuple[str, list[float]]:
    (fam, wd, cd), open_s = args
    return fam, [act_ratio(wd, cd, w, open_s) for w in WORLDS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="gpu,gpux,small")
    ap.add_argument("--k", type=int, default=12, help="draws per variant (benchmarks/reseed.py's)")
    ap.add_argument("--open", type=float, default=60.0, help="fast-open: loads begun before this many seconds")
    ap.add_argument("-j", "--jobs", type=int, default=1)
    a = ap.parse_args()
    fams = a.family.split(",")
    work = [(d, a.open) for d in draws(fams, a.k)]
    if a.jobs > 1:
        with ProcessPoolExecutor(a.jobs) as ex:
            rows = list(ex.map(_draw, work))
    else:
        rows = [_draw(w) for w in work]
    print(f"tangram's ACT/ideal (mean; draws over 1.5x ideal), {a.k} draws per variant; fast-open: before {a.open:g} s")
    print(f"{'family':<8}{'draws':>6}" + "".join(f"{w:>17}" for w in WORLDS))
    for fam in fams:
        r = [x for f, x in rows if f == fam]
        if not r:
            continue
        cells = [f"{statistics.mean(x[i] for x in r):.3f} ({sum(x[i] > 1.5 for x in r):>3})"
                 for i in range(len(WORLDS))]
        print(f"{fam:<8}{len(r):>6}" + "".join(f"{c:>17}" for c in cells))


if __name__ == "__main__":
    main()
