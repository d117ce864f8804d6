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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from seerd.db import ChunkStatus, Connection, RolloutStatus, Row, Session, queries
from seerd.db.codec import unpack_floats, unpack_ints
from seerd.db.migrate import head_revisions
from seerd.db.read import UnreadableDatabase, reading, schema_revision
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


# Groups read, checked and written per batch: the export holds this many groups' tokens however
# large the run (all of them as Python lists took 1.8 GB at 100,000 responses).
EXPORT_GROUPS = 64
EXPORT_BATCH = 512  # rows per parquet row group and JSONL write


@dataclass(frozen=True)
class ResponseRows:
    """The ended responses of a run in (group, response) order: counted up front, read in batches
    while they are iterated (within the read transaction they came from)."""

    ended: int
    failed: int
    batches: Callable[[], Iterator[list[dict]]]

    def __len__(self) -> int:
        return self.ended

    def __iter__(self) -> Iterator[dict]:
        for batch in self.batches():
            yield from batch

    @classmethod
    def of(cls, rows: list[dict]) -> ResponseRows:
        return cls(len(rows), sum(row["finish_reason"] == "error" for row in rows), lambda: iter([rows]))


def collect_rows(conn: Connection, rollout_id: int) -> tuple[ResponseRows, int]:
    """The run's ended responses (iterate them in the same transaction) and its response count."""
    total, ended_count, failed = queries.requests.ended_counts(conn, rollout_id)
    return ResponseRows(ended_count, failed, lambda: _row_batches(conn, rollout_id)), total


def _row_batches(conn: Connection, rollout_id: int) -> Iterator[list[dict]]:
    """Batches of `EXPORT_GROUPS` groups, each read by its unique index (rollout, group index)."""
    after = -1  # the last group index read
    while True:
        groups = queries.groups.page(conn, rollout_id, after, EXPORT_GROUPS)
        if not groups:
            return
        after = groups[-1].group_index
        yield group_rows(conn, groups)


def group_rows(conn: Connection, groups: Sequence[Row]) -> list[dict]:
    """The ended responses of `groups` (id, prompt_id, group_index, prompt_len) as export rows, in
    (group, response) order."""
    by_id = {group.id: group for group in groups}
    requests = queries.responses.ended_of_groups(conn, list(by_id))
    batch = {request.id: {
        "prompt_id": by_id[request.group_id].prompt_id, "group_index": by_id[request.group_id].group_index,
        "response_index": request.response_index, "token_ids": [], "logprobs": [],
        "finish_reason": request.finish_reason, "length": request.generated_tokens,
        "num_chunks": request.num_chunks, "prompt_len": by_id[request.group_id].prompt_len,
        "started_at": request.started_at, "finished_at": request.finished_at, "generation_s": 0.0,
        "error": request.error,
    } for request in requests}
    for request_id, status, token_blob, logprob_blob, leased_at, finished_at in \
            queries.responses.chunks_of_requests(conn, list(batch)):
        if status != ChunkStatus.DONE:
            continue
        row = batch[request_id]
        row["token_ids"].extend(unpack_ints(token_blob))
        row["logprobs"].extend(unpack_floats(logprob_blob))
        row["generation_s"] += (finished_at or 0.0) - (leased_at or 0.0)
    rows = sorted(batch.values(), key=lambda row: (row["group_index"], row["response_index"]))
    for row in rows:
        if len(row["token_ids"]) != row["length"]:
            raise RuntimeError(f"response {row['prompt_id']}/{row['response_index']}: "
                               f"{len(row['token_ids'])} tokens stored but {row['length']} counted")
    return rows


def write_outputs(run_dir: RunDir, rows: ResponseRows | list[dict], total: int) -> ExportResult:
    """Both files and the meta file, each written whole then renamed into place, in batches."""
    rows = rows if isinstance(rows, ResponseRows) else ResponseRows.of(rows)
    result = ExportResult(len(rows), total, rows.failed)
    with _export_lock(run_dir):
        if not result.complete and _complete_export_written(run_dir):
            return replace(result, written=False)
        parquet_tmp, jsonl_tmp = _tmp_path(run_dir.parquet_path), _tmp_path(run_dir.jsonl_path)
        try:
            with pq.ParquetWriter(parquet_tmp, SCHEMA) as parquet, open(jsonl_tmp, "w") as jsonl:
                for batch in _batched(rows, EXPORT_BATCH):
                    parquet.write_table(pa.Table.from_pylist(batch, schema=SCHEMA))
                    jsonl.write("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in batch))
            for tmp, path in ((parquet_tmp, run_dir.parquet_path), (jsonl_tmp, run_dir.jsonl_path)):
                _install(tmp, path)
        finally:
            parquet_tmp.unlink(missing_ok=True)
            jsonl_tmp.unlink(missing_ok=True)
        meta = {"complete": result.complete, "responses": len(rows), "responses_total": total,
                "failed": result.failed, "exported_at": time.time()}
        _atomic(run_dir.meta_path, lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
    return result


def _batched(rows: Iterable[dict], size: int) -> Iterator[list[dict]]:
    batch: list[dict] = []
    wrote_any = False
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch, wrote_any = [], True
    if batch or not wrote_any:  # an empty export still writes both files, with the schema
        yield batch


def export_run(session: Session, rollout_id: int, run_dir: RunDir) -> ExportResult:
    rows, total = collect_rows(session.connection(), rollout_id)
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
        rollout = queries.rollouts.latest(conn)
        if rollout is None:
            raise UnreadableDatabase(f"no run at {run_dir.path}: its creation did not complete (or never started); "
                                     f"`seerd run` with the run's arguments creates it there again")
        rows, total = collect_rows(conn, rollout.id)
        return write_outputs(run_dir, rows, total), rollout.status  # rows are read as they are written


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
    tmp = _tmp_path(path)
    try:
        write(tmp)
        _install(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _install(tmp: Path, path: Path) -> None:
    """Private, on disk, then in place of `path` in one rename."""
    os.chmod(tmp, 0o600)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)
