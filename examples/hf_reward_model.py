"""A Hugging Face reward model (a sequence classifier), resident on a GPU worker, scoring trajectories' answers.

    python examples/hf_reward_model.py [--model-dir DIR] [--nvml] [--memory-gb G]

The usual RL reward model is an ``AutoModelForSequenceClassification`` with
one label whose logit is the reward. ``sequence_classifier(DIR)`` is its
loader: the worker loads the weights from ``DIR`` straight onto the GPUs the
scheduler grants (``device_map``), keeps the replica resident and measures
what it took; each ``reward_model(name).score(pairs)`` inside a GPU action
reaches that replica.

Pass your own model's directory with ``--model-dir``. Without one, this script
writes a small stand-in (a 3 M-parameter Llama sequence classifier with random
weights and all-MiniLM-L6-v2's tokenizer): it loads and scores like a real
one, and its rewards mean nothing.

Without ``--nvml`` the worker declares one *abstract* GPU by config (this
machine may have no GPU; the model runs on the CPU, its memory accounted from
its parameter bytes). With ``--nvml`` the worker finds its GPUs through NVML
and the model goes to ``cuda:k``, its memory measured by CUDA.
"""

from __future__ import annotations

import os
import argparse
import tempfile

import dask
from distributed import Client, LocalCluster

import tangram_dask
from tangram_dask.models import minilm_path, sequence_classifier

TRAJECTORIES = [  # (prompt, the policy's final answer): one reward action per trajectory
    ("Write a function that returns the sum of a list.", "def total(xs):\n    return sum(xs)"),
    ("What is the capital of France?", "Paris."),
    ("Fix the failing test in utils.py.", "I could not find the file."),
]


def write_stand_in(model_dir: str) -> str:
    """A small reward model on disk: the files a real one has, random weights."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=30522, hidden_size=64, intermediate_size=224, num_hidden_layers=18,
                      num_attention_heads=4, num_labels=1, pad_token_id=0, dtype="bfloat16")
    LlamaForSequenceClassification(cfg).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(minilm_path()).save_pretrained(model_dir)
    return model_dir


def reward(prompt: str, answer: str) -> tuple[float, dict]:
    rm = tangram_dask.reward_model("rm")  # the replica the scheduler granted this action
    return rm.score([(prompt, answer)])[0], rm.info()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="your reward model's directory (default: a small stand-in)")
    ap.add_argument("--nvml", action="store_true", help="the worker's real GPUs (NVML) instead of an abstract one")
    ap.add_argument("--memory-gb", type=float, default=0.05, help="one replica's GPU memory, as you declare it")
    args = ap.parse_args()
    if args.model_dir is not None and not os.path.isdir(args.model_dir):
        ap.error(f"--model-dir {args.model_dir}: no such directory (a model saved with save_pretrained)")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or write_stand_in(tmp)
        gpu = {} if args.nvml else {"tangram.worker.nvml": False, "tangram.worker.gpus": 1,
                                    "tangram.worker.gpu-memory-gb": 1.0}
        with dask.config.set(gpu), \
                LocalCluster(n_workers=1, threads_per_worker=1, resources={"gpus": 1}, dashboard_address=":0",
                             scheduler_kwargs={"plugins": [tangram_dask.TangramSchedulerPlugin()]}) as cluster, \
                Client(cluster) as client:
            rm = tangram_dask.register_model(client, "rm", sequence_classifier(model_dir), memory_gb=args.memory_gb,
                                             load_s=5.0)
            with rm.action(hint_s=0.1):  # = tangram_dask.action(kind=..., resource="gpu", model="rm")
                futures = [client.submit(reward, p, a, pure=False) for p, a in TRAJECTORIES]
            for (prompt, _), (r, info) in zip(TRAJECTORIES, client.gather(futures)):
                print(f"{r:+.4f}  {prompt[:40]!r:44} replica {info['replica']} on GPUs {info['gpus']} "
                      f"{info['devices']}")
            m = tangram_dask.models_snapshot(client)["measured"]["rm"]  # what the load really took
            first = " (the worker's first load: importing transformers included)" if info["first"] else ""
            print(f"loaded {m['loads']} time(s) in {m['load_s']:.2f} s{first}, {m['memory_gb'] * 1e9:.0f} bytes "
                  f"({m['measured_by']})")


if __name__ == "__main__":
    main()
