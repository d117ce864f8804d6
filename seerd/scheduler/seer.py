"""`seer`: context-aware scheduling, the Seer paper's Algorithm 2, on divided rollout.

Each time a worker asks for work, queued requests are served in this order:
1. starved requests: queued longer than `starvation_s`, oldest first. This is the anti-starvation
   bound: no queued request waits longer than `starvation_s` plus the time until a worker with
   room asks (the paper only says "occasionally serve underserved groups").
2. probes (one speculative request per group), shortest generated length first: short probes
   finish and leave, long ones reveal the tail groups early;
3. the rest, longest group estimate first (the estimate is the group's longest finished response,
   or its max_tokens while none has finished), then the furthest along, then the oldest.
Chunks are admitted only while the worker has free sequence slots and KV room for the chunk's
whole context plus its budget; if the next request in order does not fit, nothing more is
admitted this call (no preemption by construction, no reordering around the head).
Affinity: a request whose previous chunk ran on another live worker with free slots is left for
that worker (its prefix cache holds the request), unless that worker has `affinity_spread` more
chunks in flight than the asking one (the paper uses 32 in-flight requests).
"""

from __future__ import annotations

from seerd.scheduler.base import Plan, QueuedRequest, Snapshot, admit, free_slots

DEFAULT_STARVATION_S = 300.0
DEFAULT_AFFINITY_SPREAD = 32


class SeerPolicy:
    name = "seer"

    def __init__(self, starvation_s: float = DEFAULT_STARVATION_S,
                 affinity_spread: int = DEFAULT_AFFINITY_SPREAD) -> None:
        self.starvation_s = starvation_s
        self.affinity_spread = affinity_spread

    def order(self, snapshot: Snapshot) -> list[QueuedRequest]:
        """Every queued request in serving order (the heart of the policy; tested directly)."""
        def key(r: QueuedRequest) -> tuple:
            if snapshot.now - r.queued_at > self.starvation_s:
                return (0, r.queued_at, 0, 0, r.request_id)
            if r.is_probe:
                return (1, r.generated, r.queued_at, 0, r.request_id)
            return (2, -r.group_estimate, -r.generated, r.queued_at, r.request_id)

        return sorted(snapshot.queued, key=key)

    def plan(self, snapshot: Snapshot) -> Plan:
        if free_slots(snapshot) <= 0:
            return Plan()  # skip ordering the whole queue for nothing
        asking = snapshot.worker(snapshot.worker_id)
        others = {w.worker_id: w for w in snapshot.workers if w.worker_id != snapshot.worker_id}

        def belongs_elsewhere(request: QueuedRequest) -> bool:
            # Its previous worker holds its prefix: leave it there unless that one is much busier.
            home = others.get(request.last_worker or "")
            return (home is not None and home.running_chunks < home.max_chunks
                    and home.running_chunks - asking.running_chunks <= self.affinity_spread
                    and snapshot.now - request.queued_at <= self.starvation_s)

        return admit(snapshot, self.order(snapshot), skip=belongs_elsewhere)
