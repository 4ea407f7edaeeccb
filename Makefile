# The commands of the README. Each one sets up .venv from the pinned lock file first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train lint test test-e2e test-matrix gpu-check gpu-tests matrix bench clean

# pip compiles the bytecode of what it installs one file at a time (about a third of the set-up): it
# is skipped there and done once on every core (`compileall -j 0`, the same .pyc files; this machine sets
# PYTHONDONTWRITEBYTECODE, so nothing is compiled later: without them every process spends 12 s more
# importing Lightning). compileall exits 1 for the few files that are not Python 3.11 (torch's py312 test
# intrinsics), which pip skips too. pip installs torch (only pip takes the local CPU build, and an unpinned
# resolver would pull several GB of CUDA wheels), then the pinned uv installs the rest against
# requirements.lock: the same versions (the torch installed satisfies the lock's pin, so uv keeps it),
# measured from a fresh clone in 7 s instead of pip's 50 s.
PIP_INSTALL := -m pip install -q --no-compile
# This repository's own modules (the package, the tests) change from run to run: every process here may
# write their bytecode (__pycache__, ignored by git), so that only the first to import a module compiles
# it, and pytest keeps its rewritten test modules. PYTHONDONTWRITEBYTECODE (set on this machine) is
# emptied for the commands below; measured, 0.3 s of CPU less per fresh process importing the app, 2.3 s
# less per pytest worker's collection once cached.
export PYTHONDONTWRITEBYTECODE :=
UV_INSTALL = $(dir $(1))uv pip install -q --python $(1)
COMPILE_SITE = $(1) -m compileall -q -j 0 -x '$(NOT_IMPORTED)' "$$($(1) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true
# What no test or run imports: the packages' own test suites (2,115 files), pip, setuptools and mypy
# (compiled by mypyc; its .py files are not what runs). Skipping them: 27 s of compileall instead of 43.
NOT_IMPORTED := /(tests?|pip|setuptools|mypy|mypyc|_vendor)/

$(STAMP): pyproject.toml requirements.lock
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull several GB of CUDA wheels.
	$(PY) $(PIP_INSTALL) $$(grep -E '^(torch|uv)==' requirements.lock)
	$(call UV_INSTALL,$(PY)) -c requirements.lock -e '.[test]'
	$(call COMPILE_SITE,$(PY))
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m ddp_plugins.train $(ARGS)

# Lint scope: the whole repo (package, conf/, tests/, benchmarks/, the notebooks and the Python
# blocks of the Markdown files, which ruff format checks); .venv and the .gitignore'd paths
# (.venv-lightning-*, outputs/) are skipped by ruff. mypy checks the package only.
LINT_PATHS := .

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy ddp_plugins

# Three pytest workers (pytest-xdist) on this 2-core machine: the tests wait on processes they started
# (ranks importing Lightning, timeouts, Slurm), and a third worker fills those waits. Measured back to
# back (2026-11-26): 2 workers 516 s, 3 workers 457 s, 4 workers 505 s (the ranks then compete for
# the cores, and a straggler notebook's timing broke). Work stealing: a worker that runs out takes half
# of another's queue, so the run does not end on one worker's last long tests.
XDIST := -n 3 --dist worksteal

# `make test` leaves out the slowest end-to-end proofs (marker `e2e`: Slurm and submitit requeues, the
# default-settings stall, long preemption sequences): `make test-e2e` runs them, and .ci/run runs both.
test: $(STAMP)
	$(PY) -m pytest $(XDIST) -m "not hazard_control and not e2e" $(PYTEST_ARGS)
	@if $(HAS_CUDA); then $(MAKE) --no-print-directory gpu-tests PY=$(PY); else echo "make test: no CUDA GPU here, the gpu tests were skipped (make gpu-check runs them where one is)"; fi

# The `waits` tests (three, which mostly sleep through the default liveness limits, two of them 330 s)
# run in a second pytest beside the others, their output shown after: the run is as long as its longest.
test-e2e: $(STAMP)
	@$(PY) -m pytest -n 3 -m "e2e and waits" -p no:cacheprovider $(PYTEST_ARGS) > .e2e-waits.log 2>&1 & waits=$$!; \
	$(PY) -m pytest $(XDIST) -m "e2e and not waits" $(PYTEST_ARGS); others=$$?; \
	wait $$waits; code=$$?; echo "== make test-e2e: the waits tests"; cat .e2e-waits.log; rm -f .e2e-waits.log; \
	test $$others -eq 0 && test $$code -eq 0

# The promise matrix (tests/matrix/table.py): `make test` runs its pairwise cells, this every cell (about two
# hours on this 2-core machine; 2 workers, as a cell's ranks fill the cores), then writes docs/promise_matrix.md
# with each cell's result and seconds.
MATRIX_RESULTS := .matrix-results.jsonl
test-matrix: $(STAMP)
	rm -f $(MATRIX_RESULTS)
	DDP_PLUGINS_MATRIX=full DDP_PLUGINS_MATRIX_RESULTS=$(CURDIR)/$(MATRIX_RESULTS) $(PY) -m pytest -n 2 --dist worksteal \
		tests/matrix $(PYTEST_ARGS); status=$$?; \
		$(PY) -m tests.matrix.report $(MATRIX_RESULTS) docs/promise_matrix.md full; exit $$status

# The GPU proofs, on a machine with at least one CUDA GPU, in an existing environment (no install,
# no network: `make gpu-check PY=python3`), in about 5 minutes: the tests marked `gpu` (CUDA shown,
# one at a time: the ranks of a test share the GPUs), then the benchmarks on one GPU. Exits non-zero
# on any failure, and when no GPU is there to check.
HAS_CUDA := $(PY) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null

gpu-tests:
	DDP_PLUGINS_TEST_CUDA=1 $(PY) -m pytest -m gpu -p no:cacheprovider -rA tests $(PYTEST_ARGS)

gpu-check:
	@$(HAS_CUDA) || { echo "make gpu-check: torch sees no CUDA GPU here ($(PY))"; exit 1; }
	$(MAKE) --no-print-directory gpu-tests PY=$(PY)
	$(PY) benchmarks/bench_comm_timeline.py --gpu
	$(PY) benchmarks/bench_sync_batchnorm.py --share-gpu

# The version matrix: the pinned set is `make test` (torch 2.13.0, Lightning 2.6.6); `make matrix` runs the
# fast suite (the torch-only core included) and the Trainer-level tests that go through Lightning's private
# names (seeding, evaluation, strategy, the epoch's running sums) on the declared floors and the newest torch
# installable here, each in a venv of its own: torch TORCH_FLOOR and TORCH_NEWEST, both with the oldest
# Lightning the pyproject allows. Those torch builds are PyPI's CUDA ones (about 4 GB with their libraries;
# uv keeps them in its cache after the first install) and run on the CPU here. The other direct
# dependencies keep their pins; what Lightning caps itself (packaging, fsspec) resolves freely. The
# failing-rank and hang runs (our launcher; each waits for ranks to fail or time out) run in `make test` only.
TORCH_FLOOR := 2.10.0
TORCH_NEWEST := 2.14.1
OLDEST_LIGHTNING := $(shell sed -n 's/.*"lightning>=\([0-9.]*\),.*/\1/p' pyproject.toml)
MATRIX_VENVS := .venv-torch-$(TORCH_FLOOR) .venv-torch-$(TORCH_NEWEST)
MATRIX_PINS := hydra-submitit-launcher|submitit|cloudpickle|torchmetrics|hydra-core|omegaconf|numpy|scikit-learn|typing_extensions|lightning-utilities|pytest|pytest-timeout|pytest-xdist|execnet|nbclient|nbformat|ipykernel|matplotlib
# The test harness's own tests (its timeouts of a few seconds include starting ranks, slower with a CUDA build's
# import on a busy machine) run once, in `make test`.
MATRIX_IGNORE := --ignore=tests/test_testing.py --ignore=ddp_plugins/testing.py
MATRIX_SLOW := tests/lightning/test_rank_aware_seed.py tests/lightning/test_sequential_evaluation.py tests/lightning/test_strategy.py tests/lightning/test_epoch_partials.py

.venv-torch-%/.installed: pyproject.toml requirements.lock
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/python $(PIP_INSTALL) $$(grep -E '^uv==' requirements.lock)
	grep -E '^($(MATRIX_PINS))==' requirements.lock > $(@D)/constraints.txt
	$(call UV_INSTALL,$(@D)/bin/python) -c $(@D)/constraints.txt 'torch==$*' -e '.[test]' 'lightning==$(OLDEST_LIGHTNING)'
	$(call COMPILE_SITE,$(@D)/bin/python)
	touch $@

matrix: $(STAMP) $(MATRIX_VENVS:=/.installed)
	@echo "== version matrix: $$($(PY) -c 'import lightning, torch; print("lightning", lightning.__version__, "torch", torch.__version__)') -> make test"
	for venv in $(MATRIX_VENVS); do \
		echo "== version matrix: $$($$venv/bin/python -c 'import lightning, torch; print("lightning", lightning.__version__, "torch", torch.__version__)') -> fast suite + Trainer-level seeding, evaluation, strategy, epoch sums tests"; \
		$$venv/bin/python -m pytest $(XDIST) -m "not slow" -p no:cacheprovider $(MATRIX_IGNORE) $(PYTEST_ARGS) || exit 1; \
		$$venv/bin/python -m pytest $(XDIST) -m slow -p no:cacheprovider -k "not failing_rank and not stops_progressing" $(MATRIX_SLOW) $(PYTEST_ARGS) || exit 1; \
	done
	@echo "== version matrix: torch $(TORCH_FLOOR) and $(TORCH_NEWEST) with lightning $(OLDEST_LIGHTNING) passed"

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .venv-torch-* .venv-lightning-* outputs multirun .pytest_cache .mypy_cache .ruff_cache
