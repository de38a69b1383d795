"""The drafter: a process of its own, on its own device, drafting greedily with vLLM.

Each job carries, per request, only the tokens committed since the previous job (DrafterServer keeps the rest).
The vLLM backend still re-admits each request per job (vLLM's engine cannot append tokens to a live request, so a
request cannot stay resident between jobs); its prefix cache keeps the already-seen context cheap, at a per-job
cost that grows with context (block hashing). The torch backend keeps each request's KV cache between jobs.

Greedy drafting makes each proposal deterministic, which is what lets the verifier's rejection sampler stay
exactly lossless without draft probabilities.

Run as `python -m minedraft.engine.drafter_process ADDRESS SETTINGS_JSON`; the scheduler starts it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

log = logging.getLogger("minedraft.drafter")


def _configure_device(settings: dict[str, Any]) -> None:
    """Bind this process to its own cores (or GPU) before torch or vLLM start any threads."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(settings.get("kv_cache_gib", 1))))
    cores = settings.get("cpu_cores") or []
    if cores:
        os.sched_setaffinity(0, cores)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in cores)
        os.environ["OMP_NUM_THREADS"] = str(len(cores))
    # The device as the pod named it (one entry of the engine's inherited CUDA_VISIBLE_DEVICES, mapped by
    # minedraft.engine.placement.plan_devices); the engine's own narrowed list must not leak in.
    if settings.get("cuda_visible_devices") is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(settings["cuda_visible_devices"])


class Drafter:
    def __init__(self, settings: dict[str, Any]) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        extra: dict[str, Any] = {}
        if settings.get("gpu_memory_utilization") is not None:
            extra["gpu_memory_utilization"] = settings["gpu_memory_utilization"]
        args = EngineArgs(
            model=settings["model"],
            dtype=settings.get("dtype", "float32"),
            # -1: the draft's own context length fitted to its KV cache.
            max_model_len=settings.get("max_model_len") or -1,
            max_num_seqs=settings["max_num_seqs"],
            enable_prefix_caching=True,
            seed=settings.get("seed", 0),
            disable_log_stats=True,
            **extra,
        )
        self.engine = LLMEngine.from_engine_args(args)
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.cancelled: set[str] = set()

    def draft(self, job: Any, poll_messages: Any) -> tuple[list[Any], float, float]:
        """Returns the drafts, the job's seconds and the seconds to its first drafted token (vLLM's first step:
        the prefill of what is not in the prefix cache, and position 1)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        from minedraft.engine.protocol import DraftResult

        started = time.perf_counter()
        self.cancelled.clear()
        live: dict[str, Any] = {}
        for item in job.items:
            room = self.max_model_len - len(item.token_ids)
            num = min(item.num_draft_tokens, room)
            if num <= 0 or not item.token_ids:
                continue  # (token ids were checked against the vocabulary on receipt, in DrafterServer)
            params = SamplingParams(
                max_tokens=num,
                temperature=0.0,
                ignore_eos=True,
                logprobs=0 if job.want_logprobs else None,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            key = f"{job.job_id}:{item.request_id}"
            self.engine.add_request(key, TokensPrompt(prompt_token_ids=list(item.token_ids)), params)
            # The length now: a newer job taken in mid-job (poll_messages) extends the stored context in place.
            live[key] = (item, len(item.token_ids))
        results: list[DraftResult] = []
        first_token_seconds = 0.0
        while self.engine.has_unfinished_requests():
            outputs = self.engine.step()
            if not first_token_seconds:
                first_token_seconds = time.perf_counter() - started
            for output in outputs:
                if not output.finished or output.request_id not in live:
                    continue
                item, context_num_tokens = live.pop(output.request_id)
                completion = output.outputs[0]  # type: ignore[index]
                logprobs = None
                if job.want_logprobs and completion.logprobs is not None:
                    logprobs = [
                        float(step[token].logprob)
                        for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
                    ]
                results.append(
                    DraftResult(
                        request_id=item.request_id,
                        context_num_tokens=context_num_tokens,
                        token_ids=list(completion.token_ids),
                        logprobs=logprobs,
                    )
                )
            # Cancels that arrive mid-job drop those requests here too, not just on the verifier's side.
            poll_messages()
            if self.cancelled:
                doomed = [key for key, (item, _) in live.items() if item.request_id in self.cancelled]
                if doomed:
                    self.engine.abort_request(doomed)
                    for key in doomed:
                        live.pop(key, None)
        return results, time.perf_counter() - started, first_token_seconds


class TorchDrafter:
    """The same job interface over the plain-torch drafter (KV cache kept per request between jobs)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import torch

        from minedraft.engine.torch_drafter import make_torch_drafter

        torch.set_num_threads(max(1, len(settings.get("cpu_cores") or []) or 1))
        self.model = make_torch_drafter(settings)
        self.cancelled: set[str] = set()

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    def draft(self, job: Any, poll_messages: Any) -> tuple[list[Any], float, float]:
        from minedraft.engine.protocol import DraftResult

        started = time.perf_counter()
        if self.cancelled:
            self.model.forget(sorted(self.cancelled))
            self.cancelled.clear()
        # (Token ids were checked against the vocabulary on receipt, in DrafterServer.)
        items = [(i.request_id, i.token_ids, i.num_draft_tokens) for i in job.items if i.token_ids]
        try:
            drafts = self.model.draft(items, job.want_logprobs) if items else []
        except Exception:
            self.model.forget([rid for rid, _, _ in items])
            raise
        first_token_seconds = self.model.last_first_token_seconds if items else 0.0
        results = [
            DraftResult(request_id=rid, context_num_tokens=len(context), token_ids=tokens, logprobs=logprobs)
            for (rid, context, _), (tokens, logprobs) in zip(items, drafts, strict=True)
        ]
        return results, time.perf_counter() - started, first_token_seconds


def make_drafter(settings: dict[str, Any]) -> Drafter | TorchDrafter:
    if settings.get("backend", "vllm") == "torch":
        return TorchDrafter(settings)
    return Drafter(settings)


class DrafterServer:
    """The drafter's message loop without the socket: keeps each request's committed tokens between jobs (jobs carry
    deltas), drops cancelled jobs' work without forgetting their requests, forgets finished requests, and isolates a
    request that makes jobs fail."""

    def __init__(self, drafter: Any, vocab_size: int) -> None:
        self.drafter = drafter
        self.vocab_size = vocab_size
        # Committed tokens per live request, as taken in from jobs (on receipt, so a cancelled job still counts).
        self.contexts: dict[str, list[int]] = {}
        self.queued: list[Any] = []
        self.stop = False
        self._need_context: dict[int, list[str]] = {}

    def handle(self, message: Any) -> None:
        from minedraft.engine import protocol

        if isinstance(message, protocol.DraftJob):
            self.queued.append(self._take_in(message))
        elif isinstance(message, protocol.CancelJobs):
            doomed = set(message.job_ids)
            self.queued = [job for job in self.queued if job.job_id not in doomed]
        elif isinstance(message, protocol.CancelRequests):
            gone = set(message.request_ids)
            for request_id in gone:
                self.contexts.pop(request_id, None)
            self.drafter.cancelled.update(gone)
            for job in self.queued:
                job.items[:] = [i for i in job.items if i.request_id not in gone]
        else:
            self.stop = True

    def _take_in(self, job: Any) -> Any:
        """Apply the job's deltas to the stored contexts; returns the job with whole contexts (the stored lists
        themselves, not copies: backends only read them)."""
        from minedraft.engine import protocol

        items: list[protocol.DraftItem] = []
        missing: list[str] = []
        for item in job.items:
            new = item.token_ids
            if new and (max(new) >= self.vocab_size or min(new) < 0):
                # A context the draft model cannot read: that request goes undrafted, the rest of the job proceeds.
                self.contexts.pop(item.request_id, None)
                continue
            held = self.contexts.get(item.request_id)
            if item.base_num_tokens == 0:
                held = self.contexts[item.request_id] = list(new)
            elif held is None or len(held) < item.base_num_tokens:
                missing.append(item.request_id)
                self.contexts.pop(item.request_id, None)
                continue
            else:
                del held[item.base_num_tokens:]
                held.extend(new)
            if held:
                items.append(protocol.DraftItem(item.request_id, held, item.num_draft_tokens))
        if missing:
            self._need_context[job.job_id] = missing
        return protocol.DraftJob(job.job_id, items, job.want_logprobs)

    def run_job(self, job: Any, idle_seconds: float, poll_messages: Any) -> Any:
        from minedraft.engine import protocol

        need_context = self._need_context.pop(job.job_id, [])
        try:
            results, seconds, first_token_seconds = self.drafter.draft(job, poll_messages)
            return protocol.DraftReply(job.job_id, results, seconds, idle_seconds, first_token_seconds,
                                       need_context)
        except Exception as exc:  # a bad job must not take the drafter down with it
            log.exception("draft job %d failed", job.job_id)
            return protocol.DrafterError(job.job_id, f"{type(exc).__name__}: {exc}", self._culprits(job))

    def _culprits(self, job: Any) -> list[str]:
        """Retry a failed job's requests one at a time: those that still fail are named (and forgotten here)."""
        from minedraft.engine import protocol

        if len(job.items) <= 1:
            culprits = [i.request_id for i in job.items]
        else:
            culprits = []
            for item in job.items:
                try:
                    self.drafter.draft(protocol.DraftJob(job.job_id, [item], job.want_logprobs), lambda: None)
                except Exception:
                    culprits.append(item.request_id)
        for request_id in culprits:
            self.contexts.pop(request_id, None)
        return culprits


def main(argv: list[str]) -> int:
    address, settings_json = argv[1], argv[2]
    settings = json.loads(settings_json)
    _configure_device(settings)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s drafter %(message)s")
    started = time.perf_counter()
    parent_pid = os.getppid()

    import zmq

    from minedraft.engine import protocol

    context = zmq.Context()
    socket = context.socket(zmq.PAIR)
    socket.connect(address)
    drafter = make_drafter(settings)
    server = DrafterServer(drafter, drafter.vocab_size)
    socket.send(protocol.encode(protocol.Ready(os.getpid(), settings["model"], time.perf_counter() - started)))
    log.info("drafter ready in %.1fs", time.perf_counter() - started)

    def poll_messages() -> None:
        while socket.poll(0):
            server.handle(protocol.decode_to_drafter(socket.recv()))

    idle_since = time.perf_counter()
    while not server.stop:
        if not server.queued:
            if socket.poll(1000) == 0:
                if os.getppid() != parent_pid:
                    log.warning("parent process exited; drafter stopping")
                    break
                continue
            server.handle(protocol.decode_to_drafter(socket.recv()))
            continue
        # Take in everything already sent first: cancels of queued jobs, and newer jobs' tokens.
        poll_messages()
        if not server.queued:
            continue
        job = server.queued.pop(0)
        reply = server.run_job(job, time.perf_counter() - idle_since, poll_messages)
        socket.send(protocol.encode(reply))
        idle_since = time.perf_counter()
    socket.close(linger=0)
    context.term()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
