"""The vLLM drafter's block hashing, kept between jobs (runs in the drafter process).

vLLM's engine core hashes every full KV block of a newly admitted request with its `request_block_hasher` (an
attribute of the in-process EngineCore). BlockHashReuse wraps that hasher; `install` puts it in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minedraft.engine.vllm_adapter.engine_core import in_process_core


class BlockHashReuse:
    """A caching front for vLLM's request block hasher.

    vLLM hashes every full KV block of a new request's prompt (a chained sha256 per block) to find it in the prefix
    cache. The vLLM drafter re-admits each request every job (vLLM cannot append tokens to a live request), so that
    was O(context) per request per job: about 24 ms per 32-request job at 4k tokens. A request's committed prefix does
    not change between jobs, and a block's hash depends only on the tokens up to its end, so its hashes are kept here
    and vLLM's own hasher computes only the blocks past them. DrafterServer says when a stored context is cut back or
    replaced (context_changed), which drops the hashes past the cut.
    """

    def __init__(self, inner: Callable[[Any], list[Any]], block_size: int) -> None:
        self.inner = inner
        self.block_size = block_size
        self.hashes: dict[str, list[Any]] = {}
        # vLLM request key -> minedraft request id, for requests about to be admitted (see expect()).
        # (With the committed length when the prompt runs past it: a lookahead branch's tail is not context.)
        self._pending: dict[str, tuple[str, int | None]] = {}
        # Off: vLLM's hasher alone (the benchmark's baseline).
        self.enabled = True
        self.num_reused_blocks = 0

    def __call__(self, request: Any) -> list[Any]:
        # Only a request's first call (at admission, prompt = committed context) is about committed tokens; later
        # calls hash blocks of drafted tokens, which are not context.
        if not self.enabled or request.block_hashes or request.num_output_tokens:
            return self.inner(request)
        # vLLM admits a request under the key it was given plus "-<random suffix>" (its internal id).
        key = request.request_id
        pending = self._pending.pop(key, None) or self._pending.pop(key.rpartition("-")[0], None)
        if pending is None:
            return self.inner(request)
        request_id, num_committed = pending
        committed = request.num_tokens if num_committed is None else min(num_committed, request.num_tokens)
        held = self.hashes.get(request_id)
        if held:
            reused = held[: committed // self.block_size]
            request.block_hashes.extend(reused)  # vLLM's hasher goes on from len(request.block_hashes)
            self.num_reused_blocks += len(reused)
        new = self.inner(request)
        # Kept: the blocks of committed tokens only (a branch's blocks past them hold its speculative tail).
        self.hashes[request_id] = [*request.block_hashes, *new][: committed // self.block_size]
        return new

    def expect(self, key: str, request_id: str, num_committed: int | None = None) -> None:
        """The next admission of vLLM request `key` carries the committed context of `request_id` (its first
        `num_committed` tokens, when the prompt goes on past them: a lookahead branch's tail)."""
        self._pending[key] = (request_id, num_committed)

    def context_changed(self, request_id: str, num_tokens_kept: int) -> None:
        held = self.hashes.get(request_id)
        if held is None:
            return
        if num_tokens_kept <= 0:
            del self.hashes[request_id]
        else:
            del held[num_tokens_kept // self.block_size:]


def install(llm_engine: Any) -> BlockHashReuse | None:
    """Put a BlockHashReuse in front of the in-process engine core's block hasher (None without prefix caching)."""
    core = in_process_core(llm_engine)
    if core.request_block_hasher is None:
        return None
    reuse = BlockHashReuse(core.request_block_hasher, int(core.scheduler.hash_block_size))
    core.request_block_hasher = reuse
    return reuse
