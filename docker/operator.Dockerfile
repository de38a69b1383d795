# The MineDraft operator: slim Python, no vLLM or torch (the operator imports neither; an import-linter contract
# keeps it so). Build from the repository root:
#   docker build -f docker/operator.Dockerfile -t ghcr.io/minedraft/operator:0.1.0 .
FROM python:3.11-slim

LABEL org.opencontainers.image.title="minedraft-operator" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# The base install: no `cpu`/`gpu` extra, so no vLLM and no torch.
RUN pip install --no-cache-dir . \
 && python -c "import importlib.util as u; assert not u.find_spec('vllm') and not u.find_spec('torch')"

RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp minedraft
USER 1000:1000
ENV HOME=/tmp
EXPOSE 8080 9402
ENTRYPOINT ["minedraft"]
CMD ["operator"]
