#!/usr/bin/env python
"""The simulator's figures for docs/simulator.md, each as a table of ratios measured in one run.

    .venv/bin/python tools/bench/sim.py [--seeds 5] [--section presets|sensitivity|information|iterations|timing|all]

- presets: every preset, policies group/divided/seer/oracle/streamrl-oracle, medians over seeds of
  per-seed ratios (throughput x group, x oracle; tail time x group), with the paper's figures;
- sensitivity: the qwen2-vl-72b preset with one setting changed at a time;
- information: seer beside seer-revealed:SIGMA (told each group's longest at its first finish,
  to within exp(SIGMA)), at within-group shares 0.15 and 0.02: how much a better estimate could give;
- iterations: 3 RL iterations over the same prompts; seer vs seer+prior vs oracle from the 2nd on;
- timing: wall time of one simulation of a 10,000-request qwen2-vl-72b workload per policy.
Nothing here is fitted: the cost model's constants are in seerd/sim/costs.py and presets.py.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from seerd.scheduler.seer import DEFAULT_STARVATION_S  # noqa: E402
from seerd.sim.costs import Efficiency  # noqa: E402
from seerd.sim.driver import Simulation  # noqa: E402
from seerd.sim.presets import PRESETS, get_preset  # noqa: E402
from seerd.sim.report import SimSettings, run_comparison, summarize  # noqa: E402
from seerd.sim.workload import generate  # noqa: E402

POLICIES = ["group", "divided", "seer", "oracle", "streamrl-oracle"]


def spread(entry: dict, key: str) -> str:
    value, rng = entry.get(key), entry.get(f"{key}_range")
    if value is None:
        return "-"
    return f"{value:.2f} ({rng[0]:.2f}-{rng[1]:.2f})" if rng and entry["runs"] > 1 else f"{value:.2f}"


def table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
    print(flush=True)


def section_presets(seeds: list[int]) -> None:
    print(f"## Presets: medians over seeds {seeds[0]}..{seeds[-1]} of per-seed ratios\n")
    for name, preset in PRESETS.items():
        summary = summarize(run_comparison(SimSettings(preset, preset.chunk_tokens, record_timeline=False),
                                           POLICIES, seeds))
        paper = preset.paper
        paper_x = {"divided": paper.divided_x, "seer": paper.seer_x, "oracle": paper.oracle_x}
        print(f"### {name} ({preset.requests} requests, G={preset.group_size}, {preset.instances} instances "
              f"x {preset.parallelism.gpus} GPU, chunk {preset.chunk_tokens})\n")
        rows = []
        for policy, e in summary.items():
            rows.append([policy, f"{e['throughput_tok_s']:,.0f}", f"{e['total_time_s']:,.0f}", f"{e['tail_time_s']:,.0f}",
                         f"{e['tail_time_s'] / e['total_time_s']:.2f}", f"{e['preemptions']:,.0f}",
                         f"{e['idle_fraction']:.2f}", f"{e['mean_batch']:.0f}", spread(e, "x_group"),
                         spread(e, "x_oracle"), f"{e['tail_x_group']:.2f}",
                         "-" if paper_x.get(policy) is None else f"{paper_x[policy]:.2f}"])
        table(["policy", "tok/s", "total s", "tail s", "tail/total", "preemptions", "idle", "batch",
               "x group (range)", "x oracle (range)", "tail x group", "paper x group"], rows)
        if paper.verl_tail_s:
            print(f"Paper, veRL: tail {paper.verl_tail_s} s of {paper.verl_total_s} s "
                  f"({paper.verl_tail_s / paper.verl_total_s:.2f}); full Seer (with speculative decoding): "
                  f"tail {paper.seer_tail_s} s of {paper.seer_total_s} s"
                  + (f"; context-aware scheduling alone: tail x{paper.seer_tail_x} of veRL's" if paper.seer_tail_x else "")
                  + ".\n")


def section_sensitivity(seeds: list[int]) -> None:
    base = get_preset("qwen2-vl-72b")
    print(f"## Sensitivity on qwen2-vl-72b (one change at a time; medians over seeds {seeds[0]}..{seeds[-1]})\n")
    variants: list[tuple[str, SimSettings]] = [
        (f"baseline (chunk 4096, w 0.15, pool on, prefill MFU 0.5, starvation {DEFAULT_STARVATION_S:.0f} s)",
         SimSettings(base, 4096)),
        ("chunk 1024", SimSettings(base, 1024)),
        ("chunk 16384", SimSettings(base, 16384)),
        ("within-group share 0.02 (near-identical lengths)", SimSettings(base, 4096, within_share=0.02)),
        ("within-group share 0.30", SimSettings(base, 4096, within_share=0.30)),
        ("prefill MFU 0.25", SimSettings(base, 4096, efficiency=replace(Efficiency(), prefill_mfu=0.25))),
        ("KV pool off (continuations elsewhere recompute)", SimSettings(base, 4096, pool_hit_rate=0.0)),
        ("step overhead 0.5 ms (instead of 3 ms)",
         SimSettings(base, 4096, efficiency=replace(Efficiency(), step_overhead_s=0.0005))),
        ("HBM efficiency 0.6 (instead of 0.8)", SimSettings(base, 4096, efficiency=replace(Efficiency(), mem_eff=0.6))),
        ("seer starvation bound 300 s", SimSettings(base, 4096, seer_starvation_s=300.0)),
        ("seer starvation bound 600 s", SimSettings(base, 4096, seer_starvation_s=600.0)),
        ("seer starvation off", SimSettings(base, 4096, seer_starvation_s=float("inf"))),
        ("seer growth quantile 0.75 (instead of 0.9)", SimSettings(base, 4096, growth_quantile=0.75)),
        ("seer growth quantile 0.97", SimSettings(base, 4096, growth_quantile=0.97)),
    ]
    rows = []
    for label, settings in variants:
        summary = summarize(run_comparison(replace(settings, record_timeline=False),
                                           ["group", "divided", "seer", "oracle"], seeds))
        d, s, o = summary["divided"], summary["seer"], summary["oracle"]
        rows.append([label, spread(d, "x_group"), spread(s, "x_group"), spread(o, "x_group"), spread(s, "x_oracle"),
                     f"{d['tail_x_group']:.2f}", f"{s['tail_x_group']:.2f}", f"{summary['group']['preemptions']:,.0f}"])
    table(["setting", "divided x group", "seer x group", "oracle x group", "seer x oracle", "divided tail x group",
           "seer tail x group", "group preemptions"], rows)


def section_information(seeds: list[int]) -> None:
    """How exactly must seer know a group's longest response at its first finish to reach the
    oracle? seer-revealed:SIGMA is told it to within exp(SIGMA * z) (scheduler/oracle.py)."""
    preset = get_preset("qwen2-vl-72b")
    sigmas = [0.0, 0.1, 0.25, 0.45]
    print(f"## Information bound on qwen2-vl-72b (medians over seeds {seeds[0]}..{seeds[-1]})\n")
    for within in (0.15, 0.02):
        policies = ["group", "seer", *(f"seer-revealed:{s:g}" for s in sigmas), "oracle"]
        summary = summarize(run_comparison(SimSettings(preset, preset.chunk_tokens, within_share=within,
                                                       record_timeline=False), policies, seeds))
        rows = [[p, spread(e, "x_group"), spread(e, "x_oracle"), f"{e['tail_x_group']:.2f}"] for p, e in summary.items()]
        print(f"within-group share {within}:\n")
        table(["policy", "x group (range)", "x oracle (range)", "tail x group"], rows)
        spreads = []
        for seed in seeds:
            for g in generate(preset, seed, within_share=within).groups:
                spreads.append(math.log(max(g.lengths) / g.lengths[0]))
        print(f"What one finished response says of its group's longest (w {within}): log(longest / a random "
              f"member) has mean {statistics.mean(spreads):.2f} and standard deviation "
              f"{statistics.stdev(spreads):.2f} over the groups of these workloads.\n")


def section_iterations(seeds: list[int]) -> None:
    preset = get_preset("qwen2-vl-72b")
    print(f"## Multi-iteration: 3 iterations, the same prompts, drifting lengths (seeds {seeds[0]}..{seeds[-1]}; "
          "iterations 2 and 3 reported)\n")
    results = run_comparison(SimSettings(preset, preset.chunk_tokens, record_timeline=False),
                             ["group", "seer", "seer+prior", "oracle"], seeds, iterations=3)
    summary = summarize(results)
    rows = [[p, spread(e, "x_group"), spread(e, "x_oracle"), f"{e['tail_x_group']:.2f}", str(e["runs"])]
            for p, e in summary.items()]
    table(["policy", "x group (range)", "x oracle (range)", "tail x group", "runs"], rows)
    gains = [p.throughput_tok_s / s.throughput_tok_s for p, s in zip(results["seer+prior"], results["seer"])]
    print(f"seer+prior / seer throughput per run: median {statistics.median(gains):.3f}, "
          f"range {min(gains):.3f}-{max(gains):.3f}\n")


def section_timing() -> None:
    preset = get_preset("qwen2-vl-72b")
    workload = generate(preset, 0, requests=10_000)
    print(f"## Simulation speed: one 10,000-request qwen2-vl-72b workload ({workload.output_tokens:,} tokens)\n")
    rows = []
    for policy in POLICIES:
        started = time.perf_counter()
        sim = Simulation(workload, policy, preset.costs(), instances=preset.instances,
                         chunk_tokens=preset.chunk_tokens, max_num_seqs=preset.max_num_seqs, seed=0,
                         record_timeline=False)
        result = sim.run()
        rows.append([policy, f"{time.perf_counter() - started:.2f}", f"{result.chunks:,}", f"{result.plan_calls:,}"])
    table(["policy", "wall s", "chunks", "policy calls"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--section", default="all",
                        choices=["presets", "sensitivity", "information", "iterations", "timing", "all"])
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    started = time.perf_counter()
    if args.section in ("presets", "all"):
        section_presets(seeds)
    if args.section in ("sensitivity", "all"):
        section_sensitivity(seeds[:3])
    if args.section in ("information", "all"):
        section_information(seeds)
    if args.section in ("iterations", "all"):
        section_iterations(seeds)
    if args.section in ("timing", "all"):
        section_timing()
    print(f"(tools/bench/sim.py ran {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
