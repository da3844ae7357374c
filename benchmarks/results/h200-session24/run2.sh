#!/bin/bash
# Session 24's second GPU call: MiniLM's fp16 copy (what the tool can carry) written back as fp32 there, so the model
# on the GPU has the shipped model's dtype and bytes; the GPU tests (the live test's memory check now reads the
# replica's parameter bytes, not a fixed fp32 range); MiniLM residency on the H200 capped to two replicas, seed 2.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
cp -r .gpu/minilm16 /tmp/minilm32 && python3 -c "
from safetensors.torch import load_file, save_file
t = load_file('.gpu/minilm16/model.safetensors')
save_file({k: v.float() if v.is_floating_point() else v for k, v in t.items()}, '/tmp/minilm32/model.safetensors', metadata={'format': 'pt'})" || exit 4
export TANGRAM_TEST_MINILM_DIR=/tmp/minilm32
{ date; nvidia-smi -L; cat .gpu/commit.txt; ls -la /tmp/minilm32/model.safetensors; } 2>&1 | tee $OUT/env2.txt
echo "=== test_gpu"; date +%T
timeout 150 python3 -m pytest -p no:cacheprovider tests/test_gpu.py -q -rs -s -m gpu 2>&1 | tee $OUT/pytest_gpu2.txt | grep -E "passed|failed|error|^FAILED|assert|MiniLM on|live:" | cut -c1-300
echo "=== residency --nvml MiniLM --seed 2"; date +%T
timeout 120 python3 benchmarks/residency.py --nvml --model-dir /tmp/minilm32 --seed 2 --timeout 90 --json 2>&1 | tee $OUT/residency_nvml.txt | grep -E '^\{|Error|error' | cut -c1-600
echo "=== done"; date +%T
