"""A request's text made in the serving process (an engine process's front end), as vLLM makes it in the engine.

vLLM's LLMEngine detokenises inside step() and matches stop strings there. An engine in a process of its own is sent
requests with detokenize=False (token ids only, no stop strings: vLLM takes none without detokenisation), and the
front end runs vLLM's own incremental detokenizer on each delta instead: the same text, the same held-back tail while
a stop string may still be forming, the same cut at a stop string (text before it; token ids up to the one that
completed it, later ones of the same step dropped), finish reason "stop". The front end then aborts the request in
the engine, as vLLM's output processor does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from minedraft.engine.requests import OutputDelta, SamplingSettings


class StreamDetokenizer:
    """One request's incremental detokenisation and stop-string check (vLLM's IncrementalDetokenizer)."""

    def __init__(self, tokenizer: Any, request_id: str, prompt_token_ids: list[int],
                 sampling: SamplingSettings) -> None:
        from vllm.v1.engine import EngineCoreRequest
        from vllm.v1.engine.detokenizer import IncrementalDetokenizer

        from minedraft.engine.core import vllm_sampling_params

        params = vllm_sampling_params(sampling, sampling.max_tokens)
        request = EngineCoreRequest(request_id=request_id, prompt_token_ids=list(prompt_token_ids),
                                    mm_features=None, sampling_params=params, pooling_params=None,
                                    arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None)
        self._detokenizer = IncrementalDetokenizer.from_new_request(tokenizer, request)
        # Tokens the engine made that the front end cut (after a stop string): output counts leave them out.
        self._num_dropped = 0

    def apply(self, delta: OutputDelta) -> tuple[OutputDelta, bool]:
        """The delta as the in-process engine would have sent it; True when a stop string ends the request here (the
        engine has not finished it: abort it there)."""
        if delta.finish_reason == "abort":
            # The engine's own abort notice carries no text (vLLM sends nothing for an aborted request): a tail held
            # back for a possible stop string is not sent in-process either.
            return delta, False
        detokenizer = self._detokenizer
        before = detokenizer.num_output_tokens()
        # As vLLM's output processor: a request the engine stopped (EOS, a stop token) leaves its last token's text out.
        stop_string = detokenizer.update(list(delta.token_ids), delta.finish_reason == "stop")
        kept = detokenizer.output_token_ids[before:]
        self._num_dropped += len(delta.token_ids) - len(kept)
        stopped_here = stop_string is not None and not delta.finished
        finished = delta.finished or stop_string is not None
        text = detokenizer.get_next_output_text(finished, delta=True)
        logprobs = delta.logprobs
        if logprobs is not None and len(logprobs) > len(kept):
            logprobs = logprobs[:len(kept)]  # the tokens cut after a stop string take theirs with them
        return replace(delta, token_ids=list(kept), text=text, logprobs=logprobs,
                       finish_reason="stop" if stop_string is not None else delta.finish_reason,
                       num_output_tokens=delta.num_output_tokens - self._num_dropped), stopped_here
