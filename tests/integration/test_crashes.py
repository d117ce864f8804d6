"""Crash tests on real engines: kill -9 the coordinator and resume; kill -9 a worker mid-chunk."""

from __future__ import annotations

import os
import signal

import pytest

from tests.integration.harness import (
    assert_complete_output, db_rows, done_chunks, run_seerd, start_seerd, wait_for, write_token_prompts,
)

pytestmark = pytest.mark.vllm

COMMON = ["--workers", "2", "--kv-cache-gib", "0.25", "--max-num-seqs", "16", "--no-progress"]


def chunk_table(run_dir):
    return {row[0]: row[1:] for row in db_rows(
        run_dir, "select id, request_id, seq, lease_epoch, attempt, token_ids, logprobs, finished_at "
                 "from chunks where status='done'")}


def test_coordinator_kill9_then_resume_loses_and_repeats_nothing(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=5)
    run_dir = tmp_path / "run"
    args = ["--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
            "--chunk-tokens", "16", "--n", "4", "--max-tokens", "160", "--seed", "1", *COMMON]
    proc = start_seerd("run", *args, log=tmp_path / "first.log")
    try:
        wait_for(lambda: done_chunks(run_dir) >= 30, timeout=300, what="30 finished chunks")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    before = chunk_table(run_dir)
    total_chunks_needed = 32 * 10
    assert 30 <= len(before) < total_chunks_needed, "the kill must land mid-run"
    assert db_rows(run_dir, "select status from rollouts") == [("running",)]
    killed_at = max(row[6] for row in before.values())

    resumed = run_seerd("resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = assert_complete_output(run_dir, 32)
    after = chunk_table(run_dir)
    # Every chunk finished before the kill is untouched: same tokens, same epoch, never re-leased.
    for chunk_id, row in before.items():
        assert after[chunk_id] == row
    releases = db_rows(run_dir, "select chunk_id from events where kind='chunk_leased' and ts > ?", (killed_at,))
    assert not {c for (c,) in releases} & set(before)
    # Output tokens are exactly the stored chunks, in order.
    stored = {}
    for chunk_id, (request_id, seq, *_rest) in sorted(after.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        stored.setdefault(request_id, []).append(chunk_id)
    assert sum(r["length"] for r in rows) == sum(len(row[4]) // 4 for row in after.values())
    assert db_rows(run_dir, "select count(*) from events where kind='rollout_resumed'") == [(1,)]
    assert db_rows(run_dir, "select status from rollouts") == [("finished",)]


def test_worker_kill9_leases_expire_and_run_elsewhere(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=6)
    run_dir = tmp_path / "run"
    proc = start_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--chunk-tokens", "16", "--n", "4", "--max-tokens", "160", "--lease-ttl", "4",
                       *COMMON, log=tmp_path / "run.log")
    try:
        def worker_with_leases():
            if done_chunks(run_dir) < 10:  # also: the database exists by now
                return None
            rows = db_rows(run_dir, "select w.id, w.address, count(c.id) from workers w join chunks c "
                                    "on c.lease_holder = w.id and c.status = 'leased' "
                                    "where w.rank = 0 and w.status = 'alive' group by w.id")
            return rows[0] if rows else None

        victim, address, _ = wait_for(worker_with_leases, timeout=300, what="worker 0 holding leases")
        held = {c for (c,) in db_rows(run_dir, "select id from chunks where lease_holder=? and status='leased'",
                                      (victim,))}
        os.kill(int(address.rsplit(":", 1)[1]), signal.SIGKILL)
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_complete_output(run_dir, 32)
    expired = {c for (c,) in db_rows(run_dir, "select chunk_id from events where kind='lease_expired' "
                                              "and worker_id=?", (victim,))}
    assert held and held <= expired
    for chunk_id in held:
        ((holder, status, attempt),) = db_rows(run_dir, "select lease_holder, status, attempt from chunks "
                                                        "where id=?", (chunk_id,))
        assert status == "done" and holder != victim and attempt >= 2
    assert db_rows(run_dir, "select status from workers where id=?", (victim,)) == [("stale",)]
