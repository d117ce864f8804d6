"""`divided`: request- and chunk-level scheduling, first come first served, no length context.

Every request is an independent unit; after each chunk it goes back to the buffer. A worker is
given chunks while it has free sequence slots and KV room for each chunk's whole context plus its
budget, so admitted chunks never exceed the engine's KV (no preemption by construction).
"""

from __future__ import annotations

from seerd.scheduler.base import Assignment, Plan, Snapshot, chunk_budget, kv_need


class DividedPolicy:
    name = "divided"

    def plan(self, snapshot: Snapshot) -> Plan:
        load = snapshot.worker(snapshot.worker_id)
        slots = min(snapshot.wanted, load.max_chunks - load.running_chunks)
        kv_free = load.kv_capacity_tokens - load.reserved_kv_tokens
        assignments: list[Assignment] = []
        for request in snapshot.queued.fcfs():
            if len(assignments) >= slots:
                break
            budget = chunk_budget(request, snapshot.chunk_tokens)
            need = kv_need(request, budget)
            if need > kv_free:
                # FCFS: do not let later, smaller chunks overtake the head of the queue.
                break
            kv_free -= need
            assignments.append(Assignment(request.request_id, snapshot.worker_id, budget))
        return Plan(tuple(assignments))
