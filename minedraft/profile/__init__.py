"""`minedraft profile`: cost curves (forward-pass and draft-loop times by batch, context and tokens) for a model
pair's architecture, measured on the local device with random weights, written in the `minedraft-cost-curves/v1`
format (docs/gpu.md, "Profiling: cost curves").

This package imports only the standard library and torch (numpy at most): it must run on a bare GPU machine where
the repository's files are all there is (no vLLM, no transformers, no gRPC). A test imports it with those blocked.
The command line, runner and supervisor do not import torch at all (the `minedraft` parser is built in images that
have none); only the measuring worker process (worker, model, timing) does. import-linter checks both.
"""
