# The README's two commands: `make demo` and `make test`. Both create/reuse .venv in the repo root; `make test`
# also creates/reuses .venv-mcore19 (Python >= 3.12, megatron-core 0.19.x) and runs the Megatron tests there too.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0
export DS_ACCELERATOR ?= cpu
export OMP_NUM_THREADS ?= 2
export PYTHONDONTWRITEBYTECODE = 1

# Second environment: megatron-core 0.19.x needs Python >= 3.12 (first interpreter found: python3.12/3.13 on PATH,
# then pyenv's); override with `make PYTHON312=/path/to/python3.12`.
PYTHON312 ?= $(firstword $(shell for p in python3.12 python3.13; do $$p -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1 && command -v $$p; done) $(wildcard $(or $(PYENV_ROOT),$(HOME)/.pyenv)/versions/3.12*/bin/python3.12))
VENV19  := .venv-mcore19
PY19    := $(VENV19)/bin/python
STAMP19 := $(VENV19)/.installed
# The Megatron tests: every one runs on megatron-core 0.16.1 (.venv) and again on 0.19.x (.venv-mcore19).
MEGATRON_TESTS := tests/megatron $(sort $(wildcard tests/*/test_megatron_*.py benchmarks/tests/test_megatron_*.py))
# The benches' own tests (benchmarks/tests, beside the package's tests/) run in the same phases: single-process ones
# with tests/unit, multi-process ones (benchmarks/tests/dist) with tests/dist.
DIST_TESTS := tests/dist benchmarks/tests/dist

.PHONY: test-long venv venv-mcore19 demo lint format test test-mcore19 gpu-check bench clean

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

venv-mcore19: $(STAMP19)

$(STAMP19): pyproject.toml requirements-mcore19.txt
	@test -n "$(PYTHON312)" || { echo "Python >= 3.12 not found (megatron-core 0.19 needs it): make PYTHON312=/path/to/python3.12"; exit 2; }
	test -x $(PY19) || $(PYTHON312) -m venv $(VENV19)
	$(PY19) -m pip install -q --upgrade pip
	$(PY19) -m pip install -q $(TORCH) -r requirements-mcore19.txt
	$(PY19) -m pip install -q --no-deps -e .
	touch $(STAMP19)

demo: venv
	OMP_NUM_THREADS=1 $(VENV)/bin/dsv3 train --nproc 2 --config examples/deepspeed/demo.json --out runs/demo --overwrite

# Single-process tests run on two pytest workers (pytest-xdist, one test file per worker at a time so a module's
# fixtures run once; one thread each). The multi-process tests in tests/dist run on two workers as well (one thread
# per rank: their ranks wait on each other often enough that two tests at once fill the cores), except those
# marked `serial` (short peer timeouts), which run alone afterwards at the default two threads. First `make lint`, then four pytest runs:
# those three on .venv (megatron-core 0.16.1), then the Megatron tests on .venv-mcore19 (0.19.x); each runs even
# when one before failed, and `make test` fails if any did.
# One thread per worker because two workers x two threads oversubscribe 2 cores (133 s instead of 88 s); the
# tests pass at 2 threads as well: `OMP_NUM_THREADS=2 .venv/bin/python -m pytest -n 2 tests benchmarks/tests
# --ignore=tests/dist --ignore=benchmarks/tests/dist`.
PARALLEL_PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile
# .venv-mcore19 is built (when missing or stale) in the background while the .venv phases run, its output in
# .venv-mcore19-build.log; the serial phase and the Megatron phase start once it is done (the serial tests want the
# cores to themselves), and a failed build fails `make test` with that log.
test: venv
	rc=0; $(MAKE) --no-print-directory venv-mcore19 > $(VENV19)-build.log 2>&1 & v19=$$!; \
	$(MAKE) --no-print-directory lint || rc=$$?; \
	$(PARALLEL_PYTEST) tests benchmarks/tests $(addprefix --ignore=,$(DIST_TESTS)) || rc=$$?; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 3 --dist loadfile $(DIST_TESTS) -m "not serial and not long" || rc=$$?; \
	wait $$v19; v19rc=$$?; \
	$(PY) -m pytest $(DIST_TESTS) -m serial || rc=$$?; \
	if [ $$v19rc -ne 0 ]; then cat $(VENV19)-build.log; echo "building $(VENV19) failed (above)"; exit 1; fi; \
	echo "== Megatron tests on megatron-core 0.19 ($(VENV19)) =="; \
	OMP_NUM_THREADS=1 $(PY19) -m pytest -n 3 --dist loadfile -m "not long" $(MEGATRON_TESTS) || rc=$$?; \
	exit $$rc

# The Megatron tests on 0.19 also run on 3 workers: most are 2-rank `pretrain()` launches whose start-up (imports,
# process groups) leaves the cores idle part of the time (measured: 359 s on 3 workers, 483 s on 2).
# The `long` tests: more launchers and file formats for checks `make test` runs once (a few minutes; not in CI).
# tests/dist runs on 3 workers above: its tests spend part of their time waiting (start-up, peer timeouts, roll calls).
test-long: venv venv-mcore19
	rc=0; OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadfile $(DIST_TESTS) -m long || rc=$$?; \
	OMP_NUM_THREADS=1 $(PY19) -m pytest -n 2 --dist loadfile -m long $(MEGATRON_TESTS) || rc=$$?; \
	exit $$rc

# ruff (pinned in requirements.txt; rules and line length 120 in pyproject.toml): lint with import order, and the
# format check. `make format` applies the formatter and the safe fixes.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: venv
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test-mcore19: venv-mcore19
	OMP_NUM_THREADS=1 $(PY19) -m pytest -n 2 --dist loadfile $(MEGATRON_TESTS)

# One JSON object from examples/gpu_check.py (a Hopper GPU, <= 8 minutes on one H200); on a machine without a GPU:
# `make gpu-check GPU_CHECK_ARGS=--dry-run` (tiny shapes on CPU; `make test` runs it too)
gpu-check: venv
	$(PY) examples/gpu_check.py $(GPU_CHECK_ARGS)

# One bench (benchmarks/NAME.py, run from the checkout: not installed with the package), its JSON on stdout:
# `make bench NAME=model ARGS="--preset tiny --seq-lens 32"`; `make bench` alone lists the benches.
bench: venv
	$(PY) -m benchmarks $(or $(NAME),--help) $(ARGS)

clean:
	rm -rf runs .pytest_cache
