"""Crash tests on real engines: kill -9 the coordinator and resume; kill -9 a worker mid-chunk."""

from __future__ import annotations

import json
import os
import signal

import pyarrow.parquet as pq
import pytest

from seerd.status.locate import ask_coordinator
from tests.integration.harness import (
    assert_complete_output, db_rows, done_chunks, live_processes, run_seerd, start_seerd, wait_for,
    write_token_prompts,
)

pytestmark = pytest.mark.vllm

COMMON = ["--workers", "2", "--kv-cache-gib", "0.25", "--max-num-seqs", "16", "--dtype", "float32",
          "--no-progress"]


def live_group_members(pgid: int) -> list[int]:
    return [pid for pid, fields in live_processes().items() if int(fields[2]) == pgid]


def chunk_table(run_dir):
    return {row[0]: row[1:] for row in db_rows(
        run_dir, "select id, request_id, seq, lease_epoch, attempt, token_ids, logprobs, finished_at "
                 "from chunks where status='done'")}


def test_coordinator_kill9_then_resume_loses_and_repeats_nothing(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=5)
    run_dir = tmp_path / "run"
    args = ["--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
            "--chunk-tokens", "16", "--n", "4", "--max-tokens", "320", "--seed", "1", *COMMON]
    proc = start_seerd("run", *args, log=tmp_path / "first.log")
    try:
        wait_for(lambda: done_chunks(run_dir) >= 30, timeout=300, what="30 finished chunks", interval=0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # Its workers and their engines go too (parent-death signal, then the group reaper).
    worker_pids = [int(a.rsplit(":", 1)[1]) for (a,) in db_rows(run_dir, "select address from workers")]
    wait_for(lambda: not any(live_group_members(pid) for pid in worker_pids), timeout=60,
             what="the dead coordinator's workers and engines to exit")
    before = chunk_table(run_dir)
    assert len(before) >= 30, "the kill must land mid-run"
    assert db_rows(run_dir, "select status from rollouts") == [("running",)]
    killed_at = max(row[6] for row in before.values())
    # `seerd status` on the killed run: the database still says running, the coordinator is gone,
    # and the frame says so and how to go on.
    status = run_seerd("status", str(run_dir), "--json", timeout=60)
    assert status.returncode == 0, status.stderr
    snapshot = json.loads(status.stdout)
    assert snapshot["state"] == "running" and snapshot["coordinator"] == {"reachable": False}
    assert snapshot["requests_done"] == db_rows(run_dir, "select count(*) from requests where status='finished'")[0][0]
    frame = run_seerd("status", str(run_dir), "--once", timeout=60)
    assert frame.returncode == 0 and "coordinator unreachable" in frame.stdout
    assert "`seerd resume` continues the run" in frame.stdout

    # An unfinished run exports what is finished and says clearly that it is partial.
    finished = db_rows(run_dir, "select count(*) from requests where status='finished'")[0][0]
    partial = run_seerd("export", str(run_dir), timeout=120)
    assert partial.returncode == 0 and "PARTIAL" in partial.stderr
    meta = json.loads((run_dir / "rollouts.meta.json").read_text())
    assert meta == {**meta, "complete": False, "responses": finished, "responses_total": 32}
    assert len(pq.read_table(run_dir / "rollouts.parquet")) == finished

    resumed = run_seerd("resume", str(run_dir), "--no-progress")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = assert_complete_output(run_dir, 32)
    after = chunk_table(run_dir)
    # Every chunk finished before the kill is untouched: same tokens, same epoch, never re-leased.
    for chunk_id, row in before.items():
        assert after[chunk_id] == row
    releases = db_rows(run_dir, "select chunk_id from events where kind='chunk_leased' and ts > ?", (killed_at,))
    assert not {c for (c,) in releases} & set(before)
    # Output tokens are exactly the stored chunks: none lost, none duplicated.
    assert sum(r["length"] for r in rows) == sum(len(row[4]) // 4 for row in after.values())
    assert db_rows(run_dir, "select count(*) from events where kind='rollout_resumed'") == [(1,)]
    assert db_rows(run_dir, "select status from rollouts") == [("finished",)]


def test_worker_kill9_leases_expire_and_run_elsewhere(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=6)
    run_dir = tmp_path / "run"
    proc = start_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--chunk-tokens", "16", "--n", "4", "--max-tokens", "320", "--lease-ttl", "4",
                       "--wait-for-workers", *COMMON, log=tmp_path / "run.log")
    try:
        def worker_with_leases():
            if done_chunks(run_dir) < 10:  # also: the database exists by now
                return None
            rows = db_rows(run_dir, "select w.id, w.address, count(c.id) from workers w join chunks c "
                                    "on c.lease_holder = w.id and c.status = 'leased' "
                                    "where w.rank = 0 and w.status = 'alive' group by w.id "
                                    "having count(c.id) >= 4")
            return rows[0] if rows else None

        # Freeze a worker that holds leases, then ask the coordinator's status: its answer comes
        # from the state thread after whatever the frozen worker had already sent (a report on
        # the wire when it froze), so the leases still held then were never reported and must
        # expire. A worker frozen between a report and its next lease holds none: let it go on
        # and freeze it again (its chunks run in step, so this happens; the outcome must not
        # hang on that timing).
        for _attempt in range(20):
            victim, address, _ = wait_for(worker_with_leases, timeout=300, what="worker 0 holding leases")
            victim_pid = int(address.rsplit(":", 1)[1])
            os.kill(victim_pid, signal.SIGSTOP)
            assert ask_coordinator(run_dir) is not None, "the coordinator did not answer"
            held = {c for (c,) in db_rows(run_dir, "select id from chunks where lease_holder=? "
                                                   "and status='leased'", (victim,))}
            if held:
                break
            os.kill(victim_pid, signal.SIGCONT)
        else:
            raise AssertionError("the frozen worker held no unreported lease twenty times")
        os.kill(victim_pid, signal.SIGKILL)
        # Its engine-core processes do not outlive it (they would hold their KV memory forever).
        wait_for(lambda: not live_group_members(victim_pid), timeout=30, what="the victim's engine to exit")
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert_complete_output(run_dir, 32)
    expired = {c for (c,) in db_rows(run_dir, "select chunk_id from events where kind='lease_expired' "
                                              "and worker_id=?", (victim,))}
    assert held <= expired, "every lease the dead worker held unreported had to expire"
    for chunk_id in held:
        ((holder, status, attempt),) = db_rows(run_dir, "select lease_holder, status, attempt from chunks "
                                                        "where id=?", (chunk_id,))
        assert status == "done" and holder != victim and attempt >= 2
    # Marked stale when its heartbeats stopped; gone, like every worker, once the coordinator stopped.
    assert db_rows(run_dir, "select count(*) from events where kind='worker_stale' and worker_id=?",
                   (victim,)) == [(1,)]
    assert db_rows(run_dir, "select status from workers where id=?", (victim,)) == [("gone",)]
