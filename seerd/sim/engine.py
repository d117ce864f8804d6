"""A modelled inference instance: vLLM's continuous batching, admission and preemption, timed by
`InstanceCosts`.

What it does, per scheduling point (a step boundary at which something changed):
1. admission, first come first served from its waiting queue (vLLM's rule): the head is admitted
   while fewer than `max_num_seqs` run and, after allocating the head's whole context, free KV
   stays at or above the watermark (1% of capacity, vLLM's `watermark` default in the v0 block
   manager); a head that does not fit blocks the rest;
2. the admitted contexts are built before decoding resumes (running sequences stall meanwhile):
   - a request's first chunk: prefill of its prompt, free if a sibling already left the prompt
     in this instance's prefix cache (prompts are assumed to stay cached: few and short);
   - a later chunk on the instance that ran the previous one: free (prefix cache hit);
   - a later chunk elsewhere: pulled from the global KV pool with probability `pool_hit_rate`
     (NIC-bound transfer), else recomputed (prefill over the whole context, attention included);
   - a sequence back from preemption: recomputed (vLLM's recompute preemption);
3. preemption when the next step would not fit: the latest admitted sequence is evicted, its KV
   freed, and it goes to the front of the waiting queue, keeping the tokens it produced;
4. the next segment: all running sequences decode together until the first one ends its chunk
   or KV runs out; its duration is summed exactly by `InstanceCosts.segment_time`.
KV is counted in tokens (block rounding, at most one partial block per sequence, is ignored) and
a group's shared prompt is counted once per sequence, as if prefix blocks were not shared.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass

from seerd.sim.costs import InstanceCosts

WATERMARK_FRACTION = 0.01
_TIME_EPS = 1e-9


@dataclass
class SimSeq:
    """One chunk in an engine: a request's slice of generation."""

    chunk_id: int
    request_id: int
    group_index: int
    prompt_len: int
    generated_before: int  # the request's committed tokens when this chunk was leased
    target: int  # tokens this chunk will produce: its budget, cut where the response truly ends
    previous_instance: int | None  # where the request's previous chunk ran
    produced: int = 0  # tokens produced before the current admission (kept over preemption)
    start_step: int = 0  # the engine step at which it (re)joined the running batch
    end_step: int = 0
    admitted_order: int = 0
    preempted: bool = False

    def context(self, step: int) -> int:
        return self.prompt_len + self.generated_before + self.produced + (step - self.start_step)


@dataclass
class InstanceStats:
    busy_s: float = 0.0
    prefill_s: float = 0.0
    decode_steps: int = 0
    decoded_tokens: int = 0  # tokens per step on average = decoded_tokens / decode_steps
    peak_kv: int = 0  # the most KV tokens ever held: never above capacity
    preemptions: int = 0
    recomputed_tokens: int = 0  # context rebuilt by prefill after preemption or migration
    pool_loads: int = 0
    pool_loaded_tokens: int = 0
    local_continuations: int = 0
    moved_continuations: int = 0  # later chunks run on another instance than the previous one


class SimInstance:
    def __init__(self, index: int, costs: InstanceCosts, *, kv_capacity: int, max_num_seqs: int,
                 pool_hit_rate: float, rng: random.Random, record_timeline: bool = True) -> None:
        self.index = index
        self.costs = costs
        self.kv_capacity = kv_capacity
        self.max_num_seqs = max_num_seqs
        self.watermark = int(WATERMARK_FRACTION * kv_capacity)
        self.pool_hit_rate = pool_hit_rate
        self.rng = rng
        self.clock = 0.0  # a step boundary (or the last time it was touched while idle)
        self.step = 0
        self.kv_used = 0  # tokens held by the running sequences at `step`
        self.running: dict[int, SimSeq] = {}
        self.waiting: deque[SimSeq] = deque()
        self._ends: list[tuple[int, int]] = []  # (end_step, chunk_id), lazily cleaned
        self._segment: tuple[float, int, float] | None = None  # (start clock, steps, end clock)
        self._admissions = 0
        self._cached_prompts: set[int] = set()
        self.version = 0  # bumped whenever the pending event is replaced
        self.stats = InstanceStats()
        self.record_timeline = record_timeline
        self.timeline: list[tuple[float, int, int]] = []  # (time, running sequences, KV tokens)

    # ------------------------------------------------------------- inputs
    def submit(self, seq: SimSeq) -> None:
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------- time
    def sync(self, t: float) -> list[SimSeq]:
        """Advance to the first step boundary at or after `t`; return the chunks that ended there."""
        if self._segment is None:
            self.clock = max(self.clock, t)
            return []
        start, planned, end = self._segment
        batch = len(self.running)
        if t >= end - _TIME_EPS:
            steps = planned
        else:
            steps = self.costs.steps_within(batch, self.kv_used, planned, t - start + _TIME_EPS)
            if self.costs.segment_time(batch, self.kv_used, steps) < t - start - _TIME_EPS:
                steps += 1  # t falls inside a step: the boundary is that step's end
        elapsed = end - start if steps == planned else self.costs.segment_time(batch, self.kv_used, steps)
        self.clock = start + elapsed
        self.stats.busy_s += elapsed
        self.stats.decode_steps += steps
        self.stats.decoded_tokens += batch * steps
        self.step += steps
        self.kv_used += batch * steps
        self.stats.peak_kv = max(self.stats.peak_kv, self.kv_used)
        self._segment = None if steps == planned else (self.clock, planned - steps, end)
        finished = []
        while self._ends and self._ends[0][0] <= self.step:
            end_step, chunk_id = heapq.heappop(self._ends)
            seq = self.running.get(chunk_id)
            if seq is None or seq.end_step != end_step:
                continue  # preempted since; a fresher entry exists
            del self.running[chunk_id]
            self.kv_used -= seq.context(self.step)
            finished.append(seq)
        if finished:
            self._segment = None
        return finished

    # ------------------------------------------------------------- scheduling
    def schedule(self) -> float | None:
        """Admit, build contexts, preempt if needed, and plan the next segment.

        Returns the time of the instance's next event, or None when it has nothing to run."""
        self._segment = None
        self._admit()
        self._preempt_for_next_step()
        if self.record_timeline:
            self.timeline.append((self.clock, len(self.running), self.kv_used))
        if not self.running:
            return None
        batch = len(self.running)
        while True:  # drop stale end entries from the top
            end_step, chunk_id = self._ends[0]
            seq = self.running.get(chunk_id)
            if seq is not None and seq.end_step == end_step:
                break
            heapq.heappop(self._ends)
        steps_to_end = end_step - self.step
        steps_to_full = (self.kv_capacity - self.kv_used) // batch
        steps = max(1, min(steps_to_end, steps_to_full))
        end = self.clock + self.costs.segment_time(batch, self.kv_used, steps)
        self._segment = (self.clock, steps, end)
        return end

    def _admit(self) -> None:
        build_s = 0.0
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            context = seq.prompt_len + seq.generated_before + seq.produced
            if self.kv_capacity - self.kv_used - context - 1 < self.watermark:
                break
            self.waiting.popleft()
            build_s += self._build_context(seq, context)
            seq.start_step = self.step
            seq.end_step = self.step + seq.target - seq.produced
            self._admissions += 1
            seq.admitted_order = self._admissions
            self.running[seq.chunk_id] = seq
            heapq.heappush(self._ends, (seq.end_step, seq.chunk_id))
            self.kv_used += context
            self.stats.peak_kv = max(self.stats.peak_kv, self.kv_used)
        if build_s:
            self.clock += build_s
            self.stats.busy_s += build_s
            self.stats.prefill_s += build_s

    def _build_context(self, seq: SimSeq, context: int) -> float:
        """Seconds to make `context` tokens of KV ready for `seq` on this instance."""
        prompt_cached = seq.group_index in self._cached_prompts
        self._cached_prompts.add(seq.group_index)
        prompt_s = 0.0 if prompt_cached else self.costs.prefill_time(seq.prompt_len)
        generated = context - seq.prompt_len
        if generated == 0:
            return prompt_s
        if not seq.preempted:
            if seq.previous_instance == self.index:
                self.stats.local_continuations += 1
                return 0.0
            self.stats.moved_continuations += 1
            if self.pool_hit_rate > 0 and self.rng.random() < self.pool_hit_rate:
                self.stats.pool_loads += 1
                self.stats.pool_loaded_tokens += context
                return self.costs.pool_load_time(context)
        self.stats.recomputed_tokens += generated
        return prompt_s + self.costs.prefill_time(generated, cached_tokens=seq.prompt_len)

    def _preempt_for_next_step(self) -> None:
        while self.running and self.kv_capacity - self.kv_used < len(self.running):
            victim = max(self.running.values(), key=lambda s: s.admitted_order)
            del self.running[victim.chunk_id]
            self.kv_used -= victim.context(self.step)
            victim.produced += self.step - victim.start_step
            victim.preempted = True
            self.waiting.appendleft(victim)
            self.stats.preemptions += 1
