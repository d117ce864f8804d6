"""The pure policies on hand-made snapshots (no database, no engine)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from seerd.scheduler import (
    DividedPolicy, GroupPolicy, QueuedRequest, RequestQueue, SeerPolicy, Snapshot, WorkerLoad,
)
from seerd.scheduler.forecast import GrowthRatios, expected_remaining, group_forecast
from seerd.scheduler.seer import SeerKey, seer_key


def req(rid, gid, gidx, generated=0, max_tokens=100, prompt_len=10, queued_at=0.0, resp=0):
    return QueuedRequest(rid, gid, gidx, resp, prompt_len, generated, max_tokens, resp == 0, max_tokens,
                         None, queued_at)


def load(wid, rank, running=0, reserved=0, max_chunks=4, kv=10_000):
    return WorkerLoad(wid, rank, running, reserved, max_chunks, kv)


def snap(worker, workers, queued, wanted=100, binding=None, groups=None, chunk=32):
    groups = groups if groups is not None else {r.group_id: r.group_index for r in queued}
    return Snapshot(0.0, worker, wanted, tuple(workers), RequestQueue.of(queued), binding or {}, groups, chunk)


def test_divided_is_fcfs_and_respects_slots_and_chunk_budget():
    queued = [req(3, 1, 1, queued_at=3.0), req(1, 0, 0, queued_at=1.0), req(2, 0, 0, queued_at=2.0, resp=1,
                                                                            generated=90)]
    plan = DividedPolicy().plan(snap("a", [load("a", 0, running=2)], queued))
    assert [(a.request_id, a.max_tokens) for a in plan.assignments] == [(1, 32), (2, 10)]


def test_divided_never_admits_more_kv_than_the_budget():
    queued = [req(i, i, i, queued_at=float(i)) for i in range(5)]  # each needs 10 + 0 + 32 = 42
    plan = DividedPolicy().plan(snap("a", [load("a", 0, reserved=100, kv=200, max_chunks=10)], queued))
    assert len(plan.assignments) == 2


def test_divided_honours_the_workers_wanted_count():
    queued = [req(i, i, i, queued_at=float(i)) for i in range(5)]
    assert len(DividedPolicy().plan(snap("a", [load("a", 0)], queued, wanted=1)).assignments) == 1


def test_group_binds_round_robin_by_group_index_and_ignores_kv():
    queued = [req(10 * g + k, g, g, resp=k) for g in range(4) for k in range(2)]
    workers = [load("b", 1, kv=1, max_chunks=1), load("a", 0, kv=1, max_chunks=1)]
    plan = GroupPolicy().plan(snap("a", workers, queued))
    assert dict(plan.new_bindings) == {0: "a", 1: "b", 2: "a", 3: "b"}
    assert [a.request_id for a in plan.assignments] == [0, 1, 20, 21]
    assert all(a.max_tokens == 100 for a in plan.assignments)  # never chunked


def test_group_rebinds_groups_of_a_gone_worker():
    queued = [req(0, 0, 0), req(1, 1, 1)]
    plan = GroupPolicy().plan(snap("a", [load("a", 0)], queued, binding={0: "a", 1: "dead"}))
    assert dict(plan.new_bindings) == {1: "a"}
    assert [a.request_id for a in plan.assignments] == [0, 1]


def seer_req(rid, gid, *, probe=False, generated=0, estimate=1000, queued_at=0.0, last=None, max_tokens=1000,
             n=4, finished=0, longest_unfinished=0):
    return QueuedRequest(rid, gid, gid, 0 if probe else 1, 10, generated, max_tokens, probe, estimate, last,
                         queued_at, n, finished, longest_unfinished)


def test_seer_serves_probes_first_shortest_generated_first():
    queued = [seer_req(1, 0, estimate=900, finished=1), seer_req(2, 1, probe=True, generated=50),
              seer_req(3, 2, probe=True, generated=10), seer_req(4, 3, estimate=50, finished=1)]
    order = [r.request_id for r in SeerPolicy().order(snap("a", [load("a", 0)], queued))]
    assert order == [3, 2, 1, 4]


def test_seer_serves_the_rest_most_expected_remaining_tokens_first():
    """Started or not, a request is served by its group's forecast less its own tokens (LPT):
    a response 600 tokens into a group forecast at 700 has less left than a new one at 300."""
    queued = [seer_req(1, 0, estimate=50, finished=1), seer_req(2, 1, estimate=700, finished=1),
              seer_req(3, 2, estimate=300, finished=1),
              seer_req(4, 1, estimate=700, finished=1, generated=600, longest_unfinished=600, queued_at=5.0)]
    order = [r.request_id for r in SeerPolicy().order(snap("a", [load("a", 0)], queued))]
    assert order == [2, 3, 4, 1]


def test_seer_assumes_long_for_groups_with_nothing_finished():
    # The paper's start value: a group with no finished response is estimated at its max_tokens.
    queued = [seer_req(1, 0, estimate=400, finished=2), seer_req(2, 1, estimate=1000, finished=0)]
    order = [r.request_id for r in SeerPolicy().order(snap("a", [load("a", 0)], queued))]
    assert order == [2, 1]


def test_seer_breaks_ties_at_max_tokens_by_the_longest_running_response():
    """CI, 2026-11-21: worker b asked while the probes it could take were left to a (it ran them
    and had a free slot); among non-probes, every group with nothing finished is at max_tokens,
    and the tie went by age to a short group whose probe had not finished its first chunk. The
    group whose probe has already run 64 tokens is the better bet for long."""
    queued = [seer_req(1, 0, probe=True, generated=32, last="a", longest_unfinished=32),
              seer_req(2, 3, longest_unfinished=0, queued_at=0.0),  # probe still in its first chunk
              seer_req(3, 4, longest_unfinished=64, queued_at=0.0)]
    plan = SeerPolicy().plan(snap("b", [load("a", 0, running=1), load("b", 1, running=1)], queued, wanted=1))
    assert [a.request_id for a in plan.assignments] == [3]


def test_seer_scales_a_groups_estimate_by_the_learned_growth():
    """Two groups with the same longest finished response: the one with fewer finished responses
    is expected to grow more (ratios learned from completed groups), so it goes first."""
    growth = GrowthRatios(1, {(4, 1): 3.0, (4, 3): 1.1})
    queued = [seer_req(1, 0, estimate=200, finished=3), seer_req(2, 1, estimate=200, finished=1),
              seer_req(3, 2, estimate=500, finished=3)]
    snapshot = Snapshot(0.0, "a", 10, (load("a", 0),), RequestQueue.of(queued), {}, {}, 32, growth)
    assert [r.request_id for r in SeerPolicy().order(snapshot)] == [2, 3, 1]  # 600 > 550 > 220


def test_seer_never_leaves_a_response_running_past_its_groups_forecast_behind():
    """A response past its group's longest finished one raises the group's forecast through the
    running term (tokens so far x the one-finish ratio), so it keeps priority at chunk boundaries
    over new responses of groups that finished short: it has run longer than they are expected to."""
    growth = GrowthRatios(1, {(4, 1): 2.0, (4, 2): 1.5})
    outlier = seer_req(1, 0, estimate=100, finished=2, generated=300, longest_unfinished=300, queued_at=9.0)
    fresh = seer_req(2, 1, estimate=150, finished=2)
    snapshot = Snapshot(0.0, "a", 10, (load("a", 0),), RequestQueue.of([outlier, fresh]), {}, {}, 32, growth)
    assert [r.request_id for r in SeerPolicy().order(snapshot)] == [1, 2]
    # 300 x 2.0 = 600 expected, 300 left; the fresh one: 150 x 1.5 = 225 left.
    assert group_forecast(outlier, growth) == 600 and expected_remaining(outlier, growth) == 300
    assert expected_remaining(fresh, growth) == 225
    long_run = seer_req(3, 0, estimate=100, finished=2, generated=800, longest_unfinished=800)
    assert group_forecast(long_run, growth) == 1000  # never past max_tokens


def test_seer_rebuilds_its_order_when_the_growth_table_changes():
    queue = RequestQueue.of([seer_req(1, 0, estimate=300, finished=1), seer_req(2, 1, estimate=400, finished=3)])
    before = Snapshot(0.0, "a", 10, (load("a", 0),), queue, {}, {}, 32, GrowthRatios(1, {}))
    assert [r.request_id for r in SeerPolicy().order(before)] == [2, 1]
    after = Snapshot(0.0, "a", 10, (load("a", 0),), queue, {}, {}, 32, GrowthRatios(2, {(4, 1): 2.0}))
    assert [r.request_id for r in SeerPolicy().order(after)] == [1, 2]  # 600 > 400, same queue object


def test_seer_starvation_bound_serves_the_oldest_first():
    old = seer_req(9, 5, estimate=1, queued_at=0.0)
    queued = [seer_req(1, 0, probe=True, queued_at=500.0), old]
    snapshot = Snapshot(301.0, "a", 10, (load("a", 0),), RequestQueue.of(queued), {}, {0: 0, 5: 5}, 32)
    assert [r.request_id for r in SeerPolicy(starvation_s=300).order(snapshot)] == [9, 1]


def test_seer_never_exceeds_the_kv_budget_and_stops_at_the_head():
    queued = [seer_req(1, 0, probe=True), seer_req(2, 1, probe=True, generated=5),
              seer_req(3, 2, estimate=10, max_tokens=10)]
    # Each probe needs 10 + generated + 32; the budget admits the first only, then stops.
    plan = SeerPolicy().plan(snap("a", [load("a", 0, kv=60)], queued))
    assert [a.request_id for a in plan.assignments] == [1]


def test_seer_leaves_a_request_to_the_worker_holding_its_prefix_unless_spread_is_large():
    queued = [seer_req(1, 0, last="b"), seer_req(2, 1)]
    calm = SeerPolicy().plan(snap("a", [load("a", 0), load("b", 1, running=3)], queued))
    assert [a.request_id for a in calm.assignments] == [2]
    busy = SeerPolicy(affinity_spread=2).plan(snap("a", [load("a", 0), load("b", 1, running=3)], queued))
    assert [a.request_id for a in busy.assignments] == [1, 2]


def test_seer_serves_starved_requests_one_per_call_oldest_first():
    starved = [seer_req(10 + i, 5 + i, estimate=1, queued_at=float(i)) for i in range(3)]
    queued = [seer_req(1, 0, probe=True, queued_at=700.0), *starved]
    snapshot = Snapshot(700.0, "a", 10, (load("a", 0),), RequestQueue.of(queued), {}, {}, 32)
    # Only the oldest starved one jumps the queue; the others keep their place (estimate order).
    assert [r.request_id for r in SeerPolicy(starvation_s=600).order(snapshot)] == [10, 1, 11, 12]
    assert [r.request_id for r in SeerPolicy(starvation_s=600, starved_per_call=2).order(snapshot)][:2] == [10, 11]


def test_seer_affinity_only_to_a_worker_with_kv_room():
    queued = [seer_req(1, 0, last="b"), seer_req(2, 1)]
    full = [load("a", 0), load("b", 1, reserved=9_990, kv=10_000)]  # b has slots but no KV room
    plan = SeerPolicy().plan(snap("a", full, queued))
    assert [a.request_id for a in plan.assignments] == [1, 2]


def test_seer_leaves_a_home_worker_only_as_many_requests_as_it_has_free_slots():
    # b ran all three before and has one free slot: it keeps one, a takes the other two.
    queued = [seer_req(1, 0, last="b"), seer_req(2, 1, last="b"), seer_req(3, 2, last="b")]
    workers = [load("a", 0), load("b", 1, running=3, max_chunks=4)]
    plan = SeerPolicy().plan(snap("a", workers, queued))
    assert [a.request_id for a in plan.assignments] == [2, 3]
    # The same with b's KV room for one chunk only (each needs 10 + 32 = 42 tokens).
    roomy = [load("a", 0), load("b", 1, running=0, max_chunks=4, reserved=10_000 - 50)]
    plan = SeerPolicy().plan(snap("a", roomy, queued))
    assert [a.request_id for a in plan.assignments] == [2, 3]


def test_seer_order_follows_estimate_updates_in_the_queue_index():
    queue = RequestQueue.of([seer_req(1, 0, estimate=100, finished=1), seer_req(2, 1, estimate=200, finished=1)])
    snapshot = Snapshot(0.0, "a", 10, (load("a", 0),), queue, {}, {}, 32)
    assert [r.request_id for r in SeerPolicy().order(snapshot)] == [2, 1]
    queue.put(seer_req(1, 0, estimate=900, finished=2))  # the lease book re-puts a group's views on a finish
    assert [r.request_id for r in SeerPolicy().order(snapshot)] == [1, 2]


def test_oracle_serves_the_longest_true_length_first_in_chunks():
    from seerd.scheduler.oracle import OraclePolicy

    queued = [seer_req(1, 0), seer_req(2, 1), seer_req(3, 2)]
    plan = OraclePolicy({1: 20, 2: 90, 3: 50}).plan(snap("a", [load("a", 0)], queued))
    assert [(a.request_id, a.max_tokens) for a in plan.assignments] == [(2, 32), (3, 32), (1, 32)]


def test_streamrl_oracle_is_group_atomic_and_bucketed():
    from seerd.scheduler.oracle import StreamRLOraclePolicy

    # Group 0: longest 300 (bucket 9); group 1: 40 (bucket 6); group 2: 260 (bucket 9).
    queued = [req(1, 0, 0, resp=0), req(2, 0, 0, resp=1), req(3, 1, 1, resp=0), req(4, 2, 2, resp=0),
              req(5, 2, 2, resp=1)]
    true_lengths = {1: 300, 2: 10, 3: 40, 4: 260, 5: 200}
    policy = StreamRLOraclePolicy(true_lengths)
    plan = policy.plan(snap("a", [load("a", 0, max_chunks=3)], queued))
    # Bucket 9 in input order: group 0 (2 requests) fits; group 2 (2 more) does not: stop there.
    assert [(a.request_id, a.max_tokens) for a in plan.assignments] == [(1, 300), (2, 10)]
    rest = [r for r in queued if r.request_id not in (1, 2)]
    plan = policy.plan(snap("a", [load("a", 0, max_chunks=4)], rest))
    assert [a.request_id for a in plan.assignments] == [4, 5, 3]


def test_queue_indexes_stay_sorted_under_random_puts_and_removes():
    import random

    rng = random.Random(7)
    queue = RequestQueue()
    key = lambda r: (-r.group_estimate, r.queued_at)  # noqa: E731
    list(queue.ordered("test", key))
    live: dict[int, QueuedRequest] = {}
    for step in range(2000):
        rid = rng.randrange(200)
        if rid in live and rng.random() < 0.4:
            queue.remove(rid)
            del live[rid]
        else:
            live[rid] = seer_req(rid, rid % 17, estimate=rng.randrange(50), queued_at=float(step))
            queue.put(live[rid])
        if step % 100 == 0:
            expected = sorted(live.values(), key=lambda r: (key(r), r.request_id))
            assert [r.request_id for r in queue.ordered("test", key)] == [r.request_id for r in expected]
            assert [r.request_id for r in queue.fcfs()] == [r.request_id for r in sorted(
                live.values(), key=lambda r: (r.queued_at, r.request_id))]


def test_a_queued_request_put_again_is_where_a_fresh_queue_puts_it():
    """`put` of a queued request's new view moves it only in the orders whose key changed
    (`RequestQueue._replace`): whatever changed (its group's progress, its place in line, its
    context, or nothing), every order, first-come order and the shortest context are those of a
    queue built afresh from the same views."""
    import dataclasses
    import random

    rng = random.Random(11)
    queue = RequestQueue()
    key = lambda r: (-r.group_estimate, r.group_longest_unfinished)  # noqa: E731 - queued_at not in it
    list(queue.ordered("test", key))
    live: dict[int, QueuedRequest] = {}
    for step in range(3000):
        rid = rng.randrange(120)
        old = live.get(rid)
        if old is None:
            live[rid] = seer_req(rid, rid % 9, estimate=rng.randrange(40), generated=rng.randrange(4000),
                                 queued_at=float(step))
        elif rng.random() < 0.2:
            queue.remove(rid)
            del live[rid]
            continue
        else:  # the same request again, with one thing changed, or nothing
            change = rng.choice(["estimate", "longest", "queued_at", "generated", "nothing"])
            live[rid] = dataclasses.replace(old, **{
                "estimate": {"group_estimate": rng.randrange(40)},
                "longest": {"group_longest_unfinished": rng.randrange(5)},
                "queued_at": {"queued_at": float(step)},
                "generated": {"generated": rng.randrange(4000)},
                "nothing": {}}[change])
        queue.put(live[rid])
        if step % 50 == 0:
            fresh = RequestQueue.of(live.values())
            assert [r.request_id for r in queue.ordered("test", key)] == [r.request_id for r in fresh.ordered("test", key)]
            assert [r.request_id for r in queue.fcfs()] == [r.request_id for r in fresh.fcfs()]
            assert queue.shortest_context() == fresh.shortest_context()
            assert all(queue.get(r) == live[r] for r in live)


def put_or_remove_at_random(rng: random.Random, queue: RequestQueue, live: dict[int, QueuedRequest],
                            group_state: dict[int, dict], queued_at: float = 0.0) -> None:
    """One random change of a queue of seer's requests (23 groups of 300 ids): a remove, or a put
    of a request whose group's state its members mostly share."""
    rid = rng.randrange(300)
    if rid in live and rng.random() < 0.3:
        queue.remove(rid)
        del live[rid]
        return
    gid = rid % 23
    if gid not in group_state or rng.random() < 0.2:
        group_state[gid] = dict(estimate=rng.randrange(100, 1000), finished=rng.choice([0, 0, 1, 3]),
                                longest_unfinished=rng.choice([0, 0, rng.randrange(1, 600)]))
    live[rid] = seer_req(rid, gid, probe=rng.random() < 0.1, generated=rng.randrange(0, 400, 16), n=8,
                         queued_at=queued_at, **group_state[gid])
    queue.put(live[rid])


@pytest.mark.parametrize("memo_limit", [SeerKey.MEMO_LIMIT, 4])
def test_seers_index_re_keys_only_what_reads_the_growth_table_and_equals_a_fresh_sort(monkeypatch, memo_limit):
    # A new growth table re-keys only the requests `reads_growth` names (the others' keys cannot
    # change); after random puts, removes and table changes the order is a full sort's. The
    # index keys with `SeerKey`, as the policy does (forecasts kept per group state, forgotten
    # past the memo's limit), the full sort with `seer_key`.
    from seerd.scheduler.seer import reads_growth

    monkeypatch.setattr(SeerKey, "MEMO_LIMIT", memo_limit)

    rng = random.Random(11)
    queue = RequestQueue()
    live: dict[int, QueuedRequest] = {}
    growth = GrowthRatios(0, {})
    group_state: dict[int, dict] = {}
    for step in range(3000):
        put_or_remove_at_random(rng, queue, live, group_state, queued_at=float(step))
        if step % 150 == 0:  # the table changes
            growth = GrowthRatios(growth.version + 1, {(8, k): 1 + rng.random() for k in range(1, 8)})
        if step % 50 == 0:
            got = [r.request_id for r in queue.ordered("seer", SeerKey(growth), growth.version, reads_growth)]
            assert got == [r.request_id for r in sorted(live.values(), key=lambda r: (seer_key(r, growth),
                                                                                     r.request_id))], step


def test_a_re_key_built_aside_serves_the_old_order_until_taken_up_then_a_fresh_sorts():
    # The coordinator builds a new growth table's order on a thread of its own (`rekey_aside`):
    # the order in place serves until a later call takes the built one up, and the requests put or
    # removed while it was built are keyed as they are then. On a real thread; the test waits for
    # each build before the call that takes it up, so nothing depends on timing.
    from concurrent.futures import ThreadPoolExecutor

    from seerd.scheduler.seer import reads_growth

    builds = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        def submit(*args):
            builds.append(pool.submit(*args))
            return builds[-1]

        rng = random.Random(13)
        queue = RequestQueue(rekey_aside=submit)
        live: dict[int, QueuedRequest] = {}
        group_state: dict[int, dict] = {}

        def churn(steps: int) -> None:
            for _ in range(steps):
                put_or_remove_at_random(rng, queue, live, group_state)

        def order(growth):
            return [r.request_id for r in queue.ordered("seer", SeerKey(growth), growth.version, reads_growth)]

        def sort(growth):
            return [r.request_id for r in sorted(live.values(), key=lambda r: (seer_key(r, growth), r.request_id))]

        growth = GrowthRatios(0, {})
        churn(300)
        assert order(growth) == sort(growth)  # the first index is built in place
        for round_ in range(12):
            old, growth = growth, GrowthRatios(growth.version + 1, {(8, k): 1 + rng.random() for k in range(1, 8)})
            built = len(builds)
            assert order(growth) == sort(old)  # building aside: the old order serves
            assert len(builds) == built + 1
            churn(40)  # puts and removes while it is built
            if round_ % 3 == 2:  # and a newer table before it is taken up
                growth = GrowthRatios(growth.version + 1, {(8, k): 1 + rng.random() for k in range(1, 8)})
                order(growth)
            while True:  # take up each build once built, until the newest is in place
                built = len(builds)
                builds[-1].result()
                got = order(growth)
                if len(builds) == built:
                    break
            assert got == sort(growth), round_


def test_an_index_whose_key_changed_unannounced_says_so_rather_than_dropping_another_request():
    queue = RequestQueue.of([seer_req(1, 0, estimate=10), seer_req(2, 0, estimate=20)])
    table = {"scale": 1}
    key = lambda r: (r.group_estimate * table["scale"],)  # noqa: E731 - reads a table, unannounced
    list(queue.ordered("test", key, 1, lambda _r: False))
    table["scale"] = -1
    list(queue.ordered("test", key, 2, lambda _r: False))  # "no key changes": a broken promise
    with pytest.raises(RuntimeError, match="its key changed while it was queued"):
        queue.remove(2)  # its new key would find request 1 first: that one must not go


def test_a_worker_takes_no_more_than_32_chunks_beyond_the_least_loaded_one():
    from seerd.scheduler.base import balanced_slots

    queued = [req(i, i, i, queued_at=float(i)) for i in range(100)]
    fresh = [load("a", 0, max_chunks=200, kv=10**6), load("b", 1, max_chunks=200, kv=10**6)]
    assert balanced_slots(snap("a", fresh, queued)) == 32
    assert len(DividedPolicy().plan(snap("a", fresh, queued)).assignments) == 32
    ahead = [load("a", 0, running=40, max_chunks=200, kv=10**6), load("b", 1, max_chunks=200, kv=10**6)]
    assert DividedPolicy().plan(snap("a", ahead, queued)).assignments == ()
    # A lighter worker without KV room for a chunk does not hold the others back.
    full = [load("a", 0, running=40, max_chunks=200, kv=10**6), load("b", 1, reserved=10**6, kv=10**6)]
    assert len(DividedPolicy().plan(snap("a", full, queued)).assignments) == 100


def test_the_balance_cap_binds_only_while_the_queue_cannot_fill_every_worker():
    from seerd.scheduler.base import balanced_slots

    plenty = [req(i, i, i, queued_at=float(i)) for i in range(300)]
    fresh = [load("a", 0, max_chunks=64, kv=10**6), load("b", 1, max_chunks=64, kv=10**6)]
    assert balanced_slots(snap("a", fresh, plenty)) == 64  # 236 stay for b's 64 slots
    short = plenty[:100]  # 36 beyond b's 64 free slots: a takes those or the spread, the larger
    assert balanced_slots(snap("a", fresh, short)) == 36
    assert balanced_slots(snap("a", fresh, plenty[:80])) == 32


def test_a_request_that_fits_only_another_worker_is_left_for_it():
    queued = [req(1, 0, 0, queued_at=0.0, generated=90, prompt_len=100),  # needs 100 + 90 + 10 = 200
              req(2, 1, 1, queued_at=1.0)]  # needs 10 + 32 = 42
    small_here = [load("a", 0, kv=100), load("b", 1, kv=1000)]
    assert [a.request_id for a in DividedPolicy().plan(snap("a", small_here, queued)).assignments] == [2]
    nowhere = [load("a", 0, kv=100), load("b", 1, kv=150)]  # the head fits no worker: wait for room
    assert DividedPolicy().plan(snap("a", nowhere, queued)).assignments == ()


# ------------------------------------------------------------ in-place continuation
def test_divided_keeps_a_request_continuing_in_place_before_older_queued_ones():
    """FCFS decides which request starts, not which running one stops at a boundary: a request
    whose engine request runs on here (reported, re-queued last) keeps its slot."""
    queued = [req(1, 0, 0, queued_at=1.0), req(2, 1, 1, queued_at=2.0), req(9, 9, 9, queued_at=9.0, generated=32)]
    base = snap("a", [load("a", 0, max_chunks=1)], queued, wanted=1)
    assert [a.request_id for a in DividedPolicy().plan(base).assignments] == [1]  # without: the oldest
    continuing = replace(base, continuing=frozenset({9}))
    assert [a.request_id for a in DividedPolicy().plan(continuing).assignments] == [9]


def test_seer_keeps_continuing_non_probes_before_other_non_probes_but_not_before_a_waiting_probe():
    queued = [seer_req(1, 0, estimate=900), seer_req(2, 1, probe=True),
              seer_req(3, 2, estimate=300, generated=256, queued_at=5.0),  # continues in place
              seer_req(4, 3, estimate=500, generated=256, queued_at=6.0)]  # continues in place
    base = snap("a", [load("a", 0)], queued)
    assert [r.request_id for r in SeerPolicy().order(base)] == [2, 1, 4, 3]
    continuing = replace(base, continuing=frozenset({3, 4}))
    # The probe first (its class), then the continuing ones in seer's own order, then the rest.
    assert [r.request_id for r in SeerPolicy().order(continuing)] == [2, 4, 3, 1]
    # A continuing probe is a probe: ordered with the probes, never twice.
    queued[1] = seer_req(2, 1, probe=True, generated=256)
    both = replace(snap("a", [load("a", 0)], queued), continuing=frozenset({2, 3}))
    assert [r.request_id for r in SeerPolicy().order(both)] == [2, 3, 1, 4]


def test_kv_is_reserved_in_the_engines_whole_blocks():
    """vLLM holds a sequence's KV in whole blocks: 42 tokens of context + budget take one block of
    128, so a worker with 4 blocks takes 4 chunks, not 512 / 42 = 12."""
    queued = [req(i, i, i, queued_at=float(i)) for i in range(8)]  # each 10 + 0 + 32 = 42 tokens
    worker = WorkerLoad("a", 0, 0, 0, 16, 512, kv_block_tokens=128)
    assert len(DividedPolicy().plan(snap("a", [worker], queued)).assignments) == 4
    assert len(DividedPolicy().plan(snap("a", [load("a", 0, kv=512, max_chunks=16)], queued)).assignments) == 8


def test_a_chunk_is_shortened_to_the_kv_left_rather_than_left_waiting():
    """Requests of context 10 and chunk 32 (42 tokens each): with 2 x 42 + 10 + MIN_SHRUNK_BUDGET
    tokens free, two get whole chunks and the third the shortest chunk allowed; with one token
    less the third waits."""
    from seerd.scheduler.base import MIN_SHRUNK_BUDGET

    queued = [req(i, i, i, queued_at=float(i)) for i in range(4)]
    free = 2 * 42 + 10 + MIN_SHRUNK_BUDGET
    plan = DividedPolicy().plan(snap("a", [load("a", 0, reserved=200 - free, kv=200, max_chunks=10)], queued))
    assert [a.max_tokens for a in plan.assignments] == [32, 32, MIN_SHRUNK_BUDGET]
    plan = DividedPolicy().plan(snap("a", [load("a", 0, reserved=200 - free + 1, kv=200, max_chunks=10)], queued))
    assert [a.max_tokens for a in plan.assignments] == [32, 32]


def test_a_shortened_chunk_fills_the_last_block_and_never_exceeds_it():
    # Blocks of 128, 2 free: a context of 200 holds 256 - 200 = 56 more tokens, not its chunk of 100.
    queued = [QueuedRequest(1, 1, 1, 0, 150, 50, 1000, True, 1000, None, 0.0)]
    worker = WorkerLoad("a", 0, 0, 128 * 8, 16, 128 * 10, kv_block_tokens=128)
    (assignment,) = DividedPolicy().plan(snap("a", [worker], queued, chunk=100)).assignments
    assert assignment.max_tokens == 56


def test_under_kv_pressure_every_chunk_is_lean_so_more_sequences_run():
    """Blocks of 128, 10 free, chunk 1024, contexts of 100: a whole chunk needs 9 blocks (one
    request would run); lean chunks fill the context's block and one more (156 tokens, 2 blocks):
    five run, as vLLM's own admission would run them, each reserving what it can grow into."""
    from seerd.scheduler.base import lean_budget

    queued = [QueuedRequest(i, i, i, 0, 100, 0, 2048, True, 2048, None, float(i)) for i in range(8)]
    tight = WorkerLoad("a", 0, 0, 0, 16, 128 * 10, kv_block_tokens=128)
    for policy in (DividedPolicy(), SeerPolicy()):
        plan = policy.plan(snap("a", [tight], queued, chunk=1024))
        assert [a.max_tokens for a in plan.assignments] == [156] * 5
    assert lean_budget(queued[0], 1024, 128) == 156
    # A context that ends on a block boundary grows by exactly one block; never past its chunk.
    on_boundary = QueuedRequest(9, 9, 9, 0, 200, 56, 2048, True, 2048, None, 0.0)
    assert lean_budget(on_boundary, 1024, 128) == 128 and lean_budget(on_boundary, 64, 128) == 64
    # A long context grows by a quarter of itself (fewer reports), to a block boundary.
    long = QueuedRequest(10, 10, 10, 0, 100, 3900, 16384, True, 16384, None, 0.0)
    assert lean_budget(long, 8192, 128) == 5120 - 4000 and lean_budget(long, 8192, 16) == 5008 - 4000
    # With room for every candidate's whole chunk nothing is lean.
    roomy = WorkerLoad("a", 0, 0, 0, 16, 128 * 9 * 8, kv_block_tokens=128)
    plan = DividedPolicy().plan(snap("a", [roomy], queued, chunk=1024))
    assert [a.max_tokens for a in plan.assignments] == [1024] * 8


def test_lean_admission_keeps_continuing_requests_first():
    """At a boundary under pressure the sequence already running here takes its next blocks
    before a new one starts: the policy, not the engine's preemption, decides who waits."""
    queued = [QueuedRequest(i, i, i, 0, 100, 0, 2048, True, 2048, None, float(i)) for i in range(3)]
    queued.append(QueuedRequest(7, 7, 7, 0, 100, 300, 2048, True, 2048, None, 9.0))  # ran 300 here
    tight = WorkerLoad("a", 0, 0, 0, 16, 128 * 5, kv_block_tokens=128)
    snapshot = replace(snap("a", [tight], queued, chunk=1024), continuing=frozenset({7}))
    plan = DividedPolicy().plan(snapshot)
    # 400 tokens of context: its 4 blocks hold 112 more, lean gives it 240 (5 blocks); nothing else fits.
    assert [(a.request_id, a.max_tokens) for a in plan.assignments] == [(7, 240)]


def test_the_open_workers_summary_answers_as_a_scan_of_every_worker_would():
    # Free slots, fewest running and the most KV room elsewhere, through 3,000 random load changes
    # (enough to start the room heap over from its stale entries a few times).
    import random

    from seerd.scheduler.views import OpenWorkers, can_take_a_chunk

    rng = random.Random(0)
    chunk = 32
    loads = [load(f"w{i}", i, running=rng.randrange(5), reserved=rng.choice([0, 9_980, 9_990]), max_chunks=4)
             for i in range(40)]
    summary = OpenWorkers.of(loads, chunk)
    for step in range(3_000):
        slot = rng.randrange(len(loads))
        changed = replace(loads[slot], running_chunks=min(4, rng.randrange(6)),
                          reserved_kv_tokens=rng.choice([0, 9_975, rng.randrange(10_000)]))
        summary.remove(loads[slot], chunk)
        summary.add(changed, chunk)
        loads[slot] = changed
        assert summary == OpenWorkers.of(loads, chunk), step
        me = loads[rng.randrange(len(loads))]
        others = [w for w in loads if w.worker_id != me.worker_id and can_take_a_chunk(w, chunk)]
        assert summary.others(me, chunk) == (sum(w.max_chunks - w.running_chunks for w in others),
                                             min((w.running_chunks for w in others), default=None)), step
        assert summary.most_room_but(me.worker_id) == max(
            (w.kv_capacity_tokens - w.reserved_kv_tokens for w in loads
             if w.worker_id != me.worker_id and w.running_chunks < w.max_chunks), default=-1), step


def test_a_worker_that_could_not_take_a_request_is_never_given_it():
    # `SchedulerState.could_take` (`room_for`: whom a re-queued request may wake) is a necessary condition of
    # every chunking policy's admission: a worker it says no to gets no chunk of that request,
    # whatever else holds its slots and KV.
    from seerd.scheduler import make_policy
    from seerd.scheduler.state import SchedulerState
    from seerd.scheduler.records import GroupRecord, RequestRecord

    rng = random.Random(7)
    refused = 0
    for case in range(400):
        block = rng.choice([1, 16, 128])
        state = SchedulerState(chunk_tokens=rng.choice([16, 64, 256]))
        big = rng.randint(1, 900)  # group 0's prompt: leased first, it holds KV (or cannot)
        prompt, generated = rng.randint(1, 600), rng.randint(0, 300)
        state.load([GroupRecord(0, 0, big, 1, 2000, 2000), GroupRecord(1, 1, prompt, 1, 2000, 2000)],
                   [RequestRecord(0, 0, 0, True, 2000),
                    RequestRecord(1, 1, 0, True, generated + rng.randint(1, 600), generated=generated)])
        state.add_worker("w", rank=0, max_chunks=rng.randint(1, 3), kv_capacity_tokens=rng.randint(64, 2048),
                         kv_block_tokens=block)
        hold = make_policy("divided").plan(state.snapshot("w", 1, 0.0))
        held = tuple(a for a in hold.assignments if a.request_id == 0)
        state.apply_leases("w", replace(hold, assignments=held), [10] * len(held))
        if not state.is_queued(1) or state.could_take("w", state.context_of(1)):
            continue
        refused += 1
        for policy in ("divided", "seer"):
            plan = make_policy(policy).plan(state.snapshot("w", 3, 0.0))
            assert all(a.request_id != 1 for a in plan.assignments), (case, policy)
    assert refused > 50  # the random cases did try the refusal


def test_the_queues_shortest_context_follows_puts_and_removes():
    rng = random.Random(5)
    queue = RequestQueue()
    live: dict[int, QueuedRequest] = {}
    for step in range(4000):
        rid = rng.randrange(200)
        if rid in live and rng.random() < 0.4:
            queue.remove(rid)
            del live[rid]
        else:  # a put, often of a request already queued (a refreshed view, a longer context)
            live[rid] = req(rid, rid % 17, 0, generated=rng.randrange(0, 500), prompt_len=rng.randrange(1, 50))
            queue.put(live[rid])
        expected = min((r.prompt_len + r.generated for r in live.values()), default=None)
        assert queue.shortest_context() == expected, step
    assert len(queue._contexts) <= 2 * len(live) + 65  # stale entries do not pile up


@pytest.mark.parametrize("policy", [SeerPolicy, DividedPolicy])
def test_a_worker_without_room_past_the_shortest_context_gets_the_plan_admission_would_give(monkeypatch, policy):
    # `admit` answers at once when the asking worker has no KV room for a token past the shortest
    # queued context: the same plan as looking at every request, on tight, blocky KV.
    from seerd.scheduler import base

    rng = random.Random(8)
    for case in range(400):
        block = rng.choice([1, 16, 128])
        workers = [WorkerLoad(w, i, rng.randrange(0, 4), rng.randrange(0, 6) * block, 4, 6 * block + rng.randrange(3),
                              block) for i, w in enumerate("abc")]
        queued = [replace(seer_req(rid, rid // 4, probe=rid % 4 == 0, generated=rng.randrange(0, 3 * block + 1),
                                   last=rng.choice([None, "a", "b", "c"]), finished=rng.choice([0, 1]),
                                   queued_at=float(rid)),
                          prompt_len=rng.randrange(1, 2 * block + 2))
                  for rid in range(rng.randrange(1, 12))]
        snapshot = snap("a", workers, queued)
        quick = policy().plan(snapshot)
        with monkeypatch.context() as patched:
            patched.setattr(base, "_room_for_any", lambda _snapshot: True)
            assert policy().plan(snapshot) == quick, case


def test_workers_that_join_after_the_loads_were_built_are_appended_as_a_rebuild_would_have_them():
    # `add_worker` appends the new worker's load (not every live worker's rebuilt, which cost a
    # millisecond per lease at 512 workers while they joined): the loads, their index and the
    # open-workers summary are those of a state that rebuilt them all, with leases held meanwhile.
    from seerd.scheduler import make_policy
    from seerd.scheduler.state import SchedulerState
    from seerd.scheduler.records import GroupRecord, RequestRecord
    from seerd.scheduler.views import OpenWorkers

    state = SchedulerState(chunk_tokens=16, first_chunk_spread=0.0)
    state.load([GroupRecord(g, g, 20, 2, 200, 200) for g in range(6)],
               [RequestRecord(2 * g + i, g, i, True, 200) for g in range(6) for i in range(2)])
    next_chunk = iter(range(100, 1000))
    for rank in range(5):
        state.add_worker(f"w{rank}", rank=rank, max_chunks=2 + rank, kv_capacity_tokens=400 + 100 * rank)
        assert state.worker_loads()[-1].worker_id == f"w{rank}"  # seen at once, before any lease
        plan = make_policy("divided").plan(state.snapshot(f"w{rank}", 2, 0.0))  # builds the loads
        state.apply_leases(f"w{rank}", plan, [next(next_chunk) for _ in plan.assignments])
        if rank == 2:
            state.set_live("w1", False)  # one leaves meanwhile: the loads rebuilt, then appended to again
        loads = state.worker_loads()
        snapshot = state.snapshot(f"w{rank}", 1, 0.0)
        assert [load.worker_id for load in loads] == [f"w{r}" for r in range(rank + 1) if r != 1 or rank < 2]
        assert dict(snapshot.loads_by_id) == {load.worker_id: load for load in loads}
        assert snapshot.open_workers == OpenWorkers.of(loads, state.chunk_tokens)
        state._load_list = state._loads = None  # what a full rebuild gives
        assert state.worker_loads() == loads, rank
    assert sum(load.running_chunks for load in loads) > 0  # leases were held as workers joined
