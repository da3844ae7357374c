#!/bin/bash
# Session 17's last GPU call: the GPU tests at the final tree, then examples/hf_reward_model.py --nvml with a 1B model.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD TANGRAM_TEST_MINILM_DIR=$PWD/.gpu/minilm16
cat .gpu/commit.txt | tee $OUT/final_env.txt
echo "=== test_gpu"; timeout 120 python3 -m pytest -p no:cacheprovider tests/test_gpu.py -q -rs -s -m gpu 2>&1 | tee $OUT/final_pytest_gpu.txt | grep -E "passed|failed|error|HF reward|^FAILED|assert" | cut -c1-500
echo "=== example --nvml"; timeout 40 python3 benchmarks/make_reward_model.py /tmp/rm1b --params 1e9 --device cuda --tokenizer-dir $TANGRAM_TEST_MINILM_DIR 2>&1 | grep '^{'
timeout 90 python3 examples/hf_reward_model.py --nvml --model-dir /tmp/rm1b --memory-gb 2.2 2>&1 | tee $OUT/final_example.txt | grep -v -E "INFO|Writing|Warn" | tail -8
