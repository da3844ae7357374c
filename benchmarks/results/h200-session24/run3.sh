#!/bin/bash
# Session 24's third GPU call: a reward model over 14 GB (16 B parameters, bf16, about 32 GB), written there, then
# the first action on a fresh NVML worker with and without prepare-models (first_load.py --nvml --loader hf).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
{ date; nvidia-smi -L; cat .gpu/commit.txt; df -h /tmp | tail -1; free -g | head -2; } 2>&1 | tee $OUT/env3.txt
echo "=== make 16B"; date +%T
timeout 150 python3 benchmarks/make_reward_model.py /tmp/rm16b --params 1.6e10 --device cuda --tokenizer-dir .gpu/minilm16 2>&1 | tee $OUT/make16b.txt | grep -E '^\{|Error'
echo "=== first_load hf 16B --nvml"; date +%T
timeout 150 python3 benchmarks/first_load.py --nvml --loader hf --model-dir /tmp/rm16b --memory-gb 34 --rounds 1 --wait 15 2>&1 | tee $OUT/first_load16b.txt | grep -E '^\{|Error|error' | cut -c1-300
echo "=== done"; date +%T
