"""The rows a lease writes: a checked plan's chunks leased and requests running, in the lease
book's transaction (as `reports.write_results` is for reports), pure of the book's state but the
requests' progress it is handed; and the grant that tells the worker of each chunk."""

from __future__ import annotations

from array import array
from collections.abc import Collection, Mapping, Sequence

import msgspec

from seerd.book.records import RequestProgress, chunk_seed
from seerd.db import Connection, queries
from seerd.db.codec import unpack_ints
from seerd.db.event import event_row
from seerd.db.transitions import ROW_EPOCH, ROW_ID
from seerd.protocol import ChunkGrant
from seerd.scheduler.records import LeaseRecord
from seerd.scheduler.views import Plan


def write_leases(conn: Connection, rollout_id: int, progress_of: Mapping[int, RequestProgress], worker_id: str,
                 plan: Plan, now: float, deadline: float,
                 continuing: Collection[int] = ()) -> tuple[list[int], list[int]]:
    """The rows of a checked plan, in the caller's transaction: each assignment's chunk row
    (new, or the one an ended lease left queued, epoch + 1) leased, its request running.
    Returns the chunk ids and lease epochs, in assignment order."""
    queries.groups.bind(conn, plan.new_bindings)
    chunk_ids: list[int | None] = []
    epochs, reused, fresh = [], [], []
    for assignment in plan.assignments:
        progress = progress_of[assignment.request_id]
        if progress.tokens is None and assignment.request_id not in continuing:  # a continuation needs no context
            progress.tokens = array("i") if not progress.num_chunks else read_tokens(conn, assignment.request_id)
        if progress.open_chunk is not None:
            chunk_id, epoch = progress.open_chunk
            reused.append({ROW_ID: chunk_id, ROW_EPOCH: epoch, "budget": assignment.max_tokens})
            chunk_ids.append(chunk_id)
            epochs.append(epoch + 1)
        else:
            fresh.append({"request_id": assignment.request_id, "seq": progress.num_chunks,
                          "max_tokens": assignment.max_tokens, "lease_holder": worker_id,
                          "lease_deadline": deadline, "lease_epoch": 1, "attempt": 1, "created_at": now,
                          "leased_at": now, "num_tokens": 0})
            chunk_ids.append(None)
            epochs.append(1)
    new_ids = iter(queries.chunks.insert_leased(conn, fresh))
    chunk_ids = [next(new_ids) if chunk_id is None else chunk_id for chunk_id in chunk_ids]
    if reused:
        queries.chunks.lease_again(conn, reused, worker_id=worker_id, deadline=deadline, now=now)
    queries.requests.start(conn, [a.request_id for a in plan.assignments], worker_id=worker_id, now=now)
    if plan.assignments:
        queries.events.append(conn, [
            event_row(rollout_id, now, "chunk_leased", worker_id, a.request_id, chunk_id,
                      {"seq": progress_of[a.request_id].num_chunks, "epoch": epoch, "max_tokens": a.max_tokens,
                       **({"in_place": True} if a.request_id in continuing else {})})
            for a, chunk_id, epoch in zip(plan.assignments, chunk_ids, epochs)])
    return chunk_ids, epochs


def read_tokens(conn: Connection, request_id: int) -> array:
    """A request's tokens from its done chunks, in order."""
    tokens = array("i")
    for blob in queries.chunks.done_tokens(conn, request_id):
        tokens.extend(unpack_ints(blob))
    return tokens


def chunk_grant(book, chunk_id: int, request_id: int, max_tokens: int, *,  # noqa: ANN001 - the LeaseBook (a cycle)
                continues: bool = False) -> ChunkGrant:
    """What the worker is told of a chunk the `LeaseBook` just leased it (`LeaseBook.lease_calls`)."""
    request = book.state.requests[request_id]
    group = book.state.groups[request.group_id]
    inputs = book.inputs[request.group_id]
    lease = book.state.leases[chunk_id]
    # A row's own seed still differs per response and chunk; otherwise the rollout's seed.
    base_seed = book.seed if inputs.sampling.seed is None else inputs.sampling.seed
    sampling = msgspec.structs.replace(
        inputs.sampling, seed=chunk_seed(base_seed, group.index, request.response_index, lease.seq))
    context = []  # a continuation runs on in the engine request holding its context
    if not continues:
        context = inputs.prompt.tolist()
        context.extend(book.progress[request_id].tokens)
    target = book.worker_only_targets.get(request_id)
    remaining = request.max_tokens - request.generated
    return ChunkGrant(chunk_id, lease.epoch, request_id, context, max_tokens, sampling, lease.deadline,
                      None if target is None else target - request.generated,
                      group_id=request.group_id, prompt_len=group.prompt_len, is_probe=request.is_probe,
                      run_on=book.in_place and max_tokens < remaining, response_remaining=remaining,
                      continues=continues, batch=book.rollout_id)


def grant_leases(book, leases: Sequence[LeaseRecord], epochs: Sequence[int], deadline: float,  # noqa: ANN001
                 continuing: Collection[int]) -> list[ChunkGrant]:
    """The `LeaseBook`'s fencing and deadline of leases just applied, and their grants."""
    grants = []
    for lease, epoch in zip(leases, epochs):
        progress = book.progress[lease.request_id]
        progress.open_chunk = None
        lease.epoch, lease.seq, lease.deadline = epoch, progress.num_chunks, deadline
        grants.append(chunk_grant(book, lease.chunk_id, lease.request_id, lease.max_tokens,
                                  continues=lease.request_id in continuing))
        if lease.request_id in continuing:
            # No copy of what runs in place (at a GPU job's scale, gigabytes: the tokens in
            # flight): it is read back from the database should the request run elsewhere.
            # Requests re-leased with their context keep theirs (reading it back per lease
            # cost 5x the CPU per chunk, tools/bench/book_cpu.py --groups 2).
            progress.tokens = None
    return grants
