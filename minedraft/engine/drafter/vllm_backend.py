"""The vLLM drafting backend (drafter process): the draft model in vLLM's own engine, in this process.

The vLLM backend re-admits each request per job (vLLM's engine cannot append tokens to a live request, so a request
cannot stay resident between jobs); its prefix cache keeps the already-seen context cheap, at a per-job cost that
grows with context (block hashing, made incremental by vllm_adapter/block_hashes.py). Any architecture vLLM runs;
the choice for GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from minedraft.engine.vllm_adapter.block_hashes import BlockHashReuse
from minedraft.engine.vllm_adapter.block_hashes import install as install_block_hash_reuse


def _no_op() -> None:
    pass


def steps_behind(engine: Any) -> int:
    """How many step() calls an engine's outputs lag its forwards: 1 under vLLM's async scheduling (a call
    launches forward n and returns forward n - 1's outputs), else 0."""
    config = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    return 1 if getattr(config, "async_scheduling", False) else 0


class VllmDrafter:
    """The job interface (DrafterServer's `drafter`) over the draft model in an in-process vLLM engine."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        extra: dict[str, Any] = {}
        if settings.get("gpu_memory_utilization") is not None:
            extra["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
        if settings.get("hf_overrides"):
            # The target's context stretch (RoPE scaling), so the drafter reads positions as the target does.
            extra["hf_overrides"] = settings["hf_overrides"]
        args = EngineArgs(
            model=settings["model"],
            # Concrete: the engine resolved "auto" (placement.resolve_dtype), so the draft loads as the target does.
            dtype=settings["dtype"],
            # -1: the draft's own context length fitted to its KV cache.
            max_model_len=settings.get("max_model_len") or -1,
            max_num_seqs=settings["max_num_seqs"],
            enable_prefix_caching=True,
            seed=settings.get("seed", 0),
            disable_log_stats=True,
            **extra,
        )
        self.engine = LLMEngine.from_engine_args(args)
        # Under vLLM's async scheduling a step() launches a forward and returns the previous one's outputs: the
        # first call returns before the first forward has run, and its tokens reach the host one call later.
        self.steps_behind = steps_behind(self.engine)
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.cancelled: set[str] = set()
        # The in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) hashes blocks at admission: only new ones now.
        self.block_hashes: BlockHashReuse | None = install_block_hash_reuse(self.engine)

    def context_changed(self, request_id: str, num_tokens_kept: int) -> None:
        """The stored context of a request was cut back to `num_tokens_kept` tokens (0: replaced or forgotten)."""
        if self.block_hashes is not None:
            self.block_hashes.context_changed(request_id, num_tokens_kept)

    def draft(self, job: Any, poll_messages: Any, on_step: Callable[[], None] = _no_op
              ) -> tuple[list[Any], float, float]:
        """Returns the drafts, the job's seconds and the seconds until its first drafted tokens were on the host
        (admission, the prefill of what is not in the prefix cache, position 1's forward and its sampling: under
        async scheduling one step() call later than the call that launched it)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from minedraft.engine.drafter.protocol import DraftResult

        started = time.perf_counter()
        self.cancelled.clear()
        live: dict[str, Any] = {}
        top_f = int(getattr(job, "top_f", 0) or 0)
        for item in job.items:
            # A lookahead branch drafts past its tail (speculative tokens, never stored as the request's context):
            # each branch is a vLLM request of its own over the prefix-cached committed context.
            prompt = [*item.token_ids, *item.tail] if item.tail else item.token_ids
            room = self.max_model_len - len(prompt)
            # No draft wanted: a chunk of a long catch-up, taken in (prefilled into the prefix cache) only. vLLM
            # samples at least one token; it is dropped.
            prefill_only = item.num_draft_tokens == 0
            num = 1 if prefill_only else min(item.num_draft_tokens, room)
            if num <= 0 or room <= 0 or not item.token_ids:
                continue  # (token ids were checked against the vocabulary on receipt, in DrafterServer)
            # With candidates: one token more, for the top-F at the position after the draft (then dropped).
            extra = 1 if top_f and not prefill_only and num < room else 0
            params = SamplingParams(
                max_tokens=num + extra,
                temperature=0.0,
                ignore_eos=True,
                logprobs=top_f if top_f and not prefill_only else (0 if job.want_logprobs else None),
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            key = f"{job.job_id}:{item.request_id}:{item.branch}" if item.tail else f"{job.job_id}:{item.request_id}"
            if self.block_hashes is not None:
                self.block_hashes.expect(key, item.request_id, len(item.token_ids) if item.tail else None)
            self.engine.add_request(key, TokensPrompt(prompt_token_ids=list(prompt)), params)
            # The length now: a newer job taken in mid-job (poll_messages) extends the stored context in place.
            live[key] = (item, len(prompt), prefill_only, num)
        results: list[DraftResult] = []
        first_token_seconds = 0.0
        calls = 0
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            calls += 1
            if not first_token_seconds and calls > self.steps_behind:
                # The first forward's tokens are on the host: admission, catch-up, first forward and sampling.
                first_token_seconds = time.perf_counter() - started
            on_step()
            for output in outputs:
                if not output.finished or output.request_id not in live:
                    continue
                item, context_num_tokens, prefill_only, num = live.pop(output.request_id)
                if prefill_only:
                    continue
                completion = output.outputs[0]  # type: ignore[index]
                token_ids = list(completion.token_ids)[:num]
                logprobs = None
                if job.want_logprobs and completion.logprobs is not None:
                    logprobs = [
                        float(step[token].logprob)
                        for step, token in zip(completion.logprobs, token_ids, strict=False)
                    ]
                candidates: list[list[int]] = []
                if top_f and completion.logprobs is not None:
                    # Best first by vLLM's rank (1 = the greedy token); the sampled token rides along if outside.
                    candidates = [[token for token, lp in sorted(step.items(), key=lambda kv: kv[1].rank)
                                   if lp.rank is not None and lp.rank <= top_f][:top_f]
                                  for step in completion.logprobs[:num + 1]]
                results.append(
                    DraftResult(
                        request_id=item.request_id,
                        context_num_tokens=context_num_tokens,
                        token_ids=token_ids,
                        logprobs=logprobs,
                        branch=item.branch,
                        tail=list(item.tail),
                        candidates=candidates,
                    )
                )
            # Cancels that arrive mid-job drop those requests here too, not just on the verifier's side.
            poll_messages()
            if self.cancelled:
                doomed = [key for key, (item, _, _, _) in live.items() if item.request_id in self.cancelled]
                if doomed:
                    self.engine.abort_request(doomed)
                    for key in doomed:
                        live.pop(key, None)
        return results, time.perf_counter() - started, first_token_seconds

    @property
    def max_context_tokens(self) -> int:
        return self.max_model_len
