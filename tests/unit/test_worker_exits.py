"""How a worker's end is said (`launch.exits`) and how the supervisor acts on it (`WorkerPool`), with
real child processes that kill themselves by a signal in place of workers."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from seerd.launch.exits import describe_exit, log_tail
from seerd.launch.local import RESTARTS_PER_WORKER, WorkerPool
from seerd.rundir import RunDir


@pytest.mark.parametrize("code, name", [(-4, "SIGILL"), (132, "SIGILL"), (-9, "SIGKILL"), (137, "SIGKILL"),
                                        (-11, "SIGSEGV"), (-7, "SIGBUS")])
def test_a_death_by_signal_is_named_the_way_subprocess_and_srun_report_it(code, name):
    ended = describe_exit(code)
    assert ended.signal == name and ended.meaning and name in ended.summary()


def test_sigill_names_the_bfloat16_kernels_and_the_float32_fix_and_an_own_exit_is_a_code():
    sigill = describe_exit(-4)
    assert "instruction this CPU cannot run" in sigill.meaning and "bfloat16" in sigill.meaning
    assert sigill.fix.endswith("--dtype float32") and "--dtype float32" in sigill.summary()
    own = describe_exit(4)
    assert own.signal is None and own.summary().startswith("exited with code 4 (its engine failed")


def test_the_log_tail_starts_at_the_process_and_centres_on_a_native_crash(tmp_path):
    log = tmp_path / "worker-0.log"
    earlier = "an earlier process's last words\n"
    crash = ("starting the engine\nkernels loaded\nFatal Python error: Illegal instruction\n\n"
             "Current thread 0x1 (most recent call first):\n" + "".join(f'  File "f{i}.py", line {i} in g\n'
                                                                        for i in range(30))
             + "\nExtension modules: numpy, torch (total: 2)\n")
    log.write_text(earlier + crash)
    tail = log_tail(log, since=len(earlier))
    assert tail[:3] == ["starting the engine", "kernels loaded", "Fatal Python error: Illegal instruction"]
    assert tail[4] == '  File "f0.py", line 0 in g'  # the innermost frame
    assert not any("earlier" in line or "Extension modules" in line for line in tail)
    log.write_text("one\ntwo\n" * 20)
    assert log_tail(log) == ["one", "two"] * 6  # no crash report: the last lines
    assert log_tail(tmp_path / "missing.log") == []


class SignalPool(WorkerPool):
    """Workers that are a real process killing itself by `signum` (after `after_s`)."""

    def __init__(self, run_dir: RunDir, count: int, signum: int, after_s: float = 0.0) -> None:
        super().__init__(run_dir, count)
        self.code = (f"import os, signal, time; print('engine kernels loading', flush=True); time.sleep({after_s}); "
                     f"os.kill(os.getpid(), {int(signum)})")

    def command(self, rank: int) -> list[str]:
        return [sys.executable, "-c", self.code]


def supervise_until_stopped(pool: WorkerPool, progress=lambda: 0) -> str:  # noqa: ANN001
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        reason = pool.supervise(False, progress())
        if reason:
            return reason
        time.sleep(0.05)
    raise AssertionError("the pool never stopped")


@pytest.fixture
def run_dir(tmp_path: Path) -> RunDir:
    rundir = RunDir(tmp_path / "run")
    rundir.logs.mkdir(parents=True)
    return rundir


def test_the_same_signal_again_with_no_progress_stops_the_run_after_one_restart(run_dir):
    pool = SignalPool(run_dir, 2, signal.SIGILL)
    pool.start()
    try:
        reason = supervise_until_stopped(pool)
    finally:
        pool.stop(complete=False)
    assert pool.exhausted and max(pool.restarts.values()) == 1
    assert "failed the same way again after a restart" in reason and "killed by SIGILL" in reason
    assert "--dtype float32" in reason and "engine kernels loading" in reason
    ended = pool.take_ended()
    assert [e.exit.signal for e in ended] == ["SIGILL"] * len(ended) and ended[-1].restart is None
    assert json.dumps(ended[-1].event_data())  # what the run's event records
    assert pool.take_ended() == []


def test_a_worker_that_dies_again_after_the_run_progressed_keeps_its_restarts(run_dir):
    pool = SignalPool(run_dir, 1, signal.SIGKILL)
    tokens = iter(range(0, 10_000, 100))  # the run's output grows between any two looks
    pool.start()
    try:
        reason = supervise_until_stopped(pool, progress=lambda: next(tokens))
    finally:
        pool.stop(complete=False)
    assert pool.restarts[0] == RESTARTS_PER_WORKER
    assert reason.startswith(f"every worker exited {RESTARTS_PER_WORKER + 1} times (worker 0: killed by SIGKILL")
    assert len(pool.take_ended()) == RESTARTS_PER_WORKER + 1


def test_a_worker_that_fails_as_the_rollout_completes_is_said_and_not_started_again(run_dir):
    pool = SignalPool(run_dir, 1, signal.SIGSEGV)
    pool.start()
    try:
        pool.procs[0].wait(timeout=60)
        assert pool.supervise(True) is None  # the rollout is complete
        assert pool.supervise(True) is None  # seen once
    finally:
        pool.stop(complete=True, grace_s=0)
    (ended,) = pool.take_ended()
    assert ended.exit.signal == "SIGSEGV" and ended.restart is None and pool.restarts[0] == 0


def test_a_worker_done_with_the_rollout_is_no_exit_to_record(run_dir):
    pool = SignalPool(run_dir, 1, 0)  # a process that ends on its own, code 0
    pool.code = "print('done')"
    pool.start()
    try:
        pool.procs[0].wait(timeout=60)
        assert pool.supervise(True) is None
    finally:
        pool.stop(complete=True, grace_s=0)
    assert pool.take_ended() == []
