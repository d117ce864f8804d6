"""The report's figures, drawn with matplotlib's Agg backend from the data of `metrics`.

Each `plot_*` returns its Figure (tests read what was drawn from it); `save` writes and closes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window; before pyplot is imported

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from seerd.report.cache import PrefillOverTime  # noqa: E402
from seerd.report.metrics import CompletionCurve, EstimateTracking, Leases, WorkerLoadSeries  # noqa: E402

DPI = 100
MAX_LEGEND = 16  # workers named in a legend; more would hide the plot
TAIL_LABEL = "tail start"
AVOIDED_LABEL = "continued chunks: avoided (cached)"
RECOMPUTED_LABEL = "continued chunks: recomputed"
DOWNTIME_LABEL = "coordinator down"


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _worker_label(series_worker) -> str:  # noqa: ANN001
    return f"rank {series_worker.rank} ({series_worker.id})"


def _shade_downtime(ax, downtime: Sequence[tuple[float, float]], t0: float) -> None:  # noqa: ANN001
    for i, (a, b) in enumerate(downtime):
        ax.axvspan(a - t0, b - t0, color="grey", alpha=0.2, linewidth=0,
                   label=DOWNTIME_LABEL if i == 0 else None)


def _no_data(ax, text: str) -> None:  # noqa: ANN001
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")


def plot_running_and_kv(series: Sequence[WorkerLoadSeries], downtime: Sequence[tuple[float, float]],
                        t0: float) -> Figure:
    fig, (ax_running, ax_kv) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for i, s in enumerate(series):
        label = _worker_label(s.worker) if i < MAX_LEGEND else None
        ax_running.step(s.times, s.running, where="post", linewidth=0.8, label=label)
        ax_kv.step(s.times, 100.0 * s.kv_fraction, where="post", linewidth=0.8)
    for ax in (ax_running, ax_kv):
        _shade_downtime(ax, downtime, t0)
    if not any(len(s.times) for s in series):
        _no_data(ax_running, "no chunk was leased yet")
    ax_running.set_ylabel("running requests\n(leased chunks)")
    ax_kv.set_ylabel("KV reserved (% of capacity)")
    ax_kv.set_xlabel("time since the first lease (s)")
    ax_running.set_title("Per worker: running requests, and the KV the lease book reserved for them\n"
                         "(per chunk: prompt + tokens before it + its budget, over the worker's KV capacity)",
                         fontsize=10)
    if series:
        ax_running.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def plot_completion_cdf(curve: CompletionCurve, tail_s: float | None) -> Figure:
    fig, ax = plt.subplots(figsize=(8, 5))
    if len(curve.times):
        ax.step(np.r_[0.0, curve.times], np.r_[0.0, curve.fraction], where="post", linewidth=1.2,
                label="requests finished")
    else:
        _no_data(ax, "no request has finished yet")
    ax.axhline(0.9, color="grey", linestyle=":", linewidth=0.8)
    if curve.tail_start is not None and curve.end is not None:
        ax.axvline(curve.tail_start, color="tab:red", linestyle="--", linewidth=1.0, label=TAIL_LABEL)
        ax.axvspan(curve.tail_start, curve.end, color="tab:red", alpha=0.12, linewidth=0)
        ax.set_title(f"Completion: the tail (last 10% of requests) took {tail_s:.2f} s", fontsize=10)
    else:
        finished = len(curve.times)
        ax.set_title(f"Completion: {finished} of {curve.total} requests finished; the tail (last 10%) "
                     f"has not started", fontsize=10)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("time since the first lease (s)")
    ax.set_ylabel("requests finished (fraction of all)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_length_heatmap(lengths: np.ndarray, unfinished: np.ndarray, probe: np.ndarray,
                        group_indices: np.ndarray) -> Figure:
    groups, responses = lengths.shape
    fig, ax = plt.subplots(figsize=(min(4 + 0.35 * responses, 16), min(3 + 0.18 * groups, 14)))
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e8e8e8")  # unfinished responses and padding
    image = ax.imshow(np.ma.masked_invalid(lengths), aspect="auto", interpolation="nearest", cmap=cmap)
    fig.colorbar(image, ax=ax, label="response length (tokens)")
    marks = []
    rows, cols = np.nonzero(probe)
    if len(rows):
        ax.scatter(cols, rows, s=8, marker="o", facecolors="none", edgecolors="white", linewidths=0.6)
        marks.append("o: the group's probe")
    rows, cols = np.nonzero(unfinished)
    if len(rows):
        ax.scatter(cols, rows, s=10, marker="x", color="tab:red", linewidths=0.6)
        marks.append("x: unfinished (grey)")
    if len(group_indices) <= 40:
        ax.set_yticks(range(groups), [str(i) for i in group_indices], fontsize=7)
    if responses <= 32:
        ax.set_xticks(range(responses))
    ax.set_xlabel("response" + ("\n" + "; ".join(marks) if marks else ""), fontsize=9)
    ax.set_ylabel("group (input order)")
    ax.set_title(f"Response lengths: {groups} groups x {responses} responses", fontsize=10)
    fig.tight_layout()
    return fig


def plot_chunk_timeline(leases: Leases, lanes: np.ndarray, workers: Sequence, t0: float,  # noqa: ANN001
                        downtime: Sequence[tuple[float, float]]) -> Figure:
    heights = [int(lanes[leases.worker == i].max()) + 1 if (leases.worker == i).any() else 1
               for i in range(len(workers))]
    offsets = np.r_[0, np.cumsum(heights)[:-1]] if heights else np.zeros(0)
    total = int(sum(heights)) or 1
    fig, ax = plt.subplots(figsize=(11, min(2.5 + 0.06 * total, 14)))
    known = leases.worker >= 0
    if known.any():
        y = offsets[leases.worker[known]] + lanes[known]
        x0, x1 = leases.start[known] - t0, leases.end[known] - t0
        boxes = [[(a, b - 0.4), (c, b - 0.4), (c, b + 0.4), (a, b + 0.4)] for a, c, b in zip(x0, x1, y)]
        colors = plt.get_cmap("tab20")(leases.group_index[known] % 20)
        lost = leases.outcome[known] != "done"
        edges = np.where(lost[:, None], np.array(matplotlib.colors.to_rgba("tab:red")), colors)
        ax.add_collection(PolyCollection(boxes, facecolors=colors, edgecolors=edges, linewidths=0.4))
        if lost.any():
            ax.plot([], [], color="tab:red",
                    label="lease that did not finish (expired, released, orphaned, open)")
        ax.set_xlim(0, max(float(x1.max()), 1e-3) * 1.02)
    else:
        _no_data(ax, "no chunk was leased yet")
    _shade_downtime(ax, downtime, t0)
    ax.set_ylim(-0.6, total - 0.4)
    ax.invert_yaxis()
    for offset in offsets[1:]:
        ax.axhline(offset - 0.5, color="black", linewidth=0.6)
    if len(workers) <= 32:
        ax.set_yticks([o + (h - 1) / 2 for o, h in zip(offsets, heights)],
                      [_worker_label(w) for w in workers], fontsize=7)
    ax.set_xlabel("time since the first lease (s)")
    ax.set_title("Chunks per worker (one row per concurrent lease; colour = group index mod 20)", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


def plot_estimate_tracking(tracking: EstimateTracking) -> Figure:
    fig, (ax_ratio, ax_share) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = tracking.times
    if len(t) and np.isfinite(tracking.median).any():
        ax_ratio.fill_between(t, tracking.p10, tracking.p90, step="post", alpha=0.25, label="10-90%")
        ax_ratio.step(t, tracking.median, where="post", label="median")
        ax_share.step(t, 100 * tracking.share_covering, where="post", label="estimate >= true longest")
        counted = 100 * tracking.groups / max(tracking.groups_complete, 1)
        ax_share.step(t, counted, where="post", linestyle="--",
                      label="groups counted (one finish or more)")
        ax_ratio.legend(fontsize=8, loc="lower right")
        ax_share.legend(fontsize=8, loc="lower right")
    else:
        _no_data(ax_ratio, "no group has finished all its responses yet")
    ax_ratio.axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
    ax_ratio.set_ylabel("estimate / true longest")
    ax_share.set_ylabel("% of complete groups")
    ax_share.set_ylim(0, 102)
    ax_share.set_xlabel("time since the first lease (s)")
    ax_ratio.set_title(f"Group estimates against each group's true longest response "
                       f"({tracking.groups_complete} of {tracking.groups_total} groups complete; "
                       f"{len(t)} evenly spaced samples)", fontsize=10)
    fig.tight_layout()
    return fig


def plot_prefill_avoided(series: PrefillOverTime, downtime: Sequence[tuple[float, float]],
                         t0: float) -> Figure:
    fig, ax = plt.subplots(figsize=(9, 5))
    t = np.r_[0.0, series.times]
    if len(series.times):
        ax.step(t, np.r_[0, series.avoided], where="post", color="tab:green", linewidth=1.4,
                label=AVOIDED_LABEL)
        ax.step(t, np.r_[0, series.recomputed], where="post", color="tab:red", linewidth=1.4,
                label=RECOMPUTED_LABEL)
        ax.step(t, np.r_[0, series.unavoidable], where="post", color="tab:red", linewidth=0.8, linestyle=":",
                label=f"... of which no cache could avoid (last partial {series.block_size}-token block)")
        ax.step(t, np.r_[0, series.prompt_avoided], where="post", color="tab:green", linewidth=0.9,
                linestyle="--", alpha=0.7, label="first chunks: prompt tokens cached (siblings)")
        ax.step(t, np.r_[0, series.prompt_computed], where="post", color="tab:grey", linewidth=0.9,
                linestyle="--", alpha=0.7, label="first chunks: prompt tokens computed")
        ax.legend(fontsize=7, loc="upper left")
        recomputed, avoided = int(series.recomputed[-1]), int(series.avoided[-1])
        total = recomputed + avoided
        share = f"{100 * avoided / total:.0f}%" if total else "-"
        title = (f"Prefill tokens avoided over time\ncontinued chunks: {avoided:,} context tokens cached, "
                 f"{recomputed:,} recomputed ({share} avoided)")
    else:
        _no_data(ax, "no finished chunk reported its cached tokens")
        title = "Prefill tokens avoided over time"
    if series.left_out:
        title += f"; left out: {series.left_out} finished chunk(s) without reported cached tokens"
    _shade_downtime(ax, downtime, t0)
    ax.set_xlabel("time since the first lease (s)")
    ax.set_ylabel("prefill tokens (cumulative)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig
