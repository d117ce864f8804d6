"""`--prior`: group estimates seeded from an earlier rollout, and the per-prompt length history."""

from __future__ import annotations

import json

import pytest
from sqlalchemy import select

from seerd.book.book import LeaseBook
from seerd.coordinator.create import prompt_hash
from seerd.coordinator.prior import MAX_HISTORY_AGE, PriorLengths, PriorRunError, read_prior
from seerd.db import Event, Group, PromptLengthHistory, RolloutStatus, make_engine
from seerd.io.prompts import PromptRow
from seerd.protocol import ChunkReport
from tests.unit.helpers import make_book

PROMPT_A, PROMPT_B, PROMPT_C = (1, 2, 3), (4, 5, 6, 7), (8, 9)


def row(prompt_id: str, prompt: tuple[int, ...], max_tokens: int = 40, n: int = 2) -> PromptRow:
    return PromptRow(prompt_id, prompt, n, max_tokens, {}, 1)


def finish_run(book: LeaseBook, lengths: dict[str, list[int]]) -> LeaseBook:
    """Run every request to the length given per prompt id (by response index), as EOS."""
    book.register(rank=0, address="test", max_chunks=64, kv_capacity_tokens=10**6, worker_id="w", now=1000.0)
    prompt_ids = _prompt_ids(book)
    book.set_rollout_status(RolloutStatus.RUNNING, 1000.0)
    while not book.is_complete():
        for grant in book.lease("w", wanted=64, now=1001.0):
            request = book.state.requests[grant.request_id]
            left = lengths[prompt_ids[request.group_id]][request.response_index] - request.generated
            n = min(left, grant.max_tokens)
            book.report("w", ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-1.0] * n,
                                         "stop" if n == left else "length"), now=1002.0)
    book.set_rollout_status(RolloutStatus.FINISHED, 1003.0)
    return book


def _prompt_ids(book: LeaseBook) -> dict[int, str]:
    with book.sessions.begin() as s:
        return dict(s.execute(select(Group.id, Group.prompt_id).where(Group.rollout_id == book.rollout_id)).all())


def estimates(book: LeaseBook) -> dict[str, int]:
    return {_prompt_ids(book)[gid]: g.estimate for gid, g in book.state.groups.items()}


def history(book: LeaseBook) -> list[tuple[str, int, int]]:
    with book.sessions.begin() as s:
        return sorted(s.execute(select(PromptLengthHistory.prompt_hash, PromptLengthHistory.age,
                                       PromptLengthHistory.length)).tuples())


def all_hashes(*prompts: tuple[int, ...]) -> set[str]:
    return {prompt_hash(p) for p in prompts}


@pytest.fixture
def first_run(tmp_path):
    (tmp_path / "first").mkdir()
    book = make_book(tmp_path / "first", prompt_rows=[row("a", PROMPT_A), row("b", PROMPT_B)])
    return finish_run(book, {"a": [5, 12], "b": [30, 20]})


def test_matched_groups_start_from_the_priors_longest_response_clamped(tmp_path, first_run):
    prior = read_prior(tmp_path / "first", all_hashes(PROMPT_A, PROMPT_B, PROMPT_C))
    assert prior.longest_recent(prompt_hash(PROMPT_A)) == 12
    (tmp_path / "second").mkdir()
    # Ids differ on purpose: prompts match by their tokens' hash, not by id.
    book = make_book(tmp_path / "second", prior=prior, prompt_rows=[
        row("x", PROMPT_A), row("y", PROMPT_B, max_tokens=25), row("z", PROMPT_C)])
    assert estimates(book) == {"x": 12, "y": 25, "z": 40}  # y: 30 clamped to its max_tokens; z: no prior
    with book.sessions.begin() as s:
        (event,) = s.scalars(select(Event.data_json).where(Event.kind == "prior_seeded")).all()
    assert json.loads(event) == {**json.loads(event), "groups_seeded": 2, "groups_total": 3, "history_rows": 4,
                                 "same_model_path": True}
    assert history(book) == sorted([(prompt_hash(PROMPT_A), 1, 5), (prompt_hash(PROMPT_A), 1, 12),
                                    (prompt_hash(PROMPT_B), 1, 30), (prompt_hash(PROMPT_B), 1, 20)])


def test_history_is_carried_forward_by_age_for_the_prompts_that_recur(tmp_path, first_run):
    (tmp_path / "second").mkdir()
    second = make_book(tmp_path / "second", prompt_rows=[row("a", PROMPT_A), row("c", PROMPT_C)],
                       prior=read_prior(tmp_path / "first", all_hashes(PROMPT_A, PROMPT_C)))
    finish_run(second, {"a": [9, 8], "c": [3, 4]})
    (tmp_path / "third").mkdir()
    third = make_book(tmp_path / "third", prompt_rows=[row("a", PROMPT_A), row("b", PROMPT_B)],
                      prior=read_prior(tmp_path / "second", all_hashes(PROMPT_A, PROMPT_B)))
    a = prompt_hash(PROMPT_A)
    # Iteration 3 holds iteration 2's own lengths (age 1) and iteration 1's (age 2) for prompt A.
    # Prompt B skipped iteration 2, so nothing of it came along; C is not in iteration 3.
    assert history(third) == [(a, 1, 8), (a, 1, 9), (a, 2, 5), (a, 2, 12)]
    assert estimates(third) == {"a": 9, "b": 40}  # the most recent run seeds, not the longest ever


def test_history_older_than_the_limit_is_dropped(tmp_path):
    run_dir = tmp_path / "old"
    run_dir.mkdir()
    book = finish_run(make_book(run_dir, prompt_rows=[row("a", PROMPT_A, n=1)]), {"a": [4]})
    with book.sessions.begin() as s:
        s.add_all([PromptLengthHistory(rollout_id=book.rollout_id, prompt_hash=prompt_hash(PROMPT_A), age=age,
                                       length=100 + age) for age in (1, MAX_HISTORY_AGE - 1, MAX_HISTORY_AGE)])
    prior = read_prior(run_dir, all_hashes(PROMPT_A))
    # Its own response is age 1 here; its age-1 and age-(MAX-1) history become 2 and MAX; age MAX is dropped.
    assert sorted(prior.lengths[prompt_hash(PROMPT_A)]) == [
        (1, 4), (2, 101), (MAX_HISTORY_AGE, 100 + MAX_HISTORY_AGE - 1)]


def test_the_first_finish_replaces_the_seed_and_later_ones_only_raise_it(tmp_path):
    prior = PriorLengths("earlier", "model", {prompt_hash(PROMPT_A): [(1, 30)]})
    book = make_book(tmp_path, prompt_rows=[row("a", PROMPT_A, n=3)], prior=prior)
    book.register(rank=0, address="t", max_chunks=8, kv_capacity_tokens=10**6, worker_id="w", now=1000.0)
    assert {r.group_estimate for r in book.state.queue} == {30}  # the scheduler sees the seed
    grants = book.lease("w", wanted=8, now=1000.0)
    seen = []
    for grant, length in zip(grants, (3, 2, 7)):
        book.report("w", ChunkReport(grant.chunk_id, grant.epoch, [7] * length, [-1.0] * length, "stop"), 1001.0)
        seen.append(next(iter(book.state.groups.values())).estimate)
    assert seen == [3, 3, 7]


def test_a_prior_with_no_matching_prompt_seeds_nothing(tmp_path, first_run):
    prior = read_prior(tmp_path / "first", all_hashes(PROMPT_C))
    assert prior.lengths == {}
    (tmp_path / "second").mkdir()
    book = make_book(tmp_path / "second", prompt_rows=[row("c", PROMPT_C)], prior=prior)
    assert estimates(book) == {"c": 40} and history(book) == []


def test_unusable_priors_are_refused(tmp_path):
    with pytest.raises(PriorRunError, match="no run there"):
        read_prior(tmp_path / "nowhere", set())
    (tmp_path / "empty").mkdir()
    make_engine(tmp_path / "empty" / "state.db").dispose()
    with pytest.raises(PriorRunError, match="cannot read|holds no rollout"):
        read_prior(tmp_path / "empty", set())
    (tmp_path / "running").mkdir()
    make_book(tmp_path / "running")  # created, never finished
    with pytest.raises(PriorRunError, match="not finished"):
        read_prior(tmp_path / "running", set())
