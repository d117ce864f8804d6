"""`divided`: request- and chunk-level scheduling, first come first served, no length context.

Every request is an independent unit; after each chunk it goes back to the buffer. A worker is
given chunks while it has free sequence slots and KV room for each chunk's whole context plus its
budget, so admitted chunks never exceed the engine's KV (no preemption by construction).
"""

from __future__ import annotations

from seerd.scheduler.base import Plan, Snapshot, admit


class DividedPolicy:
    name = "divided"

    def plan(self, snapshot: Snapshot) -> Plan:
        return admit(snapshot, snapshot.queued.fcfs())
