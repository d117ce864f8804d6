"""A worker's engine that is the simulator's model of one: `seerd worker` on `--engine-api sim`.

Behind the same interface as the vLLM engines (`open`, `run`, `abort`, `progress`, `shutdown`,
`max_chunks`, `kv_capacity_tokens`), a `seerd.sim.engine.SimInstance` (vLLM's admission,
preemption, prefix cache and step costs as the simulator models them, from a preset or a
measured profile) runs on the wall clock sped up `time_scale` times. Everything around it is
real: the worker's leases, reports, heartbeats and in-place continuations over HTTP, the
coordinator, SQLite. So hundreds of workers fit in a few processes of this machine
(`tools/bench/load.py`), and the daemon and `seerd sim` can be compared on the same engine model.

What it makes up: token ids (deterministic, below the model's vocabulary) and logprobs (-1.0).
Lengths are the worker's: a response ends where the row's target length or max_tokens says
(finish "length"; the worker turns a target into "length_target"). Drafting is not modelled
here (`--spec` must be off).

Time: engine time = (wall time since start) x time_scale. At each scheduling point (a chunk
ending, a request arriving or aborted, a streamed request reaching the count its worker waits
for) the instance is advanced to that time (`SimInstance.sync`: the first step boundary at or
after it) and its tokens are pushed to the streams; between them the engine's task sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

from seerd.protocol import EngineProgress, parse_engine_id
from seerd.settings import EngineConfig, Sampling
from seerd.sim.costs import InstanceCosts, ProfiledCosts
from seerd.sim.engine import SimInstance, SimSeq
from seerd.worker.engine import ChunkResult, EngineDead, Stream, run_whole

log = logging.getLogger("seerd.worker.sim")

_EPS_S = 1e-6
# The engine wakes at least this often (wall seconds), so its step count, which heartbeats carry
# as the engine's progress, moves within long segments too.
MAX_SLEEP_S = 1.0


@dataclass
class _Live:
    """One engine request: its stream and the modelled sequence producing it."""

    engine_id: str
    stream: Stream
    seq: SimSeq
    streamed: bool  # tokens pushed as they come (a chunk that may run on), else at the end
    token_base: int
    pushed: int = 0


@dataclass
class SimEngineStats:
    chunks_opened: int = 0
    chunks_aborted: int = 0
    scheduling_points: int = 0
    longest_step_s: float = 0.0  # wall seconds of the longest modelled step


class SimEngine:
    live = None  # no sampled scheduler figures (`EngineLive`) for the heartbeat
    counters = None  # nor vLLM's step counters
    dtype = "modelled"  # no tensors: the preset's engine model

    def __init__(self, costs: InstanceCosts | ProfiledCosts, *, index: int, kv_capacity_tokens: int,
                 max_num_seqs: int, time_scale: float, vocab_size: int, seed: int = 0,
                 kv_block_tokens: int = 16) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        self.max_chunks = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens
        self.kv_block_tokens = kv_block_tokens
        self.time_scale = time_scale
        self.vocab_size = vocab_size
        self.instance = SimInstance(index, costs, kv_capacity=kv_capacity_tokens, max_num_seqs=max_num_seqs,
                                    pool_hit_rate=0.0, rng=random.Random(seed), record_timeline=False)
        self.in_engine: dict[int, _Live] = {}  # SimSeq.chunk_id -> (engine requests in the instance)
        self.by_engine_id: dict[str, int] = {}
        self._ran_requests: set[int] = set()  # requests with a chunk here before: their prefix is cached
        self._next_seq = 0
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.time()
        self._changed = asyncio.Event()
        self._arrivals: list[_Live] = []
        self._aborts: list[str] = []
        self.stats = SimEngineStats()
        self.failure: BaseException | None = None
        self._task = self._loop.create_task(self._run())

    # ------------------------------------------------------------ the worker's interface
    def open(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, sampling: Sampling,
             *, stream: bool = False) -> Stream:
        """As the vLLM engines' `open`; the chunk's request, group and prompt length come from
        its engine request id (`seerd.protocol.ChunkIdentity`), as vLLM's drafter reads them."""
        if self.failure is not None:
            raise EngineDead(f"simulated engine failed earlier: {self.failure!r}")
        context = len(prompt_token_ids)
        chunk = parse_engine_id(request_id)  # None: not a seerd chunk (the warm-up)
        self._next_seq += 1
        request = chunk.request_id if chunk is not None else -self._next_seq
        previous = self.instance.index if request in self._ran_requests else None
        self._ran_requests.add(request)
        prompt_len = min(context, chunk.prompt_len) if chunk is not None else context
        seq = SimSeq(self._next_seq, request, chunk.group_id if chunk is not None else -1, prompt_len,
                     generated_before=context - prompt_len, target=max(1, max_tokens), previous_instance=previous,
                     is_probe=chunk is not None and chunk.is_probe)
        output = Stream(self._loop)
        seed = sampling.seed or 0
        self._arrivals.append(_Live(request_id, output, seq, stream, token_base=(seed + context) % self.vocab_size))
        self.stats.chunks_opened += 1
        self._changed.set()
        return output

    async def run(self, request_id: str, prompt_token_ids: list[int], max_tokens: int,
                  sampling: Sampling) -> ChunkResult:
        return await run_whole(self, request_id, prompt_token_ids, max_tokens, sampling)

    async def abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        self._changed.set()

    def progress(self) -> EngineProgress:
        return EngineProgress(self.instance.step, self.stats.longest_step_s,
                              len(self.in_engine) + len(self._arrivals))

    async def reload_weights(self, path: str) -> float:
        raise EngineDead("a modelled engine holds no weights: `seerd serve` runs vLLM engines")

    def shutdown(self) -> None:
        self._task.cancel()

    # ------------------------------------------------------------ the model's clock
    def _now(self) -> float:
        """Engine time now (seconds of modelled engine time)."""
        return (self._loop.time() - self._started) * self.time_scale

    async def _run(self) -> None:
        try:
            while True:
                wake_at = self._advance()
                timeout = None if wake_at is None else min(MAX_SLEEP_S, max(
                    0.0, wake_at / self.time_scale + self._started - self._loop.time()))
                if not self._changed.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), timeout)
                self._changed.clear()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a modelling error: fail every stream, the worker exits
            log.exception("simulated engine failed")
            self.failure = exc
            for live in [*self.in_engine.values(), *self._arrivals]:
                live.stream.fail(EngineDead(f"simulated engine failed: {exc!r}"))

    def _advance(self) -> float | None:
        """Bring the instance to now, deliver what it produced, take arrivals and aborts, plan
        the next segment; the engine time of the next scheduling point (None: nothing to run)."""
        instance = self.instance
        self.stats.scheduling_points += 1
        finished = instance.sync(self._now())
        for seq in finished:
            live = self.in_engine.pop(seq.chunk_id, None)
            if live is not None:
                self._finish(live)
        replan = bool(finished)
        for engine_id in self._aborts:
            replan |= self._cancel(engine_id)
        self._aborts.clear()
        for live in self._arrivals:
            self.in_engine[live.seq.chunk_id] = live
            self.by_engine_id[live.engine_id] = live.seq.chunk_id
            instance.submit(live.seq)
            replan = True
        self._arrivals.clear()
        self._push_progress()
        if replan or instance.segment is None:
            before = instance.clock
            instance.schedule()
            if instance.segment is not None:
                start, steps, end = instance.segment
                self.stats.longest_step_s = max(self.stats.longest_step_s,
                                                (end - max(start, before)) / max(1, steps) / self.time_scale)
        if instance.segment is None:
            return None
        return min(instance.segment[2], self._next_wanted())

    def _cancel(self, engine_id: str) -> bool:
        chunk = self.by_engine_id.pop(engine_id, None)
        if chunk is None:
            for i, live in enumerate(self._arrivals):  # aborted before it reached the instance
                if live.engine_id == engine_id:
                    del self._arrivals[i]
                    self.stats.chunks_aborted += 1
            return False
        live = self.in_engine.pop(chunk, None)
        self.stats.chunks_aborted += 1
        return live is not None and self.instance.cancel(chunk)

    def _produced(self, live: _Live) -> int:
        seq = live.seq
        if seq.chunk_id not in self.instance.running:
            return int(seq.produced)  # waiting (or preempted): what it made before
        return int(seq.produced + seq.advanced(self.instance.step))

    def _push_progress(self) -> None:
        """Streamed requests: their tokens so far, so a chunk boundary inside a segment is seen."""
        for live in self.in_engine.values():
            if live.streamed:
                produced = self._produced(live)
                if produced > live.pushed:
                    self._push(live, produced, None)

    def _next_wanted(self) -> float:
        """Engine time at which the first streamed request reaches the count its worker waits for."""
        instance = self.instance
        start, steps, end = instance.segment
        batch = len(instance.running)
        first = end
        for live in self.in_engine.values():
            wanted = live.stream.wanted if live.streamed else None
            if wanted is None or live.seq.chunk_id not in instance.running:
                continue
            missing = wanted - self._produced(live)
            if 0 < missing < steps:
                first = min(first, start + instance.costs.segment_time(batch, instance.kv_used, missing) + _EPS_S)
        return first

    def _finish(self, live: _Live) -> None:
        self.by_engine_id.pop(live.engine_id, None)
        self._push(live, int(live.seq.target), "length")

    def _push(self, live: _Live, upto: int, finish_reason: str | None) -> None:
        count = upto - live.pushed
        base = live.token_base + live.pushed
        vocab = self.vocab_size
        tokens = [(base + i) % vocab for i in range(count)]
        cached = None
        if live.pushed == 0:  # what vLLM's prefix cache would have held: the model's assumption
            seq = live.seq
            cached = seq.prompt_len + seq.generated_before if seq.previous_instance == self.instance.index else 0
        live.stream.push(tokens, [-1.0] * count, finish_reason, cached)
        live.pushed = upto


def start_sim_engine(model_path: str, engine: EngineConfig, seed: int, index: int) -> SimEngine:
    """A simulated engine for worker rank `index` from the run's engine settings: the preset's
    cost model and KV capacity, the run's `max_num_seqs`, the model's vocabulary for token ids."""
    from seerd.sim.presets import get_preset

    preset = get_preset(engine.sim_preset)
    costs = preset.costs()
    kv_tokens = preset.kv_tokens or costs.kv_capacity_tokens()
    config = json.loads((Path(model_path) / "config.json").read_text())
    return SimEngine(costs, index=index, kv_capacity_tokens=int(kv_tokens),
                     max_num_seqs=engine.max_num_seqs, time_scale=engine.time_scale,
                     vocab_size=int(config["vocab_size"]),
                     seed=seed + index)
