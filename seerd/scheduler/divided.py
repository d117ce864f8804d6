"""`divided`: request- and chunk-level scheduling, first come first served, no length context.

Every request is an independent unit; after each chunk it goes back to the buffer. A worker is
given chunks while it has free sequence slots and KV room for each chunk's whole context plus its
budget (lean chunks under KV pressure, a shorter chunk where only that fits: `base.admit`), so admitted chunks never exceed the engine's KV (no preemption by construction), and
while it stays within 32 chunks in flight of the least loaded worker with room, as long as the
queue cannot fill every worker (`balanced_slots`).
A request whose engine request runs on at the asking worker (in-place continuation) comes first:
FCFS decides which request starts, not which running one is stopped at a boundary
(`base.continuing_first`).
"""

from __future__ import annotations

from seerd.scheduler.base import DEFAULT_BALANCE_SPREAD, admit, balanced_slots, continuing_first
from seerd.scheduler.views import Plan, Snapshot


class DividedPolicy:
    name = "divided"

    def __init__(self, balance_spread: int = DEFAULT_BALANCE_SPREAD) -> None:
        self.balance_spread = balance_spread

    def plan(self, snapshot: Snapshot) -> Plan:
        limit = balanced_slots(snapshot, self.balance_spread)
        if limit <= 0:
            return Plan()
        return admit(snapshot, continuing_first(snapshot, snapshot.queued.fcfs()), limit=limit)
