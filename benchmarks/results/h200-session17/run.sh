#!/bin/bash
# Session 17's GPU checks (.gpu/ is ignored): the GPU tests at this tree (with the new HF reward-model test), then
# reward-model residency at the size of a real RL reward model: a 7B Llama sequence classifier (bf16, 14 GB, random
# weights) written to disk here, three names of it, the H200 capped to 2 replicas; tangram against fifo.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD TANGRAM_TEST_MINILM_DIR=$PWD/.gpu/minilm16
{ date; nvidia-smi -L; cat .gpu/commit.txt; python3 -c "import torch, transformers, accelerate; print(torch.__version__, transformers.__version__, accelerate.__version__)"; free -g | head -2; df -h /tmp | tail -1; } 2>&1 | tee $OUT/env.txt
echo "=== test_gpu"; timeout 170 python3 -m pytest -p no:cacheprovider tests/test_gpu.py -q -rs -s -m gpu 2>&1 | tee $OUT/pytest_gpu.txt | grep -E "passed|failed|error|HF reward|MiniLM on|^FAILED|assert" | cut -c1-400
echo "=== make 7B"; timeout 150 python3 benchmarks/make_reward_model.py /tmp/rm7b --params 7e9 --device cuda --tokenizer-dir $TANGRAM_TEST_MINILM_DIR 2>&1 | tee $OUT/make7b.txt | grep -E '^\{|Error' 
for seed in 0 1; do
  echo "=== residency --nvml --loader hf 7B --seed $seed"; date
  timeout 200 python3 benchmarks/residency.py --nvml --loader hf --model-dir /tmp/rm7b --seed $seed --timeout 150 --json 2>&1 | tee -a $OUT/residency_hf7b.txt | grep -E '^\{|Error|error' | cut -c1-600
done
echo "=== done"; date
