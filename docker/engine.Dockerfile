# The MineDraft engine: vLLM 0.32's CUDA image with this package added. Build from the repository root:
#   docker build -f docker/engine.Dockerfile -t ghcr.io/minedraft/engine:0.1.0 .
# vLLM's scheduler and worker hooks are not a public interface: the base image's vLLM must be exactly 0.32.0
# (pyproject.toml's `gpu` extra pins the same; a test checks both).
FROM vllm/vllm-openai:v0.32.0

LABEL org.opencontainers.image.title="minedraft-engine" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.source="https://github.com/minedraft/minedraft"

WORKDIR /opt/minedraft
COPY pyproject.toml README.md ./
COPY minedraft ./minedraft
# ".[gpu]" keeps vllm==0.32.0 (already in the image) and adds our own dependencies; the check fails the build if
# pip moved vLLM.
RUN pip install --no-cache-dir ".[gpu]" \
 && python -c "import vllm; assert vllm.__version__ == '0.32.0', vllm.__version__"

# Unprivileged (the operator's pods run as 1000:1000 with a read-only root filesystem; caches go to emptyDirs).
RUN useradd --uid 1000 --user-group --no-create-home --home-dir /tmp minedraft
USER 1000:1000
ENV HOME=/tmp VLLM_LOGGING_STREAM=ext://sys.stderr
EXPOSE 50051 9400
ENTRYPOINT ["minedraft"]
CMD ["serve", "--host", "0.0.0.0"]
