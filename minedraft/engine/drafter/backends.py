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
            adopt: list[tuple[str, str, int]] = []
            tree = self.model.draft_tree(
                [(i.request_id, i.token_ids, tuple(i.tail), i.num_draft_tokens) for i in items], job.want_logprobs,
                on_step, top_f) if any(i.tail for i in items) else None
            if tree is not None:
                drafts = tree
            else:
                if any(i.tail for i in items):
                    items, rows, branch_keys, adopt = self._fork_branches(items, on_step)
                else:
                    rows = [(i.request_id, i.token_ids, i.num_draft_tokens) for i in items]
                drafts = self.model.draft_with_candidates(rows, job.want_logprobs, on_step, top_f) if rows else []
            for key, request_id, num_tokens in adopt:
                self.model.adopt(key, request_id, num_tokens)
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
                       ) -> tuple[list[Any], list[tuple[str, list[int], int]], list[str], list[tuple[str, str, int]]]:
        """Lookahead's branches as rows of one batch: each tailed branch drafts in a scratch slot that starts as a
        copy of its request's cached committed tokens, so the branches share that KV and the request's own slot is
        never written past its committed tokens. The tokens committed since the last job (usually a few) are fed
        in each branch's row with its tail, and the first branch's slot then hands them back to the request's slot
        (`adopt`): one forward for catch-up and tails together. A long catch-up (a restart's whole context) is taken
        into the request's own slot first instead, so it is not computed once per branch. Branches beyond the free
        slots are not drafted (the likeliest come first in each request). Returns the items drafted, their rows, the
        scratch keys to forget and the adoptions to make after drafting."""
        model = self.model
        committed: dict[str, list[int]] = {}
        for item in items:
            if item.tail:
                committed.setdefault(item.request_id, item.token_ids)
        kept: dict[str, int] = {}
        long: list[tuple[str, list[int], int]] = []
        for request_id, context in committed.items():
            keep = min(model.cached_prefix(request_id, context), len(context) - 1)
            if len(context) - keep > LONG_BRANCH_CATCH_UP:
                long.append((request_id, context, 0))
                keep = len(context)
            kept[request_id] = keep
        if long:
            model.draft_with_candidates(long, False, on_step)
        free = model.num_free_slots
        order = sorted(range(len(items)), key=lambda i: (items[i].branch, i))
        chosen = {i for i in order if not items[i].tail} | set([i for i in order if items[i].tail][:free])
        drafted = [items[i] for i in range(len(items)) if i in chosen]
        rows: list[tuple[str, list[int], int]] = []
        keys: list[str] = []
        adopt: list[tuple[str, str, int]] = []
        for item in drafted:
            if not item.tail:
                rows.append((item.request_id, item.token_ids, item.num_draft_tokens))
                continue
            key = f"{item.request_id}\x00branch{item.branch}"
            model.fork(item.request_id, key, kept[item.request_id])
            keys.append(key)
            if kept[item.request_id] < len(item.token_ids) and not any(a[1] == item.request_id for a in adopt):
                adopt.append((key, item.request_id, len(item.token_ids)))
            rows.append((key, [*item.token_ids, *item.tail], item.num_draft_tokens))
        return drafted, rows, keys, adopt


# Committed tokens a branch's row takes in beside its tail (else the request's own slot catches up first, once).
LONG_BRANCH_CATCH_UP = 8


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
