import pytest
import torch

from minedraft.engine.vllm_adapter.cpu_fixes import expand_batch_values


def test_expand_keeps_float_values_per_request():
    # Three requests with 2, 0 and 3 draft tokens; the greedy marker -1.0 becomes 1.0.
    output = torch.full((5,), float("nan"))
    expand_batch_values(output, torch.tensor([0.7, 0.3, -1.0]), torch.tensor([2, 2, 5]), -1.0, 1)
    assert output.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.0, 1.0])


def test_expand_integers():
    output = torch.zeros(4, dtype=torch.int64)
    expand_batch_values(output, torch.tensor([5, 0]), torch.tensor([1, 4]), 0, 9)
    assert output.tolist() == [5, 9, 9, 9]


def test_vllm_cpu_expand_kernel_is_the_bug_we_fix():
    """vLLM 0.32's own CPU expand writes float outputs into an int64 copy: the real output stays unwritten."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the override is for the CPU platform only")
    current_platform.import_kernels()
    from vllm.utils import cpu_triton_utils

    # As the rejection sampler calls it for temperatures: greedy marker 0 replaced by 1.
    output = torch.full((3,), 42.0)
    cpu_triton_utils._expand_kernel_impl(output, torch.tensor([0.5, 0.25]), torch.tensor([1, 3]), 0, 1)
    if output.tolist() == [0.5, 0.25, 0.25]:
        raise AssertionError("vLLM's CPU expand kernel now handles floats: the override may be dropped")
    assert output.tolist() == [42.0, 42.0, 42.0]
