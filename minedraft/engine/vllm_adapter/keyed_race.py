"""The keyed race (its hash, noise and scores), and the race in one pass over the logits: a Triton kernel for CUDA
and the same algorithm in torch. Imports torch (and Triton where present) only, so the prepared GPU run can use it.

`race_scores` builds the race in ~28 elementwise torch passes over each row (int64 hashing in 16-bit
halves, a float64 uniform, two logs, the add) and materialises an [n, vocabulary] noise tensor plus int64 and float64
temporaries: on a GPU ~3 ms per step for 32 seeded rows at k = 3 and ~0.5 GiB outside vLLM's memory profile. The
kernel here reads each fp32 logit once, hashes its vocabulary id in registers with the same 32-bit arithmetic
(unsigned 32-bit multiplies wrap exactly as `_mul32` computes modulo 2^32), makes the same float64 uniform and Gumbel
value, rounds it to float32 and adds it as `race_scores` does, and keeps a running maximum per lane; nothing of the
vocabulary's size is written. Its winner is therefore `race_scores(logits, keys).argmax(-1)` exactly, ties going to
the lowest vocabulary id as torch's argmax does (checked against it on CPU through Triton's interpreter).

Work split: each row's vocabulary is cut into `splits` contiguous segments, one program each (a handful of rows
alone would leave most of a GPU's multiprocessors idle); each program leaves its segment's best score and id, and
a [n, splits] reduction picks the row's winner. `single_pass_winners` is the same algorithm in torch (lanes, segments,
running maxima and all), so the kernel's structure is tested on machines without Triton too.

The CPU path of the engine is unchanged: there vLLM's own fused CPU kernel draws the race (keyed_sampling.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_MASK32 = 0xFFFFFFFF
# Weyl-sequence step (2^32 / golden ratio): consecutive vocabulary ids land far apart before mixing.
_GOLDEN32 = 0x9E3779B9
# Lanes per program: one vector of vocabulary ids per iteration.
DEFAULT_BLOCK = 1024
# Programs per launch to aim for (a few per multiprocessor on an H100's 132).
_TARGET_PROGRAMS = 512


def _mul32(x: torch.Tensor, multiplier: int) -> torch.Tensor:
    """(x * multiplier) mod 2^32 for x in [0, 2^32), without int64 overflow (16-bit halves of the multiplier)."""
    low, high = multiplier & 0xFFFF, multiplier >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash with good avalanche (the "lowbias32" constants), on int64 tensors holding
    32-bit values; the same on every device."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def position_keys(seeds: Sequence[int], positions: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """One 32-bit key per (seed, position) pair: [n] int64. Seeds may use all 64 bits (vLLM's accept int64)."""
    if len(seeds) != len(positions):
        raise ValueError(f"positions: expected {len(seeds)} (one per seed), got {len(positions)}")
    seed_words = [(seed & _MASK32, (seed >> 32) & _MASK32) for seed in seeds]
    low = torch.tensor([w[0] for w in seed_words], dtype=torch.int64, device=device)
    high = torch.tensor([w[1] for w in seed_words], dtype=torch.int64, device=device)
    where = torch.tensor([p & _MASK32 for p in positions], dtype=torch.int64, device=device)
    key = _mix32(low ^ 0x5BD1E995)
    key = _mix32(key ^ high)
    # Two rounds after the position: neighbouring positions of one seed (keys differing in one low bit before mixing)
    # must give unrelated keys, and vLLM's CPU kernel derives its per-token noise from the key by simple arithmetic.
    return _mix32(_mix32(key ^ where) ^ _GOLDEN32)


# Rows of noise made at once: bounds the int64 temporaries to ~128 MiB each whatever the batch and vocabulary.
_NOISE_ELEMENTS_PER_CHUNK = 1 << 24


def keyed_gumbel(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise [n, vocab_size] (float32), a pure function of each row's key and the vocabulary id."""
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device) * _GOLDEN32
    noise = torch.empty((keys.shape[0], vocab_size), dtype=torch.float32, device=keys.device)
    rows_per_chunk = max(1, _NOISE_ELEMENTS_PER_CHUNK // max(1, vocab_size))
    for start in range(0, keys.shape[0], rows_per_chunk):
        chunk = keys[start:start + rows_per_chunk]
        bits = _mix32((chunk.unsqueeze(-1) + ids) & _MASK32)
        # A uniform in (0, 1), never 0 or 1 (32 bits: the largest Gumbel value it can give, ~22.9, is far above the
        # maximum of a vocabulary's worth of draws, ~12 for 150k tokens); float64 keeps -log(-log(u)) accurate.
        uniform = bits.to(torch.float64).add_(0.5).mul_(2.0 ** -32)
        noise[start:start + rows_per_chunk] = uniform.log_().neg_().log_().neg_()
    return noise


def race_scores(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """logits + keyed Gumbel noise per row: its argmax is an exact sample from softmax(logits), keyed by `keys` (the
    softmax's normaliser is one constant per row, so it cannot move the argmax). Masked entries (-inf, from top-k or
    top-p) stay -inf."""
    return logits.to(torch.float32) + keyed_gumbel(keys, logits.shape[-1])


def splits_for(rows: int, vocab_size: int, block: int = DEFAULT_BLOCK) -> int:
    """Vocabulary segments per row: enough programs to fill a GPU, never a segment under one block. Pure."""
    blocks = max(1, math.ceil(vocab_size / block))
    return max(1, min(blocks, math.ceil(_TARGET_PROGRAMS / max(1, rows))))


def _segment(vocab_size: int, splits: int, block: int) -> int:
    """Vocabulary ids per segment, a whole number of blocks."""
    return math.ceil(math.ceil(vocab_size / splits) / block) * block


def _mix32_u(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` on int64 tensors holding 32-bit values (full 64-bit products reduced mod 2^32: the
    products stay below 2^63)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def single_pass_winners(logits: torch.Tensor, keys: torch.Tensor, block: int = DEFAULT_BLOCK,
                        splits: int | None = None) -> torch.Tensor:
    """The kernel's algorithm in torch: per row and segment, `block` lanes walk the segment keeping each lane's best
    score (strictly greater replaces, so a lane keeps its lowest id on ties), then the segment's best lane (lowest
    id among equal scores), then the row's best segment. [n, vocab] float logits, [n] int64 keys -> [n] int64."""
    rows, vocab_size = logits.shape
    splits = splits_for(rows, vocab_size, block) if splits is None else splits
    segment = _segment(vocab_size, splits, block)
    scores_in = logits.to(torch.float32)
    key = keys.to(torch.int64).unsqueeze(-1) & _MASK32
    lane = torch.arange(block, dtype=torch.int64, device=logits.device)
    seg_best = torch.full((rows, splits), float("-inf"), dtype=torch.float32, device=logits.device)
    seg_index = torch.zeros((rows, splits), dtype=torch.int64, device=logits.device)
    for s in range(splits):
        best = torch.full((rows, block), float("-inf"), dtype=torch.float32, device=logits.device)
        best_index = torch.zeros((rows, block), dtype=torch.int64, device=logits.device)
        for start in range(s * segment, min((s + 1) * segment, vocab_size), block):
            ids = start + lane
            inside = ids < vocab_size
            x = torch.full((rows, block), float("-inf"), dtype=torch.float32, device=logits.device)
            x[:, inside] = scores_in[:, ids[inside]]
            bits = _mix32_u((key + ((ids * _GOLDEN32) & _MASK32)) & _MASK32)
            uniform = (bits.to(torch.float64) + 0.5) * 2.0 ** -32
            gumbel = (-torch.log(-torch.log(uniform))).to(torch.float32)
            score = torch.where(inside, x + gumbel, torch.tensor(float("-inf"), device=logits.device))
            better = score > best
            best = torch.where(better, score, best)
            best_index = torch.where(better, ids.expand(rows, -1), best_index)
        top = best.max(dim=-1, keepdim=True).values
        seg_best[:, s] = top.squeeze(-1)
        seg_index[:, s] = torch.where(best == top, best_index, vocab_size).min(dim=-1).values
    return reduce_segments(seg_best, seg_index, vocab_size)


def reduce_segments(seg_best: torch.Tensor, seg_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The row's winner from its segments' best scores and ids: the best score, the lowest id among equals. A row
    whose every score is -inf (no token allowed: not a distribution) gives id 0, as torch's argmax does."""
    top = seg_best.max(dim=-1, keepdim=True).values
    index = torch.where(seg_best == top, seg_index, vocab_size).min(dim=-1).values
    return torch.where(index >= vocab_size, torch.zeros_like(index), index)


try:  # Triton ships with CUDA builds of PyTorch; without it only the torch paths exist.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

if triton is not None:
    # Module-level functions: Triton resolves a kernel's callees by their global names.

    @triton.jit
    def _mix(x):  # type: ignore[no-untyped-def]
        """`_mix32` on uint32 lanes (multiplies wrap modulo 2^32, shifts are logical)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _keyed_race_kernel(logits_ptr, keys_ptr, best_ptr, index_ptr, vocab_size, row_stride,  # type: ignore[no-untyped-def]
                           segment, splits, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        part = tl.program_id(1)
        key = tl.load(keys_ptr + row).to(tl.uint32)
        golden = tl.full([BLOCK], 0x9E3779B9, tl.uint32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_index = tl.zeros([BLOCK], tl.int32)
        lane = tl.arange(0, BLOCK)
        begin = part * segment
        end = tl.minimum(begin + segment, vocab_size)
        for start in range(begin, end, BLOCK):
            ids = start + lane
            inside = ids < end
            x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + ids, mask=inside, other=float("-inf"))
            bits = _mix(key + ids.to(tl.uint32) * golden)
            uniform = (bits.to(tl.float64) + 0.5) * (2.0 ** -32)
            gumbel = (-tl.log(-tl.log(uniform))).to(tl.float32)
            score = tl.where(inside, x + gumbel, float("-inf"))
            better = score > best
            best = tl.where(better, score, best)
            best_index = tl.where(better, ids, best_index)
        top = tl.max(best, axis=0)
        index = tl.min(tl.where(best == top, best_index, vocab_size), axis=0)
        tl.store(best_ptr + row * splits + part, top)
        tl.store(index_ptr + row * splits + part, index)


def _kernel() -> Any | None:
    """The Triton kernel (compiled at its first launch); None where Triton is not importable."""
    return None if triton is None else _keyed_race_kernel


def triton_available() -> bool:
    return _kernel() is not None


def triton_winners(logits: torch.Tensor, keys: torch.Tensor, block: int = DEFAULT_BLOCK,
                   splits: int | None = None) -> torch.Tensor:
    """The keyed race's winner per row by the Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1):
    [n, vocab] logits (read as fp32), [n] int64 keys -> [n] int64. Equal to `race_scores(logits, keys).argmax(-1)`."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the keyed race kernel needs Triton, which is not importable here")
    if logits.dim() != 2 or keys.shape != (logits.shape[0],):
        raise ValueError(f"logits [n, vocab] and keys [n] expected, got {tuple(logits.shape)} and {tuple(keys.shape)}")
    rows, vocab_size = logits.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    scores = logits.to(torch.float32).contiguous()
    splits = splits_for(rows, vocab_size, block) if splits is None else splits
    segment = _segment(vocab_size, splits, block)
    seg_best = torch.empty((rows, splits), dtype=torch.float32, device=logits.device)
    seg_index = torch.empty((rows, splits), dtype=torch.int32, device=logits.device)
    kernel[(rows, splits)](scores, keys.to(torch.int64).contiguous(), seg_best, seg_index, vocab_size,
                           scores.stride(0), segment, splits, BLOCK=block)
    return reduce_segments(seg_best, seg_index.to(torch.int64), vocab_size)
