"""Rollouts with `target_lengths` on real vLLM-CPU engines: lengths honoured, and seer's order."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from seerd.scheduler.seer import DEFAULT_STARVATION_S
from tests.integration.harness import assert_complete_output, db_rows, run_seerd

pytestmark = pytest.mark.vllm


def write_target_prompts(path: Path, targets: list[list[int]], max_tokens: int, seed: int = 0,
                         **extra: object) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as handle:
        for g, lengths in enumerate(targets):
            row = {"id": f"g{g}", "prompt_token_ids": [rng.randrange(4, 1000) for _ in range(rng.randrange(6, 24))],
                   "n": len(lengths), "max_tokens": max_tokens, "target_lengths": lengths, **extra}
            handle.write(json.dumps(row) + "\n")
    return path


def assert_lengths_are_the_targets(rows: list[dict], targets: list[list[int]]) -> None:
    for row in rows:
        target = targets[row["group_index"]][row["response_index"]]
        if row["finish_reason"] == "stop":  # the model's EOS came first (rare with random weights)
            assert row["length"] <= target, row
        else:
            assert (row["length"], row["finish_reason"]) == (target, "length_target"), row


def test_responses_end_at_their_target_lengths(tiny_model_dir, tmp_path):
    # Targets below, at and across chunk boundaries (chunk 16), and equal to max_tokens.
    targets = [[1, 16, 17, 60], [33, 48, 5, 31], [60, 2, 47, 16]]
    # ignore_eos: the random model's EOS (about 1 in 1000 tokens) must not end any response early.
    prompts = write_target_prompts(tmp_path / "prompts.jsonl", targets, max_tokens=60, ignore_eos=True)
    run_dir = tmp_path / "run"
    result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--policy", "divided", "--chunk-tokens", "16", "--workers", "2", "--kv-cache-gib", "0.25",
                       "--max-num-seqs", "8", "--dtype", "float32", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_complete_output(run_dir, 12)
    assert_lengths_are_the_targets(rows, targets)
    assert {r["finish_reason"] for r in rows} == {"length_target"}
    # A response cut at its target takes no more chunks than its target needs: its first chunk's
    # budget (shorter when leased in a worker's first lease, `first_chunk_tokens`), then 16 each.
    first_budget = {(g, k): budget for g, k, budget in db_rows(run_dir, """
        select g.group_index, r.response_index, c.max_tokens from chunks c join requests r on r.id = c.request_id
        join prompt_groups g on g.id = r.group_id where c.seq = 0""")}
    for row in rows:
        first = first_budget[(row["group_index"], row["response_index"])]
        assert first <= 16 and row["num_chunks"] == 1 + -(-max(0, row["length"] - first) // 16), (row, first)
    assert {fr for (fr,) in db_rows(run_dir, "select finish_reason from requests")} == {"length_target"}


SHORT_GROUPS, LONG_GROUPS = range(0, 4), range(4, 8)


def first_leases(run_dir: Path) -> list[tuple[int, bool, int]]:
    """(group index, is probe, order of its first lease) per request, from the event log."""
    return db_rows(run_dir, """
        select g.group_index, r.is_probe, min(e.id) from events e
        join requests r on r.id = e.request_id join prompt_groups g on g.id = r.group_id
        where e.kind = 'chunk_leased' group by r.id""")


def run_short_and_long_groups(tiny_model_dir: Path, tmp_path: Path, policy: str) -> tuple[Path, list]:
    """Groups 0-3 end at ~16 tokens, groups 4-7 at ~200; 2 workers x 2 sequences.

    Why it can tell policies apart: short groups come first in the file, so any order that ignores
    lengths (divided's FCFS, group's round-robin in file order) starts short groups' non-probes
    first. Why seer must pass: 4 slots in all, no more than the long groups. Probes go first, in
    file order, so the 4 short probes take every slot and each one's finish hands its slot to a
    long probe; while probes run, a freed slot goes to a probe (re-queued after its chunk) before
    any non-probe. The first non-probe is admitted only when a probe finishes with no probe
    waiting, i.e. a long probe, by which time every short group's estimate is its probe's ~16
    tokens; unfinished or long groups are estimated at 256 or ~200, so every long non-probe is
    ahead of every short one in seer's order. One exception, seen once in CI: a worker whose
    queued probes are all left to the other worker by affinity takes a non-probe early; then a
    short group whose probe is still in its first chunk ties with the long groups at max_tokens,
    and seer breaks that tie for the group whose probe has run furthest (a long one, which has
    finished a chunk to be re-queued at all). More slots than long groups would let a non-probe
    of a short group whose probe is still running in first.
    Run once with the other policies (2026-11-22): divided started a short non-probe 5th and the
    last long one 80th; group 6th and 36th. Both fail the assertion below, as they should.
    """
    rng = random.Random(7)
    targets = [[rng.randrange(12, 21) for _ in range(4)] for _ in SHORT_GROUPS]
    targets += [[rng.randrange(180, 221) for _ in range(4)] for _ in LONG_GROUPS]
    prompts = write_target_prompts(tmp_path / "prompts.jsonl", targets, max_tokens=256, seed=3)
    run_dir = tmp_path / f"run-{policy}"
    result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--policy", policy, "--chunk-tokens", "32", "--workers", "2", "--kv-cache-gib", "0.25",
                       "--max-num-seqs", "2", "--dtype", "float32", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_complete_output(run_dir, 32)
    assert_lengths_are_the_targets(rows, targets)
    return run_dir, first_leases(run_dir)


def test_seer_starts_long_groups_before_short_ones(tiny_model_dir, tmp_path):
    run_dir, leases = run_short_and_long_groups(tiny_model_dir, tmp_path, "seer")
    # Past seer's starvation bound (from creation) the oldest requests go first: the run must beat it.
    ((span,),) = db_rows(run_dir, "select finished_at - created_at from rollouts")
    assert span < DEFAULT_STARVATION_S, f"the run took {span:.0f}s, past seer's starvation bound"
    long_starts = [order for g, probe, order in leases if g in LONG_GROUPS and not probe]
    short_starts = [order for g, probe, order in leases if g in SHORT_GROUPS and not probe]
    assert len(long_starts) == len(short_starts) == 12
    assert max(long_starts) < min(short_starts), sorted(leases, key=lambda x: x[2])
    # And probes first, as before.
    assert max(order for _, probe, order in leases if probe) < min(long_starts)


def test_next_iteration_with_prior_starts_from_the_earlier_lengths(tiny_model_dir, tmp_path):
    targets = [[9, 20], [40, 33], [3, 5]]
    prompts = write_target_prompts(tmp_path / "prompts.jsonl", targets, max_tokens=48, ignore_eos=True)
    common = ["--input", str(prompts), "--model", str(tiny_model_dir), "--chunk-tokens", "16", "--workers", "1",
              "--kv-cache-gib", "0.25", "--max-num-seqs", "8", "--dtype", "float32", "--no-progress"]
    first = run_seerd("run", "--run-dir", str(tmp_path / "it1"), *common)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_seerd("run", "--run-dir", str(tmp_path / "it2"), "--prior", str(tmp_path / "it1"), *common)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "seeded the estimates of 3 of 3 groups" in second.stderr
    ((data,),) = db_rows(tmp_path / "it2", "select data_json from events where kind = 'prior_seeded'")
    assert json.loads(data)["groups_seeded"] == 3
    history = db_rows(tmp_path / "it2", "select h.age, h.length, g.group_index from prompt_length_history h "
                                        "join prompt_groups g on g.prompt_hash = h.prompt_hash")
    assert sorted((g, length) for age, length, g in history if age == 1) == sorted(
        (g, t) for g, ts in enumerate(targets) for t in ts)
