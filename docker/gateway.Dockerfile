# The MineDraft gateway: slim Python, no vLLM or torch (it talks to engines through the generated gRPC stubs only).
# Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/minedraft/gateway:0.1.0 .
FROM python:3.11-slim

LABEL org.opencontainers.image.title="minedraft-gateway" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
RUN pip install --no-cache-dir . \
 && python -c "import importlib.util as u; assert not u.find_spec('vllm') and not u.find_spec('torch')"

RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp minedraft
USER 1000:1000
ENV HOME=/tmp
EXPOSE 50051
ENTRYPOINT ["minedraft"]
CMD ["gateway", "--host", "0.0.0.0"]
