"""Seeds that no rule was measured on while it was chosen: 44 variants beside ``variants.py``'s families.

- ``xgpu``: 12 GPU-bound seeds (201-212) over the four GPU cluster shapes, as ``gpux``;
- ``xsmall``: 10 small steps: GPU-bound on ``cluster-gpu-mixed`` (301-304), heavy tails on half of
  the tight cluster (311-314), the standard workload on it (321, 322), as ``small``;
- ``xtail``: 6 heavy-tail 2-step seeds (331-336), standard and tight clusters alternately;
- ``xtight``: 8 heavy-tail 2-step seeds (341-348) on the tight cluster;
- ``xapi``: 8 API-heavy seeds (401-408) in shapes the ``api`` family does not have (built after
  ``open_share`` and ``api_whole`` were chosen on it): rewards all through the API, a search-only
  agent, API calls that take 1..3 tokens elastically, the standard tools with an API judge, heavy
  API tails with poor hints; 8 to 48 tokens.

Prints tangram's ACT/static and step/static per variant, then per family: wins (both below
static's) and the mean and max ratios. A rule tuned on ``variants.py`` should hold here too.

    python benchmarks/holdout.py [-j 2] [-o key=value ...] [--trajectory-hints SIGMA]
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
    out: dict[str, list[tuple[dict, dict]]] = {"xgpu": [], "xsmall": [], "xtail": [], "xtight": [], "xapi": []}
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
    out["xapi"] = _api_holdout()
    return out


def _api_holdout() -> list[tuple[dict, dict]]:
    a0 = V._yaml(V.ROOT / "resources" / "variants" / "api-heavy.yaml")
    c0 = V._yaml(V.ROOT / "resources" / "variants" / "cluster-api.yaml")
    w0 = V._yaml(V.BENCH / "standard.yaml")
    c_std = V._yaml(V.BENCH / "cluster-standard.yaml")

    def tokens(c, n, slots=None, name=None):
        c = V._with(c, name or f"{c['name']}-t{n}", api={"tokens": n})
        if slots:
            c["cpu"] = {"nodes": [{"count": 2, "slots": slots}]}
        return c

    def api_rewards(d):  # every reward through the API judge
        d["rewards"] = [d["rewards"][0]]
        d["rewards"][0]["weight"] = 1.0

    def search_only(d):  # an agent that mostly searches and fetches
        for t, w in zip(d["tools"], (0.6, 0.3, 0.1, 0.0)):
            t["weight"] = w
        d["tools"] = [t for t in d["tools"] if t["weight"] > 0]

    def elastic(d):  # page fetches that fan out over 1..3 tokens
        d["tools"][1]["units"] = {"min": 1, "max": 3}
        d["tools"][1]["speedup"] = {"model": "amdahl", "parallel_fraction": 0.6}

    def api_tails(d):
        d["tools"][0]["duration_s"]["sigma"] = 1.4
        d["tools"][1]["duration_s"]["sigma"] = 1.6

    def std_api_judge(d):  # the standard tools, its large judge through an API instead of a GPU
        d["rewards"][1] = {"kind": "judge_api", "weight": 0.4, "resource": "api", "units": {"min": 1, "max": 1},
                           "duration_s": {"dist": "lognormal", "median": 4.0, "sigma": 0.5}}
    return [(V._with(a0, "xa401", seed=401, _=api_rewards), c0),
            (V._with(a0, "xa402", seed=402, trajectories=96, _=search_only), tokens(c0, 16)),
            (V._with(a0, "xa403", seed=403, _=elastic), c0),
            (V._with(a0, "xa404", seed=404, trajectories=64, _=api_rewards), tokens(c0, 8, slots=8)),
            (V._with(w0, "xa405", seed=405, trajectories=192, _=std_api_judge), tokens(c_std, 32, name="std-t32")),
            (V._with(a0, "xa406", seed=406, hint_sigma=1.8, steps=2, train_time_s=20, _=api_tails), c0),
            (V._with(a0, "xa407", seed=407, trajectories=192, _=elastic), tokens(c0, 48, slots=24)),
            (V._with(a0, "xa408", seed=408, turns={"dist": "geometric", "mean": 5, "max": 20}, trajectories=160,
                     _=search_only), tokens(c0, 20))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-j", "--jobs", type=int, default=1)
    ap.add_argument("-o", "--policy-option", action="append", default=[])
    ap.add_argument("--trajectory-hints", type=float, default=None, metavar="SIGMA",
                    help="beyond WORKLOAD.md: tangram's trajectories begin with hints of their lengths (admit_long)")
    a = ap.parse_args()
    opts = {k: float(v) for k, v in (kv.split("=") for kv in a.policy_option)}
    jobs = [(f, w, c) for f, vs in families().items() for w, c in vs]
    with ProcessPoolExecutor(a.jobs) if a.jobs > 1 else V._Inline() as ex:
        res = list(ex.map(V.measure, *zip(*[(f, w, c, opts, False, a.trajectory_hints) for f, w, c in jobs])))
    by: dict[str, list[dict]] = {}
    for r in res:
        by.setdefault(r["family"], []).append(r)
        print(f"{r['variant']:<10}{r['cluster']:<11}act/stat {r['ratios'][2]:.3f}  step/stat {r['ratios'][3]:.3f}")
    for fam, rs in by.items():
        m = np.array([r["ratios"] for r in rs])
        print(f"{fam}: {int(((m[:, 2] < 1) & (m[:, 3] < 1)).sum())}/{len(rs)} wins; act/stat mean {m[:, 2].mean():.3f} "
              f"max {m[:, 2].max():.3f}; step/stat mean {m[:, 3].mean():.3f} max {m[:, 3].max():.3f}; "
              f"act/ideal mean {m[:, 0].mean():.3f}; act/floor mean {np.mean([r['act_floor'] for r in rs]):.3f}")


if __name__ == "__main__":
    main()
