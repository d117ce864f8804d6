"""The lease book's reports: what `LeaseBook` does with a worker's report calls (it inherits
`BookReports`; this module holds that section of it, no state of its own).

A report call's reports commit in one transaction with every other call queued meanwhile (group
commit) and are acknowledged only once durable; then each call leases for the slots they freed,
in the same state-thread call (`report_calls`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Union

from seerd.book.liveness import WorkerLiveness, chunk_done, refuted_reason
from seerd.book.records import ReportCall, UnknownWorker
from seerd.book.report_rules import (
    ReportOutcome, judge_unleased, sort_reports, with_queued_contexts, write_results,
)
from seerd.cpu import CpuSnapshot, Laps
from seerd.protocol import ChunkGrant, ChunkReport, UnreadableReport

# A report call's answer: its reports' outcomes and its new grants.
Reply = tuple[list[ReportOutcome], list[ChunkGrant]]
# Where `report_calls` hands each slice of replies as its leases commit: (index of its first call, replies).
HandOut = Callable[[int, list[Union[Reply, UnknownWorker]]], None]
# How long a report turn plans leases before it commits them and hands their replies out.
ANSWER_SLICE_S = 0.02


class BookReports:
    """The report methods of `LeaseBook` (see the module docstring)."""

    answer_slice_s = ANSWER_SLICE_S

    def report(self, worker_id: str, report: ChunkReport | UnreadableReport, now: float) -> ReportOutcome:
        return self.report_many(worker_id, [report], now)[0]

    def report_many(self, worker_id: str, reports: Sequence[ChunkReport | UnreadableReport],
                    now: float) -> list[ReportOutcome]:
        """One call's reports (`report_calls` for one call, without a lease)."""
        outcomes = self._report_calls([(worker_id, reports)], now)[0]
        if isinstance(outcomes, UnknownWorker):
            raise outcomes
        return outcomes

    def _report_calls(self, calls: Sequence[tuple[str, Sequence[ChunkReport | UnreadableReport]]],
                      now: float, laps: Laps | None = None) -> list[list[ReportOutcome] | UnknownWorker]:
        """Commit every acceptable report of every call in one durable transaction (group commit:
        one fsync for all the calls that queued meanwhile), then acknowledge; per call its
        outcomes, or the `UnknownWorker` its worker is (that call alone fails). With
        `reports_synced_later` the fsync is the caller's to wait for before it acknowledges.

        A report that cannot be right (`report_problem`, or unreadable) is rejected alone: in the
        same transaction its lease ends, with an event saying why, and its chunk runs again; the
        rest of the batch is committed."""
        laps = laps or Laps({})
        answers: list[list[ReportOutcome | None] | UnknownWorker] = []
        for worker_id, reports in calls:
            try:
                self._worker(worker_id)
                answers.append([None] * len(reports))
            except UnknownWorker as exc:
                answers.append(exc)
        known = [(c, *call) for c, call in enumerate(calls) if not isinstance(answers[c], UnknownWorker)]
        accepted, results, rejected = sort_reports(known, self.state, self.progress,
                                                   self.worker_only_targets, self.vocab_size)
        prepared = self.state.prepare_results(results, now)
        laps.lap("sort and prepare")
        failures = []
        if results or rejected:
            with self.writer.begin(durable=not self.reports_synced_later) as conn:
                if results:
                    write_results(conn, self.rollout_id, prepared, accepted, now)
                failures = [self._write_failure(conn, calls[c][1][i].chunk_id, f"report rejected: {problem}", now,
                                                kind="report_rejected") for c, i, problem in rejected]
        laps.lap("commit")
        # Committed: now the state follows.
        self.state.apply_results(prepared)
        laps.lap("apply")
        if self.completed_at is None and self.state.is_complete():
            self.completed_at, self.completed_cpu = now, CpuSnapshot.now()
        for failure in failures:
            self._apply_failure(failure)
        refuted: dict[str, WorkerLiveness] = {}
        for entry, outcome in zip(accepted, prepared.requests):
            report = entry.report
            request = self.state.requests[outcome.request_id]
            refuted.update((w.id, w) for w in chunk_done(self.workers, entry.worker_id, request.id, request.failed_on))
            progress = self.progress[request.id]
            progress.num_chunks += 1
            self.listeners.tokens_committed(request.group_id, request.id, request.generated - len(report.token_ids),
                                            report.token_ids)  # e.g. the grouped draft server's copy
            if outcome.finished:
                progress.tokens = None  # durable in the database; the coordinator needs them no more
                self.listeners.request_done(request.group_id, request.id)
            elif progress.tokens is not None:  # None: running in place, read back if it moves
                progress.tokens.extend(report.token_ids)
            answers[entry.call][entry.position] = ReportOutcome(True, request_finished=outcome.finished)
        for group in prepared.groups:
            if group.complete:
                self.listeners.group_done(group.group_id)
        for (c, i, problem), failure in zip(rejected, failures):
            again = "its request failed" if failure.fatal else "the chunk runs again"
            answers[c][i] = ReportOutcome(False, reason=f"rejected, {again}: {problem}", rerun=not failure.fatal)
        laps.lap("listeners")
        if refuted:
            self._retire(list(refuted.values()), now, refuted_reason)
        unleased = [(c, i) for c, outcomes in enumerate(answers) if not isinstance(outcomes, UnknownWorker)
                    for i, outcome in enumerate(outcomes) if outcome is None]
        if unleased:
            with self.writer.begin(durable=False) as conn:  # reads only
                for c, i in unleased:
                    answers[c][i] = judge_unleased(conn, calls[c][0], calls[c][1][i])
        return answers

    def report_and_continue(self, worker_id: str, reports: Sequence[ChunkReport | UnreadableReport], now: float,
                            *, may_lease: bool = True, wanted: int = 0) -> tuple[list[ReportOutcome], list[ChunkGrant]]:
        """One call of `report_calls`: raises `UnknownWorker` for a worker the book does not know."""
        answer = self.report_calls([ReportCall(worker_id, reports, may_lease, wanted)], now)[0]
        if isinstance(answer, UnknownWorker):
            raise answer
        return answer

    def report_calls(self, calls: Sequence[ReportCall], now: float, laps: Laps | None = None,
                     hand_out: HandOut | None = None) -> list[Reply | UnknownWorker]:
        """Report calls that queued together: their reports in one durable commit (`_report_calls`),
        then, call by call in the same state-thread call (no other lease can come between), a
        lease for the slots of the chunks reported `running_on` (their engine requests still
        generate past the boundary) and `wanted` more (free slots, e.g. of finished chunks). The
        policy plans for those slots over the whole queue as at any lease call: a reported request
        it gives this worker again continues in place (a grant with `continues`, without its
        context: the worker holds it); one it does not is stopped by the worker, and the slot runs
        what the plan gave instead. So the scheduler decides exactly as with re-submitted chunks
        and lease calls; only the engine's cost of a boundary and a round trip go.

        The leases commit in slices of `answer_slice_s` of planning, and each slice's replies go
        to `hand_out` (index of its first call, replies) once committed: in a turn of 280 report
        calls whose leases took 0.9 s, the first waited for the last (tools/bench/load.py). Every
        reply is returned as well."""
        self.refuse_if_broken()
        request_of = {r.chunk_id: self.state.leases[r.chunk_id].request_id  # of every reported lease
                      for call in calls for r in call.reports if r.chunk_id in self.state.leases}
        running_on = [{r.chunk_id: request_of[r.chunk_id] for r in call.reports if self.in_place
                       and getattr(r, "running_on", False) and r.chunk_id in request_of
                       and self.state.leases[r.chunk_id].worker_id == call.worker_id} for call in calls]
        laps = laps or Laps({})  # where the time of the calls goes, phase by phase
        answers = self._report_calls([(call.worker_id, call.reports) for call in calls], now, laps)
        laps.lap("refuted and unleased")
        leasing = []  # (worker, slots, continuing) per call that may lease; 0 slots for the others
        for call, held, outcomes in zip(calls, running_on, answers):
            slots = 0
            if not isinstance(outcomes, UnknownWorker) and call.may_lease:
                slots = sum(1 for report, outcome in zip(call.reports, outcomes) if report.chunk_id in held
                            and outcome.accepted and not outcome.duplicate and not outcome.request_finished)
                slots += max(0, call.wanted)
            leasing.append((call.worker_id, slots, set(held.values())))
        # A worker taken out by a report of this batch (refuted) gets no grants: its reports stand.
        replies: list[Reply | UnknownWorker] = []
        while len(replies) < len(calls):
            first = len(replies)
            leased = self._lease_slice(leasing[first:], now)
            part: list[Reply | UnknownWorker] = [
                outcomes if isinstance(outcomes, UnknownWorker) else (outcomes, grants if isinstance(grants, list) else [])
                for outcomes, grants in zip(answers[first:], leased)]
            laps.lap("leases")
            for call, reply in zip(calls[first:], part):  # what still waits, once the slice has leased
                if not isinstance(reply, UnknownWorker):
                    reply[0][:] = with_queued_contexts(call.reports, reply[0], request_of, self.state)
            laps.lap("queued contexts")
            replies.extend(part)
            if hand_out is not None:
                hand_out(first, part)
        return replies

    def _lease_slice(self, calls: Sequence[tuple[str, int, Collection[int]]], now: float
                     ) -> list[list[ChunkGrant] | UnknownWorker]:
        """`lease_calls` for the first of `calls` that plan within `answer_slice_s` (at least one)."""
        leased: list[list[ChunkGrant] | UnknownWorker] = []
        started = time.perf_counter()
        with self.leasing(now) as lease:
            for worker_id, wanted, continuing in calls:
                leased.append(lease(worker_id, wanted, continuing))
                if time.perf_counter() - started > self.answer_slice_s:
                    break
        return leased
