"""`seerd sim`: what would each policy do on this cluster with these lengths?"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click
from click.core import ParameterSource

from seerd.sim.costs import Efficiency
from seerd.sim.presets import PRESETS, get_preset
from seerd.sim.report import (
    PRIOR_POLICY, REVEALED_POLICY, SIM_POLICIES, SPEC_SUFFIX, SimSettings, format_table, is_sim_policy, plot,
    run_comparison, speculates, summarize, without_speculation,
)
from seerd.sim.spec import TABLES, Speculation, acceptance_table
from seerd.sim.workload import TraceError, load_trace

EXIT_BAD_INPUT = 2


def _bad(message: str) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_BAD_INPUT)


def _pool_hit_rate_source(pool_hit_rate: float, run_dir: Path | None) -> dict:
    """The pool hit rate to simulate and where it came from: {"rate", "from": "default" | "option" |
    "run", and for a run what it measured (`seerd.report.MeasuredPoolHitRate.describe`)}."""
    given = click.get_current_context().get_parameter_source("pool_hit_rate") != ParameterSource.DEFAULT
    if run_dir is None:
        if not 0.0 <= pool_hit_rate <= 1.0:
            _bad(f"--pool-hit-rate must be in [0, 1], got {pool_hit_rate}")
        return {"rate": pool_hit_rate, "from": "option" if given else "default"}
    if given:
        _bad("--pool-hit-rate and --pool-hit-rate-from exclude each other: give a rate, or a run to "
             "measure it in")
    from seerd.report import ReportError, measured_pool_hit_rate

    try:
        measured = measured_pool_hit_rate(run_dir)
    except ReportError as exc:
        _bad(f"--pool-hit-rate-from: {exc}")
    return {"rate": measured.rate, "from": "run", **measured.describe()}


def _describe_pool_source(source: dict) -> str:
    if source["from"] == "run":
        return (f"measured in {source['run_dir']} ({source['run_status']}): {source['moved_chunks']} "
                f"continued chunks moved to another worker found {source['response_cached_tokens']:,} of "
                f"{source['response_cacheable_tokens']:,} cacheable response tokens cached "
                f"({source['measured']:.3f}; blocks of {source['block_size']})")
    return "--pool-hit-rate" if source["from"] == "option" else "the default (--pool-hit-rate)"


@click.command()
@click.option("--preset", "preset_name", default="qwen2-vl-72b", show_default=True,
              type=click.Choice(list(PRESETS)), help="Cluster, model and length statistics (the paper's workloads).")
@click.option("--trace", "trace_path", type=click.Path(path_type=Path),
              help='JSONL lengths to replay ({"group": id, "length": L, "prompt_len": P}); the preset '
                   "supplies the cluster and cost model.")
@click.option("--policies", default="group,divided,seer,oracle", show_default=True,
              help=f"Comma-separated, from {', '.join([*SIM_POLICIES, PRIOR_POLICY])} and the diagnostic "
                   f"{REVEALED_POLICY}[:SIGMA] (seer told each group's true longest at its first finish); "
                   f"any of them with {SPEC_SUFFIX} drafts (speculative decoding; seer{SPEC_SUFFIX} is full Seer).")
@click.option("--seed", default=0, show_default=True, help="First seed (workload and pool hits).")
@click.option("--seeds", default=1, show_default=True, help="Seeds to run (medians are reported).")
@click.option("--iterations", default=1, show_default=True,
              help="RL iterations over the same prompts with drifting lengths (adds seer+prior from the 2nd).")
@click.option("--chunk-tokens", type=int, help="Chunk size (default: the preset's).")
@click.option("--requests", type=int, help="Requests per iteration (default: the preset's).")
@click.option("--instances", type=int, help="Instances (default: the preset's).")
@click.option("--max-num-seqs", type=int, help="Sequences per engine (default: the preset's).")
@click.option("--kv-tokens", type=int, help="KV capacity per instance in tokens (default: derived from the preset).")
@click.option("--within-share", default=0.15, show_default=True,
              help="Within-group share of the log-length variance (0 = identical lengths in a group).")
@click.option("--pool-hit-rate", default=1.0, show_default=True,
              help="Chance that a chunk continued elsewhere finds its KV in the pool (else it recomputes).")
@click.option("--pool-hit-rate-from", "pool_hit_rate_from", type=click.Path(path_type=Path),
              help="Use the pool hit rate measured in this run's database (finished or not; read-only): "
                   "moved continued chunks, over response tokens, as `seerd report` states it. "
                   "Not with --pool-hit-rate.")
@click.option("--profile", "profile_path", type=click.Path(path_type=Path),
              help="A measured engine profile (tools/profile_engine.py) as the cost model instead of the "
                   "preset's; needs --kv-tokens (the engines' KV capacity, as the workers registered it).")
@click.option("--prefill-mfu", type=float, help="Prefill efficiency (default 0.5).")
@click.option("--chunk-gap-ms", type=float,
              help="Control-plane time per chunk boundary (default: the preset's; 25 for cpu-tiny, else 0).")
@click.option("--spec-acceptance", help=f"For {SPEC_SUFFIX} policies: tokens per step by finished siblings, "
                                         f"{' or '.join(TABLES)} or a JSON file (default: the preset's).")
@click.option("--spec-mode", type=click.Choice(["grouped", "request"]), default="grouped", show_default=True,
              help="grouped: acceptance grows with the group's finished responses; request: the n=0 row.")
@click.option("--spec-depth", default=8, show_default=True, help="gamma_max: most draft tokens per request per step.")
@click.option("--spec-probe-weight", default=2.0, show_default=True, help="lambda: probes' weight for draft depth.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option("--plot", "plot_dir", type=click.Path(path_type=Path), help="Write PNG plots into this directory.")
def sim(preset_name: str, trace_path: Path | None, policies: str, seed: int, seeds: int, iterations: int,
        chunk_tokens: int | None, requests: int | None, instances: int | None, max_num_seqs: int | None,
        kv_tokens: int | None, within_share: float,
        pool_hit_rate: float, pool_hit_rate_from: Path | None, profile_path: Path | None, prefill_mfu: float | None,
        chunk_gap_ms: float | None, spec_acceptance: str | None, spec_mode: str, spec_depth: int,
        spec_probe_weight: float, as_json: bool, plot_dir: Path | None) -> None:
    """Simulate a rollout under each policy with the daemon's own scheduler code."""
    preset = get_preset(preset_name)
    names = [p.strip() for p in policies.split(",") if p.strip()]
    unknown = [p for p in names if not is_sim_policy(p)]
    if unknown or not names:
        _bad(f"unknown policy {', '.join(unknown) or '(none)'}; choose from "
             f"{', '.join([*SIM_POLICIES, PRIOR_POLICY, REVEALED_POLICY + '[:SIGMA]'])}")
    if seeds < 1 or iterations < 1:
        _bad("--seeds and --iterations must be at least 1")
    if any(without_speculation(p) == PRIOR_POLICY for p in names) and iterations < 2:
        _bad(f"{PRIOR_POLICY} needs --iterations 2 or more (the prior is the iteration before)")
    pool_source = _pool_hit_rate_source(pool_hit_rate, pool_hit_rate_from)
    pool_hit_rate = pool_source["rate"]
    if not 0.0 <= within_share < 1.0:
        _bad(f"--within-share must be in [0, 1), got {within_share}")
    if chunk_gap_ms is not None and chunk_gap_ms < 0:
        _bad("--chunk-gap-ms must not be negative")
    if chunk_tokens is not None and chunk_tokens < 1:
        _bad("--chunk-tokens must be positive")
    if instances is not None:
        if instances < 1:
            _bad("--instances must be positive")
        preset = preset.with_changes(instances=instances)
    if max_num_seqs is not None:
        if max_num_seqs < 1:
            _bad("--max-num-seqs must be positive")
        preset = preset.with_changes(max_num_seqs=max_num_seqs)
    if kv_tokens is not None and kv_tokens < 1:
        _bad("--kv-tokens must be positive")
    if profile_path is not None:
        if kv_tokens is None:
            _bad("--profile needs --kv-tokens (the engines' KV capacity in tokens)")
        if not profile_path.is_file():
            _bad(f"--profile {profile_path}: no such file")
        preset = preset.with_changes(profile=str(profile_path.resolve()), kv_tokens=kv_tokens)
    if requests is not None and requests < preset.group_size:
        _bad(f"--requests must be at least the group size {preset.group_size}")
    efficiency = Efficiency() if prefill_mfu is None else replace(Efficiency(), prefill_mfu=prefill_mfu)
    if not 0.0 < efficiency.prefill_mfu <= 1.0:
        _bad("--prefill-mfu must be in (0, 1]")
    speculation = None
    if any(speculates(p) for p in names):
        try:
            speculation = Speculation(acceptance_table(spec_acceptance or preset.acceptance),
                                      grouped=spec_mode == "grouped", gamma_max=spec_depth,
                                      probe_weight=spec_probe_weight)
        except ValueError as exc:
            _bad(f"speculation: {exc}")
    workload = None
    if trace_path is not None:
        if iterations > 1:
            _bad("--iterations needs a generated workload, not --trace")
        try:
            workload = load_trace(trace_path, preset)
        except TraceError as exc:
            _bad(str(exc))
    settings = SimSettings(preset, chunk_tokens or preset.chunk_tokens, pool_hit_rate=pool_hit_rate,
                           within_share=within_share, efficiency=efficiency, requests=requests,
                           record_timeline=plot_dir is not None, kv_tokens=kv_tokens,
                           chunk_gap_s=None if chunk_gap_ms is None else chunk_gap_ms / 1e3,
                           speculation=speculation)
    try:
        costs = preset.costs(efficiency)
        results = run_comparison(settings, names, range(seed, seed + seeds), workload=workload, iterations=iterations)
    except (ValueError, RuntimeError) as exc:
        _bad(str(exc))
    summary = summarize(results)
    first = next(iter(results.values()))[0]
    document = {
        "preset": preset.name,
        "workload": {"source": workload.source if workload else "generated", "requests": first.requests,
                     "output_tokens": first.output_tokens, "seeds": list(range(seed, seed + seeds)),
                     "iterations": iterations, "within_share": within_share},
        "cluster": {"instances": preset.instances, "chunk_tokens": settings.chunk_tokens,
                    "max_num_seqs": preset.max_num_seqs, "pool_hit_rate": pool_hit_rate,
                    "pool_hit_rate_source": {k: v for k, v in pool_source.items() if k != "rate"},
                    "chunk_gap_s": preset.chunk_gap_s if settings.chunk_gap_s is None else settings.chunk_gap_s,
                    **costs.describe(),
                    **({"kv_capacity_tokens": kv_tokens} if kv_tokens else {})},
        "policies": summary,
        "paper": {k: v for k, v in vars(preset.paper).items() if v is not None},
    }
    if speculation is not None:
        document["speculation"] = speculation.describe()
    if plot_dir is not None:
        document["plots"] = [str(p) for p in plot(results, plot_dir)]
    if as_json:
        click.echo(json.dumps(document, indent=2))
        return
    click.echo(f"preset {preset.name}: {preset.instances} instances x {preset.parallelism.gpus} GPU, "
               f"{first.requests} requests ({first.output_tokens:,} output tokens), chunk {settings.chunk_tokens}, "
               f"KV {kv_tokens or costs.kv_capacity_tokens():,} tokens/instance, {seeds} seed(s) x {iterations} "
               "iteration(s)")
    click.echo(f"pool hit rate {pool_hit_rate:.3f}: {_describe_pool_source(pool_source)}")
    if speculation is not None:
        table = speculation.acceptance
        click.echo(f"{SPEC_SUFFIX}: {'grouped' if speculation.grouped else 'request'} drafts up to "
                   f"{speculation.gamma_max}, lambda {speculation.probe_weight:g}; acceptance {table.name}: "
                   + ", ".join(f"n={n} {tokens:.2f}" for n, tokens in table.rows)
                   + f" tokens per step at depth {table.depth}")
    click.echo(format_table(summary, preset))
    for path in document.get("plots", []):
        click.echo(f"wrote {path}")
