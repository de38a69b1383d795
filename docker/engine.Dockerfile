# The MineDraft engine image: Python 3.11 with this package and its `gpu` extra, which pins vLLM exactly (vLLM's
# scheduler and worker hooks are not a public interface) and brings the CUDA build of torch it needs; the NVIDIA
# driver comes from the node. Not vLLM's own image: that ships Python 3.12, which this package does not support
# (pyproject.toml's requires-python). Built by `make images REGISTRY=...` (all three images) as REGISTRY/engine:TAG.
#
# Engine pods run `minedraft serve ...` (the operator renders the command); Jobs run `minedraft profile ...` or
# `minedraft drafter ...` with the same image: the entrypoint is the `minedraft` command, so any subcommand runs.
# BASE_IMAGE: the published images build on Docker Hub's python:3.11-slim-bookworm; `make images-smoke` builds them
# on a local Debian 12 base with the same Python (scripts/images_smoke.sh), where no registry is reached.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="minedraft-engine" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

# Triton (vLLM's and torch.compile's kernels) compiles a small launcher with the system C compiler at first use.
# Debian's packages of the base image's release: pinning their revisions would break on every point release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# The package with its `engine` extra (vLLM's CUDA build, and torch through it), nothing of the gateway, operator or
# benchmarks: the versions are pyproject.toml's. The check fails the build unless the vLLM installed is exactly the
# one that extra pins (read back from the installed package's own metadata).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[engine]" \
 && python -c "from importlib.metadata import requires, version; \
pin = [r.split(';')[0].split('==')[1] for r in requires('minedraft') if r.startswith('vllm==')]; \
assert pin == [version('vllm')], (pin, version('vllm'))"

# Any UID (PodSecurity "restricted", OpenShift's arbitrary UIDs) on a read-only root filesystem: no user is created
# and nothing is owned by one. Every path a process writes is under /tmp, /var/cache/minedraft or
# /var/lib/minedraft/models, which the pods mount as volumes (the operator sets the same variables). USER is
# numeric so the kubelet can check runAsNonRoot; with an arbitrary UID there is no passwd entry, so $USER names
# one for getpass.getuser() (torch and Triton call it).
ENV HOME=/tmp \
    TMPDIR=/tmp \
    USER=minedraft \
    XDG_CACHE_HOME=/var/cache/minedraft \
    XDG_CONFIG_HOME=/var/cache/minedraft/config \
    VLLM_CACHE_ROOT=/var/cache/minedraft/vllm \
    VLLM_CONFIG_ROOT=/var/cache/minedraft/vllm-config \
    TORCHINDUCTOR_CACHE_DIR=/var/cache/minedraft/torchinductor \
    TRITON_CACHE_DIR=/var/cache/minedraft/triton \
    CUDA_CACHE_PATH=/var/cache/minedraft/nv \
    NUMBA_CACHE_DIR=/var/cache/minedraft/numba \
    OUTLINES_CACHE_DIR=/var/cache/minedraft/outlines \
    HF_HOME=/var/lib/minedraft/models/huggingface \
    PYTHONDONTWRITEBYTECODE=1 \
    VLLM_LOGGING_STREAM=ext://sys.stderr \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 65532
# gRPC, the OpenAI HTTP API and metrics, as the operator renders them by default.
EXPOSE 50051 8000 9400
ENTRYPOINT ["minedraft"]
CMD ["serve", "--host", "0.0.0.0", "--http-port", "8000"]
