"""A worker's engine, as the worker drives it: the `Engine` interface every engine implements, and
what they share (a request's output as a `Stream`, a finished chunk as a `ChunkResult`, the step
counter the coordinator renews leases by, the live sample `seerd status` shows, the errors).

The engines:
- `SteppedEngine` (`stepped.py`, default without CUDA): vLLM's `LLMEngine` in this process,
  stepped by a dedicated thread; requests and results cross to the asyncio loop through a queue
  and futures. This is the engine offline `vllm.LLM` runs, so seerd and a baseline that drives
  vLLM directly stand on the same footing.
- `AsyncEngine` (`async_engine.py`): vLLM's `AsyncLLM` (engine core in its own processes), the
  usual choice on GPUs. On a 2-core CPU machine two of them (six busy processes) gave 0.37-0.45x
  the throughput of two engines driven directly (docs/journal/2026-11-22.md).
- `SimEngine` (`sim_engine.py`): the simulator's model of an engine on a scaled clock, for load
  tests of the control plane (`--engine-api sim`).
`engines.start_engine` picks one; `vllm_args.py` turns a run's settings into vLLM's arguments.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from seerd.protocol import EngineProgress
from seerd.settings import Sampling

if TYPE_CHECKING:
    from seerd.worker.counters import EngineCounters


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


class Engine(Protocol):
    """What a worker asks of its engine. Sizes first: `max_chunks` (sequences it runs at once),
    its KV capacity and block (a sequence holds whole blocks), the dtype it resolved; then the
    figures a heartbeat carries (`live`: a sample of what it holds now, None where the engine
    does not show it; `counters`: vLLM's step figures, None likewise)."""

    @property
    def max_chunks(self) -> int: ...
    @property
    def kv_capacity_tokens(self) -> int: ...
    @property
    def kv_block_tokens(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def live(self) -> EngineLive | None: ...
    @property
    def counters(self) -> EngineCounters | None: ...

    def open(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: Sampling,
             *, stream: bool = False) -> Stream:
        """Start a request; its tokens arrive on the returned stream (as they are generated with
        `stream`, else possibly all at its end)."""
        ...

    async def run(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                  sampling: Sampling) -> ChunkResult:
        """One request from start to end as one chunk (warm-up, tests, tools)."""
        ...

    def progress(self) -> EngineProgress:
        """Its step count, longest recent step and requests in it: what renews its leases."""
        ...

    async def abort(self, request_id: str) -> None: ...

    async def reload_weights(self, path: str) -> float:
        """New weights in place (between batches); seconds taken."""
        ...

    def shutdown(self) -> None: ...


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


class EngineDead(RuntimeError):
    """The engine failed; every chunk in it is lost (the coordinator re-runs them elsewhere)."""


async def run_whole(engine: Engine, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                    sampling: Sampling) -> ChunkResult:
    """One request from start to end as one chunk (warm-up, tests, tools)."""
    stream = engine.open(request_id, prompt_token_ids, max_tokens, sampling)
    try:
        await stream.until(max_tokens)
    except asyncio.CancelledError:
        await engine.abort(request_id)
        raise
    return stream.result(0, max_tokens)[0]
