"""One vLLM engine (`AsyncLLM`) that runs chunks: prompt + tokens so far in, the next slice out."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from dataclasses import dataclass

log = logging.getLogger("seerd.worker")


@dataclass(frozen=True)
class ChunkResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    cached_tokens: int | None


def engine_env_defaults() -> None:
    """Settings every CPU engine here needs before vLLM is imported (see docs/platform notes)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class ChunkEngine:
    def __init__(self, llm, max_chunks: int, kv_capacity_tokens: int) -> None:  # noqa: ANN001
        self.llm = llm
        self.max_chunks = max_chunks
        self.kv_capacity_tokens = kv_capacity_tokens

    @classmethod
    def start(cls, model_path: str, engine: dict, seed: int) -> ChunkEngine:
        engine_env_defaults()
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kv_bytes = int(float(engine.get("kv_cache_gib", 1.0)) * (1 << 30))
        max_model_len = int(engine.get("max_model_len") or _model_max_len(model_path))
        args = dict(
            model=model_path,
            skip_tokenizer_init=True,
            enforce_eager=True,
            kv_cache_memory_bytes=kv_bytes,
            max_num_seqs=int(engine.get("max_num_seqs", 64)),
            enable_prefix_caching=True,
            # vLLM-CPU 0.32 kills the engine when a seeded request's prefill is split across steps
            # ("CPU Generator does not use offset"); unsplit prefill needs a step budget >= max_model_len.
            enable_chunked_prefill=False,
            max_model_len=max_model_len,
            max_num_batched_tokens=max(2048, max_model_len),
            dtype=engine.get("dtype", "auto"),
            disable_log_stats=True,
            seed=seed,
        )
        args.update(engine.get("extra_args") or {})
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        cache = llm.vllm_config.cache_config
        blocks = cache.num_gpu_blocks or 0
        kv_tokens = blocks * cache.block_size if blocks else kv_bytes // _kv_bytes_per_token(llm)
        return cls(llm, int(args["max_num_seqs"]), int(kv_tokens))

    async def run(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                  sampling: dict) -> ChunkResult:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            top_k=int(sampling.get("top_k", -1) or -1),
            seed=sampling.get("seed"),
            stop_token_ids=list(sampling.get("stop_token_ids") or []),
            logprobs=0,  # the sampled token's own logprob only
            flat_logprobs=True,  # plain lists instead of a dict per position
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids), params,
                                              request_id=request_id):
            final = output
        if final is None:
            raise RuntimeError(f"engine returned nothing for {request_id}")
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        # With skip_tokenizer_init the model's EOS travels as a stop token: it ends in token_ids
        # and finish_reason is "stop", like any stop token.
        logprobs = [float(x) for x in completion.logprobs.logprobs] if token_ids else []
        reason = "stop" if completion.finish_reason == "stop" else "length"
        return ChunkResult(token_ids, logprobs, reason, final.num_cached_tokens)

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown(timeout=2)
            # Drop it now: AsyncLLM.__del__ at interpreter exit would shut down again, half torn down.
            self.llm = None


def _model_max_len(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)


def _kv_bytes_per_token(llm) -> int:  # noqa: ANN001
    hf = llm.vllm_config.model_config.hf_config
    heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    return 2 * hf.num_hidden_layers * heads * head_dim * 4  # K and V, float32 on CPU
