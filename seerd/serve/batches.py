"""`seerd serve`'s batches: each one a rollout in the serve's database, created from a client's
`BatchBody`, read back as its state and as the groups that ended.

Creation checks a batch as `seerd run` checks a run (launch/prepare.validated: prompts, sampling
settings by vLLM's rules, context length) against the serve's engine settings, plus that new
weights are the serve's model (same config.json but for bookkeeping keys, the same tensors by name,
dtype and shape, no truncated file): the engines load them in place, which only works for the
architecture they were started with, and a checkpoint they fail to load would take the workers
down rather than the batch. The previous finished batch
seeds the length estimates (coordinator/prior.py, as `--prior`), so context-aware scheduling
starts each iteration from the last one's lengths.

Groups are streamed by event id: a group ends with the last `request_finished`/`request_failed`
event of its requests, ids grow in commit order (one writer), so "the ended groups among those
with such an event past the cursor" yields each group exactly once, in the order they ended.
"""

from __future__ import annotations

import json
import os
import struct
import time
from dataclasses import replace
from pathlib import Path

import msgspec

from seerd.config import RunConfig
from seerd.coordinator.create import create_rollout
from seerd.coordinator.model_identity import weight_version
from seerd.db import Connection, Engine, RolloutStatus, make_sessionmaker, queries
from seerd.db.codec import unpack_ints
from seerd.io.export import group_rows
from seerd.launch.prepare import BadRun, file_sha256, validated
from seerd.protocol import BatchBody, BatchState, GroupsReply
from seerd.rundir import RunDir

# Keys of config.json that say how a checkpoint was saved, not what model it is.
BOOKKEEPING_KEYS = frozenset({"_name_or_path", "transformers_version", "torch_dtype", "dtype"})
END_EVENTS = ("request_finished", "request_failed")
GROUPS_PER_REPLY = 256  # ended groups per answer at most: a client catching up reads in pages


class BatchRefused(ValueError):
    """A batch that cannot run on this serve: bad prompts, settings or weights. Nothing was created."""


def batch_dir(run_dir: RunDir, batch: int) -> RunDir:
    """Where a batch's outputs go (rollouts.parquet, .jsonl, .meta.json): RUN_DIR/batches/N/."""
    path = run_dir.path / "batches" / str(batch)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    return RunDir(path)


def batch_config(base: RunConfig, body: BatchBody) -> RunConfig:
    """The serve's settings with the batch's own: input, weights, sampling, key."""
    own = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k}
    sampling = msgspec.structs.replace(base.sampling, **{k: v for k, v in own.items() if v is not None})
    return replace(base, input_path=str(Path(body.input).resolve()),
                   model_path=str(Path(body.weights).resolve()) if body.weights else base.model_path,
                   n=base.n if body.n is None else body.n,
                   max_tokens=base.max_tokens if body.max_tokens is None else body.max_tokens,
                   seed=base.seed if body.seed is None else body.seed, sampling=sampling,
                   prior_run_dir=None, batch_key=body.key)


def architecture_problem(base_model: str, weights: str) -> str | None:
    """Why the checkpoint at `weights` cannot be loaded in place of `base_model`'s, or None."""
    try:
        ours, theirs = (json.loads((Path(path) / "config.json").read_text()) for path in (base_model, weights))
    except (OSError, ValueError) as exc:
        return f"cannot read the config.json of {weights} or {base_model}: {exc}"
    differ = sorted(key for key in (ours.keys() | theirs.keys()) - BOOKKEEPING_KEYS if ours.get(key) != theirs.get(key))
    if differ:
        return (f"the weights {weights} are not of the serve's model {base_model} (config.json differs in "
                f"{', '.join(differ[:8])}): the engines load new weights in place, into the same architecture")
    return None


def tensor_layout(model_dir: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} over the checkpoint's safetensors files, from their headers
    (ValueError for a file whose header is unreadable or whose data is shorter than it says)."""
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with open(shard, "rb") as handle:
            head = handle.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            size = os.fstat(handle.fileno()).st_size
            if not 0 < length <= size - 8:
                raise ValueError(f"{shard.name} is not a safetensors file")
            try:
                header = json.loads(handle.read(length))
            except ValueError:
                raise ValueError(f"{shard.name}: unreadable safetensors header") from None
        header.pop("__metadata__", None)
        end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
        if 8 + length + end > size:
            raise ValueError(f"{shard.name} is truncated: {size} bytes, its header needs {8 + length + end}")
        layout.update({name: (entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()})
    return layout


def weights_problem(base_model: str, weights: str) -> str | None:
    """Why the engines could not load `weights` in place of `base_model`'s: another architecture
    (config.json), other tensors (names, dtypes, shapes), a truncated file; None when they can."""
    if (problem := architecture_problem(base_model, weights)) is not None:
        return problem
    try:
        ours, theirs = tensor_layout(base_model), tensor_layout(weights)
    except (OSError, ValueError) as exc:
        return f"the weights {weights} cannot be read: {exc}"
    if not theirs:
        return f"the weights {weights} hold no safetensors files"
    differ = sorted(name for name in ours.keys() | theirs.keys() if ours.get(name) != theirs.get(name))
    if differ:
        return (f"the weights {weights} do not hold the tensors of the serve's model {base_model} "
                f"(names, dtypes or shapes differ: {', '.join(differ[:5])}{' ...' if len(differ) > 5 else ''})")
    return None


def create_batch(engine: Engine, run_dir: RunDir, base: RunConfig, body: BatchBody) -> int:
    """The batch's rollout id: created (one transaction, as `seerd run` creates a run), or the one
    this key created before. BatchRefused with every problem, and nothing written, otherwise."""
    sessions = make_sessionmaker(engine)
    if not body.key:
        raise BatchRefused("a batch needs a key (the client's name for it: sent again, it answers the same batch)")
    with engine.connect() as conn:
        if (found := queries.rollouts.with_batch_key(conn, body.key)) is not None:
            return found
        previous = next(iter(queries.rollouts.finished_before(conn, None, 1)), None)
    config = batch_config(base, body)
    if body.weights and (problem := weights_problem(base.model_path, config.model_path)):
        raise BatchRefused(problem)
    try:
        new = validated(config, Path(config.input_path), run_dir.path if previous else None, prior_rollout=previous)
    except BadRun as exc:
        raise BatchRefused(str(exc)) from None
    with sessions.begin() as session:
        if (found := queries.rollouts.with_batch_key(session.connection(), body.key)) is not None:
            return found
        return create_rollout(session, new.config, new.rows, input_sha256=file_sha256(Path(config.input_path)),
                              now=time.time(), prior=new.prior, model_fingerprint=new.model_fingerprint)


def next_batch(conn: Connection) -> int | None:
    """The batch to run next: the oldest not yet ended (one interrupted by a restart first of all)."""
    return queries.rollouts.oldest_unended(conn)


def batch_state(conn: Connection, run_dir: RunDir, batch: int) -> BatchState | None:
    rollout = queries.rollouts.identity(conn, batch)
    if rollout is None:
        return None
    requests, ended, _failed = queries.requests.ended_counts(conn, batch)
    groups, groups_done = queries.requests.group_counts(conn, batch)
    output = run_dir.path / "batches" / str(batch) / "rollouts.jsonl"
    finished = rollout.status == RolloutStatus.FINISHED
    return BatchState(batch, rollout.status.value, weight_version(rollout.model_path, rollout.model_fingerprint),
                      groups, groups_done, requests, ended, rollout.status_reason,
                      str(output) if finished and output.exists() else None)


def ended_groups(conn: Connection, batch: int, after: int) -> GroupsReply | None:
    """The groups of `batch` that ended with an event past `after` (see the module's docstring)."""
    rollout = queries.rollouts.identity(conn, batch)
    if rollout is None:
        return None
    total = queries.groups.count(conn, batch)
    events = queries.events.group_ends_after(conn, batch, after, END_EVENTS)
    completion = {group_id: event_id for event_id, group_id in events}  # a group's last end event
    unended = queries.requests.groups_with_unended(conn, completion)
    ended, cursor = [], after
    for event_id, group_id in events:
        if group_id not in unended and completion[group_id] == event_id:  # it ended with this event
            if len(ended) == GROUPS_PER_REPLY:
                break  # the next page starts here
            ended.append(group_id)
        cursor = event_id
    groups = queries.groups.with_prompts(conn, ended)
    rows = group_rows(conn, groups)
    version = weight_version(rollout.model_path, rollout.model_fingerprint)
    by_index: dict[int, list[dict]] = {}
    for row in rows:
        by_index.setdefault(row["group_index"], []).append({**row, "weight_version": version})
    of = {group.id: group for group in groups}
    answer = [{"group_index": of[g].group_index, "prompt_id": of[g].prompt_id,
               "prompt_token_ids": unpack_ints(of[g].prompt_token_ids), "rows": by_index.get(of[g].group_index, [])}
              for g in ended]
    return GroupsReply(answer, cursor, rollout.status.value, total)
