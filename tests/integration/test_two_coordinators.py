"""One coordinator per run, on a real engine: a second `seerd run` or `seerd resume` on a live run
exits 2 naming the owner and touches nothing; the first completes."""

from __future__ import annotations

import os

import pytest

from tests.integration.harness import (
    assert_complete_output, db_rows, done_chunks, run_seerd, start_seerd, wait_for, write_token_prompts,
)

pytestmark = pytest.mark.vllm


def test_a_second_coordinator_is_refused_and_the_first_completes(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=4, seed=7)
    run_dir = tmp_path / "run"
    args = ["--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir), "--workers", "1",
            "--chunk-tokens", "16", "--n", "2", "--max-tokens", "240", "--kv-cache-gib", "0.25",
            "--max-num-seqs", "8", "--dtype", "float32", "--no-progress"]
    first = start_seerd("run", *args, log=tmp_path / "first.log")
    try:
        wait_for(lambda: done_chunks(run_dir) >= 2, timeout=300, what="the first coordinator's chunks")
        for second in (run_seerd("run", *args, timeout=120), run_seerd("resume", str(run_dir), "--no-progress",
                                                                       timeout=120)):
            assert second.returncode == 2, second.stderr[-2000:]
            assert f"owned by a live coordinator: pid {first.pid} on {os.uname().nodename}" in second.stderr
        assert first.wait(timeout=600) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert_complete_output(run_dir, 8)
    assert db_rows(run_dir, "select count(*) from events where kind='rollout_resumed'") == [(0,)]
    assert not (run_dir / "owner.json").exists()  # released when it stopped
