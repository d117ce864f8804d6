"""`seerd status` and `/metrics` against a live run (real coordinator, two vLLM-CPU workers), then
`seerd status` and `seerd report` against the same run finished."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from seerd.rundir import RunDir
from tests.integration.harness import (
    assert_complete_output, db_rows, done_chunks, run_seerd, start_seerd, wait_for,
)

pytestmark = pytest.mark.vllm

GROUPS, N = 12, 4


def write_long_prompts(path: Path) -> int:
    """Target lengths up to ~900 tokens in chunks of 32, 4 sequences per engine: the run lasts long
    enough to be watched (with 8 per engine it took 16 s here, and ended before the checks did)."""
    rng = random.Random(5)
    total = 0
    with open(path, "w") as handle:
        for g in range(GROUPS):
            scale = rng.choice([60, 150, 600])
            targets = [max(1, int(scale * rng.uniform(0.6, 1.5))) for _ in range(N)]
            total += sum(targets)
            handle.write(json.dumps({"id": f"g{g}", "prompt_token_ids": [rng.randrange(4, 1000) for _ in range(16)],
                                     "n": N, "max_tokens": 1024, "target_lengths": targets,
                                     "ignore_eos": True}) + "\n")
    return total


def status_json(run_dir: Path) -> dict:
    result = run_seerd("status", str(run_dir), "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def pause_workers(run_dir: Path) -> list[int]:
    """SIGSTOP every alive worker (pid from its registered address); returns the pids stopped."""
    pids = [int(address.rsplit(":", 1)[1])
            for (address,) in db_rows(run_dir, "select address from workers where status = 'alive'")]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def resume_workers(paused: list[int]) -> None:
    while paused:
        try:
            os.kill(paused.pop(), signal.SIGCONT)
        except ProcessLookupError:
            pass


def scrape(run_dir: Path) -> dict:
    rundir = RunDir(run_dir)
    host, port = rundir.read_address()
    url = f"http://{host}:{port}/metrics"
    assert httpx.get(url, timeout=5).status_code == 401  # a credential, as everywhere else
    secret = {"Authorization": f"Bearer {rundir.read_secret()}"}  # never sent, and no good if it were
    assert httpx.get(url, headers=secret, timeout=5).status_code == 401
    # What Prometheus sends: its static bearer token, read from `credentials_file: RUN_DIR/metrics-token`.
    token = {"Authorization": f"Bearer {rundir.metrics_token_path.read_text()}"}
    reply = httpx.get(url, headers=token, timeout=5)
    assert reply.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text) for s in family.samples}


def test_status_and_metrics_on_a_live_run_then_status_and_report_when_finished(tiny_model_dir, tmp_path):
    total_tokens = write_long_prompts(tmp_path / "prompts.jsonl")
    run_dir = tmp_path / "run"
    proc = start_seerd("run", "--input", str(tmp_path / "prompts.jsonl"), "--model", str(tiny_model_dir),
                       "--run-dir", str(run_dir), "--chunk-tokens", "32", "--workers", "2", "--lease-ttl", "600",
                       "--kv-cache-gib", "0.25", "--max-num-seqs", "4", "--dtype", "float32", "--no-progress",
                       log=tmp_path / "run.log")
    paused: list[int] = []
    try:
        # Live: both workers have sent heartbeats with their own figures, chunks are running. The
        # checks run while both workers are paused (SIGSTOP; the 600 s lease TTL keeps their leases),
        # so the run cannot finish under them however fast or slow the machine is.
        def watched() -> dict | None:
            if done_chunks(run_dir) < 20:
                return None
            paused.extend(pause_workers(run_dir))
            snap = status_json(run_dir)
            live = [w for w in snap["workers"] if w["tokens_per_s"] is not None and w["kv_usage"] is not None]
            if snap["state"] == "running" and len(live) == 2 and snap["tail"]:
                return snap
            resume_workers(paused)
            return None

        snap = wait_for(watched, timeout=400, what="a running snapshot with both workers' figures", interval=0.5)
        assert snap["coordinator"]["reachable"] is True
        assert 0 < snap["requests_done"] < snap["requests_total"] == GROUPS * N
        assert snap["output_tokens"] >= snap["output_tokens_committed"] > 0
        assert {w["state"] for w in snap["workers"]} == {"alive"}
        assert [t["tokens"] for t in snap["tail"]] == sorted((t["tokens"] for t in snap["tail"]), reverse=True)
        assert all(t["worker"] in {w["worker_id"] for w in snap["workers"]} for t in snap["tail"])
        once = run_seerd("status", str(run_dir), "--once", timeout=60)
        assert once.returncode == 0 and "RUNNING" in once.stdout and "coordinator up" in once.stdout, once
        metrics = scrape(run_dir)
        by_state = {labels[0][1]: v for (name, labels), v in metrics.items() if name == "seerd_requests"}
        assert sum(by_state.values()) == GROUPS * N
        assert metrics[("seerd_leases_in_flight", ())] >= 0
        assert len([k for k in metrics if k[0] == "seerd_worker_alive"]) == 2
        resume_workers(paused)
        assert proc.wait(timeout=900) == 0
    finally:
        resume_workers(paused)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = assert_complete_output(run_dir, GROUPS * N)
    final = status_json(run_dir)
    assert final["state"] == "finished" and final["coordinator"] == {"reachable": False}
    assert final["requests_done"] == final["requests_total"] == GROUPS * N
    assert final["output_tokens"] == sum(r["length"] for r in rows) == total_tokens
    assert final["tail"] == [] and final["tail_phase"]["requests_left"] == 0
    assert {w["state"] for w in final["workers"]} == {"gone"}
    ((last,),) = db_rows(run_dir, "select max(finished_at) from requests")
    assert final["tail_phase"]["started_at"] <= last
    once = run_seerd("status", str(run_dir), "--once", timeout=60)
    assert once.returncode == 0 and "FINISHED" in once.stdout
    report_dir = tmp_path / "report"
    result = run_seerd("report", str(run_dir), "--out", str(report_dir), timeout=300)
    assert result.returncode == 0, result.stderr
    from tests.report_checks import assert_report_matches_run

    assert_report_matches_run(run_dir, report_dir)

