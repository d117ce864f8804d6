"""`seerd run --prior RUN_DIR`: start group estimates from an earlier rollout of the same prompts.

Prompts are matched by `prompt_hash` (sha256 of the prompt tokens). A matched group starts with
the earlier rollout's longest finished response for that prompt (clamped to the group's
max_tokens) instead of its max_tokens; then the usual rule applies (`updated_estimate`): the
group's first finished response replaces the starting value, later ones can only raise it.

The earlier run's lengths and its own history are copied into this run's
`prompt_length_history` (see `seerd.db.history`), so the next iteration's `--prior` of this run
carries them on.

What is refused (exit 2, nothing created): a directory without a run database, a database
without a rollout or unreadable, and an unfinished prior run: its unfinished responses are the
longest ones, so the finished ones would understate every estimate. A prior of another model
path is accepted (in RL each iteration samples a new checkpoint); both paths are recorded in
the `prior_seeded` event. A prior whose prompts all differ seeds nothing and says so.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from seerd.db import DatabaseError, RolloutStatus, Session, add_event, queries
from seerd.db.read import UnreadableDatabase, open_read_only
from seerd.rundir import RunDir

# Older lengths say less about the current policy's outputs; keep a few iterations, not all.
MAX_HISTORY_AGE = 8


class PriorRunError(ValueError):
    """`--prior` names something that is not a finished earlier run."""


@dataclass(frozen=True)
class PriorLengths:
    """Lengths from an earlier run for the prompts of this one: prompt_hash -> [(age, length)]."""

    run_dir: str
    model_path: str
    lengths: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    def longest_recent(self, prompt_hash: str) -> int | None:
        """The earlier run's own longest finished response for this prompt (age 1)."""
        recent = [length for age, length in self.lengths.get(prompt_hash, ()) if age == 1]
        return max(recent) if recent else None


def read_prior(run_dir: Path, prompt_hashes: set[str], rollout_id: int | None = None) -> PriorLengths:
    """Read an earlier run's lengths for `prompt_hashes`, read-only; PriorRunError if unusable.
    Its latest rollout, or `rollout_id` (`seerd serve`: the previous batch in the same database)."""
    rundir = RunDir(Path(run_dir).resolve())
    if not rundir.exists():
        raise PriorRunError(f"--prior {run_dir}: no run there (no {rundir.db_path.name})")
    try:  # through the readers' opener: it refuses a run whose live coordinator is on another host
        engine = open_read_only(rundir.db_path)
    except UnreadableDatabase as exc:
        raise PriorRunError(f"--prior {run_dir}: {exc}") from None
    try:
        with engine.connect() as conn:
            rollout = queries.rollouts.newest(conn, rollout_id)
            if rollout is None:
                raise PriorRunError(f"--prior {run_dir}: its database holds no rollout")
            if rollout.status != RolloutStatus.FINISHED:
                raise PriorRunError(
                    f"--prior {run_dir}: the run is not finished (status {rollout.status.value}); its "
                    f"unfinished responses are the longest, so its lengths would understate the estimates. "
                    f"Finish it with `seerd resume {run_dir}` or pick a finished run")
            lengths: dict[str, list[tuple[int, int]]] = defaultdict(list)
            for prompt_hash, length in queries.requests.finished_lengths_by_prompt(conn, rollout.id):
                if prompt_hash in prompt_hashes:
                    lengths[prompt_hash].append((1, length))
            # A prior made before the history table existed simply has no history.
            for prompt_hash, age, length in queries.history.younger_than(conn, rollout.id, MAX_HISTORY_AGE):
                if prompt_hash in prompt_hashes:
                    lengths[prompt_hash].append((age + 1, length))
    except DatabaseError as exc:
        raise PriorRunError(f"--prior {run_dir}: cannot read {rundir.db_path}: {exc}") from exc
    return PriorLengths(str(rundir.path), rollout.model_path, dict(lengths))


def seed_from_prior(session: Session, rollout_id: int, prior: PriorLengths, *, model_path: str,
                    now: float) -> int:
    """Seed matched groups' estimates and copy the history, in the caller's transaction.

    Returns the number of groups seeded; a `prior_seeded` event records it.
    """
    groups = queries.groups.estimate_inputs(session, rollout_id)
    seeds = {}
    for group_id, prompt_hash, max_tokens in groups:
        longest = prior.longest_recent(prompt_hash)
        if longest is not None:
            seeds[group_id] = max(1, min(longest, max_tokens))
    queries.groups.set_estimates(session, seeds)
    history = [{"rollout_id": rollout_id, "prompt_hash": prompt_hash, "age": age, "length": length}
               for prompt_hash, entries in prior.lengths.items() for age, length in entries]
    queries.history.insert_all(session, history)
    add_event(session, rollout_id, now, "prior_seeded", data={
        "prior_run_dir": prior.run_dir, "prior_model_path": prior.model_path,
        "same_model_path": prior.model_path == model_path, "groups_seeded": len(seeds),
        "groups_total": len(groups), "history_rows": len(history)})
    return len(seeds)
