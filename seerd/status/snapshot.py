"""One status snapshot of a run, read from its database without disturbing the coordinator.

The database is opened read-only (`mode=ro`); in WAL mode a reader never blocks the writer, and
every frame is one short read transaction, so the coordinator's checkpoints are held back for
milliseconds at most. When the coordinator is reachable (its address file and the run's secret),
its status endpoint adds what only it knows (queue depth, leases, whether it is accepting);
otherwise the snapshot says so, which for a run the database calls "running" means the
coordinator is gone or hung.

The snapshot is a plain dict (`SCHEMA_VERSION`): `seerd status --json` prints it as is, and
`render` draws it. Field meanings are in docs/status.md.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.parse
from pathlib import Path

from seerd.config import heartbeat_interval
from seerd.protocol import StatusReply
from seerd.rundir import RunDir
from seerd.scheduler.base import QueuedRequest
from seerd.scheduler.forecast import expected_remaining, replay_growth
from seerd.tail import finishes_before_tail

SCHEMA_VERSION = 1
RATE_WINDOW_S = 30.0  # tokens/s now from finished chunks when workers send no live figures
STALE_HEARTBEATS = 3  # a worker this many heartbeat intervals silent is highlighted


class UnknownRun(RuntimeError):
    """No run database at the given place."""


def open_read_only(db_path: Path) -> sqlite3.Connection:
    if not db_path.is_file():
        raise UnknownRun(f"no seerd run at {db_path.parent} (no {db_path.name})")
    # Quoted: a path with "?", "#" or spaces must not be read as URI syntax.
    conn = sqlite3.connect(f"file:{urllib.parse.quote(str(db_path))}?mode=ro", uri=True, timeout=2.0,
                           isolation_level=None)
    conn.row_factory = sqlite3.Row
    return conn


def read_snapshot(run_dir: Path, *, tail_rows: int = 50, now: float | None = None,
                  coordinator: StatusReply | None = None) -> dict:
    """The run's state now. `coordinator` is the status endpoint's answer, or None if unreachable."""
    now = time.time() if now is None else now
    conn = open_read_only(RunDir(run_dir).db_path)
    try:
        conn.execute("begin")  # one consistent view for the whole frame
        try:
            snapshot = _read(conn, run_dir, tail_rows, now)
        finally:
            conn.execute("commit")
    except sqlite3.OperationalError as exc:
        if "no such table" in str(exc):
            raise UnknownRun(f"{run_dir} has a database without a rollout in it ({exc})") from None
        raise
    finally:
        conn.close()
    snapshot["coordinator"] = _coordinator_part(coordinator)
    return snapshot


def _coordinator_part(answer: StatusReply | None) -> dict:
    if answer is None:
        return {"reachable": False}
    return {"reachable": True, "accepting": answer.accepting, "leases": answer.leases,
            "workers_alive": answer.workers_alive, "busy_s": answer.coordinator_busy_s,
            "kv_pool": answer.kv_pool}


def _read(conn: sqlite3.Connection, run_dir: Path, tail_rows: int, now: float) -> dict:
    rollout = conn.execute("select * from rollouts order by id desc limit 1").fetchone()
    if rollout is None:
        raise UnknownRun(f"{run_dir} has no rollout yet")
    rid = rollout["id"]
    config = json.loads(rollout["config_json"] or "{}")
    ended = rollout["finished_at"] if rollout["status"] in ("finished", "failed") else None
    clock = ended or now  # a finished run's figures stop at its end
    workers = _workers(conn, rid, clock, float(config.get("lease_ttl_s", 30.0)))
    live = {int(cid): entry for w in workers for cid, entry in w.pop("live_running").items()}

    counts = conn.execute("""
        select count(*) total, sum(status = 'finished') done, sum(status = 'running') running,
               sum(generated_tokens) tokens, min(started_at) first_start
        from requests where rollout_id = ?""", (rid,)).fetchone()
    groups = conn.execute("""select count(*) total, sum(finished_requests >= n) done
                             from prompt_groups where rollout_id = ?""", (rid,)).fetchone()
    requests_total, requests_done = counts["total"] or 0, counts["done"] or 0
    committed = counts["tokens"] or 0
    tail, tail_total, in_flight = _tail(conn, rid, clock, live, tail_rows)
    output_tokens = committed + in_flight
    started = counts["first_start"] or rollout["started_at"]
    generating = (clock - started) if started else 0.0
    rate_now = None if ended else _rate_now(conn, rid, clock, workers)
    remaining = _expected_remaining_tokens(conn, rid, live)
    return {
        "schema": SCHEMA_VERSION,
        "run_dir": str(run_dir),
        "rollout_id": rid,
        "policy": rollout["policy"],
        "state": rollout["status"],
        "state_reason": rollout["status_reason"],
        "now": now,
        "created_at": rollout["created_at"],
        "finished_at": ended,
        "elapsed_s": clock - rollout["created_at"],
        # Unknown rather than "0 s" when every unfinished request is past its forecast.
        "eta_s": remaining / rate_now if rate_now and remaining and requests_done < requests_total else None,
        "tokens_per_s_now": rate_now,
        "tokens_per_s_avg": output_tokens / generating if generating > 0 else None,
        "groups_total": groups["total"] or 0,
        "groups_done": groups["done"] or 0,
        "requests_total": requests_total,
        "requests_done": requests_done,
        "requests_running": counts["running"] or 0,
        "output_tokens": output_tokens,
        "output_tokens_committed": committed,
        "output_tokens_expected": output_tokens + remaining,
        "tail_phase": _tail_phase(conn, rid, requests_total, requests_done, clock),
        "tail": tail,
        "tail_total": tail_total,
        "workers": workers,
    }


def _workers(conn: sqlite3.Connection, rid: int, clock: float, lease_ttl_s: float) -> list[dict]:
    stale_after = STALE_HEARTBEATS * heartbeat_interval(lease_ttl_s)
    # Databases from before migration 0004 have no stats: read-only, the reader cannot upgrade them.
    has_stats = any(col["name"] == "stats_json" for col in conn.execute("pragma table_info(workers)"))
    rows = conn.execute(f"""
        select w.id, w.rank, w.status, w.max_chunks, w.kv_capacity_tokens, w.last_heartbeat,
               {'w.stats_json' if has_stats else 'null stats_json'},
               (select count(*) from chunks c where c.status = 'leased' and c.lease_holder = w.id) running,
               (select coalesce(sum(g.prompt_len + r.generated_tokens + c.max_tokens), 0)
                  from chunks c join requests r on r.id = c.request_id join prompt_groups g on g.id = r.group_id
                 where c.status = 'leased' and c.lease_holder = w.id) kv_reserved
        from workers w where w.rollout_id = ? order by w.rank, w.registered_at""", (rid,)).fetchall()
    workers = []
    for row in rows:
        stats = json.loads(row["stats_json"]) if row["stats_json"] else {}
        age = max(0.0, clock - row["last_heartbeat"])
        spec = stats.get("spec")
        pool = stats.get("kv_pool")
        workers.append({
            "worker_id": row["id"],
            "rank": row["rank"],
            "state": row["status"],
            "heartbeat_age_s": age,
            "stale": row["status"] != "alive" or age > stale_after,
            "running_chunks": row["running"],
            "max_chunks": row["max_chunks"],
            "kv_reserved_tokens": row["kv_reserved"],
            "kv_capacity_tokens": row["kv_capacity_tokens"],
            "kv_usage": stats.get("kv_usage"),
            "tokens_per_s": stats.get("tokens_per_s_recent"),
            "chunks_done": stats.get("chunks_done"),
            "tokens_out": stats.get("tokens_out"),
            "spec": _spec_part(spec) if spec else None,
            "kv_pool": _pool_part(pool) if pool else None,
            "live_running": stats.get("running") or {} if row["status"] == "alive" else {},
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
            "bytes_loaded": int(pool.get("bytes_loaded", 0)), "bytes_saved": int(pool.get("bytes_saved", 0)),
            "load_s": float(pool.get("load_s", 0.0)), "save_s": float(pool.get("save_s", 0.0)),
            "connected": bool(pool.get("reconnects", 0)) and int(pool.get("generation", 0)) > 0}


def _tail(conn: sqlite3.Connection, rid: int, clock: float, live: dict[int, dict],
          limit: int) -> tuple[list[dict], int, int]:
    """Running requests (a chunk leased), longest so far first; and the tokens of running chunks."""
    rows = conn.execute("""
        select r.id, r.response_index, r.is_probe, r.generated_tokens, r.num_chunks, r.queued_at,
               g.group_index, g.n, g.finished_requests, g.length_estimate,
               c.id chunk_id, c.lease_holder, c.leased_at,
               (select max(d.finished_at) from chunks d where d.request_id = r.id and d.status = 'done') last_done
        from requests r join prompt_groups g on g.id = r.group_id
        join chunks c on c.request_id = r.id and c.status = 'leased'
        where r.rollout_id = ? and r.status = 'running'""", (rid,)).fetchall()
    tail, in_flight = [], 0
    for row in rows:
        entry = live.get(row["chunk_id"])
        running_tokens = int(entry["tokens"]) if entry else 0
        in_flight += running_tokens
        last_progress = max(row["last_done"] or 0.0, row["leased_at"] or 0.0,
                            float(entry["changed_at"]) if entry and running_tokens else 0.0)
        tail.append({
            "request_id": row["id"],
            "group_index": row["group_index"],
            "response_index": row["response_index"],
            "probe": bool(row["is_probe"]),
            "tokens": row["generated_tokens"] + running_tokens,
            "chunks": row["num_chunks"] + 1,
            "worker": row["lease_holder"],
            "group_estimate": row["length_estimate"],
            "group_finished": row["finished_requests"],
            "group_size": row["n"],
            "since_progress_s": max(0.0, clock - last_progress),
        })
    tail.sort(key=lambda t: (-t["tokens"], t["request_id"]))
    return tail[:limit], len(tail), in_flight


def _rate_now(conn: sqlite3.Connection, rid: int, clock: float, workers: list[dict]) -> float | None:
    """Output tokens/s now: the workers' own recent rates (they count tokens as they come), else
    tokens of chunks finished in the last RATE_WINDOW_S."""
    rates = [w["tokens_per_s"] for w in workers if not w["stale"] and w["tokens_per_s"] is not None]
    if rates:
        return sum(rates)
    (tokens,) = conn.execute("""
        select coalesce(sum(c.num_tokens), 0) from chunks c join requests r on r.id = c.request_id
        where r.rollout_id = ? and c.status = 'done' and c.finished_at >= ?""", (rid, clock - RATE_WINDOW_S)).fetchone()
    return tokens / RATE_WINDOW_S


def _expected_remaining_tokens(conn: sqlite3.Connection, rid: int, live: dict[int, dict]) -> int:
    """Tokens the unfinished requests are still expected to generate, by seer's own forecast
    (seerd/scheduler/forecast.py, its growth table replayed from the finishes so far): the group's
    longest finished response scaled by how groups of this run grew after as many finishes, else
    max_tokens. For the time left only; a request already past its forecast counts nothing, so
    in the tail the figure is a floor."""
    sizes = dict(conn.execute("select id, n from prompt_groups where rollout_id = ?", (rid,)).fetchall())
    finishes = conn.execute("""select group_id, generated_tokens from requests
                               where rollout_id = ? and status = 'finished' order by finished_at, id""", (rid,))
    growth = replay_growth(finishes, sizes)[0].current
    rows = conn.execute("""
        select r.id, r.group_id, r.generated_tokens, g.finished_requests, g.length_estimate, g.max_tokens, g.n,
               (select c.id from chunks c where c.request_id = r.id and c.status = 'leased') chunk_id
        from requests r join prompt_groups g on g.id = r.group_id
        where r.rollout_id = ? and r.status != 'finished'""", (rid,)).fetchall()
    so_far = {row["id"]: row["generated_tokens"] + int((live.get(row["chunk_id"]) or {}).get("tokens", 0))
              for row in rows}
    longest_unfinished: dict[int, int] = {}
    for row in rows:
        longest_unfinished[row["group_id"]] = max(longest_unfinished.get(row["group_id"], 0), so_far[row["id"]])
    remaining = 0
    for row in rows:
        view = QueuedRequest(row["id"], row["group_id"], 0, 0, 0, so_far[row["id"]], row["max_tokens"], False,
                             row["length_estimate"], None, 0.0, row["n"], row["finished_requests"],
                             longest_unfinished[row["group_id"]])
        remaining += expected_remaining(view, growth)
    return remaining


def _tail_phase(conn: sqlite3.Connection, rid: int, total: int, done: int, clock: float) -> dict | None:
    """From the finish that took the run past 90% of its requests, to now (or the end)."""
    threshold = finishes_before_tail(total)
    if total == 0 or done < threshold:
        return None
    (started,) = conn.execute("""select finished_at from requests where rollout_id = ? and status = 'finished'
                                 order by finished_at limit 1 offset ?""", (rid, threshold - 1)).fetchone()
    last = clock if done < total else conn.execute(
        "select max(finished_at) from requests where rollout_id = ?", (rid,)).fetchone()[0]
    return {"started_at": started, "duration_s": max(0.0, last - started), "requests_left": total - done}
