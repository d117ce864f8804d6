"""Starting a run: creation is atomic (what a failed or killed creation leaves, the next `seerd run`
creates again), a run a live coordinator owns is refused with its owner named (exit 2), and a
coordinator taken over stops without writing the run's end. Real SQLite, real processes, no engines."""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from seerd.cli.main import EXIT_BAD_INPUT, cli
from seerd.config import ROLLOUT_DEFAULTS, build_config
from seerd.coordinator.daemon import Coordinator
from seerd.db import RolloutStatus
from seerd.event_loop import run_event_loop
from seerd.launch.prepare import BadRun, prepare_run, stored_rollout
from seerd.ownership import OWNER_FILE, read_owner, take_ownership
from seerd.rundir import RunDir
from tests.unit.helpers import holders, python  # noqa: F401  (holders is a fixture)
from tests.unit.test_ownership import stale_record

# `prepare_run` whose creating transaction hangs once the rows are in, until the process is killed.
CREATE_AND_HANG = """
import sys, time
from pathlib import Path
import seerd.coordinator.create as create
from seerd.config import ROLLOUT_DEFAULTS, build_config
from seerd.launch.prepare import prepare_run
from seerd.rundir import RunDir

def create_then_hang(session, *args, **kwargs):
    create.create_rollout_for_real(session, *args, **kwargs)
    session.flush()
    print("inside the transaction", flush=True)
    time.sleep(600)

create.create_rollout_for_real, create.create_rollout = create.create_rollout, create_then_hang
prompts, model, run = map(Path, sys.argv[1:4])
prepare_run(RunDir(run), build_config(workers=1, input_path=prompts, model_path=model, **ROLLOUT_DEFAULTS), prompts)
"""


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt_token_ids": [5 + i, 6, 7]}) + "\n" for i in range(3)))
    return path


def prepare(run: Path, prompts: Path, model: Path, **kwargs):  # noqa: ANN003, ANN201
    config = build_config(workers=1, input_path=prompts, model_path=model, **ROLLOUT_DEFAULTS)
    return prepare_run(RunDir(run), config, prompts, **kwargs)


def invoke(*args: str):  # noqa: ANN201
    return CliRunner().invoke(cli, [str(a) for a in args])


def assert_created_again(run: Path, prompts: Path, model: Path) -> None:
    """The next `seerd run` creates the run in what the failed creation left."""
    prepared = prepare(run, prompts, model)
    with prepared.ownership:
        assert prepared.created and prepared.groups == 3
        rollout = stored_rollout(RunDir(run))
        assert rollout.status == RolloutStatus.CREATED and rollout.model_fingerprint


def test_a_creation_killed_mid_transaction_is_created_again_by_the_next_run(tmp_path, prompts, tiny_model_dir):
    run = tmp_path / "run"
    creator = python(CREATE_AND_HANG, str(prompts), str(tiny_model_dir), str(run))
    try:
        assert creator.stdout.readline().strip() == "inside the transaction"
    finally:
        creator.send_signal(signal.SIGKILL)
        creator.wait()
    assert read_owner(run).pid == creator.pid  # it died owning the run: a stale owner now
    # Every other command says there is no run yet, and how to get one.
    for args in (["resume", run], ["export", run]):
        result = invoke(*args)
        assert result.exit_code == EXIT_BAD_INPUT and "creation did not complete" in result.output, result.output
    assert_created_again(run, prompts, tiny_model_dir)


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")],
                         ids=["ctrl-c", "disk full"])
def test_a_failed_creation_leaves_nothing_the_next_run_cannot_replace(failure, tmp_path, prompts, tiny_model_dir,
                                                                      monkeypatch):
    import seerd.coordinator.create as create

    real = create.create_rollout

    def create_then_fail(session, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        real(session, *args, **kwargs)
        session.flush()
        raise failure

    monkeypatch.setattr(create, "create_rollout", create_then_fail)
    run = tmp_path / "run"
    with pytest.raises(type(failure)):
        prepare(run, prompts, tiny_model_dir)
    assert read_owner(run) is None  # released on the way out
    assert stored_rollout(RunDir(run)) is None  # the transaction rolled back whole
    monkeypatch.setattr(create, "create_rollout", real)
    assert_created_again(run, prompts, tiny_model_dir)


def test_an_input_path_that_is_not_utf8_is_refused_before_anything_is_written(tmp_path, prompts, tiny_model_dir):
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/prompts-\xff.jsonl"))
    odd.write_bytes(prompts.read_bytes())
    with pytest.raises(BadRun, match="not valid UTF-8"):
        prepare(tmp_path / "run", odd, tiny_model_dir)
    assert not (tmp_path / "run").exists()


def test_a_live_coordinator_refuses_run_resume_submit_and_upgrade_naming_it(tmp_path, prompts, tiny_model_dir,
                                                                            holders):
    run = tmp_path / "run"
    prepare(run, prompts, tiny_model_dir).ownership.release()
    owner = holders(run)
    common = ["--input", prompts, "--model", tiny_model_dir, "--run-dir", run]
    for args in (["run", *common, "--no-progress"], ["resume", run, "--no-progress"], ["db", "upgrade", run],
                 ["submit", *common, "--cluster", "local", "--gpus-per-worker", "0"]):
        result = invoke(*args)
        assert result.exit_code == EXIT_BAD_INPUT, (args, result.output)
        assert f"owned by a live coordinator: pid {owner.pid} on " in result.output and "since" in result.output
    assert not (run / "submitit").exists()  # nothing was submitted
    assert read_owner(run).pid == owner.pid  # the owner keeps its run
    owner.kill()
    owner.wait()
    resumed = prepare(run, prompts, tiny_model_dir)  # its death frees the run at once
    with resumed.ownership:
        assert not resumed.created and not resumed.finished


def test_a_taken_over_coordinator_stops_without_writing_the_runs_end(tmp_path, prompts, tiny_model_dir):
    run = tmp_path / "run"
    prepare(run, prompts, tiny_model_dir).ownership.release()
    with take_ownership(run, heartbeat_s=0.05) as ownership:
        coordinator = Coordinator(RunDir(run), ownership)

        def taken_over(*_address: object) -> None:  # another node judged us stale and took the run
            # Its record replaces ours in one rename: the owner's heartbeat (every 50 ms) sees the
            # other owner, never the moment between a taker's rename-away and its link.
            elsewhere = tmp_path / "elsewhere"
            elsewhere.mkdir()
            stale_record(elsewhere)
            os.replace(elsewhere / OWNER_FILE, run / OWNER_FILE)

        started = time.monotonic()
        result = run_event_loop(coordinator.serve(on_ready=taken_over))
        assert time.monotonic() - started < 10
    assert result.status == RolloutStatus.INTERRUPTED and "lost the run" in result.reason
    assert "node-elsewhere" in ownership.lost
    # The run's status is the one this coordinator set at its start: the new owner's to change.
    assert stored_rollout(RunDir(run)).status == RolloutStatus.RUNNING
    assert read_owner(run).host == "node-elsewhere"
    coordinator.engine.dispose()


def test_a_coordinator_cannot_start_without_owning_its_run(tmp_path, prompts, tiny_model_dir):
    run = tmp_path / "run"
    ownership = prepare(run, prompts, tiny_model_dir).ownership
    ownership.release()
    with pytest.raises(RuntimeError, match="not owned here"):
        Coordinator(RunDir(run), ownership)
    other = tmp_path / "other"
    other.mkdir()
    with take_ownership(other) as elsewhere, pytest.raises(RuntimeError, match="not owned here"):
        Coordinator(RunDir(run), elsewhere)


def test_prepare_refuses_what_a_live_owner_holds_before_any_write(tmp_path, prompts, tiny_model_dir, holders):
    run = tmp_path / "run"
    run.mkdir()
    holders(run)  # e.g. a `seerd run` that is creating it right now
    with pytest.raises(BadRun, match="owned by a live coordinator"):
        prepare(run, prompts, tiny_model_dir)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith("owner")) == []
