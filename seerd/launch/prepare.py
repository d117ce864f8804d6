"""Before any launcher starts: create the run's state, or find the unfinished run to resume.

Shared by `seerd run` (local), `seerd slurm-run` (inside an allocation, also after a requeue) and
`seerd submit` (on the submitting host, so that bad input fails before anything is queued).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

from seerd.config import ConfigError, RunConfig
from seerd.db import Rollout, RolloutStatus, make_engine, make_sessionmaker
from seerd.db.migrate import upgrade
from seerd.rundir import RunDir


class BadRun(ValueError):
    """Bad input or settings, or a run directory that holds another input: nothing was created."""


@dataclass(frozen=True)
class PreparedRun:
    rundir: RunDir
    config: RunConfig  # the run's own (for an existing run: the stored one)
    created: bool  # False: the run existed (resumed, or already finished)
    finished: bool
    previous_status: RolloutStatus | None = None
    groups: int = 0
    requests: int = 0
    seeded: int | None = None  # groups whose estimate --prior seeded (None without --prior)
    notes: list[str] = field(default_factory=list)  # warnings for the user


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_rollout(rundir: RunDir) -> Rollout:
    """The run's rollout row, after bringing its schema up to date."""
    from seerd.coordinator.daemon import load_rollout

    engine = make_engine(rundir.db_path)
    try:
        upgrade(engine)
        return load_rollout(engine)
    finally:
        engine.dispose()


def prepare_run(rundir: RunDir, config: RunConfig, input_path: Path, prior_dir: Path | None = None) -> PreparedRun:
    """Create the run described by `config` in `rundir`, or return the run already there.

    An existing unfinished run is resumed only when it holds the same input (by content hash).
    Raises BadRun (and creates nothing) for bad prompts, model, settings or --prior; settings and
    prompts are checked by the rules the workers' engines will apply (launch/engine_rules.py).
    """
    if rundir.exists():
        return _existing(rundir, input_path, ignored_prior=prior_dir is not None)
    from seerd.coordinator.create import prompt_hash
    from seerd.coordinator.prior import PriorRunError, read_prior
    from seerd.io.prompts import ModelDirError, PromptFileError, load_model_limits, load_prompts
    from seerd.launch.engine_rules import SamplingCheck, context_length, with_context_length

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
        prior = None if prior_dir is None else read_prior(prior_dir, {prompt_hash(r.prompt_token_ids) for r in rows})
    except (ConfigError, ModelDirError, PromptFileError, PriorRunError) as exc:
        raise BadRun(str(exc)) from None
    config = with_context_length(config, context)
    seeded = _create(rundir, config, rows, file_sha256(input_path), prior)
    return PreparedRun(rundir, config, created=True, finished=False, groups=len(rows),
                       requests=sum(r.n for r in rows), seeded=seeded, notes=sampling_check.notes())


def _existing(rundir: RunDir, input_path: Path, *, ignored_prior: bool) -> PreparedRun:
    rollout = read_rollout(rundir)
    config = RunConfig.from_json(rollout.config_json)
    if rollout.status == RolloutStatus.FINISHED:
        return PreparedRun(rundir, config, created=False, finished=True, previous_status=rollout.status)
    if not input_path.exists() or file_sha256(input_path) != rollout.input_sha256:
        raise BadRun(f"{rundir.path} holds an unfinished run of another input ({rollout.input_path}); "
                     f"use `seerd resume {rundir.path}` or another --run-dir")
    notes = ["--prior is ignored: the run exists and keeps the estimates it started with"] if ignored_prior else []
    return PreparedRun(rundir, config, created=False, finished=False, previous_status=rollout.status, notes=notes)


def _create(rundir: RunDir, config: RunConfig, rows: list, input_sha: str, prior) -> int | None:  # noqa: ANN001
    """Create the run's state; return how many groups the prior seeded."""
    from seerd.coordinator.create import create_rollout, prompt_hash

    rundir.create()
    engine = make_engine(rundir.db_path, synchronous=config.sqlite_synchronous)
    upgrade(engine)
    with make_sessionmaker(engine).begin() as session:
        create_rollout(session, config, rows, input_sha256=input_sha, now=time.time(), prior=prior)
    engine.dispose()
    return None if prior is None else sum(prior.longest_recent(prompt_hash(r.prompt_token_ids)) is not None
                                          for r in rows)
