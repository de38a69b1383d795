"""Seeded sampling that does not depend on speculation: each token's randomness keyed by (seed, output position).

vLLM gives a seeded request a `torch.Generator` and draws from it as it goes: one uniform number per verified draft
token, one recovered-token row per step with drafts, one noise row per step without. How many draws a token gets then
depends on how many drafts were verified beside it, which under PSD depends on timing (a draft job late or not), so
two identical seeded requests at temperature > 0 could give different outputs.

Here a seeded request's token at output position t is the winner of an exponential race keyed by (seed, t):

    token_t = argmax_v  log p_t(v) + G(seed, t, v),    G = Gumbel noise from a counter-based hash of (seed, t, v)

where p_t is the target's processed distribution (temperature, top-k, top-p, as vLLM computes it). That is an exact
sample from p_t (the Gumbel-max trick), and it is a function of the seed, the position and the context alone. With
drafts, verification becomes: accept draft token x at position t iff x == token_t, and on the first mismatch emit
token_t; with drafts proposed greedily (a one-hot proposal, as every MineDraft drafter sends) a draft is accepted with
probability p_t(x), exactly as vLLM's rejection sampler accepts it, so acceptance does not drop. Whether a position
is reached with a draft, without one, as a bonus token, in ar, sd or psd, the token is the same: seeded output is
reproducible, and identical across modes (up to the target's own floating-point agreement between batch shapes,
which greedy identity rests on too).

How it plugs into vLLM 0.32 (target workers, installed per runner by `install`):
- the runner's `_sample` is wrapped to put the step's keyed rows (seeded random requests, their seeds and output
  positions) in a context variable for the duration of the call;
- the sampler's top-k/top-p stage (`TopKTopPSampler.forward`, the last stage before the draw, used for steps without
  drafts and for bonus tokens) is wrapped to overwrite keyed rows with their race winners;
- the rejection sampler's module function `rejection_sample` is wrapped to perturb keyed requests' target logits with
  their keyed noise and verify them as greedy requests (vLLM's greedy kernel: accept while equal, then the target's
  choice, then the bonus token).
Unseeded and greedy requests go through vLLM untouched.
"""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

# The race itself (hash, noise, scores) lives in keyed_race.py, free of vLLM; re-exported here.
from minedraft.engine.vllm_adapter.keyed_race import keyed_gumbel as keyed_gumbel
from minedraft.engine.vllm_adapter.keyed_race import position_keys, race_scores

log = logging.getLogger(__name__)

# vLLM's own threshold between greedy and random sampling (vllm.v1.sample.sampler._SAMPLING_EPS).
SAMPLING_EPS = 1e-5


def fused_cpu_race() -> Any | None:
    """vLLM's CPU kernel for a Gumbel-max draw per row with noise keyed by (row seed, token id) (what vLLM's own CPU
    sampler draws with), or None where it is not built (GPU builds)."""
    # Through the platform, which picks the library this CPU runs (vllm._C needs AVX512 with bf16: importing it
    # on an AVX2-only CPU dies of SIGILL, not ImportError).
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            current_platform.import_kernels()
        else:
            import vllm._C  # noqa: F401  (registers torch.ops._C)
    except ImportError:
        return None
    return getattr(torch.ops._C, "fused_gumbel_argmax", None)


# Set to 0 to draw CUDA rows by `race_scores` instead of the one-pass kernel (same winners; a fallback should the
# kernel fail to build on some GPU).
KERNEL_ENV = "MINEDRAFT_KEYED_RACE_KERNEL"


def cuda_kernel_enabled() -> bool:
    """Whether CUDA rows are drawn by the one-pass Triton kernel (keyed_race.py): Triton importable and not turned
    off by MINEDRAFT_KEYED_RACE_KERNEL=0."""
    from minedraft.engine.vllm_adapter import keyed_race

    return os.environ.get(KERNEL_ENV, "1") != "0" and keyed_race.triton_available()


def keyed_winners(logits: torch.Tensor, keys: torch.Tensor, fused: Any | None = None) -> torch.Tensor:
    """The keyed race's winner of each row of processed logits [n, vocab] -> [n] int64: on CPUs vLLM's fused kernel
    keyed by `keys` (one pass, no noise tensor; `fused`), on CUDA the one-pass Triton kernel of keyed_race.py (the
    same winners as `race_scores`, without its [n, vocab] temporaries), elsewhere `race_scores`. One deployment always
    takes the same path, so a position's winner does not depend on which sampler stage draws it."""
    if fused is not None and logits.device.type == "cpu":
        return fused(logits.to(torch.float32).contiguous(), keys).to(torch.int64)
    if logits.device.type == "cuda" and cuda_kernel_enabled():
        from minedraft.engine.vllm_adapter import keyed_race

        return keyed_race.triton_winners(logits, keys)
    return race_scores(logits, keys).argmax(dim=-1)


def keyed_tokens(logits: torch.Tensor, seeds: Sequence[int], positions: Sequence[int],
                 fused: Any | None = None) -> torch.Tensor:
    """The keyed race's winner for each row of processed logits, keyed by (seed, position) per row."""
    return keyed_winners(logits, position_keys(seeds, positions, logits.device), fused)


@dataclass(frozen=True)
class KeyedStep:
    """The keyed rows of one sampling call: rows (request indices in the runner's batch), their seeds, the output
    position of the request's first token this step (`first_positions`), and where the plain sampler's draw goes
    (`sample_positions`: the first position without drafts, the bonus position after n drafts)."""

    rows: tuple[int, ...]
    seeds: tuple[int, ...]
    first_positions: tuple[int, ...]
    sample_positions: tuple[int, ...]


def keyed_step(row_seeds: Sequence[tuple[int, int, int]], num_draft_tokens: Sequence[int] | None) -> KeyedStep | None:
    """From (row, seed, output tokens so far) of each seeded random request and the step's drafts per row (None
    without drafts): what the samplers key. None when no row is keyed. Pure."""
    if not row_seeds:
        return None
    rows = tuple(row for row, _, _ in row_seeds)
    firsts = tuple(done for _, _, done in row_seeds)
    drafts = [0] * len(rows) if num_draft_tokens is None else [num_draft_tokens[row] for row in rows]
    return KeyedStep(rows, tuple(seed for _, seed, _ in row_seeds), firsts,
                     tuple(first + n for first, n in zip(firsts, drafts, strict=True)))


_STEP: contextvars.ContextVar[KeyedStep | None] = contextvars.ContextVar("minedraft_keyed_step", default=None)


def _seeded_rows(runner: Any) -> list[tuple[int, int, int]]:
    """(row, seed, output tokens so far) for each seeded random request in the runner's current batch."""
    batch = runner.input_batch
    if not getattr(runner, "minedraft_reproducible_seeds", False) or not batch.random_reqs:
        return []
    found = []
    for row, request_id in enumerate(batch.req_ids):
        if request_id is None or request_id not in batch.random_reqs:
            continue
        state = runner.requests.get(request_id)
        params = getattr(state, "sampling_params", None)
        if params is None or params.seed is None:
            continue
        found.append((row, int(params.seed), len(state.output_token_ids)))
    return found


def _wrap_sample(runner: Any) -> None:
    original = runner._sample

    def _sample(logits: Any, spec_decode_metadata: Any) -> Any:
        step = keyed_step(_seeded_rows(runner),
                          None if spec_decode_metadata is None else spec_decode_metadata.num_draft_tokens)
        if step is None:
            return original(logits, spec_decode_metadata)
        token = _STEP.set(step)
        try:
            return original(logits, spec_decode_metadata)
        finally:
            _STEP.reset(token)

    _sample.minedraft_keyed = True  # type: ignore[attr-defined]
    runner._sample = _sample


def _wrap_top_k_top_p(sampler: Any, fused: Any | None) -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    stage = sampler.topk_topp_sampler
    original = stage.forward

    def forward(logits: torch.Tensor, generators: Any, k: torch.Tensor | None,
                p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = _STEP.get()
        if step is None:
            return original(logits, generators, k, p)
        rows = torch.tensor(step.rows, dtype=torch.int64, device=logits.device)
        # vLLM's stage filters in place; keep the keyed rows' logits as they come (temperature already applied).
        mine = apply_top_k_top_p(logits.index_select(0, rows).clone(),
                                 None if k is None else k.index_select(0, rows),
                                 None if p is None else p.index_select(0, rows))
        sampled, processed = original(logits, generators, k, p)
        winners = keyed_tokens(mine, step.seeds, step.sample_positions, fused)
        sampled = sampled.clone()
        sampled[rows] = winners.to(sampled.dtype)
        return sampled, processed

    stage.forward = forward


def keyed_rejection_sample(original: Any, fused: Any | None = None) -> Any:
    """vLLM's `rejection_sample` with the step's keyed requests verified against their keyed race winners."""

    def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: list[int], max_spec_len: int,
                         cu_num_draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                         target_logits: torch.Tensor, bonus_token_ids: torch.Tensor, sampling_metadata: Any,
                         *args: Any, **kwargs: Any) -> torch.Tensor:
        step = _STEP.get()
        if step is None or draft_probs is not None:
            # Without a keyed row, or with a drafter that sends its probabilities (not MineDraft's), vLLM's own rule.
            return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                            target_logits, bonus_token_ids, sampling_metadata, *args, **kwargs)
        starts = [0]
        for n in num_draft_tokens:
            starts.append(starts[-1] + n)
        token_rows: list[int] = []
        seeds: list[int] = []
        positions: list[int] = []
        for row, seed, first in zip(step.rows, step.seeds, step.first_positions, strict=True):
            for j in range(num_draft_tokens[row]):
                token_rows.append(starts[row] + j)
                seeds.append(seed)
                positions.append(first + j)
        if token_rows:
            index = torch.tensor(token_rows, dtype=torch.int64, device=target_logits.device)
            winners = keyed_winners(target_logits.index_select(0, index),
                                    position_keys(seeds, positions, target_logits.device), fused)
            # Only the argmax of these rows is read from here on (vLLM's greedy rule; log-probabilities come from the
            # raw logits, see install): the winner is made the only choice.
            target_logits[index] = float("-inf")
            target_logits[index, winners] = 0.0
        # Keyed requests are verified by vLLM's greedy rule on their winners (their bonus tokens were drawn by the
        # keyed top-k/top-p stage).
        temperature = sampling_metadata.temperature.clone()
        temperature[torch.tensor(step.rows, dtype=torch.int64, device=temperature.device)] = 0.0
        greedy = temperature < SAMPLING_EPS
        metadata = dataclasses.replace(sampling_metadata, temperature=temperature,
                                       all_greedy=bool(greedy.all()), all_random=bool((~greedy).all()))
        return original(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                        target_logits, bonus_token_ids, metadata, *args, **kwargs)

    rejection_sample.minedraft_keyed = True  # type: ignore[attr-defined]
    return rejection_sample


def install(runner: Any, enabled: bool = True) -> bool:
    """Key seeded sampling in this runner (installed once; `enabled` switches it at run time); returns `enabled`."""
    if enabled and runner.sampler.logprobs_mode != "raw_logprobs":
        # Processed log-probabilities would be read from the rows this module rewrites.
        raise ValueError("reproducible_seeds: needs vLLM's logprobs_mode 'raw_logprobs' (settings refuse others), "
                         f"not {runner.sampler.logprobs_mode!r}")
    runner.minedraft_reproducible_seeds = enabled
    if getattr(runner._sample, "minedraft_keyed", False):
        return enabled
    import vllm.v1.sample.rejection_sampler as rejection_module

    fused = fused_cpu_race()
    if not getattr(rejection_module.rejection_sample, "minedraft_keyed", False):
        rejection_module.rejection_sample = keyed_rejection_sample(rejection_module.rejection_sample, fused)
    _wrap_top_k_top_p(runner.sampler, fused)
    _wrap_sample(runner)
    log.info("seeded requests sample by keyed races (reproducible under speculation)")
    return enabled
