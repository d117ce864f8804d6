"""examples/grpo_motif.py, short: three RL iterations through `seerd serve` (issue 18). Each
iteration's rollout runs on the checkpoint the trainer wrote before it, and the trainer's
log-probs of the sampled tokens equal vLLM's (both float32): the rollout ran on exactly the
trainer's weights: the gap stays below 1e-6 here, while one training step moves those log-probs
by 0.09 on average (measured between two consecutive checkpoints of a 3-iteration run), so a batch
sampled from the previous checkpoint would fail the bound below by three orders of magnitude."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.harness import REPO_ROOT, test_env

pytestmark = pytest.mark.vllm


def test_three_iterations_each_on_the_trainers_newest_weights(tmp_path):
    done = subprocess.run([sys.executable, "examples/grpo_motif.py", "--iterations", "3", "--groups", "8", "--json",
                           "--work-dir", str(tmp_path / "rl")], capture_output=True, text=True, timeout=900,
                          env=test_env(), cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    versions = [r["weight_version"] for r in records]
    assert versions[0].startswith(str(REPO_ROOT / "examples" / "motif_model" / "weights") + "@")
    assert [v.rsplit("@", 1)[0] for v in versions[1:]] == [str(tmp_path / "rl" / f"ckpt-{i}") for i in (1, 2)]
    assert len(set(versions)) == 3
    assert all(r["responses"] == 8 * 8 and 0.0 <= r["reward"] <= 1.0 and r["rollout_s"] > 0 for r in records)
    assert all(r["logprob_gap"] < 1e-4 for r in records), records
    assert (tmp_path / "rl" / "reward.png").stat().st_size > 0
