"""The expand-kernel fix that keeps speculative sampling exact on vLLM-CPU (seerd/drafts/vllm_fixes.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from seerd.drafts.vllm_fixes import expand_keeping_dtype, register  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_writes_every_token_in_the_input_dtype(dtype: torch.dtype) -> None:
    values = torch.tensor([0.5, 7, 2], dtype=dtype) if dtype.is_floating_point else torch.tensor([5, 7, 2], dtype=dtype)
    cumulative = torch.tensor([2, 5, 6], dtype=torch.int32)
    output = torch.full((6,), -99, dtype=dtype)
    expand_keeping_dtype(output, values, cumulative, replace_from=7, replace_to=1)
    expected = [values[0]] * 2 + [torch.tensor(1, dtype=dtype)] * 3 + [values[2]]
    assert output.dtype == dtype
    assert output.tolist() == [float(x) if dtype.is_floating_point else int(x) for x in expected]


def test_rejection_sampler_expands_temperatures_after_the_plugin_ran() -> None:
    """What the rejection sampler calls, through vLLM's kernel dispatcher, once the plugin has
    patched the CPU fallback and the platform registered it (the order vLLM's workers use)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    if current_platform.device_type != "cpu":
        pytest.skip("the fix is for vLLM's CPU build")
    register()
    current_platform.register_triton_kernel_overrides()
    temperatures = torch.tensor([0.7, 1.0, 1.3], dtype=torch.float32)
    cumulative = torch.tensor([3, 4, 8], dtype=torch.int32)
    for _ in range(5):  # uninitialised memory shows up as different garbage on each call
        expanded = expand_batch_to_tokens(temperatures, cumulative, 8)
        assert expanded.tolist() == pytest.approx([0.7] * 3 + [1.0] + [1.3] * 4)
