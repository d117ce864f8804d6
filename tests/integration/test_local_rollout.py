"""End-to-end local rollouts on real vLLM-CPU engines with the tiny model."""

from __future__ import annotations

import stat

import pytest

from seerd.scheduler.state import first_chunk_tokens
from tests.integration.harness import assert_complete_output, db_rows, run_seerd, write_token_prompts

pytestmark = pytest.mark.vllm

COMMON = ["--workers", "2", "--kv-cache-gib", "0.25", "--max-num-seqs", "32", "--dtype", "float32",
          "--no-progress"]


def test_rollout_has_every_response_once_with_logprobs(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, max_tokens=[40, 64, 24, 56])
    run_dir = tmp_path / "run"
    result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--chunk-tokens", "16", "--n", "4", "--temperature", "1.0", "--seed", "3",
                       "--wait-for-workers", *COMMON)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_complete_output(run_dir, {(g, k) for g in range(8) for k in range(4)})
    assert max(r["num_chunks"] for r in rows) >= 3  # several chunks per request
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"}
    # Both workers came up: the run waits for them (without `--wait-for-workers` seer, the
    # default, starts with the first one ready, and a fast run can end before the second registers).
    assert db_rows(run_dir, "select count(*) from workers")[0][0] == 2
    # State and outputs are private to the user.
    for name in ("state.db", "secret", "rollouts.parquet", "rollouts.jsonl"):
        assert stat.S_IMODE((run_dir / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert db_rows(run_dir, "select status from rollouts") == [("finished",)]

    # A finished run: `run` again says so and changes nothing; `export` writes the same rows.
    before = (run_dir / "rollouts.parquet").read_bytes()
    again = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                      *COMMON, timeout=120)
    assert again.returncode == 0 and "already finished" in again.stderr
    assert (run_dir / "rollouts.parquet").read_bytes() == before
    exported = run_seerd("export", str(run_dir), timeout=120)
    assert exported.returncode == 0 and "exported 32 responses" in exported.stderr
    assert_complete_output(run_dir, 32)


IN_PLACE = "select count(*) from events where kind = 'chunk_leased' and json_extract(data_json, '$.in_place')"


def test_chunking_is_invisible_under_greedy_sampling(tiny_model_dir, tmp_path):
    """Chunks continued in the engine (in place, the default), chunks re-submitted with their
    context (--no-in-place) and unchunked responses give the same greedy tokens."""
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=6, seed=11)
    outputs = {}
    for name, options in (("in-place", ["--policy", "seer", "--chunk-tokens", "16"]),
                          ("resubmitted", ["--policy", "divided", "--chunk-tokens", "16", "--no-in-place"]),
                          ("group", ["--policy", "group", "--chunk-tokens", "100000"])):
        run_dir = tmp_path / name
        result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir",
                           str(run_dir), *options, "--n", "2", "--max-tokens", "64", "--temperature", "0", *COMMON)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = assert_complete_output(run_dir, 12)
        outputs[name] = {(r["group_index"], r["response_index"]): r["token_ids"] for r in rows}
        chunks = max(r["num_chunks"] for r in rows)
        # 64 tokens in chunks of 16; a worker's first lease has shorter chunks by rank (rank 1's
        # `first_chunk_tokens`), so a response it started takes one chunk more.
        chunked = {4, 1 + -(-(64 - first_chunk_tokens(16, 1)) // 16)}
        assert chunks in ({1} if name == "group" else chunked) or any(r["finish_reason"] == "stop" for r in rows)
        in_place = db_rows(run_dir, IN_PLACE)[0][0]
        # 12 requests on 64 slots: the scheduler keeps every one on its worker.
        assert in_place > 0 if name == "in-place" else in_place == 0, (name, in_place)
    assert outputs["in-place"] == outputs["resubmitted"] == outputs["group"]


def test_seer_policy_serves_every_groups_probe_first(tiny_model_dir, tmp_path):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, max_tokens=[24, 96, 48, 64])
    run_dir = tmp_path / "run"
    result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--policy", "seer", "--chunk-tokens", "16", "--n", "4",
                       "--workers", "2", "--kv-cache-gib", "0.25", "--max-num-seqs", "4", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_complete_output(run_dir, 32)
    first_leased = db_rows(run_dir, "select r.is_probe from events e join requests r on r.id = e.request_id "
                                    "where e.kind = 'chunk_leased' order by e.id limit 8")
    assert [p for (p,) in first_leased] == [1] * 8
