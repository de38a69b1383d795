"""MineDraft: batch-parallel speculative decoding (PSD) on vLLM, served over gRPC and run on Kubernetes."""

__version__ = "0.1.0"
