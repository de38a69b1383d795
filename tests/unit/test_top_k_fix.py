"""vLLM's CPU top-k on an empty batch (no draft positions for the non-greedy requests of a step)."""

import pytest


def test_top_k_on_an_empty_batch_is_a_no_op_after_the_fix():
    import torch
    import vllm.v1.sample.ops.topk_topp_sampler as sampler

    from minedraft.engine.vllm_adapter.cpu_fixes import install_empty_safe_top_k

    empty, k = torch.empty(0, 16), torch.empty(0, dtype=torch.int32)
    if not getattr(sampler.apply_top_k_only, "minedraft_empty_safe", False):
        with pytest.raises(RuntimeError):
            sampler.apply_top_k_only(empty, k)
    install_empty_safe_top_k()
    install_empty_safe_top_k()
    assert sampler.apply_top_k_only(empty, k).shape == (0, 16)
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    out = sampler.apply_top_k_only(logits.clone(), torch.tensor([1], dtype=torch.int32))
    assert out[0, 1] == 3.0 and torch.isinf(out[0, 0]) and torch.isinf(out[0, 2])
