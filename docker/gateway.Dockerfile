# The MineDraft gateway image: slim Python, no vLLM or torch (it talks to engines through the generated gRPC stubs
# only). Built by `make images REGISTRY=...` (all three images) as REGISTRY/gateway:TAG; gateway pods run
# `minedraft gateway ...` (the operator renders the command).
FROM python:3.11-slim-bookworm

ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="minedraft-gateway" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# The base install: no `cpu`/`gpu` extra, so no vLLM and no torch (the check fails the build if either came in).
RUN pip install --no-cache-dir . \
 && python -c "import importlib.util as u; assert not u.find_spec('vllm') and not u.find_spec('torch')"

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
