"""A poison request on real vLLM-CPU engines: the engine rejects it whatever runs it. The run ends
(exit 3), every other response is complete, and the poison ones are exported as failed with the
engine's message, after retries on both workers' engines."""

from __future__ import annotations

import json

import pytest

from tests.integration.harness import db_rows, run_seerd, write_token_prompts

pytestmark = pytest.mark.vllm

EXIT_FAILED_REQUESTS = 3


def test_a_poison_row_fails_alone_and_the_run_ends(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=6, max_tokens=[48], seed=4)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    # vLLM rejects it per request ("temperature must be in [0, 2]"), on every engine.
    rows[2]["temperature"] = 2.5
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run_dir = tmp_path / "run"
    result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--workers", "2", "--wait-for-workers", "--n", "2", "--chunk-tokens", "16",
                       "--kv-cache-gib", "0.25", "--max-num-seqs", "8", "--no-progress", timeout=400)
    assert result.returncode == EXIT_FAILED_REQUESTS, result.stderr[-3000:]
    assert "2 of 12 requests failed" in result.stderr
    exported = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(exported) == 12
    failed = [row for row in exported if row["finish_reason"] == "error"]
    assert {(row["group_index"], row["response_index"]) for row in failed} == {(2, 0), (2, 1)}
    assert all("temperature" in row["error"] for row in failed)
    assert all(row["error"] is None and row["length"] == len(row["token_ids"]) > 0
               for row in exported if row not in failed)
    assert json.loads((run_dir / "rollouts.meta.json").read_text())["failed"] == 2
    # Both engines were tried before each poison request was given up (retries go elsewhere).
    tried = db_rows(run_dir, "select request_id, count(distinct worker_id) from events "
                             "where kind in ('chunk_failed', 'request_failed') group by request_id")
    assert len(tried) == 2 and all(workers == 2 for _, workers in tried), tried
    assert db_rows(run_dir, "select status from rollouts") == [("finished",)]
