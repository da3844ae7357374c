#!/bin/bash
# Session 24's GPU call (.gpu/ is ignored: the wheels dask and distributed need, an fp16 copy of MiniLM's weights,
# loaded as fp32): the GPU tests at this tree; the first action on a fresh NVML worker with and without
# prepare-models (MiniLM, and a 1B HF reward model written here); reward-model residency with a 7B model, tangram
# against fifo (session 17's run, seed 0), the H200 capped to two replicas.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD TANGRAM_TEST_MINILM_DIR=$PWD/.gpu/minilm16
M=$TANGRAM_TEST_MINILM_DIR
{ date; nvidia-smi -L; cat .gpu/commit.txt; python3 -c "import torch, transformers, accelerate, sentence_transformers as s; print(torch.__version__, transformers.__version__, accelerate.__version__, s.__version__)"; nproc; } 2>&1 | tee $OUT/env.txt
echo "=== test_gpu"; date +%T
timeout 150 python3 -m pytest -p no:cacheprovider tests/test_gpu.py -q -rs -s -m gpu 2>&1 | tee $OUT/pytest_gpu.txt | grep -E "passed|failed|error|^FAILED|assert" | cut -c1-400
echo "=== make 1B"; date +%T
timeout 60 python3 benchmarks/make_reward_model.py /tmp/rm1b --params 1e9 --device cuda --tokenizer-dir $M 2>&1 | grep -E '^\{|Error'
echo "=== first_load st --nvml"; date +%T
timeout 90 python3 benchmarks/first_load.py --nvml --model-dir $M --rounds 1 --wait 15 2>&1 | tee $OUT/first_load.txt | grep -E '^\{|Error|error' | cut -c1-300
echo "=== first_load hf 1B --nvml"; date +%T
timeout 100 python3 benchmarks/first_load.py --nvml --loader hf --model-dir /tmp/rm1b --memory-gb 2.2 --rounds 1 --wait 15 2>&1 | tee -a $OUT/first_load.txt | grep -E '^\{|Error|error' | cut -c1-300
echo "=== make 7B"; date +%T
timeout 60 python3 benchmarks/make_reward_model.py /tmp/rm7b --params 7e9 --device cuda --tokenizer-dir $M 2>&1 | grep -E '^\{|Error'
echo "=== residency --nvml --loader hf 7B --seed 0"; date +%T
timeout 120 python3 benchmarks/residency.py --nvml --loader hf --model-dir /tmp/rm7b --seed 0 --timeout 90 --json 2>&1 | tee $OUT/residency_hf7b.txt | grep -E '^\{|Error|error' | cut -c1-600
echo "=== done"; date +%T
