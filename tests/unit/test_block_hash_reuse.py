"""The vLLM drafter's block-hash reuse, with vLLM's own Request and block hasher (no engine): re-admitting a request
whose context grew hashes only the new blocks, and the hashes are exactly those vLLM computes from scratch, also
after the context is cut back or replaced."""

from __future__ import annotations

import random

import pytest

from minedraft.engine.vllm_adapter.block_hashes import BlockHashReuse

BLOCK = 32


@pytest.fixture(scope="module")
def vllm_hasher():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK, hash_fn)


class CountingHasher:
    def __init__(self, inner):
        self.inner = inner
        self.blocks_hashed = 0

    def __call__(self, request):
        new = self.inner(request)
        self.blocks_hashed += len(new)
        return new


def admit(key: str, tokens: list[int], hasher):
    """As the drafter admits a request: vLLM's internal id is the key plus a random suffix."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    if isinstance(hasher, BlockHashReuse):
        hasher.expect(key, key.partition(":")[2])
    return Request(f"{key}-{random.randrange(16**8):08x}", list(tokens), SamplingParams(max_tokens=3), None,
                   block_hasher=hasher)


def test_a_growing_context_hashes_only_its_new_blocks_and_matches_vllm(vllm_hasher):
    rng = random.Random(0)
    counting = CountingHasher(vllm_hasher)
    reuse = BlockHashReuse(counting, BLOCK)
    context = [rng.randrange(1000) for _ in range(4000)]
    first = admit("1:r", context, reuse)
    assert counting.blocks_hashed == 4000 // BLOCK
    for job in range(2, 40):
        context += [rng.randrange(1000) for _ in range(rng.randrange(1, 5))]
        before = counting.blocks_hashed
        request = admit(f"{job}:r", context, reuse)
        assert counting.blocks_hashed - before <= 1, "a job re-hashed the whole context"
        assert request.block_hashes == admit("x:fresh", context, vllm_hasher).block_hashes
    assert reuse.num_reused_blocks >= 38 * (4000 // BLOCK)
    # Drafted tokens appended to a live request are hashed by vLLM as usual but are never taken for context.
    first.append_output_token_ids([7] * BLOCK)
    assert len(reuse.hashes["r"]) == len(context) // BLOCK


def test_a_cut_back_or_replaced_context_never_reuses_stale_hashes(vllm_hasher):
    rng = random.Random(1)
    reuse = BlockHashReuse(vllm_hasher, BLOCK)
    context = [rng.randrange(1000) for _ in range(700)]
    admit("1:r", context, reuse)
    # Cut back to 100 tokens and continued differently (the verifier resent from base 100).
    reuse.context_changed("r", 100)
    context = context[:100] + [rng.randrange(1000) for _ in range(600)]
    assert admit("2:r", context, reuse).block_hashes == admit("x:a", context, vllm_hasher).block_hashes
    # Replaced outright (base 0: after a restart on the verifier's side) and forgotten.
    reuse.context_changed("r", 0)
    assert "r" not in reuse.hashes
    context = [rng.randrange(1000) for _ in range(300)]
    assert admit("3:r", context, reuse).block_hashes == admit("x:b", context, vllm_hasher).block_hashes


def test_the_drafter_server_reports_every_cut_and_drop_to_the_backend():
    from minedraft.engine.drafter import protocol
    from minedraft.engine.drafter.process import DrafterServer

    from .test_drafter_link import RecordingBackend, job

    backend = RecordingBackend()
    server = DrafterServer(backend, vocab_size=1000)
    server.handle(job(1, ("a", [1, 2, 3, 4], 2), ("b", [5], 2)))
    server.handle(job(2, ("a", [9], 2, 2)))  # resent from position 2: positions 2.. are cut
    server.handle(protocol.CancelRequests(["b"]))
    server.handle(job(3, ("a", [1], 2)))  # a whole context again
    assert backend.changes == [("a", 0), ("b", 0), ("a", 2), ("b", 0), ("a", 0)]


def test_a_branchs_tail_is_hashed_but_never_kept_as_the_requests_context(vllm_hasher):
    """Lookahead: several branches of one request are admitted with the committed context plus different tails; each
    gets vLLM's own hashes, and only the committed blocks are kept for the request's next job."""
    rng = random.Random(1)
    reuse = BlockHashReuse(vllm_hasher, BLOCK)
    context = [rng.randrange(1000) for _ in range(BLOCK * 3 + 5)]
    admit("1:r", context, reuse)
    for branch in range(3):
        tail = [rng.randrange(1000) for _ in range(BLOCK)]  # long enough to complete a block past the context
        reuse.expect(f"2:r:{branch}", "r", len(context))
        from vllm import SamplingParams
        from vllm.v1.request import Request

        request = Request(f"2:r:{branch}-{branch:08x}", context + tail, SamplingParams(max_tokens=3), None,
                          block_hasher=reuse)
        assert request.block_hashes == admit("x:fresh", context + tail, vllm_hasher).block_hashes
        assert len(reuse.hashes["r"]) == len(context) // BLOCK, "no block of a tail is kept"
    grown = context + [rng.randrange(1000) for _ in range(BLOCK)]
    assert admit("3:r", grown, reuse).block_hashes == admit("y:fresh", grown, vllm_hasher).block_hashes
