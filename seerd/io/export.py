"""Write a run's responses to `rollouts.parquet` and `rollouts.jsonl`, atomically.

One row per ended response: finished, or failed (`finish_reason` "error", the engine's message in
`error`, the tokens it had generated). An unfinished run exports what has ended and says so, in
the returned result and in `rollouts.meta.json` (`"complete": false`).

Two exporters may meet: the coordinator's at the end of the run, and `seerd export` of the live
run (`export_snapshot`, which reads without the write lock and so no longer waits for the
coordinator). They write under one lock file, and a partial export never replaces a complete one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from sqlalchemy import select
from sqlalchemy.orm import Session

from seerd.db import Chunk, ChunkStatus, Group, Request, RequestStatus, RolloutStatus
from seerd.db.migrate import head_revisions
from seerd.db.read import UnreadableDatabase, latest_rollout, reading, schema_revision
from seerd.io.codec import unpack_floats, unpack_ints
from seerd.rundir import RunDir

SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("group_index", pa.int32()),
    ("response_index", pa.int32()),
    ("token_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())),
    ("finish_reason", pa.string()),
    ("length", pa.int32()),
    ("num_chunks", pa.int32()),
    ("prompt_len", pa.int32()),
    ("started_at", pa.float64()),
    ("finished_at", pa.float64()),
    ("generation_s", pa.float64()),  # summed wall time of the chunks that produced it
    ("error", pa.string()),  # why a failed response failed (the engine's message); null otherwise
])


@dataclass(frozen=True)
class ExportResult:
    responses: int  # ended: finished or failed
    responses_total: int
    failed: int = 0
    # False: a partial export found the complete one already written (the run finished meanwhile) and kept it.
    written: bool = True

    @property
    def complete(self) -> bool:
        return self.responses == self.responses_total


def collect_rows(session: Session, rollout_id: int) -> tuple[list[dict], int]:
    total = 0
    finished: dict[int, dict] = {}
    query = (
        select(Request, Group.prompt_id, Group.group_index, Group.prompt_len)
        .join(Group, Group.id == Request.group_id)
        .where(Request.rollout_id == rollout_id)
        .order_by(Group.group_index, Request.response_index)
    )
    for request, prompt_id, group_index, prompt_len in session.execute(query):
        total += 1
        if request.status not in (RequestStatus.FINISHED, RequestStatus.FAILED):
            continue
        finished[request.id] = {
            "prompt_id": prompt_id, "group_index": group_index, "response_index": request.response_index,
            "token_ids": [], "logprobs": [], "finish_reason": request.finish_reason,
            "length": request.generated_tokens, "num_chunks": request.num_chunks, "prompt_len": prompt_len,
            "started_at": request.started_at, "finished_at": request.finished_at, "generation_s": 0.0,
            "error": request.error,
        }
    chunks = session.execute(
        select(Chunk.request_id, Chunk.token_ids, Chunk.logprobs, Chunk.leased_at, Chunk.finished_at)
        .join(Request, Request.id == Chunk.request_id)
        .where(Request.rollout_id == rollout_id, Chunk.status == ChunkStatus.DONE)
        .order_by(Chunk.request_id, Chunk.seq)
    )
    for request_id, token_blob, logprob_blob, leased_at, finished_at in chunks:
        row = finished.get(request_id)
        if row is None:
            continue
        row["token_ids"].extend(unpack_ints(token_blob))
        row["logprobs"].extend(unpack_floats(logprob_blob))
        row["generation_s"] += (finished_at or 0.0) - (leased_at or 0.0)
    rows = list(finished.values())
    for row in rows:
        if len(row["token_ids"]) != row["length"]:
            raise RuntimeError(f"response {row['prompt_id']}/{row['response_index']}: "
                               f"{len(row['token_ids'])} tokens stored but {row['length']} counted")
    return rows, total


def write_outputs(run_dir: RunDir, rows: list[dict], total: int) -> ExportResult:
    result = ExportResult(len(rows), total, sum(row["finish_reason"] == "error" for row in rows))
    with _export_lock(run_dir):
        if not result.complete and _complete_export_written(run_dir):
            return replace(result, written=False)
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        _atomic(run_dir.parquet_path, lambda tmp: pq.write_table(table, tmp))
        _atomic(run_dir.jsonl_path, lambda tmp: tmp.write_text(
            "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)))
        meta = {"complete": result.complete, "responses": len(rows), "responses_total": total,
                "failed": result.failed, "exported_at": time.time()}
        _atomic(run_dir.meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
    return result


def export_run(session: Session, rollout_id: int, run_dir: RunDir) -> ExportResult:
    rows, total = collect_rows(session, rollout_id)
    return write_outputs(run_dir, rows, total)


def export_snapshot(run_dir: RunDir) -> tuple[ExportResult, RolloutStatus]:
    """Export a run, live or not, from one read transaction on its database opened read-only
    (`seerd.db.read`): never the write lock, so a live run's coordinator keeps committing. Returns
    the result and the run's status in that snapshot. UnreadableDatabase for a database this
    seerd cannot read, one of another schema included (readers never migrate)."""
    with reading(run_dir.db_path) as conn:
        revision, heads = schema_revision(conn), head_revisions()
        if revision not in heads:
            raise UnreadableDatabase(
                f"{run_dir.db_path} has schema {revision or 'none'}, this seerd reads {', '.join(heads)}: "
                f"bring it up with `seerd db upgrade {run_dir.path}` (or export with the seerd that made it)")
        rollout = latest_rollout(conn)
        if rollout is None:
            raise UnreadableDatabase(f"no run at {run_dir.path}: its creation did not complete (or never started); "
                                     f"`seerd run` with the run's arguments creates it there again")
        with Session(bind=conn) as session:
            rows, total = collect_rows(session, rollout.id)
    return write_outputs(run_dir, rows, total), rollout.status


@contextlib.contextmanager
def _export_lock(run_dir: RunDir) -> Iterator[None]:
    """One exporter at a time (an fcntl lock on a file of the run directory; NFS locks it too)."""
    fd = os.open(run_dir.path / ".export.lock", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _complete_export_written(run_dir: RunDir) -> bool:
    try:
        return json.loads(run_dir.meta_path.read_text()).get("complete") is True
    except (OSError, ValueError, AttributeError):
        return False


def _atomic(path: Path, write) -> None:  # noqa: ANN001
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.chmod(tmp, 0o600)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
