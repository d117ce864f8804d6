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

With speculative decoding (a `DepthPlanner`, `seerd/sim/spec.py`) step 4 changes: at every
scheduling point the planner picks the draft depths for the batch as it stands, and each sequence
advances by its own expected tokens per step (`SimSeq.rate`, 1 + its accepted drafts) until the
next scheduling point. A segment then ends at the first sequence to reach its chunk's end at its
rate, or when the expected growth would overfill KV; the context grows by the sum of the rates
per step, still linear, so the segment is still summed exactly. Rates change only at scheduling
points (batch changes, and a sibling's finish, which the driver turns into one); a sequence's
progress is carried over from one rate to the next (`rebase`). A chunk's tokens are exactly its
target: the step that reaches it yields only what the budget leaves.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from seerd.sim.costs import InstanceCosts, ProfiledCosts
from seerd.sim.spec import DepthPlanner, StepShape

WATERMARK_FRACTION = 0.01
_TIME_EPS = 1e-9
_RATE_EPS = 1e-9  # a chunk that ends on a step boundary at a fractional rate ends there


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
    is_probe: bool = False  # its group's speculative request (a class of its own for draft depths)
    produced: float = 0  # tokens produced before `start_step` (kept over preemption)
    start_step: int = 0  # the engine step since which it advances at `rate`
    end_step: int = 0
    admitted_order: int = 0
    preempted: bool = False
    rate: float = 1  # tokens per step since start_step: 1 without drafts, 1 + accepted drafts with them

    def advanced(self, step: int) -> float:
        """Tokens produced since start_step: at its rate, never past the chunk's target."""
        return min(self.target - self.produced, self.rate * (step - self.start_step))

    def held(self, step: int) -> float:
        """The KV the engine counted for it at `step`: its context, the last step's overshoot of
        the chunk's target included (the expected advance is counted for the whole batch)."""
        return self.prompt_len + self.generated_before + self.produced + self.rate * (step - self.start_step)

    def rebase(self, step: int, rate: float) -> None:
        """From `step` on, advance at `rate`."""
        if rate == self.rate:
            return  # same progress, same end
        self.produced += self.advanced(step)
        self.start_step, self.rate = step, rate
        self.end_step = step + steps_to_reach(self.target - self.produced, rate)


def steps_to_reach(tokens: float, rate: float) -> int:
    """Steps at `rate` tokens per step to produce `tokens` (the last one may yield less)."""
    return max(1, math.ceil(tokens / rate - _RATE_EPS))


@dataclass
class InstanceStats:
    busy_s: float = 0.0
    prefill_s: float = 0.0
    decode_steps: int = 0
    sequence_steps: int = 0  # sequences per step on average = sequence_steps / decode_steps
    spec_steps: int = 0  # decode steps that verified drafts
    drafted_tokens: int = 0
    accepted_tokens: float = 0.0  # expected accepted drafts (tokens per sequence-step - 1, summed)
    peak_kv: int = 0  # the most KV tokens ever held: never above capacity
    preemptions: int = 0
    recomputed_tokens: int = 0  # context rebuilt by prefill after preemption or migration
    pool_loads: int = 0
    pool_loaded_tokens: int = 0
    local_continuations: int = 0
    moved_continuations: int = 0  # later chunks run on another instance than the previous one


class SimInstance:
    def __init__(self, index: int, costs: InstanceCosts | ProfiledCosts, *, kv_capacity: int, max_num_seqs: int,
                 pool_hit_rate: float, rng: random.Random, record_timeline: bool = True,
                 planner: DepthPlanner | None = None) -> None:
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
        self.planner = planner  # None: no speculative decoding
        self._shape: StepShape | None = None  # the current segment's drafts and rates (speculative only)
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

    @property
    def segment(self) -> tuple[float, int, float] | None:
        """The planned segment (start time, steps, end time) from the current step, or None."""
        return self._segment

    # ------------------------------------------------------------- time
    def sync(self, t: float) -> list[SimSeq]:
        """Advance to the first step boundary at or after `t`; return the chunks that ended there."""
        if self._segment is None:
            self.clock = max(self.clock, t)
            return []
        start, planned, end = self._segment
        batch = len(self.running)
        drafts, growth = (0, None) if self._shape is None else (self._shape.drafts, self._shape.growth)
        if t >= end - _TIME_EPS:
            steps = planned
        else:
            steps = self.costs.steps_within(batch, self.kv_used, planned, t - start + _TIME_EPS, drafts, growth)
            if self.costs.segment_time(batch, self.kv_used, steps, drafts, growth) < t - start - _TIME_EPS:
                steps += 1  # t falls inside a step: the boundary is that step's end
        elapsed = end - start if steps == planned else self.costs.segment_time(batch, self.kv_used, steps,
                                                                                drafts, growth)
        self.clock = start + elapsed
        self.stats.busy_s += elapsed
        self.stats.decode_steps += steps
        self.stats.sequence_steps += batch * steps
        self.step += steps
        if self._shape is None:
            self.kv_used += batch * steps
        else:
            self._count_drafts(steps)
            self.kv_used += self._shape.growth * steps
        self.stats.peak_kv = max(self.stats.peak_kv, self.kv_used)
        self._segment = None if steps == planned else (self.clock, planned - steps, end)
        finished = self._pop_finished()
        if finished:
            self._segment = None
        return finished

    def _pop_finished(self) -> list[SimSeq]:
        finished = []
        if self.planner is not None:  # ends move with every re-plan: no heap to keep
            finished = [seq for seq in self.running.values() if seq.end_step <= self.step]
            finished.sort(key=lambda seq: (seq.end_step, seq.chunk_id))  # the heap's order
        while self._ends and self._ends[0][0] <= self.step:
            end_step, chunk_id = heapq.heappop(self._ends)
            seq = self.running.get(chunk_id)
            if seq is None or seq.end_step != end_step:
                continue  # preempted since; a fresher entry exists
            finished.append(seq)
        for seq in finished:
            del self.running[seq.chunk_id]
            self.kv_used -= seq.held(self.step)  # = its context without drafts
        return finished

    def _count_drafts(self, steps: int) -> None:
        shape = self._shape
        if shape.drafts:
            self.stats.spec_steps += steps
            self.stats.drafted_tokens += shape.drafts * steps
        self.stats.accepted_tokens += (shape.growth - len(shape.rates)) * steps

    # ------------------------------------------------------------- scheduling
    def schedule(self) -> float | None:
        """Admit, build contexts, preempt if needed, and plan the next segment.

        Returns the time of the instance's next event, or None when it has nothing to run."""
        self._segment = None
        self._shape = None
        self._admit()
        self._preempt_for_next_step()
        if self.record_timeline:
            self.timeline.append((self.clock, len(self.running), self.kv_used))
        if not self.running:
            return None
        if self.planner is not None:
            return self._schedule_speculative()
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

    def _schedule_speculative(self) -> float:
        """Step 4 with drafts: the planner's depths for this batch, each sequence at its own rate."""
        seqs = list(self.running.values())
        shape = self.planner.plan(seqs, self.kv_used)
        room = self.kv_capacity - self.kv_used
        if shape.drafts and room < shape.growth:
            # No room for the accepted drafts (preemption left room for one token each): plain step.
            shape = StepShape(shape.plan, tuple(1.0 for _ in seqs), 0)
        for seq, rate in zip(seqs, shape.rates):
            seq.rebase(self.step, rate)
        self._shape = shape
        steps_to_end = min(seq.end_step for seq in seqs) - self.step
        steps_to_full = math.floor(room / shape.growth)
        steps = max(1, min(steps_to_end, steps_to_full))
        end = self.clock + self.costs.segment_time(len(seqs), self.kv_used, steps, shape.drafts, shape.growth)
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
            seq.start_step, seq.rate = self.step, 1
            seq.end_step = self.step + steps_to_reach(seq.target - seq.produced, 1)
            self._admissions += 1
            seq.admitted_order = self._admissions
            self.running[seq.chunk_id] = seq
            if self.planner is None:  # with a planner, ends move at every re-plan and are found by a scan
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

    def cancel(self, chunk_id: int) -> bool:
        """Take a chunk out (an abort), at a step boundary (after `sync`): its KV is freed and
        the next `schedule` plans without it. False when it is not here (finished already)."""
        seq = self.running.pop(chunk_id, None)
        if seq is not None:
            self.kv_used -= seq.held(self.step)
            self._segment = None
            return True  # its end entry is dropped lazily, as a preempted one's is
        for seq in self.waiting:
            if seq.chunk_id == chunk_id:
                self.waiting.remove(seq)
                return True
        return False

    def _preempt_for_next_step(self) -> None:
        while self.running and self.kv_capacity - self.kv_used < len(self.running):
            victim = max(self.running.values(), key=lambda s: s.admitted_order)
            del self.running[victim.chunk_id]
            self.kv_used -= victim.held(self.step)
            victim.produced += victim.advanced(self.step)
            victim.preempted = True
            self.waiting.appendleft(victim)
            self.stats.preemptions += 1
