# The MineDraft operator image: slim Python, no vLLM or torch (the operator imports neither; an import-linter
# contract keeps it so). Built by `make images REGISTRY=...` (all three images) as REGISTRY/operator:TAG; the chart
# runs it with `args: [operator, ...]` after this ENTRYPOINT.
FROM python:3.11-slim-bookworm

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="minedraft-operator" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# The base install: no `cpu`/`gpu` extra, so no vLLM and no torch (the check fails the build if either came in).
RUN pip install --no-cache-dir . \
 && python -c "import importlib.util as u; assert not u.find_spec('vllm') and not u.find_spec('torch')"

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
