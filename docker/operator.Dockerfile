# The MineDraft operator image: slim Python, no vLLM or torch (the operator imports neither; an import-linter
# contract keeps it so). Built by `make images REGISTRY=...` (all three images) as REGISTRY/operator:TAG; the chart
# runs it with `args: [operator, ...]` after this ENTRYPOINT.
# BASE_IMAGE: the published images build on Docker Hub's python:3.11-slim-bookworm; `make images-smoke` builds them
# on a local Debian 12 base with the same Python (scripts/images_smoke.sh), where no registry is reached.
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="minedraft-operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# Only the operator's extra (pyproject.toml): no vLLM, torch, matplotlib or scipy, and nothing of the other components
# (the check fails the build if any came in).
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[operator]" \
 && python -c "import importlib.util as u; \
extra = [m for m in ('vllm', 'torch', 'matplotlib', 'scipy', 'grpc_tools') if u.find_spec(m)]; \
assert not extra, extra"

# Any UID on a read-only root filesystem: no user is created and nothing is owned by one; HOME and TMPDIR are /tmp,
# which the chart mounts as a volume. USER is numeric so the kubelet can check runAsNonRoot.
ENV HOME=/tmp \
    TMPDIR=/tmp \
    PYTHONDONTWRITEBYTECODE=1
USER 65532
# kopf's health endpoint and metrics, as the chart sets them by default.
EXPOSE 8080 9402
ENTRYPOINT ["minedraft"]
CMD ["operator"]
