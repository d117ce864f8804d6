"""Rollouts on a real single-node Slurm cluster (tools/dev-slurm.sh) with the tiny model on CPU.

sbatch slurm/rollout.sh to completion; the warning signal (drain, requeue, resume); an external
`scontrol requeue`; a worker step cancelled; seerd.submit through submitit on Slurm (with its own
warning signal) and on the local executor. Jobs ask for 10 minutes: Slurm's warning signal may
come a minute early and must not reach a job that is not meant to see it.
"""

from __future__ import annotations

import json
import shlex
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

import seerd
from seerd.launch.submitit_launch import SlurmResources, sbatch_script
from tests.integration.harness import (
    assert_complete_output, db_rows, done_chunks, seerd_cmd, test_env, wait_for, write_token_prompts,
)
from tests.integration.slurm_harness import (
    SUBMITTED, assert_each_chunk_ran_once, cancel_leftover_jobs, events, job_env, processes_mentioning,
    sbatch, scontrol_job, steps, wait_job_end,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

CPU_JOB = ["--gpus-per-node=0", "--time=10"]  # rollout.sh's H800 defaults, overridden for this node
ENGINE = ["--workers-per-node", "2", "--kv-cache-gib", "0.25", "--max-num-seqs", "16", "--dtype", "float32"]


def rollout_args(model: Path, prompts: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--input", str(prompts), "--model", str(model), "--run-dir", str(run_dir), *ENGINE, *extra]


@pytest.fixture(autouse=True)
def no_job_left_behind():
    yield
    cancel_leftover_jobs()


@pytest.fixture()
def job_environment(monkeypatch):
    """seerd.submit's jobs inherit this process's environment (as sbatch's do)."""
    for key, value in job_env().items():
        monkeypatch.setenv(key, value)


def registered_ranks(run_dir: Path) -> list[int]:
    try:
        return [rank for (rank,) in db_rows(run_dir, "select rank from workers order by registered_at")]
    except sqlite3.OperationalError:  # the run's database is being created
        return []


def chunks_done_before(run_dir: Path, ts: float) -> set[int]:
    return {c for (c,) in db_rows(run_dir, "select chunk_id from events where kind='chunk_done' and ts <= ?", (ts,))}


def chunks_leased_after(run_dir: Path, ts: float) -> set[int]:
    return {c for (c,) in db_rows(run_dir, "select chunk_id from events where kind='chunk_leased' and ts > ?", (ts,))}


def test_sbatch_rollout_completes_with_every_response(tmp_path, tiny_model_dir):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=4, seed=11)
    run_dir = tmp_path / "run"
    # --wait-for-workers: both register whatever the timing (without it the first worker up may
    # finish the 16 responses before the second registers; it did once chunks ran on in place).
    job = sbatch(CPU_JOB, rollout_args(tiny_model_dir, prompts, run_dir, "--chunk-tokens", "16", "--n", "4",
                                       "--max-tokens", "48", "--wait-for-workers"), tmp_path)
    log = tmp_path / f"job-{job}.out"
    # While it runs: the address is the node's, and the secret is on no command line and in no
    # process environment of the job (only in the run directory, 0600).
    wait_for(lambda: len(registered_ranks(run_dir)) == 2, timeout=240, what="both workers to register")
    secret = (run_dir / "secret").read_text().strip()
    address = json.loads((run_dir / "coordinator.json").read_text())
    assert not address["host"].startswith("127.") and address["host"] != "0.0.0.0"
    assert {name for name in steps(job)} >= {"seerd-worker-0", "seerd-worker-1"}
    pids = processes_mentioning(str(run_dir))
    assert len(pids) >= 3  # the coordinator and two workers at least
    for pid in pids:
        for what in ("cmdline", "environ"):
            try:
                seen = Path(f"/proc/{pid}/{what}").read_bytes()
            except OSError:  # it exited meanwhile
                continue
            assert secret.encode() not in seen, f"the secret is in {pid}'s {what}"
    assert secret not in scontrol_job(job)
    # rollout.sh's defaults, as Slurm holds them: requeueable, whole node; the time limit overridden.
    info = scontrol_job(job)
    assert "Requeue=1" in info and "OverSubscribe=NO" in info and "TimeLimit=00:10:00" in info

    assert wait_job_end(job, timeout=400, log=log) == ("COMPLETED", "0:0"), log.read_text()[-3000:]
    assert_complete_output(run_dir, 16)
    assert "finished in" in log.read_text()
    assert (run_dir / "secret").stat().st_mode & 0o777 == 0o600 and run_dir.stat().st_mode & 0o777 == 0o700
    (started,) = [json.loads(data) for *_, data in events(run_dir, "slurm_job")]
    assert started["address"] == address["host"] and started["job_id"] == job
    for (worker_address,) in db_rows(run_dir, "select address from workers"):
        assert not worker_address.startswith(("127.", "localhost"))
    # `seerd status JOBID`: through the coordinator's record of the job, and without it through
    # `scontrol show job` (the --run-dir on the job's command line).
    for state_home in (None, tmp_path / "empty-state"):
        env = {**test_env(), **({"XDG_STATE_HOME": str(state_home)} if state_home else {})}
        shown = subprocess.run(seerd_cmd("status", job, "--json"), capture_output=True, text=True, env=env,
                               timeout=60)
        assert shown.returncode == 0, shown.stderr
        snapshot = json.loads(shown.stdout)
        assert Path(snapshot["run_dir"]).resolve() == run_dir.resolve() and snapshot["state"] == "finished"


def interrupted_job(tmp_path: Path, model: Path, seed: int, interrupt: str, *extra: str) -> tuple[str, Path, str]:
    """A job of 32 responses, interrupted (`interrupt` is a command; JOB stands for the job id)
    after 20 chunks finished; it must restart once and complete."""
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=seed)
    run_dir = tmp_path / "run"
    job = sbatch(CPU_JOB, rollout_args(model, prompts, run_dir, "--chunk-tokens", "16", "--n", "4", "--max-tokens",
                                       "320", *extra), tmp_path)
    log = tmp_path / f"job-{job}.out"
    wait_for(lambda: done_chunks(run_dir) >= 20, timeout=300, what="20 finished chunks", interval=0.2)
    subprocess.run(interrupt.replace("JOB", job).split(), check=True, timeout=60)
    assert wait_job_end(job, timeout=500, log=log) == ("COMPLETED", "0:0"), log.read_text()[-3000:]
    return job, run_dir, log.read_text()


def assert_resumed_without_repeats(run_dir: Path, responses: int) -> tuple[float, str]:
    """Complete output, one restart, no chunk generated twice, none finished before the stop
    leased again after it. Returns when the first attempt stopped, and why."""
    assert_complete_output(run_dir, responses)
    assert_each_chunk_ran_once(run_dir)
    assert [json.loads(data)["restart_count"] for *_, data in events(run_dir, "slurm_job")] == [0, 1]
    ((stop_ts, _, _, stop),) = events(run_dir, "rollout_interrupted")
    finished_before = chunks_done_before(run_dir, stop_ts)
    assert finished_before and not finished_before & chunks_leased_after(run_dir, stop_ts)
    return stop_ts, json.loads(stop)["reason"]


def test_warning_signal_drains_requeues_and_resumes(tmp_path, tiny_model_dir):
    # What Slurm sends before the time limit (--signal=B:USR1@300), sent now.
    job, run_dir, text = interrupted_job(tmp_path, tiny_model_dir, 5, "scancel --batch --signal=USR1 JOB",
                                         "--drain-grace", "30")
    assert "draining (signal SIGUSR1)" in text and f"requeueing job {job}" in text and "finished in" in text
    stop_ts, reason = assert_resumed_without_repeats(run_dir, 32)
    assert "drained after signal SIGUSR1" in reason
    assert len(events(run_dir, "slurm_requeue")) == 1 and not events(run_dir, "slurm_requeue_failed")
    # Draining: nothing new was leased between the signal and the stop.
    ((drain_ts, *_),) = events(run_dir, "rollout_draining")
    assert not db_rows(run_dir, "select id from events where kind='chunk_leased' and ts > ? and ts <= ?",
                       (drain_ts, stop_ts))


def test_scontrol_requeue_mid_rollout_restarts_and_completes(tmp_path, tiny_model_dir):
    # An admin's requeue, or preemption in requeue mode: SIGTERM, then the job starts again.
    _, run_dir, _ = interrupted_job(tmp_path, tiny_model_dir, 6, "scontrol requeue JOB")
    assert assert_resumed_without_repeats(run_dir, 32)[1] == "signal SIGTERM"


def test_a_cancelled_worker_step_does_not_stop_the_rollout(tmp_path, tiny_model_dir):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=7)
    run_dir = tmp_path / "run"
    job = sbatch(CPU_JOB, rollout_args(tiny_model_dir, prompts, run_dir, "--chunk-tokens", "16", "--n", "4",
                                       "--max-tokens", "320", "--lease-ttl", "4"), tmp_path)
    log = tmp_path / f"job-{job}.out"

    def worker1_with_leases():
        if done_chunks(run_dir) < 10:
            return None
        rows = db_rows(run_dir, "select w.id from workers w join chunks c on c.lease_holder = w.id and "
                                "c.status = 'leased' where w.rank = 1 group by w.id having count(c.id) >= 4")
        return rows[0][0] if rows else None

    victim = wait_for(worker1_with_leases, timeout=300, what="worker 1 holding leases")
    step = steps(job)["seerd-worker-1"]
    subprocess.run(["scancel", step], check=True, timeout=60)  # Slurm kills the step's task (SIGKILL)
    assert wait_job_end(job, timeout=500, log=log) == ("COMPLETED", "0:0"), log.read_text()[-3000:]
    assert_complete_output(run_dir, 32)
    assert_each_chunk_ran_once(run_dir)
    # Every chunk leased to the killed worker was reported by it before it died, or went back to
    # the queue (its lease expired) and was done by another worker.
    def of_victim(kind: str) -> set[int]:
        return {chunk for _, worker, chunk, _ in events(run_dir, kind) if worker == victim}

    returned = of_victim("lease_released") | of_victim("lease_expired")
    assert returned, "the killed worker's leases had to go back to the queue"
    assert of_victim("chunk_leased") == of_victim("chunk_done") | returned
    assert not returned & of_victim("chunk_done")
    worker1_steps = [line.split("|") for line in subprocess.run(
        ["sacct", "-n", "-P", "-j", job, "-o", "JobID,JobName,State"], capture_output=True, text=True,
        timeout=60).stdout.split() if "|seerd-worker-1|" in line]
    assert [state.split()[0] for step_id, _, state in worker1_steps if step_id == step] == ["CANCELLED"]
    assert len(worker1_steps) == 2, "the cancelled worker step was started again, as a new step"
    # srun reports its task's SIGKILL as exit 137: the warning names the signal.
    assert "worker 1 killed by SIGKILL (exit 137)" in log.read_text()


def test_submitit_submit_wait_results_through_its_warning_signal(tmp_path, tiny_model_dir, job_environment):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=8)
    run_dir = tmp_path / "run"
    resources = dict(gpus_per_worker=0, workers_per_node=2, time_min=10, signal_delay_s=120, drain_grace_s=60)
    handle = seerd.submit(prompts, tiny_model_dir, run_dir, chunk_tokens=16, n=4, max_tokens=320, kv_cache_gib=0.25,
                          max_num_seqs=16, dtype="float32", **resources)
    SUBMITTED.append(handle.job_id)
    assert handle.job_id and handle.folder.parent == run_dir / "submitit"
    # submitit wrote exactly the script seerd renders (and pins in the unit tests' reference file).
    submitted = handle.folder / f"{handle.job_id}_submission.sh"
    assert submitted.read_text() == sbatch_script(SlurmResources(**resources), handle.folder,
                                                  shlex.quote(sys.executable))
    wait_for(lambda: done_chunks(run_dir) >= 20, timeout=300, what="20 finished chunks", interval=0.2)
    # submitit's warning signal (USR2 to every step): the coordinator drains and requeues, the
    # workers keep going until told.
    subprocess.run(["scancel", "--signal=USR2", handle.job_id], check=True, timeout=60)
    started = time.monotonic()
    summary = handle.wait()
    assert time.monotonic() - started < 500
    assert summary["complete"] and summary["responses"] == 32
    rows = handle.results()
    assert len(rows) == 32 and {r["finish_reason"] for r in rows} <= {"stop", "length"}
    assert "drained after signal SIGUSR2" in assert_resumed_without_repeats(run_dir, 32)[1]
    # submitit reads the result as soon as it is written; Slurm records the end a moment later.
    assert wait_job_end(handle.job_id, timeout=120) == ("COMPLETED", "0:0")


def test_submit_runs_on_the_local_executor_without_slurm(tmp_path, tiny_model_dir, job_environment):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=2, seed=9)
    handle = seerd.submit(prompts, tiny_model_dir, tmp_path / "run", cluster="local", gpus_per_worker=0,
                          workers_per_node=1, time_min=10, signal_delay_s=120, drain_grace_s=60, chunk_tokens=16,
                          n=2, max_tokens=32, kv_cache_gib=0.25, max_num_seqs=16, dtype="float32")
    rows = handle.results()
    assert len(rows) == 4
    assert_complete_output(tmp_path / "run", 4)
    assert not events(tmp_path / "run", "slurm_job")  # local worker processes, no Slurm
    again = seerd.submit(prompts, tiny_model_dir, tmp_path / "run", cluster="local", gpus_per_worker=0,
                         dtype="float32")
    assert again.job_id is None and again.wait()["responses"] == 4  # finished: nothing submitted


def test_a_job_that_cannot_finish_exits_nonzero_with_the_reason(tmp_path, tiny_model_dir):
    prompts = write_token_prompts(tmp_path / "prompts.jsonl", groups=8, seed=10)
    run_dir = tmp_path / "run"
    # Workers that do not fit the allocation: refused before anything is created.
    job = sbatch(CPU_JOB, rollout_args(tiny_model_dir, prompts, run_dir, "--gpus-per-worker", "1"), tmp_path)
    log = tmp_path / f"job-{job}.out"
    assert wait_job_end(job, timeout=120, log=log) == ("FAILED", "2:0")
    assert "the job has no GPUs" in log.read_text() and not run_dir.exists()
    # A job that may not be requeued: after the warning it drains, fails to requeue, says why.
    job = sbatch([*CPU_JOB, "--no-requeue"], rollout_args(tiny_model_dir, prompts, run_dir, "--chunk-tokens", "16",
                                                          "--n", "4", "--max-tokens", "320"), tmp_path)
    log = tmp_path / f"job-{job}.out"
    wait_for(lambda: done_chunks(run_dir) >= 10, timeout=300, what="10 finished chunks", interval=0.2)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True, timeout=60)
    assert wait_job_end(job, timeout=300, log=log) == ("FAILED", "1:0")
    assert f"requeueing job {job} failed" in log.read_text()
    ((status, reason),) = db_rows(run_dir, "select status, status_reason from rollouts")
    assert status == "failed" and "drained after signal SIGUSR1" in reason and f"requeueing job {job} failed" in reason
    assert len(events(run_dir, "slurm_requeue_failed")) == 1
    assert not (run_dir / "rollouts.parquet").exists()  # outputs are written only when complete


def test_sbatch_serve_runs_batches_and_serves_on_after_its_warning_signal(tmp_path, tiny_model_dir):
    """slurm/serve.sh: a batch through the serve's job; its warning signal stops the serve and
    requeues the job, and a client's next batch goes through while the job starts again."""
    from seerd.serve.client import Client

    run_dir = tmp_path / "serve"
    job = sbatch(CPU_JOB, ["--model", str(tiny_model_dir), "--run-dir", str(run_dir), "--workers-per-node", "1",
                           "--kv-cache-gib", "0.25", "--max-num-seqs", "16", "--chunk-tokens", "16", "--n", "2",
                           "--max-tokens", "32", "--temperature", "0", "--dtype", "float32"], tmp_path, script="serve.sh")
    log = tmp_path / f"job-{job}.out"
    client = Client(run_dir, patience_s=400)
    prompts = [{"id": f"p{g}", "prompt_token_ids": [5 + g, 9, 11, 40 + g]} for g in range(3)]
    first = client.rollout(prompts)
    assert len(first) == 6 and json.loads((run_dir / "coordinator.json").read_text())["host"] != "127.0.0.1"
    assert subprocess.run(["scancel", "--batch", "--signal=USR1", job], timeout=60).returncode == 0
    second = client.rollout(prompts)  # submitted while the serve stops, or to the requeued job
    wait_for(lambda: client.state(2).status == "finished", 60, "the second batch's end")  # its export follows its rows
    assert [r["token_ids"] for r in second] == [r["token_ids"] for r in first]  # greedy, the same weights
    text = log.read_text()
    assert "warning signal SIGUSR1" in text and f"requeueing job {job}" in text, text[-3000:]
    assert "Restarts=1" in scontrol_job(job)
    assert db_rows(run_dir, "select status from rollouts order by id") == [("finished",), ("finished",)]
    subprocess.run(["scancel", job], timeout=60)
    assert wait_job_end(job, timeout=120, log=log)[0] == "CANCELLED"


def test_submit_serve_on_the_local_executor_serves_batches_until_cancelled(tmp_path, tiny_model_dir,
                                                                           job_environment):
    from seerd.launch.prepare import BadRun

    with pytest.raises(BadRun, match="seerd serve runs vLLM engines"):  # refused here: nothing submitted
        seerd.submit_serve(tiny_model_dir, tmp_path / "refused", cluster="local", gpus_per_worker=0,
                           engine_api="sim")
    assert not (tmp_path / "refused" / "submitit").exists()
    handle = seerd.submit_serve(tiny_model_dir, tmp_path / "serve", cluster="local", gpus_per_worker=0,
                                workers_per_node=1, time_min=10, signal_delay_s=120, drain_grace_s=60, chunk_tokens=16, n=2,
                                max_tokens=24, temperature=0.0, kv_cache_gib=0.25, max_num_seqs=16, dtype="float32")
    client = handle.client(patience_s=300)
    prompts = [{"id": "a", "prompt_token_ids": [5, 6, 7, 8]}, {"id": "b", "prompt_token_ids": [9, 10]}]
    first, second = client.rollout(prompts), client.rollout(prompts)
    assert len(first) == 4 and [r["token_ids"] for r in second] == [r["token_ids"] for r in first]
    assert not handle.done()  # it serves on
    handle.cancel()
    wait_for(handle.done, 120, "the cancelled serve job to end")
