"""The grouped draft server: appends (idempotent, out of order, rewrites), fetch deltas, TTL,
memory bound. Time is a fake clock moved by hand."""

from __future__ import annotations

import json
import random

import msgspec
import pytest

from seerd.drafts import DraftError, DraftServer, SuffixIndex, UnknownGroup, UnknownRequest
from seerd.drafts.server import MAX_PENDING_SEGMENTS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server(clock: Clock) -> DraftServer:
    server = DraftServer(clock=clock)
    server.register(7, ttl_s=60)
    return server


class Client:
    """What a worker keeps: the tokens it holds per group and request, and their generations."""

    def __init__(self) -> None:
        self.held: dict[int, dict[int, list[int]]] = {}
        self.gens: dict[int, dict[int, int]] = {}

    def cursors(self, groups) -> dict:
        return {g: {r: (self.gens[g][r], len(t)) for r, t in self.held.get(g, {}).items()} for g in groups}

    def apply(self, result) -> int:
        """Apply a fetch result; returns how many tokens it carried."""
        carried = 0
        for group, requests in result.changes.items():
            for request, (gen, start, tokens) in requests.items():
                held = self.held.setdefault(group, {}).setdefault(request, [])
                assert start <= len(held)
                del held[start:]
                held.extend(tokens)
                self.gens.setdefault(group, {})[request] = gen
                carried += len(tokens)
        for group, requests in result.dropped.items():
            for request in requests:
                del self.held[group][request], self.gens[group][request]
        for group in result.unknown:
            self.held.pop(group, None)
            self.gens.pop(group, None)
        return carried


def test_appends_in_order_and_repeated_appends_change_nothing(server):
    assert server.append(7, 0, 0, [1, 2, 3]).count == 3
    again = server.append(7, 0, 0, [1, 2, 3])
    assert (again.count, again.appended, again.rewritten) == (3, 0, False)
    overlap = server.append(7, 0, 2, [3, 4, 5])  # a retry that overlaps and extends
    assert (overlap.count, overlap.appended) == (5, 2)
    assert server.tokens(7, 0) == [1, 2, 3, 4, 5]
    assert server.append(7, 0, 1, [2]).appended == 0
    assert server.stats()["duplicates"] == 2


def test_out_of_order_segments_wait_for_the_gap(server):
    result = server.append(7, 0, 4, [5, 6])
    assert (result.count, result.pending, result.appended) == (0, 1, 0)
    assert server.append(7, 0, 8, [9]).pending == 2  # a further gap
    result = server.append(7, 0, 0, [1, 2, 3, 4])  # fills the first gap: 4..6 follows
    assert (result.count, result.pending, result.appended) == (6, 1, 6)
    result = server.append(7, 0, 6, [7, 8])
    assert (result.count, result.pending) == (9, 0)
    assert server.tokens(7, 0) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert server.stats()["tokens"] == 9


def test_a_first_append_past_zero_is_buffered_not_refused(server):
    result = server.append(7, 3, 16, [1, 2])
    assert (result.count, result.pending) == (0, 1)
    assert server.fetch({7: {}}).changes == {}  # nothing contiguous to serve yet


def test_pending_segments_are_bounded_and_the_writer_learns_where_to_resume(server):
    for i in range(MAX_PENDING_SEGMENTS + 3):
        result = server.append(7, 0, 10 + 2 * i, [i, i])
    assert result.pending == MAX_PENDING_SEGMENTS and result.count == 0
    assert server.stats()["tokens"] == 2 * MAX_PENDING_SEGMENTS  # pending tokens are held too
    # The nearest segments were kept: filling 0..10 releases them all.
    result = server.append(7, 0, 0, list(range(10)))
    assert (result.count, result.pending) == (10 + 2 * MAX_PENDING_SEGMENTS, 0)
    assert server.stats()["tokens"] == result.count


def test_a_rewrite_by_a_newer_writer_cuts_the_log_and_bumps_gen(server):
    first = server.append(7, 0, 0, [1, 2, 3, 4, 5, 6])
    server.append(7, 0, 10, [99])  # pending from the old writer
    rerun = server.append(7, 0, 2, [3, 9])  # the chunk re-ran elsewhere: token 3 differs
    assert rerun.rewritten and rerun.gen != first.gen
    assert (rerun.count, rerun.appended, rerun.pending) == (4, 1, 0)
    assert server.tokens(7, 0) == [1, 2, 3, 9]
    # The server cannot tell writers apart: whatever arrives last wins, even a late retry of
    # the old writer (the caller rejects appends of expired leases before they get here).
    stale = server.append(7, 0, 2, [3, 4, 5])
    assert stale.rewritten and server.tokens(7, 0) == [1, 2, 3, 4, 5]
    assert server.stats()["rewrites"] == 2


def test_a_buffered_segment_loses_against_newer_tokens_at_its_positions(server):
    server.append(7, 0, 4, [50, 60])  # arrives early (old writer)
    server.append(7, 0, 0, [1, 2, 3, 4, 5, 6, 7])  # later, covers 4..6 with other values
    assert server.tokens(7, 0) == [1, 2, 3, 4, 5, 6, 7]


def test_updates_are_isolated_per_request_and_per_group(server):
    server.register(8, ttl_s=60)
    server.append(7, 0, 0, [1, 2, 3])
    server.append(7, 1, 0, [1, 2, 3])
    server.append(8, 0, 0, [1, 2, 3])
    server.append(7, 0, 1, [9])  # rewrites request 0 of group 7 only
    assert server.tokens(7, 0) == [1, 9]
    assert server.tokens(7, 1) == [1, 2, 3] and server.tokens(8, 0) == [1, 2, 3]
    assert server.append(7, 1, 3, [4]).gen == server.append(7, 1, 0, [1]).gen


def test_fetch_returns_only_what_changed_past_the_cursors(server):
    client = Client()
    server.append(7, 0, 0, [1, 2, 3])
    server.append(7, 1, 0, [4])
    assert client.apply(server.fetch({7: {}})) == 4
    assert server.fetch(client.cursors([7])).changes == {}
    server.append(7, 0, 3, [5, 6])
    result = server.fetch(client.cursors([7]))
    gen0 = client.gens[7][0]
    assert result.changes == {7: {0: (gen0, 3, [5, 6])}}
    client.apply(result)
    assert client.held[7] == {0: [1, 2, 3, 5, 6], 1: [4]}


def test_fetch_after_a_rewrite_resets_the_sequence(server):
    client = Client()
    server.append(7, 0, 0, [1, 2, 3, 4])
    client.apply(server.fetch({7: {}}))
    old_gen = client.gens[7][0]
    server.append(7, 0, 1, [7, 7])
    result = server.fetch(client.cursors([7]))
    (gen, start, tokens), = result.changes[7].values()
    assert gen != old_gen and start == 0 and tokens == [1, 7, 7]
    client.apply(result)
    assert client.held[7][0] == [1, 7, 7]


def test_a_client_ahead_of_the_log_is_reset(server):
    gen = server.append(7, 0, 0, [1, 2]).gen
    assert server.fetch({7: {0: (gen, 5)}}).changes == {7: {0: (gen, 0, [1, 2])}}


def test_fetch_names_unknown_groups_and_requests_the_server_does_not_hold(server):
    server.append(7, 0, 0, [1])
    result = server.fetch({7: {0: (server.append(7, 0, 0, [1]).gen, 1), 5: (1, 3)}, 99: {1: (1, 1)}})
    assert result.changes == {} and result.dropped == {7: [5]} and result.unknown == [99]


def test_fetch_accepts_string_keys_as_they_arrive_from_json(server):
    server.append(7, 0, 0, [1, 2, 3])
    gen = server.append(7, 0, 0, [1]).gen
    wire = json.loads(json.dumps({7: {0: [gen, 1]}}))  # {"7": {"0": [gen, 1]}}
    result = server.fetch(wire)
    assert result.changes == {7: {0: (gen, 1, [2, 3])}}
    assert json.loads(msgspec.json.encode(result)) == {
        "changes": {"7": {"0": [gen, 1, [2, 3]]}}, "dropped": {}, "unknown": []}


def test_a_group_registered_again_does_not_match_old_cursors(server):
    client = Client()
    server.append(7, 0, 0, [1, 2, 3])
    client.apply(server.fetch({7: {}}))
    server.finish(7)
    server.register(7, ttl_s=60)
    server.append(7, 0, 0, [4, 5, 6, 7])
    result = server.fetch(client.cursors([7]))
    (gen, start, tokens), = result.changes[7].values()
    assert start == 0 and tokens == [4, 5, 6, 7]  # a reset, not tokens[3:] after stale ones


def test_ttl_expiry_with_a_moving_clock(server, clock):
    server.register(8, ttl_s=10)
    server.append(8, 0, 0, [1])
    clock.now += 9
    assert server.expire() == []
    server.fetch({8: {}})  # a fetch is activity
    clock.now += 9
    assert server.expire() == []
    clock.now += 11
    assert server.expire() == [8]
    assert 8 not in server and 7 in server  # group 7's TTL is 60 s since its registration
    server.register(7, ttl_s=60)  # refreshes
    clock.now += 59
    assert server.expire() == []
    clock.now += 2
    assert server.expire() == [7]
    assert server.stats()["evictions"]["expired"] == 2


def test_finish_evicts_and_unknown_groups_are_refused_clearly(server):
    server.append(7, 0, 0, [1, 2])
    server.finish(7)
    server.finish(7)  # again: nothing to do
    with pytest.raises(UnknownGroup) as refused:
        server.append(7, 0, 2, [3])
    assert str(refused.value).startswith("group 7 is not registered (finished, expired, or never registered)")
    with pytest.raises(UnknownGroup):
        server.tokens(7, 0)
    assert server.fetch({7: {}}).unknown == [7]
    server.register(7, ttl_s=5)  # registered again: empty
    with pytest.raises(UnknownRequest, match="group 7 holds no tokens of request 0"):
        server.tokens(7, 0)
    assert server.stats()["tokens"] == 0 and server.stats()["evictions"]["finished"] == 1


@pytest.mark.parametrize("call, message", [
    (lambda s: s.append(7, 0, -1, [1]), "prev_count must be an int >= 0"),
    (lambda s: s.append(7, 0, 1.0, [1]), "prev_count must be an int >= 0"),
    (lambda s: s.append(7, 0, 0, [1, 2.5]), r"tokens must be token ids.*2\.5"),
    (lambda s: s.append(7, 0, 0, ["3"]), "tokens must be token ids"),
    (lambda s: s.append(7, 0, 0, "123"), "tokens must be a list of token ids"),
    (lambda s: s.append(7, 0, 0, [1, -4]), r"tokens must be token ids.*-4"),
    (lambda s: s.append(7, 0, 0, [2**40]), "tokens must be token ids"),
    (lambda s: s.append("seven", 0, 0, [1]), "group id must be an int"),
    (lambda s: s.append(7, None, 0, [1]), "request id must be an int"),
    (lambda s: s.register(9, ttl_s=0), "ttl_s must be a number of seconds > 0"),
    (lambda s: s.fetch({7: {0: (1,)}}), r"cursor of group 7 request 0 must be \[gen, count\]"),
    (lambda s: s.fetch({7: {0: (1, -2)}}), "must be two ints >= 0"),
    (lambda s: s.fetch({7: [1, 2]}), "must map request ids"),
])
def test_bad_input_is_refused_with_what_is_wrong(server, call, message):
    with pytest.raises(DraftError, match=message):
        call(server)
    assert server.stats()["tokens"] == 0  # nothing half-applied


def test_memory_bound_evicts_least_recently_active_but_never_the_group_appended_to(clock):
    server = DraftServer(max_tokens=100, clock=clock)
    for group in (1, 2, 3):
        server.register(group, ttl_s=600)
        server.append(group, 0, 0, [group] * 30)
        clock.now += 1
    server.fetch({1: {}})  # group 1 is now more recently active than 2
    result = server.append(3, 1, 0, [0] * 20)  # 110 > 100: evict the least recently active: 2
    assert result.evicted == (2,)
    assert 1 in server and 2 not in server and 3 in server
    assert server.stats()["tokens"] == 80
    big = server.append(3, 2, 0, [0] * 150)  # the group being appended to stays, even alone
    assert big.evicted == (1,) and 3 in server and server.stats()["tokens"] == 200
    assert server.stats()["evictions"]["memory"] == 2


def test_memory_bound_evicts_expired_groups_first(clock):
    server = DraftServer(max_tokens=100, clock=clock)
    server.register(1, ttl_s=1000)
    server.append(1, 0, 0, [1] * 40)
    server.register(2, ttl_s=5)
    server.append(2, 0, 0, [2] * 40)
    clock.now += 10  # group 2 expired, though more recently active than group 1
    server.register(3, ttl_s=1000)
    assert server.append(3, 0, 0, [3] * 40).evicted == (2,)
    assert 1 in server and 2 not in server


def test_stats_report_bytes_per_million_tokens(server):
    rng = random.Random(0)
    for request in range(16):
        for start in range(0, 2000, 16):
            server.append(7, request, start, [rng.randrange(150_000) for _ in range(16)])
    stats = server.stats()
    assert (stats["groups"], stats["requests"], stats["tokens"]) == (1, 16, 32_000)
    assert stats["appends"] == 16 * 125 and stats["appended_tokens"] == 32_000
    # int32 logs: 4 bytes a token, plus array over-allocation and per-request records
    assert 4e6 <= stats["bytes_per_million_tokens"] <= 6e6
    json.dumps(stats)


def test_a_client_index_follows_the_server_through_rewrites_and_evictions(clock):
    """End to end with random traffic: after every fetch the client's copy equals the server's
    logs, and an index fed from the deltas drafts as one built from scratch."""
    rng = random.Random(5)
    server = DraftServer(clock=clock)
    client = Client()
    indexes: dict[int, SuffixIndex] = {}
    for group in range(3):
        server.register(group, ttl_s=100)
    lengths: dict[tuple[int, int], int] = {}
    for step in range(400):
        group, request = rng.randrange(3), rng.randrange(4)
        count = lengths.get((group, request), 0)
        if rng.random() < 0.05 and count > 3:  # a re-run from an earlier point
            start = rng.randrange(count)
        else:
            start = count
        tokens = [rng.randrange(5) for _ in range(rng.randint(1, 8))]
        lengths[(group, request)] = server.append(group, request, start, tokens).count
        if step % 7 == 0:
            result = server.fetch(client.cursors(range(3)))
            client.apply(result)
            for group_id, requests in result.changes.items():
                index = indexes.setdefault(group_id, SuffixIndex(3, 8))
                for request_id, (_, start_at, new) in requests.items():
                    if start_at == 0:
                        index.replace(request_id, new)
                    else:
                        index.extend(request_id, new)
            for g in range(3):
                assert client.held.get(g, {}) == {r: server.tokens(g, r) for r in client.held.get(g, {})}
                fresh = SuffixIndex(3, 8)
                for r, tokens in sorted(client.held.get(g, {}).items()):
                    fresh.extend(r, tokens)
                if g in indexes:
                    for r, tokens in client.held[g].items():
                        assert indexes[g].length(r) == len(tokens)
                        assert indexes[g].propose(tokens, 4).match_len == fresh.propose(tokens, 4).match_len
