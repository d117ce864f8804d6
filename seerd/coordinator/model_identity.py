"""The model checkpoint's identity: a fingerprint taken at creation and compared at every start.

A rollout samples every response from one policy. A resume (or a Slurm requeue) that found other
weights at the same path, say a `latest` directory the trainer rewrote meanwhile, would mix two
policies in one batch without a trace. So creation records a fingerprint of the model directory in
the rollout's row, and every coordinator start compares it: a change is refused (ModelChanged, exit
2, naming each file that changed) unless the user passes `--allow-model-change`, which records it
(a `model_changed` event; the stored fingerprint becomes the new one, so later starts compare
against what now runs).

What is read: every file under the model directory except hidden ones and documentation (`*.md`),
by relative path. A file up to WHOLE_FILE_BYTES (configs, tokenizer, chat template, a small model's
weights) counts by its size and the SHA-256 of all of it; a larger one (weights) by its size and the
SHA-256 of its first MiB (a safetensors header in full, however long: tensor names, dtypes, shapes,
offsets) and its last MiB. Hashing all the weights at every resume would read the whole checkpoint
(hundreds of GB, minutes on a parallel filesystem); this reads about 2 MiB per weight file.
Training changes every parameter, and bytes of the first and last tensors of every shard are in the
samples, so a new checkpoint of the same shape is seen; an edit confined to the middle of a large
file (one tensor changed by hand) is not. Modification times are not used: a copied or restored
checkpoint keeps its identity.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from seerd.db import Rollout, Session, add_event, queries, sessionmaker

FINGERPRINT_VERSION = 1
WHOLE_FILE_BYTES = 16 << 20
SAMPLE_BYTES = 1 << 20


class ModelChanged(RuntimeError):
    """The run's model directory no longer holds the checkpoint the run was created with."""

    def __init__(self, model_path: str, changes: list[str]) -> None:
        self.model_path = model_path
        self.changes = changes
        super().__init__(f"the model at {model_path} changed since the run was created: {'; '.join(changes)}. "
                         f"A rollout samples every response from one checkpoint; to continue this run with "
                         f"the new one anyway, add --allow-model-change (the change is recorded in the run)")


def model_fingerprint(model_dir: Path) -> dict:
    """{"version", "files": {relative path: {"size", "sha256"}}} of `model_dir`; OSError if unreadable."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a directory")
    files = {}
    for folder, subfolders, names in os.walk(model_dir, onerror=_raise):
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or name.endswith(".md"):
                continue
            path = Path(folder) / name
            files[path.relative_to(model_dir).as_posix()] = _file_identity(path)
    return {"version": FINGERPRINT_VERSION, "files": files}


def _raise(error: OSError) -> None:
    raise error


def _file_identity(path: Path) -> dict:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size <= WHOLE_FILE_BYTES:
            for block in iter(lambda: handle.read(SAMPLE_BYTES), b""):
                digest.update(block)
        else:
            digest.update(handle.read(max(SAMPLE_BYTES, _safetensors_header_end(handle, size))))
            handle.seek(size - SAMPLE_BYTES)
            digest.update(handle.read(SAMPLE_BYTES))
    return {"size": size, "sha256": digest.hexdigest()}


def _safetensors_header_end(handle, size: int) -> int:  # noqa: ANN001
    """Where a safetensors file's JSON header ends (8 bytes of length, then the header); 0 if the
    file does not start like one."""
    handle.seek(0)
    head = handle.read(8)
    handle.seek(0)
    if len(head) < 8:
        return 0
    (length,) = struct.unpack("<Q", head)
    return 8 + length if 8 + length <= size else 0


def fingerprint_changes(recorded: dict, current: dict) -> list[str]:
    """What differs, one phrase per file, in path order."""
    before, after = recorded["files"], current["files"]
    changes = []
    for name in sorted(before.keys() | after.keys()):
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        if old is None:
            changes.append(f"{name} was added")
        elif new is None:
            changes.append(f"{name} was removed")
        elif old["size"] != new["size"]:
            changes.append(f"{name} changed size ({old['size']:,} -> {new['size']:,} bytes)")
        else:
            changes.append(f"{name} changed content")
    return changes


def fingerprint_json(fingerprint: dict) -> str:
    """As stored in `rollouts.model_fingerprint`."""
    return json.dumps(fingerprint, sort_keys=True)


def weight_version(model_path: str, fingerprint: str | None) -> str:
    """The weights a rollout samples from, as its rows and workers name them: the checkpoint's path
    and a hash of its fingerprint (`fingerprint_json`), e.g. `/ckpt/step-40@3f2a9c0d1e7b6a55`."""
    digest = hashlib.sha256((fingerprint or "").encode()).hexdigest()[:16]
    return f"{model_path}@{digest}"


def recorded_fingerprint(rollout: Rollout) -> dict | None:
    return json.loads(rollout.model_fingerprint) if rollout.model_fingerprint else None


def model_changes(model_path: str, recorded: dict | None) -> tuple[dict | None, list[str]]:
    """The model directory's fingerprint now (None if it cannot be read) and what changed since
    `recorded` (nothing when none was recorded, or by another version of the fingerprint)."""
    try:
        current = model_fingerprint(Path(model_path))
    except OSError as exc:
        if recorded is None:  # nothing to compare with: the engines will say what is wrong with it
            return None, []
        return None, [f"the model directory cannot be read ({exc})"]
    if recorded is None or recorded.get("version") != FINGERPRINT_VERSION:
        return current, []
    return current, fingerprint_changes(recorded, current)


def check_model(rollout: Rollout, *, allow_change: bool) -> tuple[dict | None, list[str]]:
    """The model directory's fingerprint now and what changed since the run recorded one;
    ModelChanged when it changed and that is not allowed (or the directory cannot be read)."""
    current, changes = model_changes(rollout.model_path, recorded_fingerprint(rollout))
    if changes and (current is None or not allow_change):
        raise ModelChanged(rollout.model_path, changes)
    return current, changes


def verify_model(sessions: sessionmaker[Session], rollout: Rollout, *, allow_change: bool, now: float) -> None:
    """At a coordinator's start: `check_model`; an allowed change is recorded, as is the first
    fingerprint of a run created without one."""
    current, changes = check_model(rollout, allow_change=allow_change)
    if current is None or current == recorded_fingerprint(rollout):
        return
    with sessions.begin() as session:
        queries.rollouts.set_model_fingerprint(session, rollout.id, fingerprint_json(current))
        if changes:
            add_event(session, rollout.id, now, "model_changed",
                      data={"model_path": rollout.model_path, "changes": changes, "allowed_by": "--allow-model-change"})
        else:  # a run created before fingerprints were recorded (or with another version of them)
            add_event(session, rollout.id, now, "model_fingerprint_recorded", data={"model_path": rollout.model_path})
