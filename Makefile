# Two commands on a fresh machine with Python 3.11: `make demo`, `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip uninstall -y -q pynvml 2>/dev/null || true  # the old NVML package shadows nvidia-ml-py
	$(BIN)/pip install -q -e ".[test]"
	touch $(STAMP)

.PHONY: install demo test bench-scale
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/tangram-dask demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench-scale: $(STAMP)
	$(BIN)/tangram-dask bench resources/bench/scale.yaml resources/bench/cluster-large.yaml --policy tangram
