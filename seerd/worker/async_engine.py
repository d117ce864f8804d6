"""vLLM's AsyncLLM behind the worker's `Engine` interface: the engine core runs in its own
processes (the usual choice on GPUs)."""

from __future__ import annotations

import asyncio
import time

from seerd.protocol import EngineProgress
from seerd.settings import EngineConfig, Sampling, SpecConfig
from seerd.worker.counters import EngineCounters
from seerd.worker.engine import ChunkResult, EngineBusy, EngineDead, EngineLive, StepClock, Stream, run_whole
from seerd.worker.vllm_args import engine_args, kv_block_tokens, kv_capacity_tokens, running_dtype, sampling_params


class AsyncEngine:
    """vLLM's AsyncLLM: the engine core runs in its own processes."""

    def __init__(self, llm, max_chunks: int, kv_tokens: int) -> None:  # noqa: ANN001
        self.llm = llm
        self.max_chunks = max_chunks
        self.kv_capacity_tokens = kv_tokens
        self.kv_block_tokens = kv_block_tokens(llm.vllm_config)
        self.dtype = running_dtype(llm.vllm_config)
        self.live: EngineLive | None = None  # the scheduler is in the core process
        self.counters: EngineCounters | None = None  # likewise
        self.clock = StepClock()  # counts outputs: one per running request per step
        self.feeding: dict[str, asyncio.Task] = {}  # engine request id -> the task pushing its outputs

    @classmethod
    def start(cls, model_path: str, engine: EngineConfig, seed: int, spec: SpecConfig = SpecConfig(),
              kv_transfer: dict | None = None) -> AsyncEngine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(model_path, engine, seed, spec, kv_transfer)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        return cls(llm, int(args["max_num_seqs"]), kv_capacity_tokens(llm.vllm_config, args["kv_cache_memory_bytes"]))

    def open(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: Sampling,
             *, stream: bool = True) -> Stream:
        """Always streamed (an output per step, `RequestOutputKind.DELTA`): the engine core is in
        another process, and the outputs arriving are what shows it steps (`progress`)."""
        output = Stream(asyncio.get_running_loop())
        self.feeding[request_id] = asyncio.create_task(self._feed(request_id, prompt_token_ids, max_tokens,
                                                                  sampling, output))
        return output

    async def _feed(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: Sampling,
                    output: Stream) -> None:
        from vllm.inputs import TokensPrompt

        from vllm.v1.engine.exceptions import EngineDeadError

        previous_at = None
        try:
            async for result in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids),
                                                  sampling_params(max_tokens, sampling, stream=True),
                                                  request_id=request_id):
                now = time.monotonic()
                # Between two outputs of one request: a step (the first waits for admission too).
                self.clock.record(0.0 if previous_at is None else now - previous_at)
                previous_at = now
                completion = result.outputs[0]
                logprobs = completion.logprobs.logprobs if completion.token_ids else ()
                output.push(completion.token_ids, logprobs,
                            (completion.finish_reason or "abort") if result.finished else None,
                            result.num_cached_tokens)
            if not output.finished:
                output.fail(EngineDead(f"engine returned nothing for {request_id}"))
        except EngineDeadError as exc:  # the core process is gone: nothing more runs here
            output.fail(EngineDead(f"engine failed: {exc!r}"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a request-level error: this request alone fails
            output.fail(exc)
        finally:
            self.feeding.pop(request_id, None)

    async def run(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                  sampling: Sampling) -> ChunkResult:
        return await run_whole(self, request_id, prompt_token_ids, max_tokens, sampling)

    def progress(self) -> EngineProgress:
        return self.clock.progress(len(self.feeding))

    async def abort(self, request_id: str) -> None:
        task = self.feeding.pop(request_id, None)
        if task is not None:
            task.cancel()  # AsyncLLM aborts a request whose output generator is closed
        await self.llm.abort(request_id)

    async def reload_weights(self, path: str) -> float:
        """As `SteppedEngine.reload_weights`, through the engine core's processes."""
        if self.feeding:
            raise EngineBusy(f"{len(self.feeding)} requests still run: new weights only between batches")
        started = time.monotonic()
        await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
        await self.llm.reset_prefix_cache()
        return time.monotonic() - started

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown(timeout=2)
            # Drop it now: AsyncLLM.__del__ at interpreter exit would shut down again, half torn down.
            self.llm = None
