"""Seer's plans through `PassingOrder` (admission passing over, in one call, the requests that fit
another worker and not the asking one, or that seer leaves to their home worker) are the plans of its plain `order`, request for request:
random queues with probes, homes, failed engines, requests continuing on the asker, the starved,
and workers from roomy to full."""

from __future__ import annotations

import random

from seerd.scheduler import QueuedRequest, RequestQueue, SeerPolicy, Snapshot, WorkerLoad
from seerd.scheduler.base import admit, balanced_slots, chunk_budget, kv_need, whole_chunk_need
from seerd.scheduler.seer import PassingOrder
from seerd.scheduler.views import Plan

CHUNK, BLOCK, KV = 64, 16, 5120


def random_state(rng: random.Random, queued: int, workers: int, probes: float = 0.3
                 ) -> tuple[RequestQueue, tuple[WorkerLoad, ...]]:
    # Home workers with a slot or two left make a home's held requests count (seer's `room_left`).
    loads = tuple(WorkerLoad(f"w{i}", i, rng.choice((0, 12, 29, 30, 31, 31, 32)),
                             KV - rng.choice((0, 64, 200, 512, 1500, 4000)), 32, KV, BLOCK) for i in range(workers))
    requests = []
    for rid in range(queued):
        gid = rid // 4
        generated = 0 if rng.random() < 0.3 else CHUNK * rng.randint(1, 7)
        # (w{workers}: a home that is gone)
        home = None if generated == 0 or rng.random() < 0.1 else f"w{rng.randrange(workers + 1)}"
        failed = frozenset({f"w{rng.randrange(workers)}"}) if rng.random() < 0.05 else frozenset()
        probe = rid % 4 == 0 and rng.random() < probes
        requests.append(QueuedRequest(
            rid, gid, gid, rid % 4, rng.randint(10, 900), generated, 512, probe, rng.randint(CHUNK, 512), home,
            rng.uniform(0, 100), group_size=4, group_finished=rng.randint(0, 3), group_longest_unfinished=generated,
            failed_on=failed))
    return RequestQueue.of(requests), loads


def plans(policy: SeerPolicy, snapshots: list[Snapshot]) -> list:
    return [policy.plan(snapshot).assignments for snapshot in snapshots]


def test_plans_through_the_passing_order_are_the_plain_orders_plans(monkeypatch):
    pass_over_unfit = PassingOrder.pass_over_unfit
    counted = []
    left_to_home = []

    def counting(self, *args):  # noqa: ANN001, ANN002, ANN202
        run = pass_over_unfit(self, *args)
        counted.extend(run)
        skip = args[5] if len(args) > 5 else None
        left_to_home.extend(r for r in run if skip is not None and skip(r))  # (seer's skip keeps its answers)
        return run

    policy = SeerPolicy()
    for seed in range(10):
        rng = random.Random(seed)
        queue, loads = random_state(rng, rng.choice((50, 600, 3000)), rng.choice((3, 10, 40, 300)))
        ids = range(len(queue) + 5)  # (a few not queued)
        snapshots = [Snapshot(rng.choice((100.0, 100.0, 100.0, 1850.0)),  # (1850: the oldest are starved)
                              loads[rng.randrange(len(loads))].worker_id, rng.randint(1, 8), loads, queue, {}, {},
                              CHUNK, continuing=frozenset(rng.sample(ids, rng.choice((0, 0, 1, 3, 8)))))
                     for _ in range(300)]
        with monkeypatch.context() as patched:
            patched.setattr(PassingOrder, "pass_over_unfit", counting)
            passing = plans(policy, snapshots)
        with monkeypatch.context() as patched:
            patched.setattr(SeerPolicy, "_admission_order", lambda self, snapshot: self.order(snapshot))
            assert plans(policy, snapshots) == passing, f"seed {seed}"
    assert len(counted) > 10_000  # most seeds' plans passed over requests through it
    assert len(left_to_home) > 500  # and requests seer leaves to their home, asked from the run


def test_the_passing_order_takes_the_requests_that_fit_elsewhere_and_stops_at_the_first_other():
    def request(rid, prompt, *, home=None, probe=False):
        return QueuedRequest(rid, rid, rid, 0, prompt, 0, 512, probe, 512, home, 0.0)

    queue = [request(1, 300, probe=True), request(2, 400), request(3, 500, home="a"), request(4, 500),
             request(5, 900), request(6, 100), request(7, 600)]
    order = PassingOrder(iter(queue), "a")

    def whole_chunk_need(r):
        return -(-(r.prompt_len + CHUNK) // BLOCK) * BLOCK

    # 300 KV tokens free here, 700 elsewhere: 1, 2, 3 (its home is the asker), 4 need 368-576.
    passed = order.pass_over_unfit(whole_chunk_need, 300, 700, 10, (CHUNK, BLOCK))
    assert [r.request_id for r in passed] == [1, 2, 3, 4]
    assert next(order).request_id == 5  # needs 976: fits nowhere, admission's to handle
    assert order.pass_over_unfit(whole_chunk_need, 300, 700, 10, (CHUNK, BLOCK)) == []  # 6 fits here
    again = order.restarted([queue[0], queue[1]])
    assert [r.request_id for r in again] == [1, 2, 6, 7]


def test_the_passing_order_asks_skip_of_the_requests_with_a_home_elsewhere_and_stops_at_a_failure():
    def request(rid, prompt, *, home=None, failed=frozenset()):
        return QueuedRequest(rid, rid, rid, 0, prompt, 0, 512, False, 512, home, 0.0, failed_on=failed)

    queue = [request(1, 100, home="h"), request(2, 400, home="h"), request(3, 400), request(4, 400, home="a"),
             request(5, 100, home="h"), request(6, 400, failed=frozenset({"x"}))]
    asked = []

    def skip(r):  # leaves request 1 to its home; 2 and 5 are the asker's to weigh
        asked.append(r.request_id)
        return r.request_id == 1

    order = PassingOrder(iter(queue), "a")
    passed = order.pass_over_unfit(None, 300, 700, 10, (CHUNK, BLOCK), skip)
    assert [r.request_id for r in passed] == [1, 2, 3, 4]  # 1 skipped, 2-4 fit only elsewhere
    assert asked == [1, 2, 5]  # never asked of requests without a home elsewhere
    assert next(order).request_id == 5  # fits here
    assert order.pass_over_unfit(None, 300, 700, 10, (CHUNK, BLOCK), skip) == []  # 6 failed somewhere
    assert next(order).request_id == 6
    without_skip = PassingOrder(iter(queue), "a")
    assert without_skip.pass_over_unfit(None, 300, 700, 10, (CHUNK, BLOCK)) == []  # 1 has a home elsewhere


def test_a_request_held_for_its_home_still_counts_against_the_homes_free_slots():
    """Request 1 does not fit the asker's KV and its home has one free slot: seer holds it there,
    so request 2 of the same home, which fits, is the asker's. Passing over request 1 without
    seer's skip would leave the home's slot free and hold request 2 for it instead."""
    def request(rid, prompt, estimate):
        return QueuedRequest(rid, rid, rid, 0, prompt, 64, 512, False, estimate, "h", 0.0, group_size=4,
                             group_finished=1, group_longest_unfinished=64)

    loads = (WorkerLoad("a", 0, 0, KV - 300, 32, KV, BLOCK), WorkerLoad("h", 1, 31, KV - 4000, 32, KV, BLOCK),
             WorkerLoad("b", 2, 0, KV - 4000, 32, KV, BLOCK))
    queue = RequestQueue.of([request(1, 400, 500), request(2, 100, 300)])
    snapshot = Snapshot(10.0, "a", 4, loads, queue, {}, {}, CHUNK)
    policy = SeerPolicy()
    assert [r.request_id for r in policy.order(snapshot)] == [1, 2]
    assert [a.request_id for a in policy.plan(snapshot).assignments] == [2]


def test_the_continuing_requests_come_first_among_the_non_probes_once_also_after_a_restart():
    def request(rid, *, probe=False):
        return QueuedRequest(rid, rid, rid, 0, 100, 0, 512, probe, 512, None, 0.0)

    p1, h, n1, n2 = request(1, probe=True), request(2), request(3), request(4)
    order = PassingOrder(iter([p1, n1, h, n2]), "a", frozenset({2}), [h])
    assert [next(order).request_id, next(order).request_id] == [1, 2]  # the probe, then the continuing one
    assert [r.request_id for r in order.restarted([p1, h])] == [1, 2, 3, 4]


def plain_seer_plan(policy: SeerPolicy, snapshot: Snapshot) -> Plan:
    """Seer's plan as first written: every test of a request's home worker spelled out, asked
    afresh per request (the policy's own keeps what it learnt of each home within a plan)."""
    limit = balanced_slots(snapshot, policy.balance_spread)
    if limit <= 0:
        return Plan()
    asking = snapshot.worker(snapshot.worker_id)
    room_left: dict[str, tuple[int, int]] = {}
    decided: dict[int, bool] = {}

    def leave_to_home(request: QueuedRequest) -> bool:
        if request.last_worker is None or request.last_worker == asking.worker_id:
            return False
        if request.last_worker in request.failed_on:
            return False
        home = snapshot.loads_by_id.get(request.last_worker)
        if home is None:
            return False
        slots, headroom = room_left.get(home.worker_id, (home.max_chunks - home.running_chunks,
                                                          home.kv_capacity_tokens - home.reserved_kv_tokens))
        if (slots <= 0 or home.running_chunks - asking.running_chunks > policy.affinity_spread
                or snapshot.now - request.queued_at > policy.starvation_s):
            return False
        need = kv_need(request, chunk_budget(request, snapshot.chunk_tokens), home.kv_block_tokens)
        if headroom < need:
            return False
        room_left[home.worker_id] = (slots - 1, headroom - need)
        return True

    def belongs_elsewhere(request: QueuedRequest) -> bool:
        if request.request_id not in decided:
            decided[request.request_id] = leave_to_home(request)
        return decided[request.request_id]

    return admit(snapshot, policy.order(snapshot), skip=belongs_elsewhere, limit=limit)


def test_seers_plans_are_those_of_its_home_tests_spelled_out():
    policy = SeerPolicy(affinity_spread=3)  # (homes much busier than the asker are common here)
    held = 0
    for seed in range(6):
        rng = random.Random(100 + seed)
        queue, loads = random_state(rng, rng.choice((300, 3000)), rng.choice((3, 10, 40)), probes=0.02)
        for _ in range(200):
            snapshot = Snapshot(rng.choice((100.0, 100.0, 1850.0)), loads[rng.randrange(len(loads))].worker_id,
                                rng.randint(1, 8), loads, queue, {}, {}, CHUNK)
            plan = policy.plan(snapshot)
            assert plan == plain_seer_plan(policy, snapshot), f"seed {seed}"
            held += plan != SeerPolicy(affinity_spread=-10**6).plan(snapshot)  # (never a home)
    assert held > 10  # plans where leaving requests to their homes changed what the asker got


def test_the_whole_chunk_need_is_kv_need_of_the_chunk_budget():
    rng = random.Random(0)
    for _ in range(2000):
        generated = rng.randint(0, 600)
        request = QueuedRequest(1, 1, 1, 0, rng.randint(1, 900), generated, generated + rng.randint(1, 300), False,
                                512, None, 0.0)
        chunk, block = rng.choice((1, 16, 64, 100)), rng.choice((1, 16, 128))
        assert whole_chunk_need(request, chunk, block) == kv_need(request, chunk_budget(request, chunk), block)
