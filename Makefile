# The README's two commands: `make demo` and `make test`. Both create/reuse .venv in the repo root.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 2
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: venv demo test clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/dsv3 train --nproc 2 --config examples/deepspeed/demo.json --out runs/demo --overwrite

test: venv
	$(PY) -m pytest tests

clean:
	rm -rf runs .pytest_cache
