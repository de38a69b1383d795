"""The one-pass keyed race (keyed_race.py) against the reference race (`race_scores(...).argmax`): the torch form of
the kernel's algorithm on thousands of random rows and keys, and the Triton kernel itself through Triton's
interpreter on the CPU (no GPU here: its CUDA compilation and speed are measured by scripts/gpu_session.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from minedraft.engine.vllm_adapter import keyed_race as kr
from minedraft.engine.vllm_adapter import keyed_sampling as ks


def _rows(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits on several scales (flat rows, where the noise decides; peaked rows, where the logits do), a
    quarter of entries masked to -inf in every third row (top-k/top-p), and random 32-bit keys."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.1, 1.0, 5.0, 30.0]).repeat(rows // 4 + 1)[:rows].unsqueeze(-1)
    logits = torch.randn(rows, vocab, generator=generator) * scale
    masked = torch.rand(rows, vocab, generator=generator) < 0.25
    masked[1::3] = False
    masked[:, 0] = False  # every row keeps a token
    logits[masked] = float("-inf")
    keys = torch.randint(0, 2**32, (rows,), dtype=torch.int64, generator=generator)
    return logits, keys


@pytest.mark.parametrize(("rows", "vocab", "block", "splits"), [
    (4096, 300, 64, None),   # several blocks per lane walk, one segment
    (1024, 1000, 128, 3),    # uneven segments (the last one empty)
    (256, 5003, 256, None),  # a vocabulary that no block divides, many segments
])
def test_the_single_pass_algorithm_equals_the_reference_race(rows, vocab, block, splits):
    logits, keys = _rows(rows, vocab, seed=rows + vocab)
    expected = ks.race_scores(logits, keys).argmax(dim=-1)
    assert torch.equal(kr.single_pass_winners(logits, keys, block=block, splits=splits), expected)


def test_keys_from_positions_and_bf16_logits_give_the_reference_winners():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2000, 257, generator=generator).to(torch.bfloat16)
    keys = ks.position_keys(list(range(2000)), [7 * i for i in range(2000)])
    assert torch.equal(kr.single_pass_winners(logits, keys, block=64), ks.race_scores(logits, keys).argmax(dim=-1))


def test_ties_go_to_the_lowest_id_as_torchs_argmax_does():
    # A row of -inf but two equal finite scores is a tie only if the noise ties; build it with equal scores directly.
    seg_best = torch.tensor([[1.0, 3.0, 3.0], [float("-inf")] * 3])
    seg_index = torch.tensor([[5, 70, 40], [0, 0, 0]])
    assert kr.reduce_segments(seg_best, seg_index, vocab_size=100).tolist() == [40, 0]


def test_splits_fill_the_device_without_segments_under_a_block():
    assert kr.splits_for(rows=1, vocab_size=151_936) == 149  # 149 blocks of 1024: one segment each
    assert kr.splits_for(rows=32, vocab_size=151_936) == 16
    assert kr.splits_for(rows=256, vocab_size=151_936) == 2
    assert kr.splits_for(rows=4096, vocab_size=151_936) == 1
    assert kr.splits_for(rows=8, vocab_size=100) == 1


def test_cpu_rows_never_take_the_cuda_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(kr, "triton_winners", lambda *args, **kwargs: calls.append(args))
    logits, keys = _rows(8, 50, seed=1)
    ks.keyed_winners(logits, keys)
    assert calls == []


_INTERPRETED = textwrap.dedent("""
    import json, sys, torch
    from minedraft.engine.vllm_adapter import keyed_race as kr, keyed_sampling as ks
    sys.path.insert(0, sys.argv[1])
    from test_keyed_race import _rows
    results = []
    for rows, vocab, block, splits in [(96, 700, 1024, None), (4, 3001, 128, None), (32, 1000, 256, 3)]:
        logits, keys = _rows(rows, vocab, seed=rows * vocab)
        got = kr.triton_winners(logits, keys, block=block, splits=splits)
        results.append([rows, int((got == ks.race_scores(logits, keys).argmax(dim=-1)).sum())])
    print(json.dumps(results))
""")


def test_the_triton_kernel_through_the_interpreter_equals_the_reference_race():
    pytest.importorskip("triton")
    # TRITON_INTERPRET is read when the kernel is defined (at import): a fresh interpreter process.
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _INTERPRETED, os.path.dirname(__file__)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for rows, equal in json.loads(done.stdout.strip().splitlines()[-1]):
        assert equal == rows
