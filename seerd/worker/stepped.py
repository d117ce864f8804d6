"""vLLM's LLMEngine in the worker's own process, stepped by one thread that owns it (the engine a
CPU worker runs by default: `seerd.worker.engine`)."""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time

from seerd.cpu import ThreadClock
from seerd.protocol import EngineProgress, parse_engine_id
from seerd.settings import EngineConfig, Sampling, SpecConfig
from seerd.worker.counters import EngineCounters
from seerd.worker.engine import ChunkResult, EngineBusy, EngineDead, EngineLive, StepClock, Stream, run_whole
from seerd.worker.vllm_args import engine_args, kv_block_tokens, kv_capacity_tokens, running_dtype, sampling_params

log = logging.getLogger("seerd.worker")

SLOW_STEP_S = 1.0  # a step longer than this is logged (a large prefill, or the machine stalled)
LIVE_SAMPLE_INTERVAL_S = 0.5
# The stepped engine streams a request that runs on past its chunk (in place) one output per this
# many tokens: vLLM builds an output object per request per output, which at one per step cost
# ~8% of a 64-sequence engine's throughput here; a chunk boundary is then seen at most 15 tokens
# late (those tokens belong to the next chunk, or are dropped if it does not continue here).
# AsyncLLM streams every step: its outputs are how the worker sees its engine core step.
STREAM_EVERY_TOKENS = 16  # sampling walks every running request: not at every step


def sample_scheduler(llm) -> EngineLive | None:  # noqa: ANN001
    """KV use and per-request progress from vLLM's in-process scheduler (v1 internals: None if
    they moved, so a vLLM upgrade costs the status view its live figures, never a rollout)."""
    try:
        scheduler = llm.engine_core.engine_core.scheduler
        progress = {_lease_key(rid): int(request.num_output_tokens)
                    for rid, request in list(scheduler.requests.items())}
        return EngineLive(time.time(), float(scheduler.kv_cache_manager.usage), progress)
    except (AttributeError, TypeError):
        return None


def _lease_key(engine_id: str) -> str:
    identity = parse_engine_id(engine_id)
    return engine_id if identity is None else identity.lease_key


def _settle_reload(done: asyncio.Future, answer: object) -> None:
    if done.done():
        return
    if isinstance(answer, BaseException):
        done.set_exception(answer)
    else:
        done.set_result(answer)


class SteppedEngine:
    """vLLM's LLMEngine in-process, stepped by one thread that owns it."""

    def __init__(self, llm, max_chunks: int, kv_tokens: int) -> None:  # noqa: ANN001
        self.llm = llm
        self.max_chunks = max_chunks
        self.kv_capacity_tokens = kv_tokens
        self.kv_block_tokens = kv_block_tokens(llm.vllm_config)
        self.dtype = running_dtype(llm.vllm_config)
        self.loop = asyncio.get_running_loop()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.streams: dict[str, Stream] = {}  # engine request id -> its output so far
        self.wakeup = threading.Event()
        self.stopped = False
        self.failure: BaseException | None = None
        self.live: EngineLive | None = None  # replaced (never mutated) by the stepping thread
        self.clock = StepClock()
        self.counters = EngineCounters.attach(llm)
        self.thread = threading.Thread(target=self._step_loop, name="vllm-stepper", daemon=True)
        self.thread.start()

    @classmethod
    def start(cls, model_path: str, engine: EngineConfig, seed: int, spec: SpecConfig = SpecConfig(),
              kv_transfer: dict | None = None) -> SteppedEngine:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        args = engine_args(model_path, engine, seed, spec, kv_transfer)
        llm = LLMEngine.from_engine_args(EngineArgs(**args))
        return cls(llm, int(args["max_num_seqs"]), kv_capacity_tokens(llm.vllm_config, args["kv_cache_memory_bytes"]))

    def _step_loop(self) -> None:
        sampled_at = 0.0
        thread_clock = ThreadClock()
        try:
            while not self.stopped:
                self._drain_inbox()
                now = time.monotonic()
                if now - sampled_at >= LIVE_SAMPLE_INTERVAL_S:
                    sampled_at = now
                    self.live = sample_scheduler(self.llm)
                if not self.llm.has_unfinished_requests():
                    self.wakeup.wait(0.05)
                    self.wakeup.clear()
                    continue
                # CPU from thread_time: schedstat's runtime is brought up to date only at a tick
                # or a switch (a short step read 0); the run-queue wait from schedstat.
                started, cpu_started, runq_started = time.monotonic(), time.thread_time(), thread_clock.read()[1]
                outputs = self.llm.step()
                took = time.monotonic() - started
                cpu_now, runq_now = time.thread_time(), thread_clock.read()[1]
                if took > SLOW_STEP_S:
                    log.info("engine step took %.2f s (%d requests in the engine)", took, len(self.streams))
                self.clock.record(took)
                if self.counters is not None:
                    self.counters.after_step(took, cpu_now - cpu_started, runq_now - runq_started)
                for output in outputs:
                    self._push(output)
        except BaseException as exc:  # the engine is gone: fail every stream, the worker exits
            log.exception("engine step failed")
            self.failure = exc
            for request_id in list(self.streams):
                stream = self.streams.pop(request_id, None)
                if stream is not None:
                    stream.fail(EngineDead(f"engine failed: {exc!r}"))
        finally:
            thread_clock.close()

    def _push(self, output) -> None:  # noqa: ANN001
        stream = self.streams.get(output.request_id)
        if stream is None:
            return  # aborted meanwhile
        completion = output.outputs[0]
        logprobs = completion.logprobs.logprobs if completion.token_ids else ()
        stream.push(completion.token_ids, logprobs, completion.finish_reason if output.finished else None,
                    output.num_cached_tokens)
        if output.finished:
            self.streams.pop(output.request_id, None)

    def _drain_inbox(self) -> None:
        while True:
            try:
                verb, request_id, payload = self.inbox.get_nowait()
            except queue.Empty:
                return
            if verb == "add":
                try:
                    self.llm.add_request(request_id, *payload)
                except Exception as exc:  # noqa: BLE001 - vLLM refused this request (too long, bad
                    # parameters) before it entered the scheduler: it alone fails, the engine goes on
                    log.warning("engine refused %s: %r", request_id, exc)
                    stream = self.streams.pop(request_id, None)
                    if stream is not None:
                        stream.fail(exc)
            elif verb == "reload":
                self._reload(payload)
            elif self.llm.has_unfinished_requests():
                self.llm.abort_request([request_id])

    def _reload(self, asked: tuple[str, asyncio.Future]) -> None:
        """On the stepping thread, between two steps: the weights at `path` in place (see
        `reload_weights`); the answer (seconds taken, or the error) goes to `done`."""
        path, done = asked
        try:
            if self.llm.has_unfinished_requests() or self.streams:
                raise EngineBusy(f"{len(self.streams)} requests still run: new weights only between batches")
            started = time.monotonic()
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
            self.llm.reset_prefix_cache()  # KV computed by the old weights must never be reused
            answer: object = time.monotonic() - started
        except Exception as exc:  # noqa: BLE001 - the caller's to handle; the engine keeps its old weights or dies
            answer = exc
        self.loop.call_soon_threadsafe(_settle_reload, done, answer)

    def open(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: Sampling,
             *, stream: bool = False) -> Stream:
        """Start a request; `stream`: its tokens arrive at every step (for chunks cut while it
        runs on), else all at its end (the cheaper path for a request that ends with its chunk)."""
        from vllm.inputs import TokensPrompt

        if self.failure is not None:
            raise EngineDead(f"engine failed earlier: {self.failure!r}")
        output = self.streams[request_id] = Stream(self.loop)
        self.inbox.put(("add", request_id, (TokensPrompt(prompt_token_ids=prompt_token_ids),
                                            sampling_params(max_tokens, sampling, stream=stream,
                                                            every=STREAM_EVERY_TOKENS))))
        self.wakeup.set()
        return output

    async def run(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                  sampling: Sampling) -> ChunkResult:
        return await run_whole(self, request_id, prompt_token_ids, max_tokens, sampling)

    def progress(self) -> EngineProgress:
        return self.clock.progress(len(self.streams))

    async def abort(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.inbox.put(("abort", request_id, None))
        self.wakeup.set()

    async def reload_weights(self, path: str) -> float:
        """Load the checkpoint at `path` into the running engine (vLLM's `reload_weights`, the
        model's architecture unchanged) and drop its prefix cache; seconds taken. Only with no
        request in it (`EngineBusy` otherwise): a batch runs under one set of weights."""
        done = self.loop.create_future()
        self.inbox.put(("reload", "", (str(path), done)))
        self.wakeup.set()
        return await done

    def shutdown(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=10)
        core = getattr(self.llm, "engine_core", None)
        if core is not None:
            core.shutdown()
        self.llm = None
