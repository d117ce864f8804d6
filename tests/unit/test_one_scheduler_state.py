"""One scheduler state for the daemon and the simulator: a recorded stream of events (worker
registrations, lease calls, reports, expiries, releases) is fed to the coordinator's lease book
(real SQLite) and to the simulator's driver; after every event their queues, estimates, growth
tables, leases, worker loads and the plans every policy would make are equal.

Both sides wrap the same `SchedulerState`, so what this guards is each side's own part: the book's
translation of reports (finish rules, requeues, lease epochs and reused chunk rows, registrations)
and the simulator's (finish at the true length, its workers' capacities), which must feed the
state the same updates. Ids differ between the two (database ids, chunk rows reused after an
expiry), so everything is compared by (group index, response index).
"""

from __future__ import annotations

import random

import pytest

from seerd.io.prompts import PromptRow
from seerd.protocol import ChunkReport
from seerd.scheduler import make_policy
from seerd.scheduler.views import OpenWorkers
from seerd.scheduler.wake import WaitingCall, wake_order
from seerd.sim.driver import Simulation
from seerd.sim.presets import get_preset
from seerd.sim.workload import SimGroup, Workload
from tests.unit.helpers import make_book

GROUPS, N, MAX_TOKENS, CHUNK = 10, 4, 96, 16
INSTANCES, MAX_SEQS, KV_CAPACITY = 2, 5, 520
LEASE_TTL_S = 10.0


def workload(seed: int) -> Workload:
    rng = random.Random(seed)
    groups = []
    for g in range(GROUPS):
        scale = rng.choice([8, 24, 60])  # lengths related within a group, as in RL
        lengths = tuple(min(MAX_TOKENS, max(1, round(scale * rng.lognormvariate(0, 0.5)))) for _ in range(N))
        groups.append(SimGroup(g, 5 + g % 4, MAX_TOKENS, lengths))
    return Workload(tuple(groups), "replay")


def prompt_rows(load: Workload) -> list[PromptRow]:
    return [PromptRow(f"p{g.index}", tuple(range(100, 100 + g.prompt_len)), N, MAX_TOKENS, {}, g.index)
            for g in load.groups]


class Replay:
    """Feeds each event to both sides, as the daemon's API and the simulator's event loop would."""

    def __init__(self, tmp_path, policy: str, seed: int) -> None:
        self.load = workload(seed)
        self.policy = policy
        self.sim = Simulation(self.load, policy, get_preset("qwen2-vl-72b").costs(), instances=INSTANCES,
                              chunk_tokens=CHUNK, max_num_seqs=MAX_SEQS, seed=seed, kv_capacity=KV_CAPACITY)
        # The daemon builds a new growth table's order aside (it takes effect a call or so later);
        # here both sides re-key in place, so that every decision can be compared.
        self.book = make_book(tmp_path, policy=policy, chunk_tokens=CHUNK, lease_ttl_s=LEASE_TTL_S,
                              prompt_rows=prompt_rows(self.load), now=0.0, rekey_in_place=True)
        self.workers = list(self.sim.worker_ids)
        self.true_length = {(g.index, k): length for g in self.load.groups for k, length in enumerate(g.lengths)}
        # Per worker: the chunks it holds, each as (book grant, simulator sequence).
        self.held: dict[str, list] = {w: [] for w in self.workers}
        self.now = 0.0
        self.done: dict[str, int] = {"lease": 0, "report": 0, "expire": 0, "release": 0}  # events that did something

    def key(self, side, request_id: int) -> tuple[int, int]:
        request = side.requests[request_id]
        return side.groups[request.group_id].index, request.response_index

    # ------------------------------------------------------------- events
    def register(self, i: int) -> None:
        load = self.sim.state.workers[self.workers[i]]
        worker = self.book.register(rank=load.rank, address="replay", max_chunks=load.max_chunks,
                                    kv_capacity_tokens=load.kv_capacity_tokens, worker_id=load.id, now=self.now)
        assert worker.id == load.id

    def lease(self, i: int) -> None:
        worker = self.workers[i]
        wanted = MAX_SEQS - len(self.held[worker])
        grants = self.book.lease(worker, wanted, self.now)
        seqs = self.sim.lease(i, self.now)
        book_keys = [self.key(self.book.state, g.request_id) for g in grants]
        sim_keys = [self.key(self.sim.state, s.request_id) for s in seqs]
        assert book_keys == sim_keys, "the two sides leased different requests"
        self.held[worker].extend(zip(grants, seqs))
        self.done["lease"] += bool(grants)

    def report(self, i: int, rng: random.Random) -> None:
        worker = self.workers[i]
        if not self.held[worker]:
            return
        done = rng.sample(self.held[worker], rng.randint(1, min(3, len(self.held[worker]))))
        reports = []
        for grant, seq in done:
            generated = self.book.state.requests[grant.request_id].generated
            tokens = seq.target  # the engine's: min(budget, true length - generated)
            at_end = generated + tokens == self.true_length[self.key(self.book.state, grant.request_id)]
            reports.append(ChunkReport(grant.chunk_id, grant.epoch, [5] * tokens, [-0.5] * tokens,
                                       "stop" if at_end else "length"))
        assert all(o.accepted for o in self.book.report_many(worker, reports, self.now))
        self.sim.report(i, [seq for _, seq in done], self.now)
        self.held[worker] = [pair for pair in self.held[worker] if pair not in done]
        self.done["report"] += 1

    def expire(self, i: int, rng: random.Random) -> None:
        """Some of worker i's chunks stop being heartbeated: past the TTL their leases expire."""
        worker = self.workers[i]
        if not self.held[worker]:
            return
        lost = rng.sample(self.held[worker], rng.randint(1, min(2, len(self.held[worker]))))
        self.held[worker] = [pair for pair in self.held[worker] if pair not in lost]
        for moment in (self.now, self.now + LEASE_TTL_S + 1):
            for w in self.workers:  # every worker stays alive; only the lost chunks go unmentioned
                self.book.heartbeat(w, [g.chunk_id for g, _ in self.held[w]], moment)
        self.now += LEASE_TTL_S + 1
        assert self.book.expire(self.now) == len(lost)
        self.sim.return_leases([seq.chunk_id for _, seq in lost])
        self.done["expire"] += 1

    def release(self, i: int, rng: random.Random) -> None:
        worker = self.workers[i]
        if not self.held[worker]:
            return
        pair = rng.choice(self.held[worker])
        self.held[worker].remove(pair)
        assert self.book.release(worker, pair[0].chunk_id, pair[0].epoch, "engine error", self.now)
        self.sim.return_leases([pair[1].chunk_id])
        self.done["release"] += 1

    # ------------------------------------------------------------- what must be equal
    def picture(self, side) -> dict:
        key = lambda rid: self.key(side, rid)  # noqa: E731
        return {
            "queue": sorted((key(r.request_id), r.generated, r.is_probe, r.group_estimate, r.last_worker, r.queued_at,
                             r.group_size, r.group_finished, r.group_longest_unfinished, r.prompt_len, r.max_tokens)
                            for r in side.queue),
            "groups": sorted((g.index, g.estimate, g.finished, tuple(g.finished_lengths)) for g in side.groups.values()),
            "forecasts": sorted((g.index, side.forecast(g.id)) for g in side.groups.values()),
            "growth": (side.growth.current.version, sorted(side.growth.current.ratios.items())),
            "leases": sorted((l.worker_id, key(l.request_id), l.max_tokens, l.kv_reserved, l.previous_worker)
                             for l in side.leases.values()),
            "loads": side.worker_loads(),
            "bindings": sorted((side.groups[gid].index, w) for gid, w in side.bindings.items()),
            "counts": (side.finished_requests, side.output_tokens, sorted(side.groups[g].index for g in side.unfinished_groups)),
            "plans": [self.plan(side, w) for w in self.workers],
        }

    def plan(self, side, worker: str) -> tuple:
        wanted = MAX_SEQS - len(side.workers[worker].chunks) if worker in side.workers else 0
        if worker not in side.workers or not len(side.queue):
            return ()
        plan = make_policy(self.policy).plan(side.snapshot(worker, wanted, self.now))
        return (tuple((self.key(side, a.request_id), a.worker_id, a.max_tokens) for a in plan.assignments),
                tuple(sorted((side.groups[gid].index, w) for gid, w in plan.new_bindings.items())))

    def check(self, event: str) -> None:
        book, sim = self.picture(self.book.state), self.picture(self.sim.state)
        for part in book:
            assert book[part] == sim[part], f"after {event}: the {part} differ"
        for side in (self.book.state, self.sim.state):  # what the state keeps as loads change
            snapshot, loads = side.snapshot(self.workers[0], 1, self.now), side.worker_loads()
            assert dict(snapshot.loads_by_id) == {load.worker_id: load for load in loads}, event
            assert snapshot.open_workers == OpenWorkers.of(loads, side.chunk_tokens), event
        # Every worker long-polling since the same moment: the order work wakes them in. The
        # simulator's model of the daemon's lease line, fed the same calls by its own driver code.
        saved, self.sim.waiting_since = self.sim.waiting_since, [(0.0, i) for i in range(INSTANCES)]
        sim_order = [self.workers[i] for i in self.sim._waiting_in_wake_order(self.now)]
        self.sim.waiting_since = saved
        book_order = wake_order([WaitingCall(w, 0, self.book.state.room_for(w, 0), i)
                                 for i, w in enumerate(self.workers)])
        assert sim_order == book_order, event


@pytest.mark.parametrize("policy", ["seer", "divided", "group"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_book_and_the_simulator_keep_one_state_through_a_recorded_stream(tmp_path, policy, seed):
    replay = Replay(tmp_path, policy, seed)
    rng = random.Random(seed)
    for i in range(INSTANCES):  # the simulator's workers exist from the start; the book's register
        replay.register(i)
    replay.check("registering the workers")
    kinds = ["lease", "lease", "report", "report", "report", "expire", "release"]
    events = 0
    while not replay.book.is_complete():
        events += 1
        assert events < 2000, "the stream does not end"
        kind, i = rng.choice(kinds), rng.randrange(INSTANCES)
        replay.now += rng.choice([0.0, 0.25, 1.0])  # equal times too: ties must break the same way
        if kind == "lease":
            replay.lease(i)
        elif kind == "report":
            replay.report(i, rng)
        elif kind == "expire":
            replay.expire(i, rng)
        else:
            replay.release(i, rng)
        replay.check(f"event {events} ({kind} on worker {i})")
    assert replay.sim.state.is_complete()
    # The stream exercised what it is for: finishes that teach the growth table, expiries, releases.
    assert replay.book.state.growth.completed_groups == GROUPS
    assert min(replay.done.values()) >= 1, replay.done


def test_a_restarted_books_state_equals_the_one_it_replaced(tmp_path):
    """The book's load (a resumed run) rebuilds the very state the running book had, growth included."""
    from tests.unit.helpers import reopen

    replay = Replay(tmp_path, "seer", seed=3)
    rng = random.Random(3)
    for i in range(INSTANCES):
        replay.register(i)
    while replay.book.state.finished_requests < GROUPS * N // 2:
        i = rng.randrange(INSTANCES)
        replay.now += 0.5
        replay.lease(i)
        replay.report(i, rng)
    for worker in replay.workers:  # a restart voids every lease: their requests are queued again
        replay.sim.return_leases([seq.chunk_id for _, seq in replay.held[worker]])
        replay.held[worker] = []
    restarted = reopen(replay.book, now=replay.now)
    before, after = replay.picture(replay.sim.state), replay.picture(restarted.state)
    for part in ("queue", "groups", "forecasts", "growth", "counts"):
        assert before[part] == after[part], part
