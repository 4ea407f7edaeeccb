# The commands of the README. Each one sets up .venv from the pinned lock file first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train lint test bench clean

$(STAMP): pyproject.toml requirements.lock
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull several GB of CUDA wheels.
	$(PY) -m pip install -q $$(grep '^torch==' requirements.lock)
	$(PY) -m pip install -q -c requirements.lock -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m ddp_plugins.train $(ARGS)

# Lint scope: the package (ddp_plugins/ and its Hydra configs' conf/__init__.py); tests/ and
# benchmarks/ are not linted yet.
LINT_PATHS := ddp_plugins conf

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/mypy ddp_plugins

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .mypy_cache .ruff_cache
