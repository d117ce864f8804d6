"""Run policies side by side on one workload and summarise: a table, a JSON document, plots.

Every policy of a comparison sees the same workload (same seed), and ratios are taken per seed
before the median over seeds, so a ratio never mixes two workloads.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from seerd.scheduler.seer import SeerPolicy
from seerd.sim.costs import Efficiency
from seerd.sim.driver import SimResult, Simulation
from seerd.sim.presets import Preset
from seerd.sim.spec import Speculation, acceptance_table
from seerd.sim.workload import Workload, generate, next_iteration

SIM_POLICIES = ("group", "divided", "seer", "oracle", "streamrl-oracle")
REVEALED_POLICY = "seer-revealed"  # diagnostic, with an optional ":SIGMA" (scheduler/oracle.py)
PRIOR_POLICY = "seer+prior"  # seer with estimates seeded from the previous iteration
SPEC_SUFFIX = "+sd"  # any policy with speculative decoding on (e.g. seer+sd: full Seer)


def without_speculation(name: str) -> str:
    return name.removesuffix(SPEC_SUFFIX)


def speculates(name: str) -> bool:
    return name.endswith(SPEC_SUFFIX)


def is_sim_policy(name: str) -> bool:
    name = without_speculation(name)
    base, colon, sigma = name.partition(":")
    if base == REVEALED_POLICY:
        try:
            return not colon or float(sigma) >= 0
        except ValueError:
            return False
    return name in SIM_POLICIES or name == PRIOR_POLICY


@dataclass(frozen=True)
class SimSettings:
    preset: Preset
    chunk_tokens: int
    pool_hit_rate: float = 1.0
    within_share: float = 0.15
    efficiency: Efficiency = Efficiency()
    requests: int | None = None  # override the preset's requests per iteration
    record_timeline: bool = True
    seer_starvation_s: float | None = None  # override seer's anti-starvation bound
    kv_tokens: int | None = None  # override the KV capacity per instance
    chunk_gap_s: float | None = None  # override the preset's control-plane gap per chunk
    growth_quantile: float | None = None  # override the quantile of seer's growth ratios
    speculation: Speculation | None = None  # what `+sd` policies run (None: `default_speculation`)


def default_speculation(preset: Preset) -> Speculation:
    """Grouped drafts at the paper's gamma_max 8 and lambda 2, with the preset's acceptance table."""
    return Speculation(acceptance_table(preset.acceptance))


def simulate(settings: SimSettings, workload: Workload, policy: str, seed: int,
             priors: dict[int, int] | None = None) -> SimResult:
    preset = settings.preset
    name = without_speculation(policy).removesuffix("+prior")
    speculation = None
    if speculates(policy):
        speculation = settings.speculation or default_speculation(preset)
    chosen: str | SeerPolicy = name
    if name == "seer" and settings.seer_starvation_s is not None:
        chosen = SeerPolicy(starvation_s=settings.seer_starvation_s)
    sim = Simulation(workload, chosen, preset.costs(settings.efficiency),
                     instances=preset.instances, chunk_tokens=settings.chunk_tokens,
                     max_num_seqs=preset.max_num_seqs, seed=seed, pool_hit_rate=settings.pool_hit_rate,
                     priors=priors, record_timeline=settings.record_timeline, kv_capacity=settings.kv_tokens,
                     chunk_gap_s=preset.chunk_gap_s if settings.chunk_gap_s is None else settings.chunk_gap_s,
                     growth_quantile=settings.growth_quantile, speculation=speculation)
    result = sim.run()
    result.policy = policy
    return result


def run_comparison(settings: SimSettings, policies: Sequence[str], seeds: Sequence[int], *,
                   workload: Workload | None = None, iterations: int = 1) -> dict[str, list[SimResult]]:
    """policy -> one result per (seed, iteration). With iterations > 1 the same prompts recur
    with drifting lengths; `seer+prior` runs from the second iteration on, seeded with each
    group's longest response of the iteration before (as `seerd run --prior` does)."""
    results: dict[str, list[SimResult]] = {p: [] for p in policies}
    for seed in seeds:
        current = workload or generate(settings.preset, seed, within_share=settings.within_share,
                                       requests=settings.requests)
        previous: Workload | None = None
        for iteration in range(iterations):
            if iteration > 0:
                previous, current = current, next_iteration(current, settings.preset, seed * 1000 + iteration,
                                                            within_share=settings.within_share)
            for policy in policies:
                if without_speculation(policy) == PRIOR_POLICY:
                    if previous is None:
                        continue
                    priors = {g.index: max(g.lengths) for g in previous.groups}
                    results[policy].append(simulate(settings, current, policy, seed, priors))
                elif iterations == 1 or iteration > 0:
                    results[policy].append(simulate(settings, current, policy, seed))
    return results


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(results: dict[str, list[SimResult]]) -> dict[str, dict]:
    """Medians per policy, and per-run ratios to `group` and `oracle` (when they ran)."""
    summary: dict[str, dict] = {}
    for policy, runs in results.items():
        if not runs:
            continue
        entry = {
            "runs": len(runs),
            "throughput_tok_s": _median([r.throughput_tok_s for r in runs]),
            "total_time_s": _median([r.total_time_s for r in runs]),
            "tail_time_s": _median([r.tail_time_s for r in runs]),
            "preemptions": _median([r.preemptions for r in runs]),
            "idle_fraction": _median([r.idle_fraction for r in runs]),
            "recomputed_tokens": _median([r.recomputed_tokens for r in runs]),
            "chunks": _median([r.chunks for r in runs]),
            "moved_chunks": _median([r.moved_chunks for r in runs]),
            "local_continuations": _median([r.local_continuations for r in runs]),
            "pool_loads": _median([r.pool_loads for r in runs]),
            "mean_batch": _median([r.mean_batch for r in runs]),
            "tokens_per_sequence_step": _median([r.tokens_per_sequence_step for r in runs]),
            "sim_wall_s": _median([r.wall_s for r in runs]),
        }
        if speculates(policy):
            entry["spec_step_share"] = _median([r.spec_steps / max(1, r.decode_steps) for r in runs])
            entry["draft_acceptance"] = _median([r.draft_acceptance for r in runs if r.draft_acceptance is not None])
        for base in ("group", "oracle"):
            base_runs = results.get(base) or []
            if len(base_runs) == len(runs):
                xs = [r.throughput_tok_s / b.throughput_tok_s for r, b in zip(runs, base_runs)]
                entry[f"x_{base}"] = _median(xs)
                entry[f"x_{base}_range"] = [min(xs), max(xs)]
                tails = [r.tail_time_s / b.tail_time_s for r, b in zip(runs, base_runs) if b.tail_time_s > 0]
                entry[f"tail_x_{base}"] = _median(tails)
        summary[policy] = entry
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(summary: dict[str, dict], preset: Preset) -> str:
    """One row per policy; with a `+sd` policy among them, a column of tokens per sequence-step."""
    paper = preset.paper
    paper_x = {"divided": paper.divided_x, "seer": paper.seer_x, "seer" + SPEC_SUFFIX: paper.seer_sd_x,
               "oracle": paper.oracle_x}
    drafting = any(speculates(policy) for policy in summary)
    header = ("policy", "tok/s", "total s", "tail s", "preempt", "idle", *(("tok/step",) if drafting else ()),
              "x group (range)", "x oracle", "tail x group", "paper x group")
    rows = [header]
    for policy, e in summary.items():
        rng = e.get("x_group_range")
        x_group = _fmt(e.get("x_group"), ".2f") + (f" ({rng[0]:.2f}-{rng[1]:.2f})" if rng and e["runs"] > 1 else "")
        tokens_per_step = (_fmt(e["tokens_per_sequence_step"], ".2f"),) if drafting else ()
        rows.append((policy, _fmt(e["throughput_tok_s"], ",.0f"), _fmt(e["total_time_s"], ",.0f"),
                     _fmt(e["tail_time_s"], ",.0f"), _fmt(e["preemptions"], ",.0f"), _fmt(e["idle_fraction"], ".2f"),
                     *tokens_per_step, x_group, _fmt(e.get("x_oracle"), ".3f"), _fmt(e.get("tail_x_group"), ".2f"),
                     _fmt(paper_x.get(policy), ".2f")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(results: dict[str, list[SimResult]], out_dir: Path) -> list[Path]:
    """Per policy: running requests and KV use per instance over time (first run); and the
    completion CDF of every policy on one chart."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for policy, runs in results.items():
        if not runs:
            continue
        run = runs[0]
        fig, (ax_running, ax_kv) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
        for index, timeline in enumerate(run.timelines):
            if not timeline:
                continue
            times = [t for t, _, _ in timeline] + [run.total_time_s]
            running = [b for _, b, _ in timeline] + [0]
            kv = [100.0 * k / run.kv_capacity for _, _, k in timeline] + [0.0]
            ax_running.step(times, running, where="post", linewidth=0.7, label=f"instance {index}")
            ax_kv.step(times, kv, where="post", linewidth=0.7)
        ax_running.set_ylabel("running requests")
        ax_kv.set_ylabel("KV used (%)")
        ax_kv.set_xlabel("time (s)")
        ax_running.set_title(f"{policy}: per instance (total {run.total_time_s:,.0f} s, tail {run.tail_time_s:,.0f} s)")
        fig.tight_layout()
        path = out_dir / f"instances_{policy.replace('+', '_')}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 5))
    for policy, runs in results.items():
        if runs:
            times = sorted(runs[0].finish_times)
            ax.plot(times, [(i + 1) / len(times) for i in range(len(times))], label=policy)
    ax.axhline(0.9, color="grey", linestyle=":", linewidth=0.8)
    ax.text(0, 0.91, "tail: last 10% of requests", fontsize=8, color="grey")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests finished (fraction)")
    ax.legend()
    fig.tight_layout()
    path = out_dir / "completion_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written
