"""Tangram against fifo and static on variants of the standard files.

Varies what a new deployment varies: seed, load (trajectories), hint quality,
the tool mix, and the cluster's shape. Prints one line per variant with the
ratios the targets are stated in. Not a test: figures to read.

    python benchmarks/variants.py [--quick] [--policy-option key=value ...]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tangram_dask.bench import parity, simulate  # noqa: E402
from tangram_dask.cluster import parse_cluster  # noqa: E402
from tangram_dask.policy import TangramOptions  # noqa: E402
from tangram_dask.workload import generate, parse_workload  # noqa: E402

BENCH = ROOT / "resources" / "bench"


def variants(quick: bool):
    w0 = yaml.safe_load(open(BENCH / "standard.yaml"))
    c_std = yaml.safe_load(open(BENCH / "cluster-standard.yaml"))
    c_tight = yaml.safe_load(open(BENCH / "cluster-tight.yaml"))
    c_odd = copy.deepcopy(c_std)
    c_odd["name"] = "odd"
    c_odd["cpu"]["nodes"] = [{"count": 2, "slots": 48}, {"count": 4, "slots": 8}]
    c_odd["gpu"]["nodes"] = [{"count": 3, "gpus": 4, "gpu_memory_gb": 80, "groups": [2, 2]}]
    out = []

    def w(name, **changes):
        d = copy.deepcopy(w0)
        d["name"] = name
        for k, v in changes.items():
            if callable(v):
                v(d)
            else:
                d[k] = v
        return d

    seeds = [1, 2] if quick else [1, 2, 3, 4]
    for s in seeds:
        out.append((w(f"seed{s}", seed=s), c_std))
        out.append((w(f"seed{s}", seed=s), c_tight))
    out.append((w("load-x1.5", trajectories=384, seed=5), c_std))
    out.append((w("load-x0.5", trajectories=128, seed=6), c_std))
    out.append((w("hint-sharp", hint_sigma=0.3, seed=7), c_std))
    out.append((w("hint-noisy", hint_sigma=1.6, seed=8), c_std))

    def heavy_tests(d):
        d["tools"][0]["weight"] = 0.35
        d["tools"][1]["weight"] = 0.5
    out.append((w("mix-tests", seed=9, **{"_": heavy_tests}), c_std))
    out.append((w("steps-3", steps=3, train_time_s=30, trajectories=128, seed=10), c_std))
    out.append((w("seed11-odd", seed=11), c_odd))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parity", action="store_true")
    ap.add_argument("-o", "--policy-option", action="append", default=[])
    a = ap.parse_args()
    opts = {}
    for kv in a.policy_option:
        k, v = kv.split("=")
        opts[k] = float(v)
    options = TangramOptions(**opts)
    print(f"{'variant':<14}{'cluster':<9}{'act/ideal':>10}{'step/ideal':>11}{'act/fifo':>9}{'act/stat':>9}"
          f"{'step/stat':>10}{'parity':>7}{'loads':>6}{'rest':>5}")
    agg = []
    for wd, cd in variants(a.quick):
        ws = parse_workload(wd, wd["name"])
        cs = parse_cluster(cd, cd["name"])
        gen = generate(ws)
        t = simulate(gen, cs, "tangram", options=options)
        f = simulate(gen, cs, "fifo")
        s = simulate(gen, cs, "static")
        par = parity(gen, cs, s["step_s"], options=options) if a.parity else None
        row = (t["act_mean_s"] / t["ideal_act_mean_s"], t["step_s"] / t["ideal_step_s"],
               t["act_mean_s"] / f["act_mean_s"], t["act_mean_s"] / s["act_mean_s"], t["step_s"] / s["step_s"])
        agg.append(row)
        print(f"{ws.name:<14}{cs.name:<9}{row[0]:>10.3f}{row[1]:>11.3f}{row[2]:>9.3f}{row[3]:>9.3f}{row[4]:>10.3f}"
              f"{(par if par is not None else float('nan')):>7.2f}{t['model_loads']:>6}{t['restores']:>5}")
    import numpy as np
    m = np.mean(agg, axis=0)
    print(f"{'mean':<23}{m[0]:>10.3f}{m[1]:>11.3f}{m[2]:>9.3f}{m[3]:>9.3f}{m[4]:>10.3f}")


if __name__ == "__main__":
    main()
