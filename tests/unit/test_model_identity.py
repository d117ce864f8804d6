"""The model checkpoint's identity: a changed checkpoint is refused at resume (exit 2, saying what
changed), accepted with --allow-model-change and then recorded; what the fingerprint reads."""

from __future__ import annotations

import json
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from seerd.cli.main import EXIT_BAD_INPUT, cli
from seerd.config import ROLLOUT_DEFAULTS, build_config
from seerd.coordinator.daemon import Coordinator
from seerd.coordinator.model_identity import (
    SAMPLE_BYTES, WHOLE_FILE_BYTES, ModelChanged, fingerprint_changes, model_fingerprint,
)
from seerd.launch.prepare import prepare_run
from seerd.ownership import take_ownership
from seerd.rundir import RunDir


@pytest.fixture
def model(tmp_path, tiny_model_dir) -> Path:
    """A copy of the tiny model that a test may change."""
    return Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))


@pytest.fixture
def run(tmp_path, model) -> Path:
    """An unfinished run of `model`, owned by nobody."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 6, 7]}) + "\n")
    config = build_config(workers=1, input_path=prompts, model_path=model, **ROLLOUT_DEFAULTS)
    prepare_run(RunDir(tmp_path / "run"), config, prompts).ownership.release()
    return tmp_path / "run"


def change_checkpoint(model: Path) -> None:
    """What a trainer writing the next checkpoint into the same directory does: new weights (same
    size) and a config that says something else."""
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-10:] = bytes(255 - b for b in weights[-10:])
    (model / "model.safetensors").write_bytes(weights)


def events(run: Path, kind: str) -> list[dict]:
    with sqlite3.connect(run / "state.db") as db:
        return [json.loads(data) for (data,) in db.execute("select data_json from events where kind = ?", (kind,))]


def stored_fingerprint(run: Path) -> dict:
    with sqlite3.connect(run / "state.db") as db:
        return json.loads(db.execute("select model_fingerprint from rollouts").fetchone()[0])


def start_coordinator(run: Path, **options) -> None:  # noqa: ANN003
    """A coordinator's start on the run (it verifies the model), without serving."""
    with take_ownership(run) as ownership:
        Coordinator(RunDir(run), ownership, **options).engine.dispose()


def test_a_changed_checkpoint_is_refused_then_accepted_with_allow_model_change_and_recorded(run, model):
    created = stored_fingerprint(run)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(created["files"])
    change_checkpoint(model)
    prompts = run.parent / "prompts.jsonl"
    for args in (["resume", run, "--no-progress"],
                 ["run", "--input", prompts, "--model", model, "--run-dir", run, "--no-progress"]):
        result = CliRunner().invoke(cli, [str(a) for a in args])
        assert result.exit_code == EXIT_BAD_INPUT, result.output
        assert f"the model at {model} changed since the run was created" in result.output
        assert "config.json changed size" in result.output and "model.safetensors changed content" in result.output
        assert "--allow-model-change" in result.output
    with pytest.raises(ModelChanged):
        start_coordinator(run)
    assert stored_fingerprint(run) == created and not events(run, "model_changed")  # a refusal writes nothing

    start_coordinator(run, allow_model_change=True)
    [changed] = events(run, "model_changed")
    assert changed == {"model_path": str(model), "allowed_by": "--allow-model-change",
                       "changes": [changed["changes"][0], "model.safetensors changed content"]}
    assert changed["changes"][0].startswith("config.json changed size")
    assert stored_fingerprint(run) == model_fingerprint(model)
    start_coordinator(run)  # the new checkpoint is the run's now: no flag needed, nothing recorded again
    assert len(events(run, "model_changed")) == 1


def test_submit_refuses_a_changed_checkpoint_before_submitting(run, model):
    import seerd
    from seerd.launch.prepare import BadRun

    change_checkpoint(model)
    with pytest.raises(BadRun, match="model.safetensors changed content"):
        seerd.submit(run.parent / "prompts.jsonl", model, run, gpus_per_worker=0, cluster="local",
                     allow_model_change=False)
    assert not (run / "submitit").exists()


def test_an_unchanged_checkpoint_copied_elsewhere_keeps_its_identity(tmp_path, tiny_model_dir):
    copy = shutil.copytree(tiny_model_dir, tmp_path / "copy")  # new inodes and times, same bytes
    assert model_fingerprint(copy) == model_fingerprint(tiny_model_dir)


def test_a_run_created_without_a_fingerprint_records_one_at_its_next_start(run, model):
    with sqlite3.connect(run / "state.db") as db:
        db.execute("update rollouts set model_fingerprint = null")  # as a run from before migration 0007
    start_coordinator(run)
    assert stored_fingerprint(run) == model_fingerprint(model)
    assert events(run, "model_fingerprint_recorded") == [{"model_path": str(model)}]


def test_a_missing_model_directory_is_refused_even_when_changes_are_allowed(run, model):
    shutil.rmtree(model)
    with pytest.raises(ModelChanged, match="the model directory cannot be read"):
        start_coordinator(run, allow_model_change=True)


def write_safetensors(path: Path, data_bytes: int, header_bytes: int = 200) -> None:
    header = json.dumps({"w": {"dtype": "U8", "shape": [data_bytes], "data_offsets": [0, data_bytes]}}).encode()
    header = header.ljust(header_bytes)
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(data_bytes))


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def test_large_files_count_by_size_header_and_ends_small_ones_whole(tmp_path):
    weights = tmp_path / "model.safetensors"
    write_safetensors(weights, WHOLE_FILE_BYTES + 4 * SAMPLE_BYTES, header_bytes=SAMPLE_BYTES + 4096)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "README.md").write_text("a model")  # documentation and hidden files are no part of it
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "download.lock").write_text("x")
    before = model_fingerprint(tmp_path)
    assert set(before["files"]) == {"config.json", "model.safetensors"}

    def changes() -> list[str]:
        return fingerprint_changes(before, model_fingerprint(tmp_path))

    (tmp_path / "README.md").write_text("a better model")
    assert changes() == []
    size = weights.stat().st_size
    flip(weights, size // 2)  # the middle of a large file is not read: the documented blind spot
    assert changes() == []
    flip(weights, SAMPLE_BYTES + 100)  # inside a safetensors header longer than the first MiB
    assert changes() == ["model.safetensors changed content"]
    flip(weights, SAMPLE_BYTES + 100)
    flip(weights, size - 5)  # the last MiB
    assert changes() == ["model.safetensors changed content"]
    flip(weights, size - 5)
    (tmp_path / "config.json").write_text("[]")  # small files are read whole
    (tmp_path / "tokenizer.json").write_text("{}")
    with open(weights, "ab") as handle:
        handle.write(b"\0")
    assert changes() == ["config.json changed content",
                         f"model.safetensors changed size ({size:,} -> {size + 1:,} bytes)", "tokenizer.json was added"]
    (tmp_path / "config.json").unlink()
    assert "config.json was removed" in changes()
