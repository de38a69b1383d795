"""The drafting backends behind DrafterServer's job interface, and the one place that picks one (drafter process).

A backend drafts one job (`draft`), drops cancelled requests (`cancelled`), hears when a request's stored context
was cut back (`context_changed`) and states its vocabulary and longest context:
  vllm   VllmDrafter (vllm_backend.py): the draft model in vLLM with prefix caching; any architecture
  torch  TorchDrafter (here) over the plain-torch model (torch_backend.py, or torch_window.py's windowed one), which
         keeps each request's KV cache between jobs

Each backend imports torch or vLLM only when it is made, so the message loop (process.py) loads without them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter
    from minedraft.engine.drafter.vllm_backend import VllmDrafter


def no_op() -> None:
    pass


# The keys of a target's `hf_overrides` (vLLM's --hf-overrides) that stretch its context: the drafter of the pair
# must read positions the same way (RoPE scaling) and as far. Anything else in them is the target's own business.
CONTEXT_OVERRIDE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


def context_overrides(hf_overrides: Any) -> dict[str, Any] | None:
    """The context-stretching part of a target's hf_overrides, for its drafter (None: nothing to apply)."""
    if not isinstance(hf_overrides, dict):
        return None
    picked = {key: hf_overrides[key] for key in CONTEXT_OVERRIDE_KEYS if key in hf_overrides}
    return picked or None


class TorchDrafter:
    """The same job interface over the plain-torch drafter (KV cache kept per request between jobs)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(max(1, len(settings.get("cpu_cores") or []) or 1))
        self.model = make_torch_drafter(settings)
        self.cancelled: set[str] = set()

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    @property
    def max_context_tokens(self) -> int:
        return int(self.model.max_model_len)

    def context_changed(self, request_id: str, num_tokens_kept: int) -> None:
        """(Nothing to do: each job's context is compared with the request's cached tokens.)"""

    def draft(self, job: Any, poll_messages: Any, on_step: Callable[[], None] = no_op
              ) -> tuple[list[Any], float, float]:
        from minedraft.engine.drafter.protocol import DraftResult

        started = time.perf_counter()
        if self.cancelled:
            self.model.forget(sorted(self.cancelled))
            self.cancelled.clear()
        # (Token ids were checked against the vocabulary on receipt, in DrafterServer.)
        items = [i for i in job.items if i.token_ids]
        top_f = int(getattr(job, "top_f", 0) or 0)
        branch_keys: list[str] = []
        try:
            # (Messages are taken in only between jobs here: a newer job's tokens would extend these contexts in place.)
            if any(i.tail for i in items):
                rows, branch_keys = self._fork_branches(items, on_step)
            else:
                rows = [(i.request_id, i.token_ids, i.num_draft_tokens) for i in items]
            drafts = self.model.draft_with_candidates(rows, job.want_logprobs, on_step, top_f) if rows else []
        except Exception:
            self.model.forget([i.request_id for i in items])
            raise
        finally:
            self.model.forget(branch_keys)
        first_token_seconds = self.model.last_first_token_seconds if items else 0.0
        results = [
            DraftResult(request_id=item.request_id, context_num_tokens=len(item.token_ids) + len(item.tail),
                        token_ids=tokens, logprobs=logprobs, branch=item.branch, tail=list(item.tail),
                        candidates=candidates)
            for item, (tokens, logprobs, candidates) in zip(items, drafts, strict=True)
        ]
        return results, time.perf_counter() - started, first_token_seconds

    def _fork_branches(self, items: list[Any], on_step: Callable[[], None]
                       ) -> tuple[list[tuple[str, list[int], int]], list[str]]:
        """Lookahead's branches: each request with a tailed branch is caught up on its committed context in its own
        slot (one batched forward), which every one of its branches then copies into a scratch slot and drafts from
        there past its tail: the branches share the committed KV, run as rows of one batch, and the request's slot
        keeps exactly its committed tokens. Returns the rows to draft (roots on their own slots) and the scratch
        keys to forget afterwards."""
        committed: dict[str, list[int]] = {}
        for item in items:
            if item.tail:
                committed.setdefault(item.request_id, item.token_ids)
        self.model.draft_with_candidates([(rid, context, 0) for rid, context in committed.items()], False, on_step)
        rows: list[tuple[str, list[int], int]] = []
        keys: list[str] = []
        for item in items:
            if not item.tail:
                rows.append((item.request_id, item.token_ids, item.num_draft_tokens))
                continue
            key = f"{item.request_id}\x00branch{item.branch}"
            self.model.fork(item.request_id, key, len(item.token_ids))
            keys.append(key)
            rows.append((key, [*item.token_ids, *item.tail], item.num_draft_tokens))
        return rows, keys


def make_torch_drafter(settings: dict[str, Any]) -> TorchLlamaDrafter:
    """The torch model for these settings: windowed (bounded context) when asked for, and always on GPUs."""
    from minedraft.engine.drafter.torch_backend import TorchLlamaDrafter, concrete_dtype
    from minedraft.engine.drafter.torch_window import make_windowed_drafter

    if settings.get("drafter_window") or settings.get("device", "cpu") != "cpu":
        return make_windowed_drafter(settings)
    return TorchLlamaDrafter(
        settings["model"],
        max_slots=2 * int(settings["max_num_seqs"]) + 8,
        max_model_len=int(settings["max_model_len"]),
        dtype=concrete_dtype(settings),
        config_overrides=settings.get("hf_overrides"),
    )


def make_drafter(settings: dict[str, Any]) -> VllmDrafter | TorchDrafter:
    if settings.get("backend", "vllm") == "torch":
        return TorchDrafter(settings)
    from minedraft.engine.drafter.vllm_backend import VllmDrafter

    return VllmDrafter(settings)
