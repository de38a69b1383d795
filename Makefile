# The README's two commands: `make run` and `make test`. Both set up what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test lint bench bench-all
setup:
	@bash scripts/setup.sh

run: setup
	@VENV=$(VENV) bash scripts/run_local.sh

test: setup
	@$(PY) -m pytest

lint: setup
	@$(VENV)/bin/ruff check minedraft tests && $(VENV)/bin/mypy && $(VENV)/bin/lint-imports

bench: setup
	@$(VENV)/bin/minedraft bench --modes ar,vllm-sd,sd,psd --concurrency 16 --json benchmarks/results/local-c16.json

bench-all: setup  # every canonical result set in benchmarks/results/ (about an hour on 2 cores)
	@$(PY) scripts/bench_all.py
