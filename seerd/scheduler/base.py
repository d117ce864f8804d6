"""The rules every chunking policy shares: chunk budgets, KV admission, load balance, estimates.

A policy is a pure function from a snapshot to a plan (`views.py`); the coordinator's lease book
and the simulator drive the very same policies over one `SchedulerState` (`state.py`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from seerd.scheduler.views import Assignment, Plan, QueuedRequest, Snapshot


def updated_estimate(finished_before: int, estimate: int, length: int) -> int:
    """A group's estimate after one of its responses finishes with `length` tokens.

    The paper's L_g: the longest finished response of the group. The first finish replaces the
    starting value (the group's max_tokens, or a prior from an earlier rollout); later ones can
    only raise it. One rule for the daemon's lease book and the simulator.
    """
    return length if finished_before == 0 else max(estimate, length)


def chunk_budget(request: QueuedRequest, chunk_tokens: int) -> int:
    """The paper's rule: max_tokens = min(chunk_size, original_max_tokens - generated)."""
    return min(chunk_tokens, request.remaining)


def kv_need(request: QueuedRequest, budget: int, block_tokens: int = 1) -> int:
    """KV tokens a chunk can occupy at its end: the whole context plus its budget, in the whole
    blocks the engine allocates (vLLM-CPU's are 128 tokens: on a small KV cache the rounding
    is a quarter of it, and counting tokens let the engine preempt what the scheduler admitted)."""
    tokens = request.prompt_len + request.generated + budget
    return -(-tokens // block_tokens) * block_tokens


def whole_chunk_need(request: QueuedRequest, chunk_tokens: int, block_tokens: int) -> int:
    """`kv_need` of a whole chunk (`chunk_budget`) in one call: admission asks it of most requests
    it passes over, where the three calls were most of the loop's time."""
    generated = request.generated
    remaining = request.max_tokens - generated
    tokens = request.prompt_len + generated + (chunk_tokens if chunk_tokens < remaining else remaining)
    return -(-tokens // block_tokens) * block_tokens


def continuing_first(snapshot: Snapshot, ordered: Iterable[QueuedRequest],
                     key: Callable[[QueuedRequest], object] | None = None) -> Iterator[QueuedRequest]:
    """`ordered`, with the requests that continue in place on the asking worker first (in `key`
    order, else oldest first). A chunk boundary stays a scheduling point (a request the worker
    has no slot or KV room for, or that balance sends elsewhere, is stopped and runs again
    wherever it is leased next) but not a rotation: swapping a running request for a queued
    one of the same class costs a prefill of its context later and gains nothing (the paper's
    Seer re-queues after every chunk too, but moves KV through its pool at no prefill)."""
    held = snapshot.continuing
    if not held:
        yield from ordered
        return
    first = [snapshot.queued.get(rid) for rid in held if rid in snapshot.queued]
    yield from sorted(first, key=key or (lambda r: (r.queued_at, r.request_id)))
    yield from (r for r in ordered if r.request_id not in held)


# The shortest chunk a request is shrunk to when the worker's KV cannot hold its whole budget:
# below it a chunk's report round trip would cost more than the tokens it carries.
MIN_SHRUNK_BUDGET = 16


def fitting_budget(request: QueuedRequest, kv_free: int, block_tokens: int = 1) -> int:
    """The largest budget whose chunk, context included, fits in `kv_free` tokens of whole blocks
    (at most the request's chunk budget); 0 or less if not even its context fits."""
    return min(request.remaining, (kv_free // block_tokens) * block_tokens - request.prompt_len - request.generated)


# Under KV pressure a chunk reserves growth past its context of a quarter of that context, at
# least LEAN_GROWTH_TOKENS, rounded up to the engine's blocks (vLLM-CPU's 128), instead of its
# whole chunk budget. A sequence then holds at most ~1.25x its context: the engine runs at least
# ~80% of the sequences vLLM's own admission would, and a request sends a report per 25% of
# growth (a few dozen over a long response), not one per 128 tokens.
LEAN_GROWTH_TOKENS = 128
LEAN_GROWTH_SHARE = 4


def lean_growth(context: int) -> int:
    return max(LEAN_GROWTH_TOKENS, context // LEAN_GROWTH_SHARE)


def lean_budget(request: QueuedRequest, chunk_tokens: int, block_tokens: int = 1) -> int:
    """A chunk's budget when the worker's KV cannot hold every candidate's whole chunk: the
    context's last block filled plus whole blocks for `lean_growth` more (at most the chunk
    budget). vLLM admits sequences reserving no growth and preempts when they outgrow its
    KV; a lean chunk reserves little and ends soon, and at its report (in place: no stop) it
    takes its next blocks first (`continuing_first`), so a running sequence that cannot grow is
    stopped at a boundary by the policy's order, never preempted by the engine."""
    context = request.prompt_len + request.generated
    grown = -(-(context + lean_growth(context)) // block_tokens) * block_tokens
    return min(chunk_budget(request, chunk_tokens), grown - context)


def free_slots(snapshot: Snapshot) -> int:
    load = snapshot.worker(snapshot.worker_id)
    return min(snapshot.wanted, load.max_chunks - load.running_chunks)


DEFAULT_BALANCE_SPREAD = 32  # the paper's threshold: in-flight requests between instances
# A lease call looks at most this many requests past those it leaves to other workers: bounded
# work per call (otherwise a worker without room scans the whole queue on every call).
MAX_PASSED_OVER = 256


def balanced_slots(snapshot: Snapshot, spread: int = DEFAULT_BALANCE_SPREAD) -> int:
    """Free slots the asking worker may fill while staying within `spread` chunks in flight of
    the least loaded live worker that can still take a chunk (a free slot and KV room for one).

    The paper routes to the least loaded instance once the spread of in-flight requests passes
    32; workers here pull, so the same rule caps what one asking worker takes. Without it, the
    first worker to ask after start-up took every chunk its KV could hold while the others idled.
    The cap binds only while work is short: the asking worker may always take what the queue holds
    beyond the other workers' free slots (at start-up, with a queue longer than every slot, the
    first to ask fills up instead of taking 32 and waiting a long poll for the rest).
    """
    me = snapshot.worker(snapshot.worker_id)
    slots = free_slots(snapshot)
    # The other workers that can take a chunk: their free slots, and the fewest chunks one runs.
    others_free, fewest_running = snapshot.open_workers.others(me, snapshot.chunk_tokens)
    if fewest_running is not None:
        spare = len(snapshot.queued) - others_free
        slots = min(slots, max(fewest_running + spread - me.running_chunks, spare))
    return max(0, slots)


def failed_here(request: QueuedRequest, worker_id: str, live: list[str]) -> bool:
    """The engine of `worker_id` failed a chunk of this request and another live worker's has not:
    a retry goes there (a poison request then fails on several engines, not one bad one)."""
    return (bool(request.failed_on) and worker_id in request.failed_on
            and any(w not in request.failed_on for w in live))


def admit(snapshot: Snapshot, ordered: Iterable[QueuedRequest],
          skip: Callable[[QueuedRequest], bool] = lambda _request: False, *, limit: int | None = None) -> Plan:
    """Give the asking worker requests in `ordered` order while it has free slots and KV room.

    A request's chunk needs KV for its whole context plus its budget, so admitted chunks never
    exceed the worker's KV (no preemption). A request whose chunk failed on this worker's engine
    waits for another live worker's (`failed_here`). A request that does not fit here but fits another
    live worker with a free slot is left for that one. When the KV left cannot hold every
    candidate's whole chunk, admission starts over with lean chunks (`lean_budget`: one to two
    blocks of growth each), so the engine runs about as many sequences as vLLM's own admission
    would, without the preemptions that admission pays when they grow. One that still fits no
    worker gets a shorter chunk where the KV left holds at least `MIN_SHRUNK_BUDGET` tokens past
    its context (`fitting_budget`). Only a request that cannot get even that stops admission, so
    smaller ones never overtake a head that waits for room (the paper: "choose an instance with
    room; if none has room, schedule nothing"). `limit` caps the number of chunks. `skip` (a
    request to pass over, e.g. one left to its home worker) is asked again of a request the lean
    pass sees again, or that an order passing over in one call left next: it must answer the same.
    """
    if not _room_for_any(snapshot):
        return Plan()  # what both passes below would end with, after looking at up to 257 requests each
    seen: list[QueuedRequest] = []
    ordered = iter(ordered)
    plan = _admit(snapshot, ordered, skip, limit, lean=False, seen=seen)
    if plan is not None:
        return plan
    # The KV ran short: again from the first request, every chunk lean.
    restarted = getattr(ordered, "restarted", None)
    again = itertools.chain(seen, ordered) if restarted is None else restarted(seen)
    plan = _admit(snapshot, again, skip, limit, lean=True)
    assert plan is not None
    return plan


def _room_for_any(snapshot: Snapshot) -> bool:
    """Whether the asking worker has a free slot and KV room for a chunk of one token past the
    shortest queued context, in its whole blocks. Without, every request's chunk needs more than
    its KV (`kv_need` is at least that), and even a shrunk one leaves less than a token of
    budget (`fitting_budget`), so `_admit` gives nothing; most lease calls of KV-bound workers
    (tools/bench/load.py) found that out by passing over hundreds of requests."""
    load = snapshot.worker(snapshot.worker_id)
    shortest = snapshot.queued.shortest_context()
    if shortest is None or free_slots(snapshot) <= 0:
        return False
    block = load.kv_block_tokens
    return -(-(shortest + 1) // block) * block <= load.kv_capacity_tokens - load.reserved_kv_tokens


def _admit(snapshot: Snapshot, ordered: Iterable[QueuedRequest], skip: Callable[[QueuedRequest], bool],
           limit: int | None, *, lean: bool, seen: list[QueuedRequest] | None = None) -> Plan | None:
    """One admission pass (see `admit`); None when, with whole chunks, the KV ran short. `seen`
    gets each request taken from `ordered` (a second pass starts over with them)."""
    load = snapshot.worker(snapshot.worker_id)
    slots = free_slots(snapshot) if limit is None else min(limit, free_slots(snapshot))
    kv_free = load.kv_capacity_tokens - load.reserved_kv_tokens
    # What needs every live worker is worked out only when a request needs it (the live ids are
    # a scan of every worker; the most KV room elsewhere comes from the kept summary: its scan
    # was a quarter of the state thread at 512 workers, tools/bench/load.py).
    live: list[str] | None = None
    room_elsewhere: int | None = None
    assignments: list[Assignment] = []
    passed_over = 0
    ordered = iter(ordered)
    # An order that can pass over, in one call, the requests that fit another worker and not this
    # one (`seer.PassingOrder`): with the workers' KV full they were 95% of the requests a plan looked
    # at, each a step through the policy's generators and `skip` (docs/journal/2026-11-30.md). Asked once
    # the walk passed one over like that: a plan that takes what it meets first never needs it.
    pass_over = getattr(ordered, "pass_over_unfit", None)
    passing = False
    block = load.kv_block_tokens
    chunk_tokens = snapshot.chunk_tokens

    def need_of(request: QueuedRequest) -> int:
        budget = lean_budget(request, chunk_tokens, block) if lean else chunk_budget(request, chunk_tokens)
        return kv_need(request, budget, block)

    while True:
        if passing and len(assignments) < slots and passed_over <= MAX_PASSED_OVER:
            if room_elsewhere is None:
                room_elsewhere = snapshot.open_workers.most_room_but(load.worker_id)
            passed = pass_over(need_of, kv_free, room_elsewhere, MAX_PASSED_OVER + 1 - passed_over,
                               None if lean else (chunk_tokens, block), skip)
            if seen is not None:
                seen.extend(passed)
            passed_over += len(passed)
        request = next(ordered, None)
        if request is None:
            break
        if seen is not None:
            seen.append(request)
        if len(assignments) >= slots or passed_over > MAX_PASSED_OVER:
            break
        if request.failed_on and live is None:
            live = [w.worker_id for w in snapshot.workers]
        if skip(request) or (request.failed_on and failed_here(request, snapshot.worker_id, live)):
            passed_over += 1
            passing = pass_over is not None
            continue
        budget = lean_budget(request, chunk_tokens, block) if lean else chunk_budget(request, chunk_tokens)
        need = kv_need(request, budget, block)
        if need > kv_free:
            if room_elsewhere is None:
                room_elsewhere = snapshot.open_workers.most_room_but(load.worker_id)
            if need <= room_elsewhere:
                passed_over += 1
                passing = pass_over is not None
                continue  # another worker has room for it and takes it when it asks
            if not lean:
                return None
            budget = fitting_budget(request, kv_free, block)
            if budget < min(MIN_SHRUNK_BUDGET, request.remaining):
                break
            need = kv_need(request, budget, block)
        kv_free -= need
        assignments.append(Assignment(request.request_id, snapshot.worker_id, budget))
    return Plan(tuple(assignments))
