"""`seerd run --engine-api sim`: the real coordinator, SQLite and HTTP with simulated engines
(the simulator's engine model in each worker, seerd/worker/sim_engine.py), several workers per
process. No vLLM: these are the control plane's tests at a scale real engines cannot reach here."""

from __future__ import annotations

import json
import stat
import time

from tests.integration.harness import assert_complete_output, db_rows, run_seerd
from tests.integration.test_target_lengths import assert_lengths_are_the_targets, write_target_prompts


def test_simulated_workers_complete_every_response_at_its_target_length(tiny_model_dir, tmp_path):
    # Lengths below, at and across chunk boundaries (chunk 64), up to max_tokens; 8 workers in one
    # process, each a worker of its own to the coordinator.
    targets = [[(g * 37 + r * 101) % 300 + 1 for r in range(4)] for g in range(24)]
    prompts = write_target_prompts(tmp_path / "prompts.jsonl", targets, max_tokens=300)
    run_dir = tmp_path / "run"
    started = time.time()
    result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                       "--engine-api", "sim", "--time-scale", "20", "--workers", "8", "--max-num-seqs", "8",
                       "--chunk-tokens", "64", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = assert_complete_output(run_dir, 96)
    assert_lengths_are_the_targets(rows, targets)
    assert {r["finish_reason"] for r in rows} == {"length_target"}
    workers = db_rows(run_dir, "select count(*), count(distinct id) from workers")[0]
    assert workers == (8, 8)
    # Several chunks per long response, continued in place where the scheduler keeps them.
    assert db_rows(run_dir, "select count(*) from chunks")[0][0] > 96
    # What the workers measured of the coordinator, per endpoint, in a private file.
    calls_file = run_dir / "logs" / "sim-calls-0.json"
    assert stat.S_IMODE(calls_file.stat().st_mode) == 0o600
    calls = json.loads(calls_file.read_text())
    assert len(calls["/v1/register"]) == 8 and len(calls["/v1/report"]) > 0
    assert all(seconds >= 0 for _, seconds, _ in calls["/v1/lease"])  # its long-poll wait out
    # Each worker's first call of an endpoint is marked (a first lease is its share of the start-up fill).
    assert sum(first for *_, first in calls["/v1/lease"]) == 8
    assert all(first for *_, first in calls["/v1/register"])
    # Each call with the wall time it was sent, within the run.
    sent = [sent_at for endpoint_calls in calls.values() for sent_at, *_ in endpoint_calls]
    assert started <= min(sent) <= max(sent) <= time.time()


def test_simulated_engines_refuse_drafting_and_the_pool_before_anything_starts(tiny_model_dir, tmp_path):
    prompts = write_target_prompts(tmp_path / "prompts.jsonl", [[3, 4]], max_tokens=8)
    for extra, words in [(["--spec", "grouped"], "--spec off"), (["--kv-pool", "mooncake"], "--kv-pool off"),
                         (["--time-scale", "0"], "--time-scale"), (["--sim-preset", "gpt5"], "--sim-preset")]:
        run_dir = tmp_path / f"run{len(words)}"
        result = run_seerd("run", "--input", str(prompts), "--model", str(tiny_model_dir), "--run-dir", str(run_dir),
                           "--engine-api", "sim", *extra, "--no-progress")
        assert result.returncode == 2, (extra, result.stderr[-2000:])
        assert words in result.stderr, (extra, result.stderr[-2000:])
        assert not (run_dir / "state.db").exists()


def test_the_daemon_on_simulated_engines_agrees_with_the_simulator(tmp_path):
    """The same workload and cluster through `seerd sim` and through the daemon with simulated
    engines (`tools/bench/load.py --compare-sim`): the engines are the same model, so makespan, tail and
    chunk counts must stay close; what differs is the daemon's real control plane against the
    simulator's fixed gap per chunk, and in-place continuation (a continued chunk keeps its
    sequence in the daemon, re-enters admission in the simulator). The ratios measured on this
    machine are in docs/benchmarks.md ("The daemon beside the simulator"); a machine twice as
    slow adds control-plane time, so the bound is loose on that side."""
    import subprocess
    import sys

    from tests.integration.harness import REPO_ROOT

    done = subprocess.run([sys.executable, "tools/bench/load.py", "--workers", "4", "--requests", "512", "--time-scale", "1",
                           "--policy", "seer", "--compare-sim", "--json", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exactly_once"], result["problems"]
    sim = result["sim"]
    assert 0.7 <= result["model_total_s"] / sim["total_s"] <= 1.5, (result["model_total_s"], sim)
    assert abs(result["chunks"] - sim["chunks"]) <= 0.15 * sim["chunks"], (result["chunks"], sim)


def test_the_load_tool_runs_64_workers_and_5000_requests_each_exactly_once(tmp_path):
    """Issue 17's CI form of `tools/bench/load.py`: the real coordinator, 64 simulated workers in one
    process, 5,000 requests at the engines' own speed; every request ends once, at its target
    length, with its chunks 0..k-1 (the tool's own checks, on the database), and the figures the
    issue names are reported."""
    import subprocess
    import sys

    from tests.integration.harness import REPO_ROOT

    done = subprocess.run([sys.executable, "tools/bench/load.py", "--workers", "64", "--requests", "5000", "--time-scale", "1",
                           "--json", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exactly_once"] and not result["problems"], result["problems"]
    assert (result["workers"], result["requests"]) == (64, 5000)
    for key in ("lease_p99_ms", "report_p99_ms", "serving_lease_p99_ms",
                "serving_report_p99_ms", "coordinator_cpu_share", "coordinator_rss_mb", "db_mb"):
        assert result[key] is not None and result[key] > 0, key
    assert result["calls"]["/v1/register"]["calls"] == 64
    assert result["joining_leases"]["calls"] == 64  # one first lease each, out of the serving figures
    assert result["calls_serving"]["/v1/lease"]["calls"] == result["calls"]["/v1/lease"]["calls"] - 64
    # The same work dir again would resume the finished run and report its old calls: refused.
    again = subprocess.run([sys.executable, "tools/bench/load.py", "--workers", "64", "--requests", "5000", "--json",
                            "--work-dir", str(tmp_path)], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120)
    assert again.returncode == 2 and "already holds a run" in again.stderr, again.stderr[-3000:]


def test_the_load_tool_runs_through_api_front_processes_each_request_exactly_once(tmp_path):
    """The same with the API served by two front processes (server/front.py), as from 600
    workers: every call forwarded to the coordinator's handlers, every request ends once, and
    the fronts' CPU is counted as the coordinator's (its load figures name them)."""
    import sqlite3
    import subprocess
    import sys

    from tests.integration.harness import REPO_ROOT

    done = subprocess.run([sys.executable, "tools/bench/load.py", "--workers", "16", "--requests", "1000", "--time-scale", "1",
                           "--api-processes", "2", "--json", "--work-dir", str(tmp_path)],
                          capture_output=True, text=True, cwd=REPO_ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exactly_once"] and not result["problems"], result["problems"]
    assert (result["workers"], result["requests"], result["api_processes"]) == (16, 1000, 2)
    assert result["calls"]["/v1/register"]["calls"] == 16
    with sqlite3.connect(tmp_path / "run" / "state.db") as db:
        load = json.loads(db.execute("select data_json from events where kind = 'coordinator_load'").fetchone()[0])
    assert {"api-front-0", "api-front-1"} <= set(load["generation_cpu_by_thread_s"])
    assert result["server_calls"]["/v1/register"]["calls"] == 16  # timed in the coordinator, as in one process
