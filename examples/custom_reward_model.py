"""Your own reward model, resident on a GPU worker, scored inside GPU actions.

    python examples/custom_reward_model.py [--weights DIR]

A reward model is a *loader*: a picklable callable ``(devices) -> scorer``,
where ``scorer.score(batch) -> list[float]``. Here the loader reads real
weights from disk (a numpy file this script writes: a linear head over hashed
word features that rewards answers mentioning the expected units). The worker
loads it once, where and when the scheduler says, and keeps it resident;
each ``reward_model(name).score(batch)`` inside a GPU action reaches the
replica the scheduler granted.

This machine may have no GPU: the worker declares one *abstract* GPU by config
(``tangram.worker.nvml: false``, ``gpus: 1``, ``gpu-memory-gb``); the scheduler
places and accounts the model's memory on it exactly as on a real one, and the
scorer runs on the CPU. On a GPU worker drop that config: NVML finds the GPUs
and the loader gets ``"cuda:k"`` devices.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import dask
import numpy as np
from distributed import Client, LocalCluster

import tangram_dask

FEATURES = 4096


def features(text: str) -> np.ndarray:
    x = np.zeros(FEATURES, np.float32)
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        x[zlib.crc32(word.encode()) % FEATURES] += 1.0
    return x


def write_weights(path: Path) -> Path:
    """'Training': the head rewards the words that answers with units use."""
    w = np.zeros(FEATURES, np.float32)
    for word in ("meters", "seconds", "kilograms"):
        w[zlib.crc32(word.encode()) % FEATURES] = 2.0
    np.savez(path, w=w, b=np.float32(-1.0))
    return path


class UnitsRewardModel:
    """The loaded model: ``score([(response, reference), ...])`` -> a reward in (0, 1) per item."""

    def __init__(self, path: str, devices: tuple[str, ...]):
        with np.load(path) as f:
            self.w, self.b = f["w"], float(f["b"])
        self.devices = devices

    @property
    def param_bytes(self) -> int:  # what the worker accounts against the GPU's memory
        return int(self.w.nbytes) + 4

    def score(self, batch: list[tuple[str, str]]) -> list[float]:
        return [float(1 / (1 + np.exp(-(features(resp) @ self.w + self.b)))) for resp, _ref in batch]


@dataclass(frozen=True)
class UnitsLoader:
    """The loader the workers receive (pickled): only a path, the weights stay on disk until a load."""

    path: str

    def __call__(self, devices: tuple[str, ...]) -> UnitsRewardModel:
        return UnitsRewardModel(self.path, tuple(devices))


def judge(response: str, reference: str) -> tuple[float, dict]:
    rm = tangram_dask.reward_model("units-rm")  # the replica the scheduler granted this action
    return rm.score([(response, reference)])[0], rm.info()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=None, help="directory for the weights file (default: a temporary one)")
    args = ap.parse_args()
    if args.weights is not None and not Path(args.weights).is_dir():
        ap.error(f"--weights {args.weights}: no such directory (the script writes its weights file there)")
    with tempfile.TemporaryDirectory() as tmp:
        weights = write_weights(Path(args.weights or tmp) / "units_rm.npz")
        abstract_gpu = {"tangram.worker.nvml": False, "tangram.worker.gpus": 1, "tangram.worker.gpu-memory-gb": 1.0}
        with dask.config.set(abstract_gpu), \
                LocalCluster(n_workers=1, threads_per_worker=1, resources={"gpus": 1}, dashboard_address=":0",
                             scheduler_kwargs={"plugins": [tangram_dask.TangramSchedulerPlugin()]}) as cluster, \
                Client(cluster) as client:
            rm = tangram_dask.register_model(client, "units-rm", UnitsLoader(str(weights)), memory_gb=0.01,
                                             load_s=0.1)
            answers = ["The rod is 3 meters long.", "It is three.", "It took 9.8 seconds."]
            with rm.action(hint_s=0.05):  # = tangram_dask.action(kind=..., resource="gpu", model="units-rm")
                futures = [client.submit(judge, a, "3 meters", pure=False) for a in answers]
            for answer, (reward, info) in zip(answers, client.gather(futures)):
                print(f"{reward:.3f}  {answer!r:30} replica {info['replica']} on GPUs {info['gpus']} "
                      f"{info['devices']}")
            snap = tangram_dask.models_snapshot(client)
            m = snap["measured"]["units-rm"]  # what the load really took, now the policy's figure
            print(f"loaded {m['loads']} time(s) in {m['load_s']:.3f} s, {m['param_bytes']} bytes of parameters "
                  f"({m['measured_by']})")


if __name__ == "__main__":
    main()
