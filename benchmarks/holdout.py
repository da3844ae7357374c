"""Seeds that no rule was measured on while it was chosen: 36 variants beside ``variants.py``'s families.

- ``xgpu``: 12 GPU-bound seeds (201-212) over the four GPU cluster shapes, as ``gpux``;
- ``xsmall``: 10 small steps: GPU-bound on ``cluster-gpu-mixed`` (301-304), heavy tails on half of
  the tight cluster (311-314), the standard workload on it (321, 322), as ``small``;
- ``xtail``: 6 heavy-tail 2-step seeds (331-336), standard and tight clusters alternately;
- ``xtight``: 8 heavy-tail 2-step seeds (341-348) on the tight cluster.

Prints tangram's ACT/static and step/static per variant, then per family: wins (both below
static's) and the mean and max ratios. A rule tuned on ``variants.py`` should hold here too.

    python benchmarks/holdout.py [-j 2] [-o key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import variants as V  # noqa: E402


def families() -> dict[str, list[tuple[dict, dict]]]:
    shapes = {c["name"]: c for _, c in V.gpu_family(False)}
    g0 = V._yaml(V.ROOT / "resources" / "variants" / "gpu-bound.yaml")
    small = V.small_family(False)
    c_gpu, c_half = small[0][1], small[4][1]
    w0 = V._yaml(V.BENCH / "standard.yaml")
    c_std = V._yaml(V.BENCH / "cluster-standard.yaml")
    c_tight = V._yaml(V.BENCH / "cluster-tight.yaml")

    def tails(d):
        d["tools"][0]["duration_s"]["sigma"] = 1.5
        d["tools"][1]["duration_s"]["sigma"] = 1.5
    out: dict[str, list[tuple[dict, dict]]] = {"xgpu": [], "xsmall": [], "xtail": [], "xtight": []}
    names = ["gpu-mixed", "gpu-h200", "gpu-small", "gpu-wide"]
    for i, seed in enumerate(range(201, 213)):
        c = shapes[names[i % 4]]
        n = 96 if c["name"] == "gpu-small" else 128
        out["xgpu"].append((V._with(g0, f"xg{seed}", seed=seed, trajectories=n, hint_sigma=(1.0, 1.5)[i % 2]), c))
    for seed in range(301, 305):
        out["xsmall"].append((V._with(g0, f"xsg{seed}", seed=seed, trajectories=48 + 4 * (seed % 4)), c_gpu))
    for seed in range(311, 315):
        out["xsmall"].append((V._with(w0, f"xst{seed}", seed=seed, hint_sigma=1.5, trajectories=64, _=tails),
                              c_half))
    for seed in range(321, 323):
        out["xsmall"].append((V._with(w0, f"xss{seed}", seed=seed, trajectories=64), c_half))
    for i, seed in enumerate(range(331, 337)):
        out["xtail"].append((V._with(w0, f"xt{seed}", seed=seed, hint_sigma=1.5 + 0.1 * i, steps=2, train_time_s=20,
                                     trajectories=128 + 32 * (i % 3), _=tails), (c_std, c_tight)[i % 2]))
    for i, seed in enumerate(range(341, 349)):
        out["xtight"].append((V._with(w0, f"xtt{seed}", seed=seed, hint_sigma=1.6 + 0.1 * (i % 4), steps=2,
                                      train_time_s=20, trajectories=128 + 32 * (i % 2), _=tails), c_tight))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("-o", "--policy-option", action="append", default=[])
    a = ap.parse_args()
    opts = {k: float(v) for k, v in (kv.split("=") for kv in a.policy_option)}
    jobs = [(f, w, c) for f, vs in families().items() for w, c in vs]
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else V._Inline() as ex:
        res = list(ex.map(V.measure, *zip(*[(f, w, c, opts, False) for f, w, c in jobs])))
    by: dict[str, list[dict]] = {}
    for r in res:
        by.setdefault(r["family"], []).append(r)
        print(f"{r['variant']:<10}{r['cluster']:<11}act/stat {r['ratios'][2]:.3f}  step/stat {r['ratios'][3]:.3f}")
    for fam, rs in by.items():
        m = np.array([r["ratios"] for r in rs])
        print(f"{fam}: {int(((m[:, 2] < 1) & (m[:, 3] < 1)).sum())}/{len(rs)} wins; act/stat mean {m[:, 2].mean():.3f} "
              f"max {m[:, 2].max():.3f}; step/stat mean {m[:, 3].mean():.3f} max {m[:, 3].max():.3f}; "
              f"act/ideal mean {m[:, 0].mean():.3f}")


if __name__ == "__main__":
    main()
