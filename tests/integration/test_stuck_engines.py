"""Liveness by progress on real engines (vLLM's AsyncLLM, whose engine core is a process of its
own under the worker): an engine core stopped with SIGSTOP, under a worker whose loop still
heartbeats, used to hold its chunks forever; a core killed made vLLM raise its own
EngineDeadError. Now the stopped engine's chunks run elsewhere within the stall bound and its
worker is taken out; the dead engine's worker exits; both are started again, and the run
completes with every response exactly once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from tests.integration.harness import (
    assert_complete_output, db_rows, done_chunks, live_processes, start_seerd, wait_for, write_token_prompts,
)

pytestmark = pytest.mark.vllm

GROUPS, N = 24, 2


def engine_core_of(worker_pid: int) -> int | None:
    """The AsyncLLM engine core process the worker started (vLLM titles it VLLM::EngineCore)."""
    for pid, fields in live_processes().items():
        if int(fields[1]) != worker_pid:
            continue
        with contextlib.suppress(OSError):
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    return None


def serving_worker(run_dir: Path, rank: int) -> tuple[str, int] | None:
    """(worker id, pid) of the live worker of `rank` that has finished chunks, if there is one."""
    rows = db_rows(run_dir, "select w.id, w.address from workers w where w.rank = ? and w.status = 'alive' "
                            "and exists (select 1 from chunks c where c.lease_holder = w.id and c.status = 'done')",
                   (rank,))
    return (rows[0][0], int(rows[0][1].rsplit(":", 1)[1])) if rows else None


# --lease-ttl 8: the stall bound. At 3 s, a loaded machine's first AsyncLLM steps after registration
# (engines that took 28 s to start) held chunks past it with nothing stopped: a worker taken out
# before the fault (the full suite, 2026-11-29).
def test_a_stopped_engine_core_and_a_dead_one_end_their_workers_and_the_run_completes(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=GROUPS, seed=11)
    run_dir = tmp_path / "run"
    proc = start_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--workers", "2", "--engine-api", "async", "--wait-for-workers", "--lease-ttl", "8",
                       "--chunk-tokens", "16", "--n", str(N), "--max-tokens", "512", "--temperature", "0",
                       "--kv-cache-gib", "0.25", "--max-num-seqs", "16", "--dtype", "float32", "--no-progress",
                       log=tmp_path / "run.log")
    stopped = None
    try:
        wait_for(lambda: done_chunks(run_dir) >= 8, timeout=400, what="8 finished chunks", interval=0.1)
        stuck_id, stuck_pid = wait_for(lambda: serving_worker(run_dir, 0), timeout=60, what="rank 0 serving")
        stopped = wait_for(lambda: engine_core_of(stuck_pid), timeout=30, what="rank 0's engine core")
        os.kill(stopped, signal.SIGSTOP)
        retired = wait_for(lambda: db_rows(run_dir, "select worker_id, data_json from events "
                                                    "where kind = 'worker_retired'"), timeout=120,
                           what="the stopped engine's worker taken out")
        assert [worker for worker, _ in retired] == [stuck_id]
        assert "no progress" in json.loads(retired[0][1])["reason"]
        assert db_rows(run_dir, "select status from rollouts") == [("running",)], "the fault must land mid-run"
        # Now the other engine dies under its worker: vLLM's EngineDeadError ends that worker.
        dead_id, dead_pid = wait_for(lambda: serving_worker(run_dir, 1), timeout=60, what="rank 1 serving")
        os.kill(wait_for(lambda: engine_core_of(dead_pid), timeout=30, what="rank 1's engine core"), signal.SIGKILL)
        assert proc.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "run.log").read_text()
    # Taken out, or its engine dead: each worker exits 4 to be started again. Which of them the
    # supervisor sees before the run completes depends on timing (the stopped one's shutdown waits
    # for its engine up to 10 s), but the run completes only on a worker started again.
    exited = "exited with code 4 (its engine failed, or the coordinator took it out)"
    assert any(f"worker {rank} {exited}; starting it again (1/3)" in log for rank in (0, 1)), log[-3000:]
    assert_complete_output(run_dir, GROUPS * N)
    # The stopped chunks ran again elsewhere: revoked with the worker, none lost or doubled.
    assert db_rows(run_dir, "select count(*) from events where kind = 'lease_revoked' and worker_id = ?",
                   (stuck_id,))[0][0] >= 1
    assert db_rows(run_dir, "select count(*) from chunks where lease_holder = ? and status = 'done' and "
                            "finished_at > (select ts from events where kind = 'worker_retired')",
                   (stuck_id,)) == [(0,)]
    assert dead_id != stuck_id
    # Nothing of either engine is left: the stopped core went with its worker's process group.
    assert stopped not in live_processes()
