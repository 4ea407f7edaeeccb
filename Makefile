# The two commands of the README. Each one sets up .venv from the pinned lock file first.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: train test bench clean

$(STAMP): pyproject.toml requirements.lock
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first, pinned: an unpinned torch would pull several GB of CUDA wheels.
	$(PY) -m pip install -q $$(grep '^torch==' requirements.lock)
	$(PY) -m pip install -q -c requirements.lock -e '.[test]'
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m ddp_plugins.train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
