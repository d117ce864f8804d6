"""A worker's vLLM engine: runs chunks (prompt + tokens so far in, the next slice out).

Two drivers behind one interface (`start`, `open` -> `Stream`, `run`, `abort`, `shutdown`):
- `SteppedEngine` (default without CUDA): vLLM's `LLMEngine` in this process, stepped by a
  dedicated thread; requests and results cross to the asyncio loop through a queue and futures.
  This is the engine offline `vllm.LLM` runs, so seerd and the baseline stand on the same footing.
- `AsyncEngine`: vLLM's `AsyncLLM` (engine core in its own processes), the usual choice on GPUs.
  On this 2-core CPU machine it measured 1.3x slower for one engine, and two of them (six busy
  processes) gave about the throughput of one: see docs/benchmarks.md.

Both expose `progress()`, the step counter the coordinator renews leases by (`StepClock`), and
`live`: an `EngineLive` sample (KV use, tokens so far of each running request) for
`seerd status`, or None where the engine does not show it. The stepped engine samples its own
scheduler between steps; AsyncLLM's scheduler lives in another process, so there the worker
reports committed chunks only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from seerd.cpu import ThreadClock
from seerd.protocol import EngineProgress, parse_engine_id
from seerd.worker.counters import EngineCounters

DRAFTER_SETTINGS_ENV = "SEERD_DRAFT_SETTINGS"  # read by seerd.drafts.drafter in the engine's process

log = logging.getLogger("seerd.worker")


@dataclass(frozen=True)
class ChunkResult:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    cached_tokens: int | None


class Stream:
    """One engine request's output as it grows. The engine's side pushes (from the stepping thread
    or AsyncLLM's output loop); the worker waits for a count (`until`) and cuts chunks from it,
    several when the request runs on across chunk boundaries. Plain lists: pushes append, reads
    slice; a push wakes the waiter only when its count is reached, so a request costs one wake-up
    per chunk, not one per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish_reason: str | None = None  # set once the engine finished the request
        self.cached_tokens: int | None = None
        self.error: BaseException | None = None
        self._wake_at = 1 << 62
        self._event = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    @property
    def wanted(self) -> int | None:
        """The token count a waiter waits for and does not have yet (None: nobody waits)."""
        return self._wake_at if len(self.token_ids) < self._wake_at < 1 << 62 and not self.finished else None

    def push(self, token_ids, logprobs, finish_reason: str | None, cached_tokens: int | None) -> None:  # noqa: ANN001
        """New tokens (any thread). `finish_reason` ends the stream."""
        self.token_ids.extend(token_ids)
        self.logprobs.extend(float(x) for x in logprobs)
        if cached_tokens is not None and self.cached_tokens is None:
            self.cached_tokens = cached_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason
        if finish_reason is not None or len(self.token_ids) >= self._wake_at:
            self._wake()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            self.loop.call_soon_threadsafe(self._event.set)

    async def until(self, count: int) -> None:
        """Return once `count` tokens are in or the request ended; raise the engine's error."""
        while not self.finished and len(self.token_ids) < count:
            self._wake_at = count
            self._event.clear()
            if self.finished or len(self.token_ids) >= count:  # a push between the check and the clear
                break
            await self._event.wait()
        if self.error is not None:
            raise self.error

    def result(self, start: int, count: int) -> tuple[ChunkResult, bool]:
        """The chunk of up to `count` tokens from `start`, and whether the request runs on past it.
        Call after `until(start + count)`."""
        end = start + count
        token_ids, logprobs = self.token_ids[start:end], self.logprobs[start:end]
        if len(logprobs) != len(token_ids):
            raise EngineDead(f"stream with {len(self.token_ids)} tokens and {len(self.logprobs)} logprobs")
        ends_here = self.finish_reason is not None and len(self.token_ids) <= end
        if ends_here and self.finish_reason not in ("stop", "length"):
            raise EngineDead(f"chunk ended with finish_reason {self.finish_reason!r}")
        finish_reason = self.finish_reason if ends_here else "length"
        return ChunkResult(token_ids, logprobs, finish_reason, self.cached_tokens if start == 0 else None), \
            not ends_here


@dataclass(frozen=True)
class EngineLive:
    """What the engine holds now: sampled by the thread that steps it."""

    at: float  # time.time() of the sample
    kv_usage: float  # fraction of the engine's KV blocks in use
    progress: dict[str, int] = field(default_factory=dict)  # lease key c{chunk}e{epoch} -> tokens so far


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


class StepClock:
    """Counts an engine's steps and keeps the longest recent one (over the last one or two windows
    of `WINDOW` steps, so one slow warm-up step is forgotten). Written by the thread that sees the
    steps, read by the heartbeat: plain int and float fields, no lock needed."""

    WINDOW = 256

    def __init__(self) -> None:
        self.steps = 0
        self._longest_now = 0.0
        self._longest_before = 0.0

    def record(self, seconds: float) -> None:
        self.steps += 1
        self._longest_now = max(self._longest_now, seconds)
        if self.steps % self.WINDOW == 0:
            self._longest_before, self._longest_now = self._longest_now, 0.0

    def progress(self, generating: int) -> EngineProgress:
        return EngineProgress(self.steps, max(self._longest_before, self._longest_now), generating)


class EngineBusy(RuntimeError):
    """New weights were asked for while requests still run in the engine."""


def _settle_reload(done: asyncio.Future, answer: object) -> None:
    if done.done():
        return
    if isinstance(answer, BaseException):
        done.set_exception(answer)
    else:
        done.set_result(answer)


class EngineDead(RuntimeError):
    """The engine failed; every chunk in it is lost (the coordinator re-runs them elsewhere)."""


def engine_env_defaults() -> None:
    """Settings every CPU engine here needs before vLLM is imported."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two engines without it ran 17x slower
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def speculative_config(spec: dict | None) -> dict | None:
    """vLLM's `speculative_config` for seerd's `--spec` mode (None: off)."""
    mode = (spec or {}).get("mode", "off")
    depth = int(spec.get("gamma_max", 8)) if spec else 8
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


def drafter_settings(spec: dict | None, run_dir: str | None) -> str:
    """What `SeerdDrafter` reads from its environment (it is built by vLLM, maybe in another process)."""
    spec = spec or {}
    return json.dumps({"mode": spec.get("mode"), "probe_weight": spec.get("probe_weight", 2.0),
                       "adaptive": spec.get("adaptive", True), "profile_path": spec.get("profile_path"),
                       "run_dir": run_dir})


def kv_transfer_config(kv_pool: dict | None, run_dir: str | None) -> dict | None:
    """vLLM's `kv_transfer_config` for the job's KV pool (None: no pool)."""
    if not kv_pool or kv_pool.get("mode") != "mooncake":
        return None
    from seerd.kvpool.connector import transfer_config

    return transfer_config(run_dir=str(run_dir), run_tag=kv_pool["run_tag"], model_revision=kv_pool["model_revision"],
                           local_host=kv_pool.get("local_host"))


HALF_PRECISION = ("bfloat16", "float16")


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


def engine_args(model_path: str, engine: dict, seed: int, spec: dict | None = None,
                kv_transfer: dict | None = None) -> dict:
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
        dtype=engine_dtype(engine.get("dtype", "auto"), model_path, cuda=_cuda_available()),
        disable_log_stats=True,
        seed=seed,
    )
    speculative = speculative_config(spec)
    if speculative is not None:
        args["speculative_config"] = speculative
    if kv_transfer is not None:
        args["kv_transfer_config"] = kv_transfer
    args.update(engine.get("extra_args") or {})
    return args


def sampling_params(max_tokens: int, sampling: dict, *, stream: bool = False, every: int = 1):  # noqa: ANN201
    """vLLM's parameters for a chunk; `stream`: outputs while it runs, one per `every` tokens (and
    at its first and last), else only at its end."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    return SamplingParams(
        max_tokens=max_tokens,
        temperature=float(sampling.get("temperature", 1.0)),
        top_p=float(sampling.get("top_p", 1.0)),
        top_k=int(sampling.get("top_k", -1) or -1),
        seed=sampling.get("seed"),
        stop_token_ids=list(sampling.get("stop_token_ids") or []),
        ignore_eos=bool(sampling.get("ignore_eos", False)),
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


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _model_max_len(model_path: str) -> int:
    config = json.loads((Path(model_path) / "config.json").read_text())
    return int(config.get("max_position_embeddings") or 4096)


def start_engine(model_path: str, engine: dict, seed: int, spec: dict | None = None,  # noqa: ANN201
                 run_dir: str | None = None, kv_pool: dict | None = None):
    """The engine driver for this machine: `engine["api"]` is "stepped", "async" or "auto"."""
    engine_env_defaults()
    os.environ[DRAFTER_SETTINGS_ENV] = drafter_settings(spec, run_dir)
    api = engine.get("api", "auto")
    if api == "auto":
        api = "async" if _cuda_available() else "stepped"
    if api == "sim":
        raise ValueError("--engine-api sim: simulated workers run in `python -m seerd.worker.sim_host`")
    driver = {"stepped": SteppedEngine, "async": AsyncEngine}.get(api)
    if driver is None:
        raise ValueError(f"unknown engine api {api!r}: use auto, stepped or async")
    return driver.start(model_path, engine, seed, spec, kv_transfer_config(kv_pool, run_dir))


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
    def start(cls, model_path: str, engine: dict, seed: int, spec: dict | None = None,
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

    def open(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: dict,
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
                  sampling: dict) -> ChunkResult:
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


async def run_whole(engine, request_id: str, prompt_token_ids: list[int], max_tokens: int,  # noqa: ANN001
                    sampling: dict) -> ChunkResult:
    """One request from start to end as one chunk (warm-up, tests, tools)."""
    stream = engine.open(request_id, prompt_token_ids, max_tokens, sampling)
    try:
        await stream.until(max_tokens)
    except asyncio.CancelledError:
        await engine.abort(request_id)
        raise
    return stream.result(0, max_tokens)[0]


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
    def start(cls, model_path: str, engine: dict, seed: int, spec: dict | None = None,
              kv_transfer: dict | None = None) -> AsyncEngine:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(model_path, engine, seed, spec, kv_transfer)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        return cls(llm, int(args["max_num_seqs"]), kv_capacity_tokens(llm.vllm_config, args["kv_cache_memory_bytes"]))

    def open(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: dict,
             *, stream: bool = True) -> Stream:
        """Always streamed (an output per step, `RequestOutputKind.DELTA`): the engine core is in
        another process, and the outputs arriving are what shows it steps (`progress`)."""
        output = Stream(asyncio.get_running_loop())
        self.feeding[request_id] = asyncio.create_task(self._feed(request_id, prompt_token_ids, max_tokens,
                                                                  sampling, output))
        return output

    async def _feed(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: dict,
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
                  sampling: dict) -> ChunkResult:
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
