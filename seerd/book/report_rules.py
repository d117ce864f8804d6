"""What a worker's chunk report means, and what it writes.

The rules (is it well-formed, does it finish its request) are pure functions of the report and
what the lease book knows of the chunk, so they live in one place and are tested without a
database. The rows an accepted report writes, and the verdict on a report without a live lease,
take the lease book's connection: the book runs them in its transactions.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

from seerd.book.records import RequestProgress
from seerd.db import ChunkStatus, Connection, queries
from seerd.db.codec import pack_floats, pack_ints
from seerd.db.event import event_row
from seerd.db.transitions import ROW_EPOCH, ROW_ID
from seerd.protocol import ChunkReport, UnreadableReport
from seerd.scheduler.state import SchedulerState
from seerd.scheduler.records import ChunkResult, ResultsUpdate
from seerd.scheduler.views import response_ended


# "length_target": the worker ended the response at its target length (benchmark rows).
FINISH_REASONS = frozenset({"stop", "length", "length_target"})
# A sampled token's logprob is <= 0; vLLM computes it in float32 (log_softmax), whose rounding
# near 0 is ~1e-6 for logits of ordinary size. Up to this much above 0 is rounding, stored as
# reported; anything larger is a probability above 1.
LOGPROB_ROUNDING = 1e-3


class Report(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class ReportOutcome:
    accepted: bool
    duplicate: bool = False
    reason: str = ""
    request_finished: bool = False
    rerun: bool = False  # rejected as wrong: its chunk is queued to run again
    # Its request waits in the queue once the report calls committed with it have leased (no
    # lease of theirs continued or took it): its context, for whom to wake (`api.report`).
    queued_context: int | None = None


class AcceptedReport(NamedTuple):
    position: int  # in its call's batch
    report: ChunkReport
    finish_reason: str  # the request's, should this chunk finish it
    num_chunks: int  # the request's done chunks, this one included
    worker_id: str  # who reported it
    call: int = 0  # its call, in a group commit of several


@dataclass(frozen=True)
class Verdict:
    finished: bool  # the request is complete with this chunk
    finish_reason: str  # the request's, if finished (the chunk keeps the worker's own)


def report_problem(report: Report, budget: int, generated: int, target: int | None, vocab_size: int) -> str | None:
    """Why the report cannot be right for a chunk of `budget` tokens of a request with `generated`
    tokens so far and, for benchmark rows, a `target` length, from a model of `vocab_size`
    tokens; None when it can."""
    if report.finish_reason not in FINISH_REASONS:
        return f"finish_reason must be one of {sorted(FINISH_REASONS)}, got {report.finish_reason!r}"
    if len(report.logprobs) != len(report.token_ids):
        return f"{len(report.token_ids)} token ids but {len(report.logprobs)} logprobs"
    if len(report.token_ids) > budget:
        return f"{len(report.token_ids)} tokens exceed the chunk budget {budget}"
    if not report.token_ids:
        return None if report.finish_reason == "stop" else "an empty chunk must end with finish_reason 'stop'"
    total = generated + len(report.token_ids)
    if target is not None and total > target:
        return f"{total} tokens pass the response's target length {target}"
    if report.finish_reason == "length_target" and target is None:
        return "finish_reason 'length_target' for a request without a target length"
    if report.finish_reason == "length_target" and total != target:
        return f"finish_reason 'length_target' at {total} tokens, but the target is {target}"
    if min(report.token_ids) < 0 or max(report.token_ids) >= vocab_size:
        at, token = next((i, t) for i, t in enumerate(report.token_ids) if not 0 <= t < vocab_size)
        return f"token_ids[{at}] = {token} is outside the model's vocabulary (0..{vocab_size - 1})"
    stored = array("f", report.logprobs)  # float32, as stored: a float64 past its range becomes infinite
    if not all(map(math.isfinite, stored)):
        at, logprob = next((i, x) for i, x in enumerate(stored) if not math.isfinite(x))
        return f"logprobs[{at}] = {logprob} is not finite (as float32)"
    if max(report.logprobs) > LOGPROB_ROUNDING:
        at, logprob = next((i, x) for i, x in enumerate(report.logprobs) if x > LOGPROB_ROUNDING)
        return f"logprobs[{at}] = {logprob} is positive (a probability above 1)"
    return None


def judge(report: Report, budget: int, generated: int, max_tokens: int, target: int | None) -> Verdict:
    """Whether a (valid) report finishes its request: EOS, the response's budget reached, a chunk
    shorter than its budget ("length" with room left: the model's context is full), or the
    target length reached (a worker that stopped there but called it "length" must not get a
    0-token chunk next)."""
    n_tokens = len(report.token_ids)
    total = generated + n_tokens
    at_target = total == target
    finished = response_ended(total, max_tokens, stopped=report.finish_reason in ("stop", "length_target")
                              or n_tokens < budget or at_target)
    reason = "length_target" if at_target and report.finish_reason == "length" else report.finish_reason
    return Verdict(finished, reason)


def sort_reports(calls: Sequence[tuple[int, str, Sequence[ChunkReport | UnreadableReport]]], state: SchedulerState,
                 progress: Mapping[int, RequestProgress],
                 targets: Mapping[int, int], vocab_size: int
                 ) -> tuple[list[AcceptedReport], list[ChunkResult], list[tuple[int, int, str]]]:
    """The reports of known workers' calls ((call index, worker, reports)) sorted against their
    leases: accepted ones with their results, and rejected ones as (call, position, problem). A
    report of no live lease of its worker's at its epoch (or a second one of a chunk in the batch)
    is in neither: it is judged against the database (`judge_unleased`)."""
    accepted, results, rejected = [], [], []
    seen: set[int] = set()
    for c, worker_id, reports in calls:
        for i, report in enumerate(reports):
            lease = state.leases.get(report.chunk_id)
            if (lease is None or lease.epoch != report.epoch or lease.worker_id != worker_id
                    or report.chunk_id in seen):
                continue
            seen.add(report.chunk_id)
            request = state.requests[lease.request_id]
            target = targets.get(request.id)
            problem = (report.problem if isinstance(report, UnreadableReport) else
                       report_problem(report, lease.max_tokens, request.generated, target, vocab_size))
            if problem is not None:
                rejected.append((c, i, problem))
                continue
            verdict = judge(report, lease.max_tokens, request.generated, request.max_tokens, target)
            num_chunks = progress[request.id].num_chunks + 1
            accepted.append(AcceptedReport(i, report, verdict.finish_reason, num_chunks, worker_id, c))
            results.append(ChunkResult(report.chunk_id, len(report.token_ids), verdict.finished))
    return accepted, results, rejected


def write_results(conn: Connection, rollout_id: int, prepared: ResultsUpdate,
                  accepted: Sequence[AcceptedReport], now: float) -> None:
    """The rows of a prepared update (`SchedulerState.prepare_results`) of `accepted`, in the
    caller's transaction: each chunk `leased` -> `done` (guarded by its lease epoch, with its
    tokens), its request `running` -> `finished` or `queued`, the groups' counts and estimates."""
    chunk_rows, finished_rows, requeued_rows, events = [], [], [], []
    for (_, report, finish_reason, num_chunks, worker_id, _), outcome in zip(accepted, prepared.requests):
        n_tokens = len(report.token_ids)
        chunk_rows.append({ROW_ID: report.chunk_id, ROW_EPOCH: report.epoch, "fin": now, "n": n_tokens,
                           "tok": pack_ints(report.token_ids), "lp": pack_floats(report.logprobs),
                           "fr": report.finish_reason, "cached": report.cached_tokens})
        row = {ROW_ID: outcome.request_id, "gen": outcome.generated, "nc": num_chunks}
        events.append(event_row(rollout_id, now, "chunk_done", worker_id, outcome.request_id,
                                report.chunk_id, {"tokens": n_tokens, "finish_reason": report.finish_reason,
                                                  "cached_tokens": report.cached_tokens}))
        if outcome.finished:
            finished_rows.append({**row, "fr": finish_reason})
            events.append(event_row(rollout_id, now, "request_finished", worker_id, outcome.request_id,
                                    None, {"length": outcome.generated, "finish_reason": finish_reason,
                                           "group_estimate": outcome.group_estimate}))
        else:
            requeued_rows.append(row)
    queries.chunks.done(conn, chunk_rows)
    queries.requests.finish(conn, finished_rows, now)
    queries.requests.requeue_counted(conn, requeued_rows, now)
    queries.groups.set_counts(conn, [{"gid": g.group_id, "fr": g.finished, "est": g.estimate,
                                      "fa": now if g.complete else None} for g in prepared.groups])
    queries.events.append(conn, events)


def judge_unleased(conn: Connection, worker_id: str, report: ChunkReport | UnreadableReport) -> ReportOutcome:
    """A report without a matching live lease: a harmless duplicate, or stale and rejected.

    Reports are idempotent per lease epoch: a chunk row, once `done`, never changes again (the
    request's next chunk is a new row), so the same report sent again (its answer lost, or a
    5xx) finds its chunk `done` at its epoch by its worker and is acknowledged as a duplicate
    without counting twice; a report for a lease that ended meanwhile finds another epoch or
    status and is rejected."""
    chunk = queries.chunks.lease_of(conn, report.chunk_id)
    if chunk is None:
        return ReportOutcome(False, reason=f"unknown chunk {report.chunk_id}")
    if chunk.status == ChunkStatus.DONE and chunk.lease_epoch == report.epoch and chunk.lease_holder == worker_id:
        return ReportOutcome(True, duplicate=True)
    return ReportOutcome(False, reason=(
        f"stale lease: chunk {report.chunk_id} is {chunk.status.value} at epoch {chunk.lease_epoch}, "
        f"report is for epoch {report.epoch}"))


def with_queued_contexts(reports: Sequence[ChunkReport | UnreadableReport], outcomes: Sequence[ReportOutcome],
                         request_of: Mapping[int, int], state: SchedulerState) -> list[ReportOutcome]:
    """`outcomes`, each whose request (`request_of`: chunk id -> request id) waits in the queue
    now marked with its context (`ReportOutcome.queued_context`): what the API wakes workers for."""
    return [replace(o, queued_context=state.context_of(request_of[r.chunk_id]))
            if r.chunk_id in request_of and state.is_queued(request_of[r.chunk_id]) else o
            for r, o in zip(reports, outcomes)]
