# The README's two commands: `make demo` and `make test`. Both create/reuse .venv in the repo root.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 2
export PYTHONDONTWRITEBYTECODE = 1

.PHONY: venv demo test gpu-check clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.txt requirements-te-recipe.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
# TE recipe wheels for the tests: downloaded, not installed (see requirements-te-recipe.txt); one pip call
# per line, since pip will not fetch two versions of one package in one call
	grep '^transformer-engine==' requirements-te-recipe.txt | while read -r req; do \
	  echo "$$req" > $(VENV)/te-req.txt && \
	  $(PY) -m pip download -q --no-deps --only-binary=:all: --require-hashes -d $(VENV)/te-wheels \
	    -r $(VENV)/te-req.txt || exit 1; done
	touch $(STAMP)

demo: venv
	$(VENV)/bin/dsv3 train --nproc 2 --steps 30 --out runs/demo

test: venv
	$(PY) -m pytest tests

# One JSON object from examples/gpu_check.py (a Hopper GPU, <= 8 minutes on one H200); on a machine without a GPU:
# `make gpu-check GPU_CHECK_ARGS=--dry-run` (tiny shapes on CPU; `make test` runs it too)
gpu-check: venv
	$(PY) examples/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf runs .pytest_cache
