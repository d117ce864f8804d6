"""`group`: the veRL baseline. Whole groups are bound to workers round-robin, never chunked.

veRL splits the batch across data-parallel ranks up front and hands each engine its whole share;
the engine batches continuously and preempts (recomputes) when its KV runs out. So this policy
ignores the worker's free slots and KV budget on purpose: vLLM's own scheduler queues the rest.
Bindings are made once for all groups (group i -> live worker i mod W, workers ordered by rank);
a group whose worker is gone is bound again the same way over the live workers.
"""

from __future__ import annotations

from seerd.scheduler.views import Assignment, Plan, Snapshot


class GroupPolicy:
    name = "group"

    def plan(self, snapshot: Snapshot) -> Plan:
        live = sorted(snapshot.workers, key=lambda w: (w.rank, w.worker_id))
        live_ids = {w.worker_id for w in live}
        unbound = sorted(
            (gid for gid in snapshot.group_indices if snapshot.group_binding.get(gid) not in live_ids),
            key=lambda gid: snapshot.group_indices[gid],
        )
        new_bindings = {
            gid: live[snapshot.group_indices[gid] % len(live)].worker_id for gid in unbound
        }
        binding = {**snapshot.group_binding, **new_bindings}
        assignments = tuple(
            Assignment(r.request_id, snapshot.worker_id, r.remaining)
            for r in sorted(snapshot.queued, key=lambda r: (r.group_index, r.response_index))
            if binding.get(r.group_id) == snapshot.worker_id
        )
        return Plan(assignments, new_bindings)
