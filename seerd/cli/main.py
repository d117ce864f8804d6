"""`seerd` command line: thin commands over the coordinator, the launcher and the exporter.

Exit codes: 0 the output is complete; 1 the run failed or was interrupted (resumable);
2 bad input or settings (nothing was created).
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import click

from seerd.cli import ui
from seerd.cli.sim import sim
from seerd.config import DEFAULT_CHUNK_TOKENS, ConfigError, EngineConfig, RunConfig, SamplingDefaults
from seerd.db import RolloutStatus, make_engine, make_sessionmaker
from seerd.db.migrate import current_revision, head_revisions, upgrade
from seerd.rundir import RunDir

EXIT_OK, EXIT_INCOMPLETE, EXIT_BAD_INPUT = 0, 1, 2


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Log the coordinator's decisions.")
def cli(verbose: bool) -> None:
    """seerd: batch rollouts for synchronous LLM RL (divided rollout on vLLM workers)."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


@cli.command()
@click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
              help="Prompt file: .jsonl or .parquet (veRL's layout loads).")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
              help="Model directory (Hugging Face layout) that vLLM loads.")
@click.option("--run-dir", required=True, type=click.Path(path_type=Path),
              help="Where the run's database, secret, logs and outputs live.")
@click.option("--workers", default=2, show_default=True, help="Local vLLM worker processes.")
@click.option("--policy", default="seer", show_default=True, type=click.Choice(["seer", "divided", "group"]),
              help="seer: context-aware (probes first, then longest estimate); divided: chunked FCFS; "
                   "group: veRL baseline.")
@click.option("--chunk-tokens", default=DEFAULT_CHUNK_TOKENS, show_default=True,
              help="Tokens per chunk before a request goes back to the queue.")
@click.option("--n", "n", default=4, show_default=True, help="Responses per prompt (rows may override).")
@click.option("--max-tokens", default=1024, show_default=True, help="Response budget (rows may override).")
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-p", default=1.0, show_default=True)
@click.option("--top-k", default=-1, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--kv-cache-gib", default=1.0, show_default=True, help="KV cache per worker engine.")
@click.option("--max-num-seqs", default=64, show_default=True, help="Concurrent sequences per engine.")
@click.option("--max-model-len", default=None, type=int, help="Engine context limit (default: the model's).")
@click.option("--dtype", default="auto", show_default=True, help="Engine dtype (auto, float32, bfloat16).")
@click.option("--engine-api", default="auto", show_default=True, type=click.Choice(["auto", "stepped", "async"]),
              help="vLLM driver: stepped = LLMEngine in the worker process; async = AsyncLLM (auto: async with CUDA).")
@click.option("--lease-ttl", default=30.0, show_default=True, help="Seconds a lease lives without a heartbeat.")
@click.option("--wait-for-workers", is_flag=True,
              help="Hand out no work until every worker is up (always so for --policy group).")
@click.option("--prior", "prior_dir", default=None, type=click.Path(path_type=Path),
              help="A finished earlier run of the same prompts: its longest response per prompt seeds each "
                   "group's length estimate (matched by a hash of the prompt tokens).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: when on a terminal).")
def run(input_path: Path, model_path: Path, run_dir: Path, workers: int, policy: str, chunk_tokens: int,
        n: int, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int,
        kv_cache_gib: float, max_num_seqs: int, max_model_len: int | None, dtype: str, engine_api: str,
        lease_ttl: float, wait_for_workers: bool, prior_dir: Path | None, progress: bool | None) -> None:
    """Run a rollout on this machine: a coordinator and WORKERS local vLLM engines."""
    from seerd.coordinator.create import prompt_hash
    from seerd.coordinator.prior import PriorRunError, read_prior
    from seerd.io.prompts import ModelDirError, PromptFileError, load_model_limits, load_prompts

    rundir = RunDir(run_dir.resolve())
    if rundir.exists():
        if prior_dir is not None:
            ui.warn("--prior is ignored: the run exists and keeps the estimates it started with")
        _run_existing(rundir, input_path, progress)
        return
    config = RunConfig(
        input_path=str(input_path.resolve()), model_path=str(model_path.resolve()), policy=policy,
        workers=workers, chunk_tokens=chunk_tokens, n=n, max_tokens=max_tokens, seed=seed,
        sampling=SamplingDefaults(temperature=temperature, top_p=top_p, top_k=top_k),
        engine=EngineConfig(kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                            dtype=dtype, api=engine_api),
        lease_ttl_s=lease_ttl, wait_for_workers=wait_for_workers,
        prior_run_dir=str(prior_dir.resolve()) if prior_dir is not None else None,
    )
    try:
        config.validate()
        limits = load_model_limits(model_path)
        rows = load_prompts(input_path, model_path, default_n=n, default_max_tokens=max_tokens,
                            max_model_len=max_model_len or limits.max_model_len)
        prior = None if prior_dir is None else read_prior(prior_dir, {prompt_hash(r.prompt_token_ids) for r in rows})
    except (ConfigError, ModelDirError, PromptFileError, PriorRunError) as exc:
        ui.error(str(exc))
        raise SystemExit(EXIT_BAD_INPUT) from None
    seeded = _create_run(rundir, config, rows, _file_sha256(input_path), prior)
    ui.info(f"run {rundir.path}: {len(rows)} groups, {sum(r.n for r in rows)} requests, policy {policy}, "
            f"{workers} workers")
    if prior is not None:
        ui.info(f"--prior {prior.run_dir}: seeded the estimates of {seeded} of {len(rows)} groups")
    _drive(rundir, workers, progress)


def _create_run(rundir: RunDir, config: RunConfig, rows: list, input_sha: str, prior) -> int:  # noqa: ANN001
    """Create the run's state; return how many groups the prior seeded."""
    from seerd.coordinator.create import create_rollout, prompt_hash

    rundir.create()
    engine = make_engine(rundir.db_path, synchronous=config.sqlite_synchronous)
    upgrade(engine)
    with make_sessionmaker(engine).begin() as session:
        create_rollout(session, config, rows, input_sha256=input_sha, now=time.time(), prior=prior)
    engine.dispose()
    return 0 if prior is None else sum(prior.longest_recent(prompt_hash(r.prompt_token_ids)) is not None
                                       for r in rows)


def _run_existing(rundir: RunDir, input_path: Path, progress: bool | None) -> None:
    rollout = _read_rollout(rundir)
    if rollout.status == RolloutStatus.FINISHED:
        ui.info(f"run {rundir.path} is already finished; outputs: {rundir.parquet_path}, {rundir.jsonl_path}")
        return
    if not input_path.exists() or _file_sha256(input_path) != rollout.input_sha256:
        ui.error(f"{rundir.path} holds an unfinished run of another input ({rollout.input_path}); "
                 f"use `seerd resume {rundir.path}` or another --run-dir")
        raise SystemExit(EXIT_BAD_INPUT)
    ui.info(f"run {rundir.path} exists and is unfinished ({rollout.status.value}): resuming it")
    config = RunConfig.from_json(rollout.config_json)
    _drive(rundir, config.workers, progress)


def _drive(rundir: RunDir, workers: int, progress: bool | None) -> None:
    from seerd.launch.local import run_local

    started = time.monotonic()
    with ui.RunProgress(progress) as bar:
        result = run_local(rundir, workers, on_tick=bar.update)
    elapsed = time.monotonic() - started
    if result.status == RolloutStatus.FINISHED and result.export is not None:
        ui.info(f"finished in {elapsed:.1f}s")
        figures = {"responses": result.export.responses, "parquet": rundir.parquet_path,
                   "jsonl": rundir.jsonl_path}
        if result.load:
            figures["coordinator"] = (f"{result.load['cpu_s']:.2f}s CPU = {result.load['cpu_share']:.2%} of the "
                                      f"{result.load['generation_s']:.1f}s generation phase "
                                      f"({result.load['api_calls']} API calls)")
        ui.summary(figures)
        return
    if result.status == RolloutStatus.FINISHED:
        ui.info(f"run {rundir.path} is already finished")
        return
    ui.error(f"run {result.status.value}: {result.reason}. Continue with `seerd resume {rundir.path}`")
    raise SystemExit(EXIT_INCOMPLETE)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--workers", default=None, type=int, help="Override the number of local workers.")
@click.option("--progress/--no-progress", default=None)
def resume(run_dir: Path, workers: int | None, progress: bool | None) -> None:
    """Continue an interrupted run from its database."""
    rundir = _existing_run(run_dir)
    rollout = _read_rollout(rundir)
    if rollout.status == RolloutStatus.FINISHED:
        ui.info(f"run {rundir.path} is already finished; nothing to do")
        return
    config = RunConfig.from_json(rollout.config_json)
    _drive(rundir, workers or config.workers, progress)


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def export(run_dir: Path) -> None:
    """Write rollouts.parquet and rollouts.jsonl again (partial for an unfinished run)."""
    from seerd.io.export import export_run

    rundir = _existing_run(run_dir)
    rollout = _read_rollout(rundir)
    engine = make_engine(rundir.db_path)
    with make_sessionmaker(engine).begin() as session:
        result = export_run(session, rollout.id, rundir)
    engine.dispose()
    if result.complete:
        ui.info(f"exported {result.responses} responses to {rundir.parquet_path} and {rundir.jsonl_path}")
    else:
        ui.warn(f"PARTIAL export: {result.responses} of {result.responses_total} responses are finished "
                f"(run is {rollout.status.value}); wrote {rundir.parquet_path} and {rundir.jsonl_path}")


@cli.group()
def db() -> None:
    """The run database's schema."""


@db.command("upgrade")
@click.argument("run_dir", type=click.Path(path_type=Path))
def db_upgrade(run_dir: Path) -> None:
    """Apply Alembic migrations to RUN_DIR's database."""
    rundir = _existing_run(run_dir)
    engine = make_engine(rundir.db_path)
    before = current_revision(engine)
    upgrade(engine)
    after = current_revision(engine)
    engine.dispose()
    ui.info(f"{rundir.db_path}: {before or 'empty'} -> {after} (head {', '.join(head_revisions())})")


def _read_rollout(rundir: RunDir):  # noqa: ANN202
    """The run's rollout row, after bringing its schema up to date."""
    from seerd.coordinator.daemon import load_rollout

    engine = make_engine(rundir.db_path)
    try:
        upgrade(engine)
        return load_rollout(engine)
    finally:
        engine.dispose()


def _existing_run(run_dir: Path) -> RunDir:
    rundir = RunDir(run_dir.resolve())
    if not rundir.exists():
        ui.error(f"no run at {run_dir} (no {rundir.db_path.name}); start one with `seerd run`")
        raise SystemExit(EXIT_BAD_INPUT)
    return rundir


cli.add_command(sim)


def main() -> None:
    cli(prog_name="seerd")


if __name__ == "__main__":
    main()
