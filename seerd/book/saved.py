"""What a rollout's database holds for a coordinator that (re)starts: the lease book reads it once.

A pure read in the caller's transaction: the groups and requests as the scheduler's records,
the prompts and sampling per group, chunk counts per request, the order the responses finished
in (the events' order, as the running coordinator learned it), the benchmark target lengths
and the chunks not done (a `leased` one is a previous coordinator's lease, to go back to the queue).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

import msgspec

from seerd.book.records import GroupInputs, RequestProgress
from seerd.db import Connection, RequestStatus, queries
from seerd.db.codec import unpack_ints
from seerd.scheduler.records import GroupRecord, RequestRecord
from seerd.settings import Sampling


@dataclass
class SavedRollout:
    groups: list[GroupRecord]
    requests: list[RequestRecord]
    inputs: dict[int, GroupInputs]  # group id ->
    progress: dict[int, RequestProgress]  # request id ->
    bindings: dict[int, str]  # group id -> the worker the group policy bound it to
    finish_order: list[int]  # request ids
    targets: dict[int, int]  # request id -> target length (worker-only)
    unfinished_chunks: list[Any]  # rows: id, request_id, status, lease_epoch, lease_holder


def read_saved_rollout(conn: Connection, rollout_id: int) -> SavedRollout:
    groups, requests, inputs, progress, bindings = [], [], {}, {}, {}
    for row in queries.groups.of_rollout_whole(conn, rollout_id):
        prompt = array("i", unpack_ints(row.prompt_token_ids))
        inputs[row.id] = GroupInputs(prompt, msgspec.json.decode(row.sampling_json, type=Sampling))
        groups.append(GroupRecord(row.id, row.group_index, len(prompt), row.n, row.max_tokens,
                                  row.length_estimate, row.finished_requests))
        if row.bound_worker:
            bindings[row.id] = row.bound_worker
    max_tokens = {group.id: group.max_tokens for group in groups}
    for row in queries.requests.of_rollout_whole(conn, rollout_id):
        requests.append(RequestRecord(row.id, row.group_id, row.response_index, row.is_probe,
                                      max_tokens[row.group_id], row.generated_tokens, row.last_worker,
                                      row.queued_at, row.status == RequestStatus.FINISHED,
                                      row.status == RequestStatus.FAILED))
        progress[row.id] = RequestProgress(row.num_chunks, row.failed_attempts)
    # Finished responses in the order the running coordinator learned of them: its events were
    # written in that order (finished_at ties within one report).
    finish_order = queries.events.finish_order(conn, rollout_id)
    targets = queries.targets.of_rollout(conn, rollout_id)
    unfinished_chunks = queries.chunks.unfinished(conn, rollout_id)
    return SavedRollout(groups, requests, inputs, progress, bindings, list(finish_order), targets,
                        list(unfinished_chunks))
