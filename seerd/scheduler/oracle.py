"""Simulation-only policies that know every response's true length (for comparison).

- `oracle`: divided rollout served longest true length first (then furthest along, then oldest),
  with the same chunking, KV admission and load balance as `seer`, so the two differ only in what they know:
  the paper's "oracle longest-first scheduler".
- `streamrl-oracle`: group-atomic. Whole groups go to one worker together, unchunked, in buckets
  of their longest true response (powers of two), longest bucket first and input order within a
  bucket; a worker takes the next group only if all of its requests fit its free slots and its
  KV. Each response's budget is its true length, so the KV reserved for it is exactly what it
  uses (perfect knowledge, no preemption).
  This stands for length-aware group scheduling in the style of StreamRL's skewness-aware
  dispatch, given a perfect length ranker.
- `seer-revealed[:SIGMA]`: a diagnostic, not a scheduler. It is `seer` except that from a
  group's first finished response on, its forecast is the group's true longest response times
  exp(SIGMA * z), z a fixed standard normal per group. It answers "how good would seer be if
  one finished response told it the group's longest, to within a factor of exp(SIGMA)?", the
  bound that the information in one finish puts on any estimate (docs/simulator.md).
The daemon never offers them: it has no true lengths. `make_sim_policy` builds them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping

from seerd.scheduler.base import admit, balanced_slots, free_slots
from seerd.scheduler.seer import SeerPolicy
from seerd.scheduler.views import Assignment, Plan, QueuedRequest, Snapshot


class OraclePolicy:
    name = "oracle"

    def __init__(self, true_lengths: Mapping[int, int]) -> None:
        self.true_lengths = true_lengths

    def _key(self, r: QueuedRequest) -> tuple:
        return (-self.true_lengths[r.request_id], -r.generated, r.queued_at)

    def plan(self, snapshot: Snapshot) -> Plan:
        limit = balanced_slots(snapshot)
        if limit <= 0:
            return Plan()
        return admit(snapshot, snapshot.queued.ordered("oracle", self._key), limit=limit)


class StreamRLOraclePolicy:
    name = "streamrl-oracle"

    def __init__(self, true_lengths: Mapping[int, int]) -> None:
        self.true_lengths = true_lengths
        self._order: list[tuple[int, list[int]]] | None = None  # (group, its request ids), serving order
        self._head = 0  # groups before it have been handed out whole

    def _build_order(self, snapshot: Snapshot) -> list[tuple[int, list[int]]]:
        members: dict[int, list[int]] = {}
        for request in snapshot.queued.fcfs():
            members.setdefault(request.group_id, []).append(request.request_id)

        def key(gid: int) -> tuple:
            longest = max(self.true_lengths[rid] for rid in members[gid])
            return (-longest.bit_length(), snapshot.group_indices.get(gid, gid), gid)

        return [(gid, members[gid]) for gid in sorted(members, key=key)]

    def plan(self, snapshot: Snapshot) -> Plan:
        if self._order is None:
            self._order = self._build_order(snapshot)
        load = snapshot.worker(snapshot.worker_id)
        slots = free_slots(snapshot)
        kv_free = load.kv_capacity_tokens - load.reserved_kv_tokens
        assignments: list[Assignment] = []
        position = self._head
        while position < len(self._order):
            gid, request_ids = self._order[position]
            if not all(rid in snapshot.queued for rid in request_ids):
                position += 1  # handed out earlier
                continue
            members = [snapshot.queued.get(rid) for rid in request_ids]
            # Perfect knowledge: each response's budget is its true remaining length, so the
            # KV the daemon reserves (context + budget) is exactly what it will use.
            budgets = [self.true_lengths[r.request_id] - r.generated for r in members]
            need = sum(r.prompt_len + r.generated + b for r, b in zip(members, budgets))
            idle = load.running_chunks == 0 and not assignments
            if not idle and (len(members) > slots or need > kv_free):
                break  # group-atomic and in order: nothing overtakes the head group
            # (A group too big for any worker still runs, alone on an idle one, and preempts.)
            slots -= len(members)
            kv_free -= need
            assignments.extend(Assignment(r.request_id, snapshot.worker_id, b) for r, b in zip(members, budgets))
            position += 1
        self._head = position  # every group before it has been handed out
        return Plan(tuple(assignments))


class RevealedSeerPolicy(SeerPolicy):
    name = "seer-revealed"

    def __init__(self, true_lengths: Mapping[int, int], group_of: Mapping[int, int], sigma: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__()
        if sigma < 0:
            raise ValueError(f"sigma must not be negative, got {sigma}")
        longest: dict[int, int] = {}
        for rid, length in true_lengths.items():
            longest[group_of[rid]] = max(longest.get(group_of[rid], 0), length)
        rng = random.Random(seed)
        self.revealed = {gid: length * math.exp(sigma * rng.gauss(0.0, 1.0)) for gid, length in sorted(longest.items())}
        self.name = f"seer-revealed:{sigma:g}" if sigma else "seer-revealed"

    def _key(self, r: QueuedRequest) -> tuple:
        if r.is_probe:
            return (0, r.generated, r.queued_at)
        forecast = r.group_estimate if r.group_finished == 0 else min(r.max_tokens, round(self.revealed[r.group_id]))
        return (1, -(max(forecast, r.generated) - r.generated), r.queued_at)

    def order(self, snapshot: Snapshot) -> Iterator[QueuedRequest]:
        yield from snapshot.queued.ordered("seer-revealed", self._key)
