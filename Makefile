# The README's two commands: `make run` and `make test`. Both set up what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup run test test-other-cpu lint bench bench-all images push images-smoke
setup:
	@bash scripts/setup.sh

run: setup
	@VENV=$(VENV) bash scripts/run_local.sh

test: setup
	@$(PY) -m pytest
	@$(MAKE) --no-print-directory test-other-cpu

# The unit tests that read the CPU kind (marked cpu_kind) again as if on the other kind of x86 CPU (AVX2 only vs
# AVX-512 BF16/AMX): what the engine decides from the CPU (dtype, doctor's report) must hold on both.
# MINEDRAFT_CPU_FAST_BF16=0/1 overrides the detection and placement._cpu_has_fast_bf16 is its only reader, so only a
# test that reads it can change outcome with it. This tier used to rerun all of tests/unit (1,537 tests, 7 min 41 s);
# tests/cpu_kind_audit.py's run (its docstring has the command) found one reader of this process's environment,
# test_doctor's dtype note (test_placement's read mappings they pass in), and tests/unit passed whole with the value
# refused, so no child process reads it. tests/conftest.py fails a unit test that reads it unmarked: the selection
# stays complete as tests are added.
test-other-cpu: setup
	@other=$$($(PY) -c "from minedraft.engine.placement import detect_device; print(int(not detect_device().cpu_fast_bf16))"); \
	echo "unit tests that read the CPU kind, as if on a CPU with$$([ $$other = 1 ] || echo out) fast bf16 (MINEDRAFT_CPU_FAST_BF16=$$other)"; \
	MINEDRAFT_CPU_FAST_BF16=$$other $(PY) -m pytest tests/unit -q -m cpu_kind

lint: setup
	@$(VENV)/bin/ruff check minedraft tests && $(VENV)/bin/mypy && $(VENV)/bin/lint-imports

bench: setup
	@$(VENV)/bin/minedraft bench --modes ar,vllm-sd,sd,psd --concurrency 16 --json benchmarks/results/local-c16.json

bench-all: setup  # every canonical result set in benchmarks/results/ (about an hour on 2 cores)
	@$(PY) scripts/bench_all.py

# The three images (docker/*.Dockerfile): `make images REGISTRY=registry.example.com/minedraft` builds
# REGISTRY/operator:TAG, REGISTRY/engine:TAG and REGISTRY/gateway:TAG; `make push` builds and pushes them. TAG
# defaults to the package version (pyproject.toml), which is also the chart's appVersion: install the chart with
# --set image.registry=REGISTRY (and --set image.tag=TAG if you chose another). PLATFORM (e.g. linux/amd64) builds
# for the GPU nodes' architecture from another machine; DOCKER=podman works too.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
TAG ?= $(VERSION)
DOCKER ?= docker
PLATFORM ?=
IMAGES := operator engine gateway
IMAGE_PREFIX = $(patsubst %/,%,$(REGISTRY))

ifneq ($(filter images push image-% push-%,$(MAKECMDGOALS)),)
ifeq ($(strip $(REGISTRY)),)
$(error REGISTRY is required: the registry and path to build and push the images as, e.g. make images push REGISTRY=registry.example.com/minedraft)
endif
endif

images: $(IMAGES:%=image-%)

push: $(IMAGES:%=push-%)

image-%:
	$(DOCKER) build -f docker/$*.Dockerfile$(if $(PLATFORM), --platform $(PLATFORM)) --build-arg VERSION=$(VERSION) -t $(IMAGE_PREFIX)/$*:$(TAG) .

push-%: image-%
	$(DOCKER) push $(IMAGE_PREFIX)/$*:$(TAG)

# Opt-in, not part of `make test`: builds the operator and gateway images here on a locally made Debian 12 base (no
# registry), streams a completion through the gateway image and reports the images' sizes (docs/kubernetes.md).
# DOCKER=docker to use a Docker daemon instead of podman; BASELINE_REF=<commit> to compare sizes with that commit's.
images-smoke: setup
	@VENV=$(VENV) bash scripts/images_smoke.sh
