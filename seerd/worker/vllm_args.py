"""A run's settings as vLLM's: the engine's arguments (dtype, KV, speculative decoding, the KV
pool's connector), a chunk's `SamplingParams`, and what the engine's sizes are once it runs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from seerd.settings import EngineConfig, PoolSettings, Sampling, SpecConfig
from seerd.worker.engine import EngineDead

DRAFTER_SETTINGS_ENV = "SEERD_DRAFT_SETTINGS"  # read by seerd.drafts.drafter in the engine's process


def engine_env_defaults() -> None:
    """Settings every CPU engine here needs before vLLM is imported."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two engines without it ran 17x slower
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def speculative_config(spec: SpecConfig) -> dict | None:
    """vLLM's `speculative_config` for seerd's `--spec` mode (None: off)."""
    mode, depth = spec.mode, spec.gamma_max
    if mode == "off":
        return None
    if mode == "ngram":  # vLLM's prompt lookup, with the same match window as seerd's index
        return {"method": "ngram", "num_speculative_tokens": depth, "prompt_lookup_min": 3, "prompt_lookup_max": 16}
    if mode == "suffix":
        try:
            import arctic_inference  # noqa: F401
        except ImportError:
            raise EngineDead("--spec suffix needs arctic-inference in the worker's environment (vLLM's "
                             "suffix method); see docs/speculative.md") from None
        return {"method": "suffix", "num_speculative_tokens": depth}
    return {"method": "custom_class", "model": "seerd.drafts.drafter.SeerdDrafter", "num_speculative_tokens": depth}


def drafter_settings(spec: SpecConfig, run_dir: str | None) -> str:
    """What `SeerdDrafter` reads from its environment (it is built by vLLM, maybe in another process)."""
    return json.dumps({"mode": spec.mode, "probe_weight": spec.probe_weight, "adaptive": spec.adaptive,
                       "profile_path": spec.profile_path, "run_dir": run_dir})


def kv_transfer_config(kv_pool: PoolSettings | None, run_dir: str | None) -> dict | None:
    """vLLM's `kv_transfer_config` for the job's KV pool (None: no pool)."""
    if kv_pool is None or kv_pool.mode != "mooncake":
        return None
    from seerd.kvpool.connector import transfer_config

    return transfer_config(run_dir=str(run_dir), run_tag=kv_pool.run_tag, model_revision=kv_pool.model_revision,
                           local_host=kv_pool.local_host)


def checkpoint_dtype(model_path: str) -> str | None:
    """The dtype the checkpoint's config.json names (transformers writes `dtype`, before 4.56
    `torch_dtype`; a multimodal model's text part may carry it), or None."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for part in (config, config.get("text_config") or {}):
        named = part.get("dtype") or part.get("torch_dtype")
        if isinstance(named, str):
            return named.removeprefix("torch.")
    return None


def engine_dtype(requested: str, model_path: str, *, cuda: bool) -> str:
    """The dtype an engine is started with. `auto` on a CPU engine with a float32 checkpoint is
    float32: vLLM's own auto would run it in bfloat16 there, which measured no faster on CPUs
    (docs/benchmarks.md, "Engine dtype"), takes the kernels that die by SIGILL where the CPU or
    kernel does not allow them, and samples logprobs further from a float32 trainer's. Anything
    else (a half-precision checkpoint, a GPU, an explicit dtype) is vLLM's to resolve."""
    if requested == "auto" and not cuda and checkpoint_dtype(model_path) == "float32":
        return "float32"
    return requested


def running_dtype(vllm_config) -> str:  # noqa: ANN001
    """The dtype the engine resolved and runs at ("float32", "bfloat16")."""
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def engine_args(model_path: str, engine: EngineConfig, seed: int, spec: SpecConfig = SpecConfig(),
                kv_transfer: dict | None = None) -> dict:
    """vLLM's engine arguments for a run's engine settings (its `extra_args` applied last)."""
    kv_bytes = int(engine.kv_cache_gib * (1 << 30))
    max_model_len = int(engine.max_model_len or _model_max_len(model_path))
    args = dict(
        model=model_path,
        skip_tokenizer_init=True,
        enforce_eager=True,
        kv_cache_memory_bytes=kv_bytes,
        max_num_seqs=engine.max_num_seqs,
        enable_prefix_caching=True,
        # vLLM-CPU 0.32 kills the engine when a seeded request's prefill is split across steps
        # ("CPU Generator does not use offset"); unsplit prefill needs a step budget >= max_model_len.
        enable_chunked_prefill=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=max(2048, max_model_len),
        dtype=engine_dtype(engine.dtype, model_path, cuda=cuda_available()),
        disable_log_stats=True,
        seed=seed,
    )
    speculative = speculative_config(spec)
    if speculative is not None:
        args["speculative_config"] = speculative
    if kv_transfer is not None:
        args["kv_transfer_config"] = kv_transfer
    args.update(engine.extra_args)
    return args


def sampling_params(max_tokens: int, sampling: Sampling, *, stream: bool = False, every: int = 1):  # noqa: ANN201
    """vLLM's parameters for a chunk; `stream`: outputs while it runs, one per `every` tokens (and
    at its first and last), else only at its end."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k or -1,  # 0 is vLLM's "off" too
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        logprobs=0,  # the sampled token's own logprob only
        flat_logprobs=True,  # plain lists instead of a dict per position
        detokenize=False,
        output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY,
        stream_interval=every if stream and every > 1 else None,
    )


def kv_block_tokens(vllm_config) -> int:  # noqa: ANN001
    """The engine's KV block size (tokens): vLLM allocates a sequence's KV in whole blocks."""
    return int(getattr(vllm_config.cache_config, "block_size", None) or 1)


def kv_capacity_tokens(vllm_config, kv_bytes: int) -> int:  # noqa: ANN001
    cache = vllm_config.cache_config
    if cache.num_gpu_blocks:
        return int(cache.num_gpu_blocks * cache.block_size)
    hf = vllm_config.model_config.hf_config
    heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return kv_bytes // (2 * hf.num_hidden_layers * heads * head_dim * 4)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_max_len(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)
