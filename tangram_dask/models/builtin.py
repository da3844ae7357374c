"""``rm-small``: the built-in reward model, numpy only, its weights a real file shipped with the package.

It scores a response against a reference answer: both are turned into bags of
hashed word unigrams and bigrams, embedded with the weight matrix in
``data/rm_small.npz`` (a fixed random projection, 4096 x 32 float32, seed 0,
rewritten by ``python -m tangram_dask.models.builtin``), and compared by
cosine similarity: 1.0 for the same text, near 0 for unrelated ones.

It always runs on the CPU (numpy); on a GPU worker it still occupies the
granted GPU's memory budget in the scheduler's ledger, by its parameter bytes.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import ModelError

WEIGHTS = Path(__file__).parent / "data" / "rm_small.npz"
VOCAB, DIM = 4096, 32
_WORD = re.compile(r"[a-z0-9]+")


def _pair(item: Any) -> tuple[str, str]:
    if isinstance(item, dict):
        return str(item["response"]), str(item["reference"])
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return str(item[0]), str(item[1])
    raise ModelError(f"a batch item must be (response, reference) or {{'response', 'reference'}}, got "
                     f"{type(item).__name__}")


class NumpyRewardModel:
    """The loaded ``rm-small``: ``score([(response, reference), ...]) -> [similarity, ...]``."""

    def __init__(self, path: Path, devices: tuple[str, ...] = ("cpu",)):
        with np.load(path) as f:
            self.embed = np.ascontiguousarray(f["embed"], dtype=np.float32)
            self.bias = np.ascontiguousarray(f["bias"], dtype=np.float32)
        if self.embed.ndim != 2 or self.bias.shape != (self.embed.shape[1],):
            raise ModelError(f"{path}: embed must be (vocab, dim) and bias (dim,), got {self.embed.shape} "
                             f"and {self.bias.shape}")
        self.devices = devices
        self.path = path

    @property
    def param_bytes(self) -> int:
        return int(self.embed.nbytes + self.bias.nbytes)

    def _vec(self, text: str) -> np.ndarray:
        words = _WORD.findall(text.lower())
        grams = words + [a + " " + b for a, b in zip(words, words[1:])]
        v = self.bias.copy()
        if grams:
            idx = np.fromiter((zlib.crc32(g.encode()) % self.embed.shape[0] for g in grams), dtype=np.int64)
            v += self.embed[idx].sum(axis=0)
        return v

    def score(self, batch: Sequence[Any]) -> list[float]:
        out = []
        for item in batch:
            resp, ref = _pair(item)
            a, b = self._vec(resp), self._vec(ref)
            out.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12)))
        return out


@dataclass(frozen=True)
class NumpyLoader:
    """Loads ``rm-small`` (or any weights file of the same layout) from disk."""

    path: str = str(WEIGHTS)

    def __call__(self, devices: tuple[str, ...]) -> NumpyRewardModel:
        return NumpyRewardModel(Path(self.path), tuple(devices))


def rm_small(path: str | Path | None = None) -> NumpyLoader:
    """The loader of the built-in reward model (``register_model(client, "rm-small", rm_small(), ...)``)."""
    return NumpyLoader(str(path or WEIGHTS))


def write_weights(path: Path = WEIGHTS, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    embed = (rng.standard_normal((VOCAB, DIM)) / np.sqrt(DIM)).astype(np.float32)
    bias = np.zeros(DIM, dtype=np.float32)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, embed=embed, bias=bias)
    return path


if __name__ == "__main__":  # pragma: no cover
    print(write_weights())
