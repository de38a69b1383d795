# The MineDraft gateway image: slim Python, no vLLM or torch (it talks to engines through the generated gRPC stubs
# only). Built by `make images REGISTRY=...` (all three images) as REGISTRY/gateway:TAG; gateway pods run
# `minedraft gateway ...` (the operator renders the command).
# BASE_IMAGE: the published images build on Docker Hub's python:3.11-slim-bookworm; `make images-smoke` builds them
# on a local Debian 12 base with the same Python (scripts/images_smoke.sh), where no registry is reached.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="minedraft-gateway" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# Only the gateway's extra (pyproject.toml): no vLLM, torch, matplotlib or scipy, and nothing of the other components
# (the check fails the build if any came in).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gateway]" \
 && python -c "import importlib.util as u; \
extra = [m for m in ('vllm', 'torch', 'matplotlib', 'scipy', 'kopf', 'grpc_tools') if u.find_spec(m)]; \
assert not extra, extra"

# Any UID on a read-only root filesystem: no user is created and nothing is owned by one; HOME and TMPDIR are /tmp,
# which the pods mount as a volume. USER is numeric so the kubelet can check runAsNonRoot.
ENV HOME=/tmp \
    TMPDIR=/tmp \
    PYTHONDONTWRITEBYTECODE=1
USER 65532
# gRPC, the OpenAI HTTP API and metrics, as the operator renders them by default.
EXPOSE 50051 8080 9401
ENTRYPOINT ["minedraft"]
# A gateway needs its engines named (--engines HOST:PORT,... or --kubernetes-service NAMESPACE/NAME): the operator's
# pods give them; by hand, `docker run IMAGE gateway --host 0.0.0.0 --port 50051 --engines HOST:PORT`.
CMD ["gateway", "--help"]
