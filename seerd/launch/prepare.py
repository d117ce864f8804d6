"""Before any launcher starts: own the run directory, then create the run's state or find the
unfinished run to resume.

Shared by `seerd run` (local), `seerd slurm-run` (inside an allocation, also after a requeue) and
`seerd submit` (on the submitting host, so that bad input fails before anything is queued).

Creation is atomic: a run exists exactly when its database holds a rollout row, and that row, its
groups, requests and model fingerprint are written in one transaction. A creation that fails at any
point (disk full, Ctrl-C, kill -9) leaves at most the directory, its secret, logs/ and a database
without a rollout; the next `seerd run` creates the run in them again, and the other commands say
that no run was created there. Input is validated before anything is written, so bad input leaves
nothing at all.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from seerd.config import ConfigError, RunConfig
from seerd.db import Rollout, RolloutStatus, Row, make_engine, make_sessionmaker, queries
from seerd.db.migrate import upgrade, upgrade_run_database
from seerd.db.read import reading
from seerd.ownership import Ownership, OwnershipError, RunOwned, take_ownership
from seerd.rundir import RunDir

if TYPE_CHECKING:
    from seerd.coordinator.prior import PriorLengths
    from seerd.io.prompts import PromptRow


class BadRun(ValueError):
    """Bad input or settings, a run directory that holds another input, or one that a live
    coordinator owns: nothing was created."""


@dataclass(frozen=True)
class PreparedRun:
    rundir: RunDir
    config: RunConfig  # the run's own (for an existing run: the stored one)
    created: bool  # False: the run existed (resumed, or already finished)
    finished: bool
    # This process owns the run until the caller releases it; None for a finished run.
    ownership: Ownership | None = None
    previous_status: RolloutStatus | None = None
    groups: int = 0
    requests: int = 0
    seeded: int | None = None  # groups whose estimate --prior seeded (None without --prior)
    notes: list[str] = field(default_factory=list)  # warnings for the user


@dataclass(frozen=True)
class NewRun:
    """A validated input, ready to become a run."""

    rows: list[PromptRow]
    prior: PriorLengths | None
    model_fingerprint: dict
    config: RunConfig  # with the context length the prompts were checked against (the workers use it)
    notes: list[str]  # warnings of the input check


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_rollout(rundir: RunDir) -> Row:
    """The run's rollout (id, status, config, input), read-only: looking at a run never migrates
    it or takes its write lock (its coordinator may be running)."""
    from seerd.coordinator.daemon import RunNotFound

    with reading(rundir.db_path) as conn:
        rollout = queries.rollouts.latest(conn)
    if rollout is None:
        raise RunNotFound("the run's database holds no rollout")
    return rollout


def stored_rollout(rundir: RunDir) -> Rollout | None:
    """The run's rollout row, after bringing its schema up to date (a copy of the database aside
    while it migrates); None when no run was created in `rundir` (no database, or one whose
    creating transaction never committed). The caller owns the run directory: an upgrade writes."""
    from seerd.coordinator.daemon import RunNotFound, load_rollout

    if not rundir.exists():
        return None
    engine = make_engine(rundir.db_path)
    try:
        upgrade_run_database(engine, rundir.db_path)
        return load_rollout(engine)
    except RunNotFound:
        return None
    finally:
        engine.dispose()


def owned_rollout(rundir: RunDir) -> Rollout:
    """The run's rollout row for its owner (see `stored_rollout`); BadRun when no run was created there."""
    rollout = stored_rollout(rundir)
    if rollout is None:
        raise BadRun(f"no run at {rundir.path}: its creation did not complete (or never started); "
                     f"`seerd run` with the run's arguments creates it there again")
    return rollout


def own(rundir: RunDir) -> Ownership:
    """Own the (existing) run directory; BadRun naming the owner when a live coordinator has it."""
    try:
        return take_ownership(rundir.path)
    except (RunOwned, OwnershipError) as exc:
        raise BadRun(str(exc)) from None


def prepare_run(rundir: RunDir, config: RunConfig, input_path: Path, prior_dir: Path | None = None, *,
                allow_model_change: bool = False) -> PreparedRun:
    """Create the run described by `config` in `rundir`, or return the run already there; either way
    owned by this process (`PreparedRun.ownership`, which the caller releases), unless finished.

    An existing unfinished run is resumed only when it holds the same input (by content hash) and
    its model checkpoint did not change (or `allow_model_change`: the coordinator records it).
    Raises BadRun (and creates nothing) for bad prompts, model, settings or --prior, and when a
    live coordinator owns the run; settings and prompts are checked by the rules the workers'
    engines will apply (launch/engine_rules.py).
    """
    new_run = None if rundir.exists() else validated(config, input_path, prior_dir)  # before any write
    rundir.path.mkdir(parents=True, exist_ok=True, mode=0o700)
    ownership = own(rundir)
    try:
        rollout = stored_rollout(rundir)
        if rollout is not None:
            prepared = _existing(rundir, rollout, input_path, ownership, ignored_prior=prior_dir is not None,
                                 allow_model_change=allow_model_change)
        else:  # nothing here yet, or a creation that did not complete: (re)create it in place
            prepared = _create(rundir, new_run or validated(config, input_path, prior_dir), input_path, ownership)
    except BaseException:
        ownership.release()
        raise
    if prepared.finished:
        ownership.release()
    return prepared


def validated(config: RunConfig, input_path: Path, prior_dir: Path | None, *,
               prior_rollout: int | None = None) -> NewRun:
    from seerd.coordinator.create import prompt_hash
    from seerd.coordinator.model_identity import model_fingerprint
    from seerd.coordinator.prior import PriorRunError, read_prior
    from seerd.io.prompts import ModelDirError, PromptFileError, load_model_limits, load_prompts
    from seerd.launch.engine_rules import SamplingCheck, context_length, with_context_length

    for flag, path in (("--input", config.input_path), ("--model", config.model_path)):
        try:  # a file name that is not UTF-8 arrives with lone surrogates, which no UTF-8 column stores
            path.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRun(f"{flag} {path!r}: the path is not valid UTF-8 and cannot be stored in the run; "
                         f"rename it") from None
    try:
        config.validate()
        context = context_length(config.engine, load_model_limits(Path(config.model_path)))
        sampling_check = SamplingCheck(config)
        options_problem = sampling_check.options_problem()
        if options_problem:
            raise ConfigError(options_problem)
        rows = load_prompts(input_path, Path(config.model_path), default_n=config.n,
                            default_max_tokens=config.max_tokens, context=context,
                            check_sampling=sampling_check.check)
        prior = None if prior_dir is None else read_prior(prior_dir, {prompt_hash(r.prompt_token_ids) for r in rows},
                                                          prior_rollout)
    except (ConfigError, ModelDirError, PromptFileError, PriorRunError) as exc:
        raise BadRun(str(exc)) from None
    try:
        fingerprint = model_fingerprint(Path(config.model_path))
    except OSError as exc:
        raise BadRun(f"cannot read the model directory {config.model_path}: {exc}") from None
    return NewRun(rows, prior, fingerprint, with_context_length(config, context), sampling_check.notes())


def _existing(rundir: RunDir, rollout: Rollout, input_path: Path, ownership: Ownership, *,
              ignored_prior: bool, allow_model_change: bool) -> PreparedRun:
    from seerd.coordinator.model_identity import ModelChanged, check_model

    config = RunConfig.from_json(rollout.config_json)
    if rollout.status == RolloutStatus.FINISHED:
        return PreparedRun(rundir, config, created=False, finished=True, previous_status=rollout.status)
    if not input_path.exists() or file_sha256(input_path) != rollout.input_sha256:
        raise BadRun(f"{rundir.path} holds an unfinished run of another input ({rollout.input_path}); "
                     f"use `seerd resume {rundir.path}` or another --run-dir")
    try:  # refused here what the coordinator would refuse, before anything is launched
        check_model(rollout, allow_change=allow_model_change)
    except ModelChanged as exc:
        raise BadRun(str(exc)) from None
    notes = ["--prior is ignored: the run exists and keeps the estimates it started with"] if ignored_prior else []
    return PreparedRun(rundir, config, created=False, finished=False, ownership=ownership,
                       previous_status=rollout.status, notes=notes)


def _create(rundir: RunDir, new_run: NewRun, input_path: Path, ownership: Ownership) -> PreparedRun:
    """Create the run's state in one transaction (see the module docstring)."""
    from seerd.coordinator.create import create_rollout, prompt_hash

    config = new_run.config
    rundir.create()
    engine = make_engine(rundir.db_path, synchronous=config.sqlite_synchronous)
    try:
        upgrade(engine)
        with make_sessionmaker(engine).begin() as session:
            create_rollout(session, config, new_run.rows, input_sha256=file_sha256(input_path), now=time.time(),
                           prior=new_run.prior, model_fingerprint=new_run.model_fingerprint)
    finally:
        engine.dispose()
    rows, prior = new_run.rows, new_run.prior
    seeded = None if prior is None else sum(prior.longest_recent(prompt_hash(r.prompt_token_ids)) is not None
                                            for r in rows)
    return PreparedRun(rundir, config, created=True, finished=False, ownership=ownership, groups=len(rows),
                       requests=sum(r.n for r in rows), seeded=seeded, notes=list(new_run.notes))
