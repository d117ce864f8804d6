"""What the coordinator cost a run: its share of the generation phase in CPU time, its commits,
its API calls and state-thread turns (`coordinator_load` events, `seerd run`'s summary,
`tools/bench/load.py`)."""

from __future__ import annotations

from seerd.book.book import LeaseBook
from seerd.coordinator.heap import HeapKeeper
from seerd.cpu import CpuSnapshot
from seerd.db.base import CommitTimes
from seerd.server.control import CoordinatorControl


def coordinator_load(book: LeaseBook, control: CoordinatorControl, heap: HeapKeeper, *, started_at: float,
                     cpu_started: CpuSnapshot, now: float, export_s: float) -> dict:
    """The coordinator's share of the generation phase, in CPU time of this process.

    Engines take tens of seconds to start; the share that matters is of the generation phase, from
    the first lease to the report that finished the last request: CPU time of this process (API,
    scheduling, commits) then, while the engines generate. The export after it runs alone and is
    `cpu_s` minus that. Handler wall times would overlap under concurrency."""
    cpu_now = CpuSnapshot.now()
    wall = max(now - started_at, 1e-9)
    started = book.first_lease_cpu or cpu_started
    ended_at, ended = book.completed_at or now, book.completed_cpu or cpu_now
    generating = max(ended_at - (book.first_lease_at or started_at), 1e-9)
    generation_cpu = ended.process_s - started.process_s
    cpu = cpu_now.process_s - started.process_s
    return {"wall_s": wall, "generation_s": generating, "cpu_s": cpu, "generation_cpu_s": generation_cpu,
            "generation_cpu_by_thread_s": ended.since(started),
            "api_wall_s": control.busy_s, "export_s": export_s, "api_calls": control.calls,
            "cpu_share": generation_cpu / generating,
            "longest_commit_s": CommitTimes.longest_s, "slow_commits": CommitTimes.slow,
            "durable_commits": CommitTimes.durable, "relaxed_commits": CommitTimes.relaxed,
            **_wal_sync_figures(control),
            "report_commits": control.report_commits, "reports_committed": control.reports_committed,
            "server_calls": control.latencies.figures(), "state_turns": control.turns.figures(),
            "largest_state_turn": control.largest_turn,
            "state_turn_seconds": {kind: dict(zip(("wall", "cpu", "run_queue", "slices"),
                                                  (round(v, 2) for v in seconds)))
                                   for kind, seconds in control.turn_seconds.items()},
            "slowest_state_turns": control.slow_turns.figures(),
            "slow_checkpoints": [{"at_s": round(control.slow_turns.since_first(at), 2), "ms": round(1e3 * s, 1)}
                                 for at, s in book.writer.slow_checkpoints],
            "lease_plans": control.lease_plans.figures(), **heap.figures()}


def _wal_sync_figures(control: CoordinatorControl) -> dict:
    syncer = control.wal_syncer
    if syncer is None:
        return {}
    return {"wal_syncs": syncer.syncs, "wal_sync_s": syncer.sync_s, "longest_wal_sync_s": syncer.longest_sync_s}
