"""Helpers for the Slurm tests: the single-node cluster (tools/dev-slurm.sh), job submission and states."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.harness import REPO_ROOT, db_rows, test_env

DEV_SLURM = REPO_ROOT / "tools" / "dev-slurm.sh"
SUBMITTED: list[str] = []  # job ids of this test session, cancelled if a test leaves one behind
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
         "DEADLINE"}


def dev_slurm(action: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([str(DEV_SLURM), action], capture_output=True, text=True, timeout=timeout)


def job_env() -> dict[str, str]:
    """What a job inherits (sbatch exports the submitter's environment): this checkout's seerd and
    this interpreter, one OpenMP thread per engine."""
    env = test_env()
    env["SEERD_PYTHON"] = sys.executable
    return env


def sbatch(args: list[str], script_args: list[str], log_dir: Path, script: str = "rollout.sh") -> str:
    out = subprocess.run(["sbatch", "--parsable", f"--output={log_dir}/job-%j.out", *args,
                          str(REPO_ROOT / "slurm" / script), *script_args],
                         capture_output=True, text=True, timeout=60, env=job_env(), cwd=log_dir)
    assert out.returncode == 0, out.stderr
    job_id = out.stdout.strip().split(";")[0]
    SUBMITTED.append(job_id)
    return job_id


def cancel_leftover_jobs() -> None:
    """A failed test must not leave its job holding the (exclusive) node for the next one."""
    while SUBMITTED:
        job_id = SUBMITTED.pop()
        if job_state(job_id)[0] not in ENDED:
            subprocess.run(["scancel", job_id], timeout=60)


def job_state(job_id: str) -> tuple[str, str]:
    """(state, exit code) of the job itself, from accounting (what submitit reads too)."""
    out = subprocess.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"], capture_output=True,
                         text=True, timeout=60)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    if not lines:
        return "UNKNOWN", ""
    state, exit_code = lines[-1].split("|")
    return state.split()[0], exit_code


def wait_job_end(job_id: str, timeout: float, log: Path | None = None) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state, exit_code = job_state(job_id)
        if state in ENDED:
            return state, exit_code
        time.sleep(1)
    subprocess.run(["scancel", job_id], timeout=60)
    text = log.read_text()[-4000:] if log is not None and log.exists() else ""
    raise AssertionError(f"job {job_id} did not end within {timeout:.0f}s (state {job_state(job_id)}):\n{text}")


def scontrol_job(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=60).stdout


def steps(job_id: str) -> dict[str, str]:
    """Running steps of the job: step name -> step id (`4.1`)."""
    out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j"], capture_output=True, text=True,
                         timeout=60)
    return {name: step for step, name in (line.split("|") for line in out.stdout.split())}


def events(run_dir: Path, kind: str) -> list[tuple]:
    return db_rows(run_dir, "select ts, worker_id, chunk_id, data_json from events where kind=? order by id", (kind,))


def assert_each_chunk_ran_once(run_dir: Path) -> None:
    """Every chunk generated (reported done) exactly once, and every done chunk has one report."""
    done_events = db_rows(run_dir, "select chunk_id, count(*) from events where kind='chunk_done' group by chunk_id")
    assert done_events and all(count == 1 for _, count in done_events), "a chunk was reported done twice"
    done_chunks = {c for (c,) in db_rows(run_dir, "select id from chunks where status='done'")}
    assert {c for c, _ in done_events} == done_chunks


def processes_mentioning(word: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if word.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
            except OSError:
                continue
    return pids
