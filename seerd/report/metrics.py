"""The report's figures, computed from a `RunData`: pure functions that return arrays and dataclasses.

Times inside the results are seconds since the run's first lease (when generation starts; engine
start-up before it is not the scheduler's doing), except where a field says "absolute".
A lease is one hand-out of a chunk to a worker, from its `chunk_leased` event to the event that
ended it: `chunk_done`, or `lease_expired` / `lease_released` / `lease_orphaned` / `chunk_failed` /
`report_rejected` (the chunk went back to the queue and was leased again later, as a new lease with a higher epoch),
or `request_failed` (its engine failed it for the last time: the request ended failed).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from seerd.report.source import RunData, WorkerInfo
from seerd.tail import tail_start

# How a lease ended. "open": still held when the data was read (a live or crashed run).
LEASE_OUTCOMES = ("done", "expired", "released", "orphaned", "failed", "open")
_ENDING_KINDS = {"chunk_done": "done", "lease_expired": "expired", "lease_released": "released",
                 "lease_orphaned": "orphaned", "chunk_failed": "failed", "report_rejected": "failed",
                 "request_failed": "failed"}
# Times at which the estimate tracking is sampled, evenly from the first lease to the last finish.
ESTIMATE_SAMPLES = 101


@dataclass(frozen=True)
class Leases:
    """One entry per lease, in the order they were handed out. `start`/`end` are absolute."""

    worker: np.ndarray  # index into RunData.workers
    request_id: np.ndarray
    group_index: np.ndarray
    seq: np.ndarray
    epoch: np.ndarray
    start: np.ndarray
    end: np.ndarray
    # What the lease book reserved for it: prompt + tokens before this chunk + the chunk's budget
    # (scheduler/base.py `kv_need`), i.e. the most KV the chunk can occupy.
    kv_tokens: np.ndarray
    outcome: np.ndarray  # strings from LEASE_OUTCOMES

    def __len__(self) -> int:
        return len(self.start)


@dataclass(frozen=True)
class Timing:
    """Throughput and tail. `first_lease` and `end` are absolute; the rest are durations."""

    first_lease: float | None
    end: float | None  # the last committed chunk (in a finished run: the last finish)
    # Gaps from a coordinator's last event to the first lease after its resume (absolute).
    downtime: tuple[tuple[float, float], ...]
    generation_s: float  # end - first lease - downtime
    output_tokens: int
    throughput_tok_s: float | None
    requests_total: int
    requests_finished: int
    tail_start: float | None  # absolute; when 90% of all requests had finished (None: not yet)
    tail_s: float | None  # tail_start to end, less downtime within (so far, in an unfinished run)


@dataclass(frozen=True)
class CompletionCurve:
    times: np.ndarray  # finish times of the finished requests, sorted, seconds since the first lease
    fraction: np.ndarray  # of all requests of the run, finished by then
    total: int
    tail_start: float | None  # seconds since the first lease
    end: float | None  # seconds since the first lease


@dataclass(frozen=True)
class WorkerLoadSeries:
    worker: WorkerInfo
    times: np.ndarray  # change points, seconds since the first lease
    running: np.ndarray  # leases held (= requests running on it) from each change point on
    kv_tokens: np.ndarray  # KV tokens reserved by those leases

    @property
    def kv_fraction(self) -> np.ndarray:
        return self.kv_tokens / max(self.worker.kv_capacity_tokens, 1)


@dataclass(frozen=True)
class EstimateTracking:
    """How the group estimates tracked the true longest response of each group, over time.

    Only groups whose responses have all finished have a known true longest; a group counts at a
    time once one of its responses had finished (before that the estimate is the starting value).
    """

    times: np.ndarray  # sample times, seconds since the first lease (ESTIMATE_SAMPLES of them)
    groups: np.ndarray  # groups counted at each time
    median: np.ndarray  # of estimate / true longest over those groups (NaN: none counted)
    p10: np.ndarray
    p90: np.ndarray
    share_covering: np.ndarray  # share of them whose estimate is at least their true longest
    first_ratio: np.ndarray  # per complete group: the estimate after its first finish / true longest
    groups_complete: int
    groups_total: int


@dataclass(frozen=True)
class LeaseCounts:
    leases: int
    chunks_done: int
    re_leased: int  # leases of a chunk that had been leased before (epoch > 1)
    expired: int
    released: int
    orphaned: int  # still leased when a coordinator stopped; re-queued by the next one
    open: int
    failed: int = 0  # the engine failed the chunk (retried, or its request ended failed)


def _first_lease(run: RunData) -> float | None:
    return next((e.ts for e in run.events if e.kind == "chunk_leased"), None)


def time_origin(run: RunData) -> float:
    """The first lease, or when the run was created if nothing was leased yet."""
    first = _first_lease(run)
    return first if first is not None else run.rollout.created_at


def response_length_matrix(run: RunData) -> np.ndarray:
    """Groups (in input order) x responses: each finished response's length; NaN for unfinished
    responses and for the padding of groups with fewer than the largest n."""
    matrix, _, _ = _request_cells(run)
    return matrix


def _request_cells(run: RunData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The length matrix, and masks of unfinished and probe cells (same shape)."""
    groups, requests = run.groups, run.requests
    width = int(groups.n.max()) if len(groups.n) else 0
    lengths = np.full((len(groups.id), width), np.nan)
    unfinished = np.zeros(lengths.shape, dtype=bool)
    probe = np.zeros(lengths.shape, dtype=bool)
    rows, cols = _group_rows(run), requests.response_index
    done = requests.finished
    lengths[rows[done], cols[done]] = requests.generated[done]
    unfinished[rows[~done], cols[~done]] = True
    probe[rows[requests.is_probe], cols[requests.is_probe]] = True
    return lengths, unfinished, probe


def _group_rows(run: RunData) -> np.ndarray:
    """Per request, the row of its group in RunData.groups (group_index order)."""
    ids = run.groups.id
    if not len(ids):
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(ids)  # rows are in group_index order; ids need not be
    return order[np.searchsorted(ids[order], run.requests.group_id)]


def request_cell_masks(run: RunData) -> tuple[np.ndarray, np.ndarray]:
    """(unfinished, probe) masks in the shape of `response_length_matrix`."""
    _, unfinished, probe = _request_cells(run)
    return unfinished, probe


def lease_intervals(run: RunData) -> Leases:
    """Every lease from the event log, with how and when it ended."""
    worker_index = {w.id: i for i, w in enumerate(run.workers)}
    group_of_request = _group_index_of_requests(run)
    prompt_of_request = prompt_len_of_requests(run)
    before = tokens_before_chunk(run)
    ts_all = sorted(e.ts for e in run.events)
    data_end = ts_all[-1] if ts_all else run.rollout.created_at
    rows: list[list] = []
    open_by_chunk: dict[int, int] = {}
    for event in run.events:
        if event.kind == "chunk_leased":
            seq, budget = int(event.data.get("seq", 0)), int(event.data.get("max_tokens", 0))
            rid = event.request_id
            kv = prompt_of_request.get(rid, 0) + before.get((rid, seq), 0) + budget
            open_by_chunk[event.chunk_id] = len(rows)
            rows.append([worker_index.get(event.worker_id, -1), rid, group_of_request.get(rid, -1), seq,
                         int(event.data.get("epoch", 1)), event.ts, np.nan, kv, "open"])
        elif event.kind in _ENDING_KINDS and event.chunk_id in open_by_chunk:
            row = rows[open_by_chunk.pop(event.chunk_id)]
            row[8] = _ENDING_KINDS[event.kind]
            # An orphaned lease died with the coordinator that granted it: it ended (at the latest)
            # at that coordinator's last event, not when the next one found it.
            orphaned = event.kind == "lease_orphaned"
            row[6] = max(row[5], _last_before(ts_all, event.ts)) if orphaned else event.ts
    for index in open_by_chunk.values():
        rows[index][6] = max(rows[index][5], data_end)
    columns = list(zip(*rows)) if rows else [()] * 9
    ints = [np.array(c, dtype=np.int64) for c in columns[:5]]
    return Leases(*ints, np.array(columns[5], dtype=float), np.array(columns[6], dtype=float),
                  np.array(columns[7], dtype=np.int64), np.array(columns[8], dtype=object))


def _last_before(sorted_ts: list[float], ts: float) -> float:
    """The latest event time before `ts` (`ts` itself when there is none)."""
    k = bisect.bisect_left(sorted_ts, ts)
    return sorted_ts[k - 1] if k else ts


def _group_index_of_requests(run: RunData) -> dict[int, int]:
    index_of_group = dict(zip(run.groups.id.tolist(), run.groups.index.tolist()))
    return {rid: index_of_group[gid] for rid, gid in _request_groups(run)}


def prompt_len_of_requests(run: RunData) -> dict[int, int]:
    prompt_of_group = dict(zip(run.groups.id.tolist(), run.groups.prompt_len.tolist()))
    return {rid: prompt_of_group[gid] for rid, gid in _request_groups(run)}


def _request_groups(run: RunData) -> zip:
    """(request id, group id) pairs."""
    return zip(run.requests.id.tolist(), run.requests.group_id.tolist())


def tokens_before_chunk(run: RunData) -> dict[tuple[int, int], int]:
    """(request id, seq) -> tokens the request had committed before that chunk (chunks of a
    request run one after another, so these are the done chunks of lower seq)."""
    chunks = run.chunks
    order = np.lexsort((chunks.seq, chunks.request_id))
    before: dict[tuple[int, int], int] = {}
    total, current = 0, None
    for i in order.tolist():
        rid, seq = int(chunks.request_id[i]), int(chunks.seq[i])
        if rid != current:
            total, current = 0, rid
        before[(rid, seq)] = total
        if chunks.done[i]:
            total += int(chunks.num_tokens[i])
    return before


def lease_counts(run: RunData, leases: Leases) -> LeaseCounts:
    outcome = leases.outcome
    return LeaseCounts(
        leases=len(leases), chunks_done=int(run.chunks.done.sum()), re_leased=int((leases.epoch > 1).sum()),
        expired=int((outcome == "expired").sum()), released=int((outcome == "released").sum()),
        orphaned=int((outcome == "orphaned").sum()), open=int((outcome == "open").sum()),
        failed=int((outcome == "failed").sum()))


def downtime(run: RunData) -> tuple[tuple[float, float], ...]:
    """From each stopped coordinator's last event to the first lease after the resume."""
    ts_all = sorted(e.ts for e in run.events)
    leased = sorted(e.ts for e in run.events if e.kind == "chunk_leased")
    gaps = []
    for event in run.events:
        if event.kind != "rollout_resumed":
            continue
        stopped = _last_before(ts_all, event.ts)
        k = bisect.bisect_left(leased, event.ts)
        restarted = leased[k] if k < len(leased) else event.ts
        if restarted > stopped:
            gaps.append((stopped, restarted))
    return tuple(gaps)


def _overlap(gaps: tuple[tuple[float, float], ...], lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in gaps)


def timing(run: RunData) -> Timing:
    requests = run.requests
    finished_at = requests.finished_at[requests.finished]
    total, finished = len(requests.id), int(requests.finished.sum())
    output_tokens = int(requests.generated.sum())
    first = _first_lease(run)
    done_ts = [e.ts for e in run.events if e.kind == "chunk_done"]
    end = max(done_ts) if done_ts else (float(finished_at.max()) if finished else None)
    start90 = tail_start(finished_at.tolist(), total)
    if first is None or end is None:
        return Timing(first, end, (), 0.0, output_tokens, None, total, finished, start90, None)
    gaps = tuple((max(a, first), min(b, end)) for a, b in downtime(run) if b > first and a < end)
    generation = end - first - _overlap(gaps, first, end)
    throughput = output_tokens / generation if generation > 0 else None
    tail = None if start90 is None else end - start90 - _overlap(gaps, start90, end)
    return Timing(first, end, gaps, generation, output_tokens, throughput, total, finished, start90, tail)


def completion_curve(run: RunData) -> CompletionCurve:
    t0 = time_origin(run)
    requests = run.requests
    times = np.sort(requests.finished_at[requests.finished]) - t0
    total = len(requests.id)
    fraction = np.arange(1, len(times) + 1) / max(total, 1)
    start90 = tail_start(requests.finished_at[requests.finished].tolist(), total)
    return CompletionCurve(times, fraction, total, None if start90 is None else start90 - t0,
                           float(times[-1]) if len(times) else None)


def worker_load(run: RunData, leases: Leases) -> list[WorkerLoadSeries]:
    """Per worker, the leases it held and the KV they reserved, as step functions of time."""
    t0 = time_origin(run)
    series = []
    for index, worker in enumerate(run.workers):
        mine = leases.worker == index
        starts, ends, kv = leases.start[mine] - t0, leases.end[mine] - t0, leases.kv_tokens[mine]
        times = np.concatenate([starts, ends])
        is_start = np.concatenate([np.ones(len(starts), dtype=bool), np.zeros(len(ends), dtype=bool)])
        # Ends before starts at one instant: a report and the next lease in the same tick are no spike.
        order = np.lexsort((is_start, times))
        times, is_start = times[order], is_start[order]
        running = np.cumsum(np.where(is_start, 1, -1))
        reserved = np.cumsum(np.concatenate([kv, -kv])[order])
        last_at_time = np.r_[times[1:] != times[:-1], True] if len(times) else np.array([], dtype=bool)
        series.append(WorkerLoadSeries(worker, times[last_at_time], running[last_at_time],
                                       reserved[last_at_time]))
    return series


def timeline_lanes(leases: Leases) -> np.ndarray:
    """A lane per lease within its worker, so that the leases of one lane never overlap (the
    lowest free lane first: a worker's lane count is the most leases it held at once)."""
    lanes = np.zeros(len(leases), dtype=np.int64)
    for worker in np.unique(leases.worker):
        index = np.flatnonzero(leases.worker == worker)
        index = index[np.lexsort((leases.end[index], leases.start[index]))]
        busy: list[tuple[float, int]] = []  # (end, lane) of leases still running
        free: list[int] = []
        used = 0
        for i in index.tolist():
            while busy and busy[0][0] <= leases.start[i]:
                heapq.heappush(free, heapq.heappop(busy)[1])
            if free:
                lane = heapq.heappop(free)
            else:
                lane, used = used, used + 1
            lanes[i] = lane
            heapq.heappush(busy, (leases.end[i], lane))
    return lanes


def _finish_estimates(run: RunData) -> dict[int, tuple[list[float], list[int]]]:
    """group id -> (times, estimate after each finish), from `request_finished` events."""
    group_of = dict(zip(run.requests.id.tolist(), run.requests.group_id.tolist()))
    out: dict[int, tuple[list[float], list[int]]] = {}
    for event in run.events:
        if event.kind == "request_finished" and "group_estimate" in event.data:
            times, estimates = out.setdefault(group_of[event.request_id], ([], []))
            times.append(event.ts)
            estimates.append(int(event.data["group_estimate"]))
    return out


def true_longest(run: RunData) -> dict[int, int]:
    """group id -> its longest response, for groups whose responses have all finished."""
    requests, groups = run.requests, run.groups
    rows = _group_rows(run)
    finished = np.bincount(rows[requests.finished], minlength=len(groups.id))
    longest = np.zeros(len(groups.id), dtype=np.int64)
    np.maximum.at(longest, rows, requests.generated)
    complete = finished == groups.n
    return dict(zip(groups.id[complete].tolist(), longest[complete].tolist()))


def estimate_tracking(run: RunData, samples: int = ESTIMATE_SAMPLES) -> EstimateTracking:
    t0 = time_origin(run)
    longest = true_longest(run)
    finishes = {gid: f for gid, f in _finish_estimates(run).items() if gid in longest and longest[gid] > 0}
    last = max((times[-1] for times, _ in finishes.values()), default=None)
    first_ratio = np.array([estimates[0] / longest[gid] for gid, (_, estimates) in finishes.items()])
    empty = np.array([])
    if last is None:
        return EstimateTracking(empty, empty, empty, empty, empty, empty, first_ratio, len(longest),
                                len(run.groups.id))
    times = t0 + np.linspace(0.0, max(last - t0, 0.0), samples)
    counted, median, p10, p90, covering = [], [], [], [], []
    for t in times.tolist():
        ratios = []
        for gid, (ts, estimates) in finishes.items():
            k = bisect.bisect_right(ts, t)
            if k:
                ratios.append(estimates[k - 1] / longest[gid])
        counted.append(len(ratios))
        if ratios:
            lo, mid, hi = np.percentile(ratios, [10, 50, 90])
            p10.append(lo), median.append(mid), p90.append(hi)
            covering.append(float(np.mean(np.array(ratios) >= 1.0)))
        else:
            p10.append(np.nan), median.append(np.nan), p90.append(np.nan), covering.append(np.nan)
    return EstimateTracking(times - t0, np.array(counted), np.array(median), np.array(p10), np.array(p90),
                            np.array(covering), first_ratio, len(longest), len(run.groups.id))
