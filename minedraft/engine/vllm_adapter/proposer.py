"""The in-worker proposer vLLM's custom_class speculative method asks for.

It proposes nothing: our scheduler attaches the drafter's tokens itself. vLLM only needs it to enable verification
(the rejection sampler) in the target worker.
"""

from __future__ import annotations

from typing import Any


class NullProposer:
    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """The CPU model runner calls this unconditionally; there is no model to load."""

    def propose(self, sampled_token_ids: list[Any], *args: Any, **kwargs: Any) -> list[list[int]]:
        return [[] for _ in sampled_token_ids]
