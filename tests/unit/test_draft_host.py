"""The coordinator's draft host: committed chunks feed the draft server, finished groups leave it,
a resumed run and `--spec-history` seed it (real lease book, real SQLite)."""

from __future__ import annotations

import pytest

from seerd.drafts.host import DraftHost, book_sequences, history_sequences
from seerd.drafts.server import UnknownRequest
from seerd.protocol import ChunkReport
from tests.unit.helpers import make_book, reopen, rows


def wired(tmp_path, name: str = "state.db"):  # noqa: ANN001, ANN201
    book = make_book(tmp_path, prompt_rows=rows(groups=2, n=2, max_tokens=8), chunk_tokens=4, db_name=name)
    host = DraftHost()
    book.listeners.committed_tokens.append(host.committed)
    book.listeners.group_ended.append(host.group_finished)
    host.register(list(book.state.unfinished_groups))
    book.register(rank=0, address="x", max_chunks=8, kv_capacity_tokens=10_000, worker_id="w", now=1000.0)
    return book, host


def run_all(book, now: float = 1001.0) -> dict[int, list[int]]:  # noqa: ANN001
    """Lease and report every chunk until done; token values say (request, position)."""
    produced: dict[int, list[int]] = {}
    while not book.is_complete():
        grants = book.lease("w", 8, now)
        assert grants, "nothing to lease but the rollout is not complete"
        for grant in grants:
            start = len(produced.get(grant.request_id, []))
            tokens = [100 * grant.request_id + start + i for i in range(grant.max_tokens)]
            produced.setdefault(grant.request_id, []).extend(tokens)
            book.report_many("w", [ChunkReport(grant.chunk_id, grant.epoch, tokens, [-1.0] * len(tokens),
                                               "length")], now)
    return produced


def held(host: DraftHost, group: int, request: int) -> list[int] | None:
    def read():  # noqa: ANN202
        try:
            return host.server.tokens(group, request)
        except UnknownRequest:
            return None
    return host._thread.submit(read).result()


def test_committed_chunks_reach_the_server_and_finished_groups_leave(tmp_path):
    book, host = wired(tmp_path)
    group = min(book.state.groups)
    request = book.state.groups[group].request_ids[0]
    book.report_many("w", [ChunkReport(g.chunk_id, g.epoch, [5, 6, 7, 8], [-1.0] * 4, "length")
                           for g in book.lease("w", 8, 1001.0)], 1001.0)
    assert held(host, group, request) == [5, 6, 7, 8]
    run_all(book)
    assert host._thread.submit(lambda: group in host.server).result() is False  # evicted when done
    host.close()


def test_a_resumed_run_seeds_every_unfinished_group_with_its_tokens_so_far(tmp_path):
    book, host = wired(tmp_path)
    group = min(book.state.groups)
    request = book.state.groups[group].request_ids[0]
    book.report_many("w", [ChunkReport(g.chunk_id, g.epoch, [1, 2, 3, 4], [-1.0] * 4, "length")
                           for g in book.lease("w", 8, 1001.0)], 1001.0)
    host.close()
    again = reopen(book, 1002.0)
    sequences = book_sequences(again)
    assert sequences[group][request] == [1, 2, 3, 4]
    assert set(sequences) == set(again.state.unfinished_groups)
    fresh = DraftHost()
    fresh.seed(sequences)
    assert held(fresh, group, request) == [1, 2, 3, 4]
    fresh.close()


def test_history_seeds_groups_of_the_same_prompt_with_the_earlier_responses(tmp_path):
    earlier, host = wired(tmp_path, "earlier.db")
    produced = run_all(earlier)
    host.close()
    later = make_book(tmp_path, prompt_rows=rows(groups=3, n=2, max_tokens=8), db_name="later.db")
    seeded = history_sequences(tmp_path / "earlier.db", tmp_path / "later.db", list(later.state.groups))
    # Prompts p0 and p1 were in the earlier run; p2 was not.
    by_index = {later.state.groups[gid].index: gid for gid in later.state.groups}
    assert set(seeded) == {by_index[0], by_index[1]}
    earlier_by_index = {earlier.state.groups[gid].index: gid for gid in earlier.state.groups}
    for index in (0, 1):
        expected = [produced[rid] for rid in earlier.state.groups[earlier_by_index[index]].request_ids]
        got = seeded[by_index[index]]
        assert all(key < 0 for key in got)  # never a real request id
        assert sorted(got.values()) == sorted(expected)


def test_an_unreadable_history_raises_what_the_coordinator_catches(tmp_path):
    """The daemon logs UnreadableDatabase and drafts without the history; nothing else may escape."""
    from seerd.db.read import UnreadableDatabase

    later = make_book(tmp_path, prompt_rows=rows(groups=2, n=2, max_tokens=8), db_name="later.db")
    (tmp_path / "garbage.db").write_bytes(b"not a database" * 100)
    for history in (tmp_path / "missing.db", tmp_path / "garbage.db"):
        with pytest.raises(UnreadableDatabase, match=history.name):
            history_sequences(history, tmp_path / "later.db", list(later.state.groups))
