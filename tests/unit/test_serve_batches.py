"""`seerd serve`'s batches without engines (seerd/serve/batches.py): the groups that ended come
back each exactly once, in the order they ended, in pages that never split a group and never skip
one; new weights that the engines could not load in place are refused at submission."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from seerd.db.read import reading
from seerd.protocol import ChunkReport
from seerd.serve import batches
from seerd.serve.batches import ended_groups, weights_problem
from tests.unit.helpers import make_book, rows

NOW = 1000.0


def finish_requests(book, order: list[int]) -> None:  # noqa: ANN001
    """Lease everything to one worker, then report each request's only chunk in `order` (request
    ids), one report call each: one `request_finished` event per call, in that order."""
    book.register(rank=0, address="x", max_chunks=1000, kv_capacity_tokens=10**6, worker_id="w0", now=NOW)
    grants = book.lease("w0", 1000, NOW)
    by_request = {g.request_id: g for g in grants}
    for request_id in order:
        grant = by_request[request_id]
        book.report_many("w0", [ChunkReport(grant.chunk_id, grant.epoch, [7] * 3, [-0.5] * 3, "stop")], NOW)


def read_all(db: Path, batch: int, page: int | None = None) -> list[list[int]]:
    """Every page until nothing new: the group indexes of each."""
    pages, after = [], 0
    while True:
        with reading(db) as conn:
            reply = ended_groups(conn, batch, after)
        if not reply.groups and reply.cursor == after:
            return pages
        pages.append([g["group_index"] for g in reply.groups])
        after = reply.cursor


def test_each_ended_group_comes_once_in_the_order_it_ended(tmp_path, monkeypatch):
    book = make_book(tmp_path, chunk_tokens=64, prompt_rows=rows(groups=6, n=3, max_tokens=40))
    request_group = {rid: r.group_id for rid, r in book.state.requests.items()}
    group_index = {gid: i for i, gid in enumerate(sorted(set(request_group.values())))}
    order = list(request_group)
    random.Random(3).shuffle(order)
    finish_requests(book, order)
    ended_at: dict[int, int] = {}  # group index -> position of its last request in `order`
    for position, rid in enumerate(order):
        ended_at[group_index[request_group[rid]]] = position
    expected = sorted(ended_at, key=ended_at.get)
    monkeypatch.setattr(batches, "GROUPS_PER_REPLY", 2)
    pages = read_all(tmp_path / "state.db", book.rollout_id)
    assert [g for page in pages for g in page] == expected
    assert all(len(page) <= 2 for page in pages) and len(pages) >= 3
    with reading(tmp_path / "state.db") as conn:
        reply = ended_groups(conn, book.rollout_id, 0)
    assert reply.groups_total == 6
    assert all(len(g["rows"]) == 3 and g["prompt_token_ids"] for g in reply.groups)
    (version,) = {r["weight_version"] for g in reply.groups for r in g["rows"]}
    assert version.startswith("model@")  # the rollout's model path and a hash of its fingerprint


def test_a_group_half_ended_is_not_yet_delivered(tmp_path):
    book = make_book(tmp_path, chunk_tokens=64, prompt_rows=rows(groups=2, n=2, max_tokens=40))
    requests = sorted(book.state.requests)  # group 0: the first two
    book.register(rank=0, address="x", max_chunks=10, kv_capacity_tokens=10**6, worker_id="w0", now=NOW)
    grants = {g.request_id: g for g in book.lease("w0", 10, NOW)}
    grant = grants[requests[0]]
    book.report_many("w0", [ChunkReport(grant.chunk_id, grant.epoch, [7], [-0.5], "stop")], NOW)
    with reading(tmp_path / "state.db") as conn:
        first = ended_groups(conn, book.rollout_id, 0)
    assert first.groups == [] and first.cursor > 0  # its request_finished event is read past
    grant = grants[requests[1]]
    book.report_many("w0", [ChunkReport(grant.chunk_id, grant.epoch, [7], [-0.5], "stop")], NOW)
    with reading(tmp_path / "state.db") as conn:
        second = ended_groups(conn, book.rollout_id, first.cursor)
        assert [g["group_index"] for g in second.groups] == [0]
        assert ended_groups(conn, book.rollout_id, second.cursor).groups == []
        assert ended_groups(conn, book.rollout_id + 1, 0) is None


def _model(tmp_path: Path, name: str, shapes: dict[str, tuple[int, ...]], config: dict) -> Path:
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: torch.zeros(v) for k, v in shapes.items()}, folder / "model.safetensors")
    return folder


def test_weights_the_engines_could_not_load_in_place_are_refused(tmp_path):
    config = {"model_type": "llama", "hidden_size": 8, "transformers_version": "5.0"}
    shapes = {"a.weight": (8, 8), "b.weight": (8,)}
    base = _model(tmp_path, "base", shapes, config)
    assert weights_problem(str(base), str(_model(tmp_path, "next", shapes, {**config, "transformers_version": "5.1"}))) \
        is None  # bookkeeping keys may differ
    assert "config.json differs in hidden_size" in weights_problem(
        str(base), str(_model(tmp_path, "wider", shapes, {**config, "hidden_size": 16})))
    assert "b.weight" in weights_problem(str(base), str(_model(tmp_path, "shape", {**shapes, "b.weight": (9,)}, config)))
    assert "c.weight" in weights_problem(str(base), str(_model(tmp_path, "extra", {**shapes, "c.weight": (2,)}, config)))
    truncated = tmp_path / "truncated"
    shutil.copytree(base, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:-10])
    assert "truncated" in weights_problem(str(base), str(truncated))
    assert "cannot read" in weights_problem(str(base), str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(config))
    assert "no safetensors" in weights_problem(str(base), str(empty))


@pytest.mark.parametrize("garbage", [b"", b"\x01", b"\xff" * 8 + b"{}"])
def test_a_file_that_is_no_safetensors_is_refused(tmp_path, garbage):
    config = {"model_type": "llama"}
    base = _model(tmp_path, "base", {"a": (2,)}, config)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes(garbage)
    assert "cannot be read" in weights_problem(str(base), str(bad))


def test_a_batchs_drafts_are_seeded_with_the_earlier_batches_responses_only(tmp_path):
    from seerd.drafts.host import history_sequences

    same = rows(groups=2, n=2, max_tokens=40)
    first = make_book(tmp_path, chunk_tokens=64, prompt_rows=same)
    finish_requests(first, sorted(first.state.requests))
    second = make_book(tmp_path, chunk_tokens=64, prompt_rows=same)  # the next batch, same database
    assert second.rollout_id == first.rollout_id + 1
    db = tmp_path / "state.db"
    groups = list(second.state.unfinished_groups)
    seeded = history_sequences(db, db, groups, rollouts=[first.rollout_id])
    assert sorted(seeded) == sorted(groups) and all(
        len(responses) == 2 and all(tokens == [7] * 3 for tokens in responses.values()) for responses in seeded.values())
    assert history_sequences(db, db, groups, rollouts=[second.rollout_id]) == {}  # its own: none finished


def test_a_batch_is_created_once_per_key_checked_as_a_run_and_seeded_by_the_previous_batch(tmp_path,
                                                                                          tiny_model_dir):
    from seerd.config import RunConfig
    from seerd.book.book import LeaseBook
    from seerd.db import RolloutStatus, make_engine, make_sessionmaker
    from seerd.db.migrate import upgrade
    from seerd.protocol import BatchBody
    from seerd.rundir import RunDir
    from seerd.scheduler import make_policy
    from seerd.serve.batches import BatchRefused, create_batch
    from tests.unit.helpers import VOCAB_SIZE

    rundir = RunDir(tmp_path)
    engine = make_engine(rundir.db_path, synchronous="NORMAL")
    upgrade(engine)
    base = RunConfig(input_path="", model_path=str(tiny_model_dir), n=2, max_tokens=40, chunk_tokens=64)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    first = create_batch(engine, rundir, base, BatchBody(str(prompts), "key-1"))
    assert create_batch(engine, rundir, base, BatchBody(str(prompts), "key-1")) == first  # sent again: the same
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "prompt_token_ids": [1, 2, 99999]}\n')
    with pytest.raises(BatchRefused, match="out of range"):
        create_batch(engine, rundir, base, BatchBody(str(bad), "key-bad"))
    with pytest.raises(BatchRefused, match="needs a key"):
        create_batch(engine, rundir, base, BatchBody(str(prompts), ""))
    with pytest.raises(BatchRefused, match="cannot read"):
        create_batch(engine, rundir, base, BatchBody(str(prompts), "key-w", weights=str(tmp_path / "nowhere")))
    # The first batch runs: its responses end at 3, 9 and 17 tokens, one group each.
    book = LeaseBook(make_sessionmaker(engine), first, make_policy("divided"), chunk_tokens=64, lease_ttl_s=30,
                     seed=0, vocab_size=VOCAB_SIZE)
    book.load(NOW)
    book.set_rollout_status(RolloutStatus.RUNNING, NOW)
    book.register(rank=0, address="x", max_chunks=100, kv_capacity_tokens=10**6, worker_id="w0", now=NOW)
    index_of = {gid: i for i, gid in enumerate(sorted({r.group_id for r in book.state.requests.values()}))}
    for grant in book.lease("w0", 100, NOW):  # each group's two responses: its length, and one less
        length = (3, 9, 17)[index_of[book.state.requests[grant.request_id].group_id]] - grant.request_id % 2
        book.report_many("w0", [ChunkReport(grant.chunk_id, grant.epoch, [7] * length, [-0.5] * length, "stop")], NOW)
    book.set_rollout_status(RolloutStatus.FINISHED, NOW)
    book.close()
    second = create_batch(engine, rundir, base, BatchBody(str(prompts), "key-2"))
    assert second == first + 1
    with engine.connect() as conn:
        estimates = [e for (e,) in conn.exec_driver_sql(
            "select length_estimate from prompt_groups where rollout_id = ? order by group_index", (second,))]
    assert estimates == [3, 9, 17]  # each prompt's longest response of the previous batch
