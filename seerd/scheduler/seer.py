"""`seer`: context-aware scheduling, the Seer paper's Algorithm 2, on divided rollout.

Each time a worker asks for work, queued requests are served in this order:
1. the oldest starved request (queued longer than `starvation_s`, default 1800 s), at most
   `starved_per_call` (1) per lease call. This is the anti-starvation rule ("occasionally serve
   underserved groups" in the paper): a request starved at time T is served once the starved
   requests older than it have been, one per lease call that admits anything. In a batch
   rollout nothing waits forever anyway (no new work arrives), so the bound is a safety net set
   above the rollouts it should not disturb: in the simulator, bounds of 300 and 600 s cost seer
   throughput and tail time, and serving every starved request at once turned it into FCFS for
   minutes at a time (docs/simulator.md, sensitivity).
2. probes (one speculative request per group), shortest generated length first: short probes
   finish and leave, long ones reveal the tail groups early;
3. continuations: requests that have started, in the order their last chunk ended (first come,
   first served), so that a chunk boundary never turns into a long wait for a started response;
4. requests not yet started, longest group estimate first (the estimate is the group's longest
   finished response; before any finishes, its max_tokens, or with `--prior` the longest
   response of an earlier run of the same prompt), then the oldest.
   The estimate thus decides which responses start, not which running ones continue. Ordering
   continuations by estimate too (the literal reading of Algorithm 2) let the long responses of
   a group whose first finished response was short wait thousands of seconds at chunk
   boundaries: in the simulator on kimi-k2 that cost 1.22x -> 1.47x of `group` and a tail of
   0.48x -> 0.08x of group's; on the other presets the two orders were within noise
   (docs/simulator.md).
Admission (`base.admit`): chunks only while the worker has free sequence slots and KV room for
the chunk's whole context plus its budget (no preemption by construction); a request that fits
only another worker is left for it, and one that fits no worker stops admission (nothing smaller
overtakes a head that waits for room).
Affinity: a request whose previous chunk ran on another live worker with a free slot and KV room
for the chunk is left for that worker (its prefix cache holds the request), unless that worker has
`affinity_spread` more chunks in flight than the asking one (the paper uses 32 in-flight requests).
Balance: the asking worker takes no more than keeps it within `balance_spread` (32) chunks in flight
of the least loaded worker with room (`balanced_slots`): the paper's "least loaded" routing.
"""

from __future__ import annotations

from collections.abc import Iterator

from seerd.scheduler.base import (
    DEFAULT_BALANCE_SPREAD, Plan, QueuedRequest, Snapshot, admit, balanced_slots, chunk_budget, kv_need,
)

DEFAULT_STARVATION_S = 1800.0
DEFAULT_AFFINITY_SPREAD = DEFAULT_BALANCE_SPREAD
DEFAULT_STARVED_PER_CALL = 1


def seer_key(r: QueuedRequest) -> tuple:
    """Probes, shortest generated first; then continuations, oldest first; then new requests,
    longest group estimate first (see the module docstring)."""
    if r.is_probe:
        return (0, r.generated, r.queued_at)
    if r.generated > 0:
        return (1, r.queued_at)
    return (2, -r.group_estimate, r.queued_at)


class SeerPolicy:
    name = "seer"

    def __init__(self, starvation_s: float = DEFAULT_STARVATION_S,
                 affinity_spread: int = DEFAULT_AFFINITY_SPREAD,
                 starved_per_call: int = DEFAULT_STARVED_PER_CALL,
                 balance_spread: int = DEFAULT_BALANCE_SPREAD) -> None:
        self.starvation_s = starvation_s
        self.starved_per_call = starved_per_call
        self.balance_spread = balance_spread
        self.affinity_spread = affinity_spread

    def order(self, snapshot: Snapshot) -> Iterator[QueuedRequest]:
        """Every queued request in serving order, lazily (the heart of the policy; tested directly)."""
        starved: set[int] = set()
        for request in snapshot.queued.fcfs():  # oldest first: the starved are a prefix
            if (len(starved) >= self.starved_per_call
                    or snapshot.now - request.queued_at <= self.starvation_s):
                break
            starved.add(request.request_id)
            yield request
        for request in snapshot.queued.ordered("seer", seer_key):
            if request.request_id not in starved:
                yield request

    def plan(self, snapshot: Snapshot) -> Plan:
        limit = balanced_slots(snapshot, self.balance_spread)
        if limit <= 0:
            return Plan()  # skip ordering the whole queue for nothing
        asking = snapshot.worker(snapshot.worker_id)
        loads = snapshot.loads_by_id

        def belongs_elsewhere(request: QueuedRequest) -> bool:
            # Its previous worker holds its prefix: leave it there unless that one is much busier.
            if request.last_worker is None or request.last_worker == asking.worker_id:
                return False
            home = loads.get(request.last_worker)
            if home is None or home.running_chunks >= home.max_chunks:
                return False
            headroom = home.kv_capacity_tokens - home.reserved_kv_tokens
            return (headroom >= kv_need(request, chunk_budget(request, snapshot.chunk_tokens))
                    and home.running_chunks - asking.running_chunks <= self.affinity_spread
                    and snapshot.now - request.queued_at <= self.starvation_s)

        return admit(snapshot, self.order(snapshot), skip=belongs_elsewhere, limit=limit)
