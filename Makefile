# The README's two commands: `make run` and `make test`. Both set up what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-other-cpu lint bench bench-all
setup:
	@bash scripts/setup.sh

run: setup
	@VENV=$(VENV) bash scripts/run_local.sh

test: setup
	@$(PY) -m pytest
	@$(MAKE) --no-print-directory test-other-cpu

# The unit tier again as if on the other kind of x86 CPU (AVX2 only vs AVX-512 BF16/AMX): what the engine decides from
# the CPU (dtype, doctor's report) must hold on both. MINEDRAFT_CPU_FAST_BF16=0/1 overrides the detection.
test-other-cpu: setup
	@other=$$($(PY) -c "from minedraft.engine.placement import detect_device; print(int(not detect_device().cpu_fast_bf16))"); \
	echo "unit tests as if on a CPU with$$([ $$other = 1 ] || echo out) fast bf16 (MINEDRAFT_CPU_FAST_BF16=$$other)"; \
	MINEDRAFT_CPU_FAST_BF16=$$other $(PY) -m pytest tests/unit -q

lint: setup
	@$(VENV)/bin/ruff check minedraft tests && $(VENV)/bin/mypy && $(VENV)/bin/lint-imports

bench: setup
	@$(VENV)/bin/minedraft bench --modes ar,vllm-sd,sd,psd --concurrency 16 --json benchmarks/results/local-c16.json

bench-all: setup  # every canonical result set in benchmarks/results/ (about an hour on 2 cores)
	@$(PY) scripts/bench_all.py
