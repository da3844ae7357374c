"""The half-cluster shape of tests/test_variants.py on 24 seeds: how often each claim holds.

tests/test_variants.py checks tangram's step against fifo's on four variants of one shape (the
standard workload cut to 96 trajectories, the tight cluster with its CPU halved to 32 slots) and
one seed each; a rule that moves one trajectory's admission by 30 s passes or fails there by
chance. Here the same shape on seeds 100-123 (hint sigma 1.0, 0.3 and 1.6 in turn), none of them
the test's. Prints, per seed, tangram's step/fifo and ACT/static, then how many seeds have its
step under fifo's, its ACT under static's, and both of those with its step under static's.

    python benchmarks/half_seeds.py [-j 2] [-o key=value ...] [--seeds 120 --base 500 --quiet]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import simulate  # noqa: E402
from tangram_dask.cluster import parse_cluster  # noqa: E402
from tangram_dask.policy import TangramOptions  # noqa: E402
from tangram_dask.workload import generate, parse_workload  # noqa: E402

BENCH = ROOT / "resources" / "bench"
SEEDS = range(100, 124)


def shape(seed: int) -> tuple[dict, dict]:
    wd = yaml.safe_load((BENCH / "standard.yaml").read_text())
    wd.update(trajectories=96, seed=seed, hint_sigma=(1.0, 0.3, 1.6)[seed % 3])
    cd = copy.deepcopy(yaml.safe_load((BENCH / "cluster-tight.yaml").read_text()))
    cd["cpu"]["nodes"] = [{"count": 2, "slots": 16}]
    return wd, cd


def measure(seed: int, opts: dict[str, float]) -> tuple[int, dict, dict, dict]:
    wd, cd = shape(seed)
    gen = generate(parse_workload(wd, f"half{seed}"))
    cl = parse_cluster(cd, cd["name"])
    t = simulate(gen, cl, "tangram", options=replace(TangramOptions(), **opts))
    return seed, t, simulate(gen, cl, "fifo"), simulate(gen, cl, "static")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("-o", "--policy-option", action="append", default=[], help="a tangram option, key=value")
    ap.add_argument("--seeds", type=int, default=0, help="N seeds from --base instead of the 24 (a wider sample)")
    ap.add_argument("--base", type=int, default=500)
    ap.add_argument("--quiet", action="store_true", help="the summary line only")
    a = ap.parse_args()
    opts = {k: float(v) for k, v in (kv.split("=") for kv in a.policy_option)}
    seeds = range(a.base, a.base + a.seeds) if a.seeds else SEEDS
    with ProcessPoolExecutor(max(a.jobs, 1)) as ex:
        res = list(ex.map(measure, seeds, [opts] * len(seeds)))
    sf, sa = [], []
    n_f = n_a = n_all = 0
    for seed, t, f, s in res:
        rf, ra = t["step_s"] / f["step_s"], t["act_mean_s"] / s["act_mean_s"]
        sf.append(rf)
        sa.append(ra)
        n_f += rf < 1
        n_a += ra < 1
        n_all += rf < 1 and ra < 1 and t["step_s"] < s["step_s"]
        if not a.quiet:
            print(f"half{seed}  step/fifo {rf:.3f}  act/static {ra:.3f}")
    n = len(res)
    print(f"step under fifo's {n_f}/{n}; ACT under static's {n_a}/{n}; both, step under static's too {n_all}/{n}; "
          f"step/fifo mean {statistics.mean(sf):.3f} max {max(sf):.3f}; "
          f"act/static mean {statistics.mean(sa):.3f} max {max(sa):.3f}")


if __name__ == "__main__":
    main()
