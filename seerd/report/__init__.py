"""`seerd report`: plots and a markdown summary of a run, read from its database read-only.

`source` reads the database into arrays, `metrics` computes the figures (pure functions, what the
tests check), `plots` draws them with matplotlib's Agg backend, `summary` writes summary.md and
`build` ties them together.
"""

from seerd.report.build import (
    PLOT_FILES, SUMMARY_FILE, MeasuredPoolHitRate, ReportFiles, measured_pool_hit_rate, write_report,
)
from seerd.report.source import ReportError, RunData, load_run

__all__ = ["PLOT_FILES", "SUMMARY_FILE", "MeasuredPoolHitRate", "ReportError", "ReportFiles", "RunData",
           "load_run", "measured_pool_hit_rate", "write_report"]
