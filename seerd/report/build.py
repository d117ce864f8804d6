"""`seerd report`: read a run once, compute its figures, draw the plots and write summary.md."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from seerd.report import cache as kv_cache
from seerd.report import metrics, summary
from seerd.report.cache import KV_BLOCK_SIZE, ContinuationCache
from seerd.report.source import ReportError, RunData, load_run
from seerd.rundir import RunDir

# File name -> caption, in the order summary.md shows them.
PLOT_FILES = {
    "running_and_kv.png": "Running requests and reserved KV per worker",
    "completion_cdf.png": "Completion CDF, with the tail marked",
    "length_heatmap.png": "Response lengths, groups x responses",
    "chunk_timeline.png": "Chunk timeline per worker",
    "estimate_tracking.png": "Group estimates against the true longest response",
    "prefill_avoided.png": "Prefill tokens avoided over time",
}
SUMMARY_FILE = "summary.md"


@dataclass(frozen=True)
class ReportFiles:
    out_dir: Path
    plots: tuple[Path, ...]
    summary: Path
    run: RunData


def write_report(run_dir: Path, out_dir: Path) -> ReportFiles:
    """Write the PNGs of PLOT_FILES and summary.md into `out_dir` (created if missing)."""
    from seerd.report import plots as draw  # matplotlib only when drawing

    rundir = RunDir(Path(run_dir))
    if not rundir.exists():
        raise ReportError(f"no run at {run_dir} (no {rundir.db_path.name})")
    run = load_run(rundir.db_path)
    t0 = metrics.time_origin(run)
    leases = metrics.lease_intervals(run)
    timing = metrics.timing(run)
    counts = metrics.lease_counts(run, leases)
    tracking = metrics.estimate_tracking(run)
    lengths = metrics.response_length_matrix(run)
    unfinished, probe = metrics.request_cell_masks(run)
    continuation = kv_cache.continuation_cache_figures(run)

    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {
        "running_and_kv.png":
            lambda: draw.plot_running_and_kv(metrics.worker_load(run, leases), timing.downtime, t0),
        "completion_cdf.png": lambda: draw.plot_completion_cdf(metrics.completion_curve(run), timing.tail_s),
        "length_heatmap.png": lambda: draw.plot_length_heatmap(lengths, unfinished, probe, run.groups.index),
        "chunk_timeline.png":
            lambda: draw.plot_chunk_timeline(leases, metrics.timeline_lanes(leases), run.workers, t0,
                                             timing.downtime),
        "estimate_tracking.png": lambda: draw.plot_estimate_tracking(tracking),
        "prefill_avoided.png":
            lambda: draw.plot_prefill_avoided(kv_cache.prefill_avoided_over_time(run), timing.downtime, t0),
    }
    written = tuple(draw.save(figures[name](), out_dir / name) for name in PLOT_FILES)
    text = summary.render(rundir.path, run, timing, counts, tracking, list(PLOT_FILES.items()), continuation)
    summary_path = out_dir / SUMMARY_FILE
    summary_path.write_text(text)
    return ReportFiles(out_dir, written, summary_path, run)


@dataclass(frozen=True)
class MeasuredPoolHitRate:
    """The pool hit rate a run measured, for `seerd sim --pool-hit-rate-from RUN_DIR`."""

    run_dir: Path
    rate: float  # `measured` clamped to [0, 1]: the simulator's pool_hit_rate
    measured: float  # the moved continued chunks' token-weighted hit rate over response tokens
    cache: ContinuationCache
    run_status: str  # when it was read: finished, running, interrupted, ...

    def describe(self) -> dict:
        moved = self.cache.moved
        return {"run_dir": str(self.run_dir), "measured": self.measured, "moved_chunks": moved.chunks,
                "response_cached_tokens": moved.response_cached_tokens,
                "response_cacheable_tokens": moved.response_cacheable_tokens,
                "block_size": self.cache.block_size, "run_status": self.run_status}


def measured_pool_hit_rate(run_dir: Path, block_size: int = KV_BLOCK_SIZE) -> MeasuredPoolHitRate:
    """Read a run (finished or not, read-only, as `seerd report` does) and return its measured pool
    hit rate over response tokens (`ContinuationCache.pool_hit_rate_response`).

    ReportError: no run there, or no moved continued chunk whose response tokens could be cached.
    """
    rundir = RunDir(Path(run_dir))
    if not rundir.path.is_dir():
        raise ReportError(f"no run directory {run_dir}")
    if not rundir.exists():
        raise ReportError(f"no run at {run_dir} (no {rundir.db_path.name})")
    run = load_run(rundir.db_path)
    cache = kv_cache.continuation_cache_figures(run, block_size)
    moved = cache.moved
    if not moved.chunks:
        raise ReportError(f"the run at {run_dir} has no continued chunk that moved to another worker (with "
                          f"reported cached tokens; {cache.same.chunks} stayed on their worker, "
                          f"{cache.left_out} left out): it measured no pool hit rate")
    measured = cache.pool_hit_rate_response
    if measured is None:
        raise ReportError(f"the {moved.chunks} moved continued chunks of the run at {run_dir} had no "
                          f"response tokens that could be cached (no whole {block_size}-token block of "
                          f"their contexts reached past the prompt): it measured no pool hit rate")
    return MeasuredPoolHitRate(rundir.path, min(max(measured, 0.0), 1.0), measured, cache, run.rollout.status)
