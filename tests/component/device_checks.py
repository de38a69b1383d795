"""Greedy-output checks that hold on the device the suite runs on.

On this CPU in float32, speculative verification (k+1 query tokens) and plain decoding compute the same logits bit
for bit, so every speculative mode must reproduce the target alone exactly: the CPU check is bitwise equality.

On a GPU in bf16 the verifier and plain decoding run different kernels; near-ties flip and the outputs fork from
there, which is why vLLM's own spec-decode tests use match rates. The GPU check: over the first AGREEMENT_TOKENS
tokens, at least AGREEMENT_THRESHOLD of the requests agree exactly. A PSD bug (drafts from the wrong context,
tokens committed without verification) breaks nearly every request within a few tokens, far below that threshold.
The distribution test (chi-square at temperature 1) is the same on both devices.
"""

from __future__ import annotations

import functools

AGREEMENT_TOKENS = 16
AGREEMENT_THRESHOLD = 0.9


@functools.cache
def on_gpu() -> bool:
    import torch

    # Not is_available(): that initialises CUDA in the test process, after which an engine started later could no
    # longer narrow its CUDA_VISIBLE_DEVICES. device_count() asks NVML.
    return torch.cuda.device_count() > 0


def prefix_agreement(outputs: list[list[int]], references: list[list[int]], num_tokens: int = AGREEMENT_TOKENS
                     ) -> float:
    """Share of requests whose first `num_tokens` tokens equal the reference's."""
    assert len(outputs) == len(references) and outputs
    same = sum(1 for out, ref in zip(outputs, references, strict=True) if out[:num_tokens] == ref[:num_tokens])
    return same / len(outputs)


def assert_greedy_matches(outputs: list[list[int]], references: list[list[int]], label: str,
                          gpu: bool | None = None) -> None:
    if not (on_gpu() if gpu is None else gpu):
        for i, (out, ref) in enumerate(zip(outputs, references, strict=True)):
            assert out == ref, f"{label}: request {i} diverged from the target alone"
        return
    agreement = prefix_agreement(outputs, references)
    assert agreement >= AGREEMENT_THRESHOLD, (
        f"{label}: only {agreement:.0%} of requests agree with the target alone over the first {AGREEMENT_TOKENS} "
        f"tokens (GPU threshold {AGREEMENT_THRESHOLD:.0%})")
