"""One status snapshot of a run, read from its database without disturbing the coordinator.

The database is opened read-only (`seerd.db.read.open_read_only`: `mode=ro`, or `immutable=1`
for a finished run in a directory we may not write) and read with `seerd.db.read`'s queries; in
WAL mode a reader never blocks the writer, and every frame is one short read transaction, so the
coordinator's checkpoints are held back for milliseconds at most. The time left comes from the
forecast the coordinator persists per group (`prompt_groups.forecast_tokens`): status reads it,
it does not run the scheduler. When the coordinator is reachable (its address file and the run's
secret), its status endpoint adds what only it knows (queue depth, leases, whether it is
accepting); otherwise the snapshot says so, which for a run the database calls "running" means
the coordinator is gone or hung.

The snapshot is a plain dict (`SCHEMA_VERSION`): `seerd status --json` prints it as is, and
`render` draws it. Field meanings are in docs/status.md.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING


from seerd.db import Connection, RolloutStatus, WorkerStatus, queries, read
from seerd.db.queries.requests import UnfinishedRequest
from seerd.protocol import StatusReply, heartbeat_interval
from seerd.rundir import RunDir
from seerd.tail import finishes_before_tail

if TYPE_CHECKING:
    from seerd.ownership import Ownership

SCHEMA_VERSION = 1
READ_BUSY_TIMEOUT_MS = 2_000  # waits this long for a locked database, then says it cannot read it
RATE_WINDOW_S = 30.0  # tokens/s now from finished chunks when workers send no live figures
STALE_HEARTBEATS = 3  # a worker this many heartbeat intervals silent is highlighted
WORKER_EXITS_SHOWN = 5  # the latest worker process exits a snapshot carries


class UnknownRun(RuntimeError):
    """No run database at the given place."""


def read_snapshot(run_dir: Path, *, tail_rows: int = 50, now: float | None = None,
                  coordinator: StatusReply | None = None, ownership: Ownership | None = None) -> dict:
    """The run's state now. `coordinator` is the status endpoint's answer, or None if unreachable;
    `ownership`: the coordinator's own, when it reads for another host (`seerd.db.read.reading`).

    Raises UnknownRun (no run there) or seerd.db.read.UnreadableDatabase (its subclass
    DatabaseInUseElsewhere when another host's coordinator writes it on a network filesystem)."""
    now = time.time() if now is None else now
    db_path = RunDir(run_dir).db_path
    if not db_path.is_file():
        raise UnknownRun(f"no seerd run at {db_path.parent} (no {db_path.name})")
    with read.reading(db_path, busy_timeout_ms=READ_BUSY_TIMEOUT_MS, ownership=ownership) as conn:  # one view
        if "rollouts" not in read.table_names(conn):
            raise UnknownRun(f"{run_dir} has a database without a rollout in it (no rollouts table)")
        snapshot = _read(conn, run_dir, tail_rows, now)
    snapshot["coordinator"] = _coordinator_part(coordinator)
    return snapshot


def _coordinator_part(answer: StatusReply | None) -> dict:
    if answer is None:
        return {"reachable": False}
    return {"reachable": True, "accepting": answer.accepting, "leases": answer.leases,
            "workers_alive": answer.workers_alive, "busy_s": answer.coordinator_busy_s,
            "kv_pool": answer.kv_pool}


def _read(conn: Connection, run_dir: Path, tail_rows: int, now: float) -> dict:
    rollout = queries.rollouts.latest(conn)
    if rollout is None:
        raise UnknownRun(f"{run_dir} has no rollout yet")
    rid = rollout.id
    config = json.loads(rollout.config_json or "{}")
    ended = rollout.finished_at if rollout.status in (RolloutStatus.FINISHED, RolloutStatus.FAILED) else None
    clock = ended or now  # a finished run's figures stop at its end
    workers = _workers(conn, rid, clock, float(config.get("lease_ttl_s", 30.0)))
    live = {int(cid): entry for w in workers for cid, entry in w.pop("live_running").items()}

    counts = queries.requests.counts(conn, rid)
    groups = queries.groups.counts(conn, rid)
    requests_total, requests_done, requests_failed = counts.total or 0, counts.done or 0, counts.failed or 0
    committed = counts.tokens or 0
    unfinished = queries.requests.unfinished(conn, rid)
    tail, tail_total, in_flight = _tail(unfinished, clock, live, tail_rows)
    output_tokens = committed + in_flight
    started = counts.first_start or rollout.started_at
    generating = (clock - started) if started else 0.0
    rate_now = None if ended else _rate_now(conn, rid, clock, workers)
    remaining = _expected_remaining_tokens(unfinished, live)
    return {
        "schema": SCHEMA_VERSION,
        "run_dir": str(run_dir),
        "rollout_id": rid,
        "policy": rollout.policy,
        "state": rollout.status.value,
        "state_reason": rollout.status_reason,
        "now": now,
        "created_at": rollout.created_at,
        "finished_at": ended,
        "elapsed_s": clock - rollout.created_at,
        # Unknown rather than "0 s" when every unfinished request is past its forecast.
        "eta_s": (remaining / rate_now if rate_now and remaining and requests_done + requests_failed < requests_total
                  else None),
        "tokens_per_s_now": rate_now,
        "tokens_per_s_avg": output_tokens / generating if generating > 0 else None,
        "groups_total": groups.total or 0,
        "groups_done": groups.done or 0,
        "requests_total": requests_total,
        "requests_done": requests_done,
        "requests_running": counts.running or 0,
        "requests_failed": requests_failed,  # ended without finishing (the engine failed them)
        "output_tokens": output_tokens,
        "output_tokens_committed": committed,
        "output_tokens_expected": output_tokens + remaining,
        "tail_phase": _tail_phase(conn, rid, requests_total, requests_done, clock),
        "tail": tail,
        "tail_total": tail_total,
        "workers": workers,
        # Worker processes that exited before the run was done: signal, meaning, fix, log tail.
        "worker_exits": queries.events.worker_exits(conn, rid, WORKER_EXITS_SHOWN),
        # True when the coordinator read this for a host that may not open the database (status.locate).
        "read_through_coordinator": False,
    }


def _workers(conn: Connection, rid: int, clock: float, lease_ttl_s: float) -> list[dict]:
    rows = queries.workers.loads(conn, rid)
    # The interval the coordinator gives its workers follows how many are alive.
    alive_count = sum(row.status == WorkerStatus.ALIVE for row in rows)
    stale_after = STALE_HEARTBEATS * heartbeat_interval(lease_ttl_s, alive_count)
    workers = []
    taken_out = queries.events.taken_out_workers(conn, rid)
    for row in rows:
        stats = json.loads(row.stats_json) if row.stats_json else {}
        age = max(0.0, clock - row.last_heartbeat)
        spec = stats.get("spec")
        pool = stats.get("kv_pool")
        alive = row.status == WorkerStatus.ALIVE
        workers.append({
            "worker_id": row.id,
            "rank": row.rank,
            "state": row.status.value,
            "taken_out": taken_out.get(row.id),  # why the coordinator took it out, if it did
            "heartbeat_age_s": age,
            "stale": not alive or age > stale_after,
            "running_chunks": row.running,
            "max_chunks": row.max_chunks,
            "kv_reserved_tokens": row.kv_reserved,
            "kv_capacity_tokens": row.kv_capacity_tokens,
            "kv_usage": stats.get("kv_usage"),
            "tokens_per_s": stats.get("tokens_per_s_recent"),
            "chunks_done": stats.get("chunks_done"),
            "tokens_out": stats.get("tokens_out"),
            "spec": _spec_part(spec) if spec else None,
            "kv_pool": _pool_part(pool) if pool else None,
            "engine": stats.get("engine"),  # the engine scheduler's steps, preemptions, mean running
            "cpu": stats.get("cpu"),  # the worker's event loop and process CPU seconds
            "live_running": stats.get("running") or {} if alive else {},
        })
    return workers


def _spec_part(spec: dict) -> dict:
    drafted, accepted = int(spec.get("drafted", 0)), int(spec.get("accepted", 0))
    return {"drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None}


def _pool_part(pool: dict) -> dict:
    """A worker's KV pool figures: of the full blocks its chunks' contexts had beyond its own
    prefix cache, how many the pool held (hit rate); blocks and bytes moved each way."""
    asked, hits = int(pool.get("lookup_blocks", 0)), int(pool.get("hit_blocks", 0))
    return {"hit_rate": hits / asked if asked else None, "blocks_loaded": int(pool.get("blocks_loaded", 0)),
            "blocks_saved": int(pool.get("blocks_saved", 0)), "load_failures": int(pool.get("load_failures", 0)),
            "blocks_rejected": int(pool.get("blocks_rejected", 0)),  # failed their MAC: forged or corrupted
            "bytes_loaded": int(pool.get("bytes_loaded", 0)), "bytes_saved": int(pool.get("bytes_saved", 0)),
            "load_s": float(pool.get("load_s", 0.0)), "save_s": float(pool.get("save_s", 0.0)),
            "connected": bool(pool.get("reconnects", 0)) and int(pool.get("generation", 0)) > 0}


def _tail(unfinished: list[UnfinishedRequest], clock: float, live: dict[int, dict],
          limit: int) -> tuple[list[dict], int, int]:
    """Running requests (a chunk leased), longest so far first; and the tokens of running chunks."""
    tail, in_flight = [], 0
    for row in unfinished:
        if not row.running or row.chunk_id is None:
            continue
        entry = live.get(row.chunk_id)
        running_tokens = int(entry["tokens"]) if entry else 0
        in_flight += running_tokens
        last_progress = max(row.last_done or 0.0, row.leased_at or 0.0,
                            float(entry["changed_at"]) if entry and running_tokens else 0.0)
        tail.append({
            "request_id": row.id,
            "group_index": row.group_index,
            "response_index": row.response_index,
            "probe": bool(row.is_probe),
            "tokens": row.generated_tokens + running_tokens,
            "chunks": row.num_chunks + 1,
            "worker": row.lease_holder,
            "group_estimate": row.group_estimate,
            "group_finished": row.group_finished,
            "group_size": row.group_size,
            "since_progress_s": max(0.0, clock - last_progress),
        })
    tail.sort(key=lambda t: (-t["tokens"], t["request_id"]))
    return tail[:limit], len(tail), in_flight


def _rate_now(conn: Connection, rid: int, clock: float, workers: list[dict]) -> float | None:
    """Output tokens/s now: the workers' own recent rates (they count tokens as they come), else
    tokens of chunks finished in the last RATE_WINDOW_S."""
    rates = [w["tokens_per_s"] for w in workers if not w["stale"] and w["tokens_per_s"] is not None]
    if rates:
        return sum(rates)
    return queries.chunks.tokens_done_since(conn, rid, clock - RATE_WINDOW_S) / RATE_WINDOW_S


def _expected_remaining_tokens(unfinished: list[UnfinishedRequest], live: dict[int, dict]) -> int:
    """Tokens the unfinished requests are still expected to generate: each up to its group's
    forecast as the coordinator persisted it (`seerd.db.queries.groups.group_forecast`: what seer schedules
    by, else the group's length estimate), less its tokens so far (committed plus its running
    chunk's progress). For the time left only; a request already past its forecast counts
    nothing, so in the tail the figure is a floor."""
    remaining = 0
    for row in unfinished:
        so_far = row.generated_tokens + int((live.get(row.chunk_id) or {}).get("tokens", 0))
        remaining += max(0, row.group_forecast - so_far)
    return remaining


def _tail_phase(conn: Connection, rid: int, total: int, done: int, clock: float) -> dict | None:
    """From the finish that took the run past 90% of its requests, to now (or the end)."""
    threshold = finishes_before_tail(total)
    if total == 0 or done < threshold:
        return None
    started = queries.requests.nth_finish_at(conn, rid, threshold)
    last = clock if done < total else queries.requests.last_finish_at(conn, rid)
    return {"started_at": started, "duration_s": max(0.0, last - started), "requests_left": total - done}
