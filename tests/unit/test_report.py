"""`seerd report` on run databases made by the real lease book driven by a synthetic engine.

No vLLM here: `SyntheticEngine` plays two workers that lease chunks from the real `LeaseBook`
(real SQLite, seer policy) and report made-up tokens, each response ending at a length drawn in
advance. The report's figures are then checked against the database (`tests/report_checks.py`,
plain SQL) and against what the book itself held while the run went.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest
from click.testing import CliRunner

from seerd.book.book import LeaseBook
from seerd.cli.main import EXIT_BAD_INPUT, cli
from seerd.db import RolloutStatus, add_event
from seerd.io.prompts import PromptRow
from seerd.protocol import ChunkReport
from seerd.report import PLOT_FILES, ReportError, load_run, write_report
from seerd.report import cache as kv_cache
from seerd.report import metrics
from seerd.report.plots import (
    AVOIDED_LABEL, RECOMPUTED_LABEL, TAIL_LABEL, plot_completion_cdf, plot_length_heatmap,
    plot_prefill_avoided,
)
from seerd.tail import tail_start
from tests.report_checks import assert_report_matches_run, expected_figures, summary_figures
from tests.unit.helpers import HAND_CHUNKS, FakeClock, hand_built_cache_run, make_book, reopen

GROUPS, N, MAX_TOKENS, CHUNK = 10, 4, 160, 32
TICK_S = 0.25


def synthetic_lengths(seed: int = 0) -> dict[tuple[int, int], int]:
    """(group index, response index) -> the response's length: a base per group, heavy-tailed,
    with responses of one group close to it (as in RL rollouts)."""
    rng = random.Random(seed)
    lengths = {}
    for g in range(GROUPS):
        base = rng.lognormvariate(3.5, 0.8)
        for r in range(N):
            lengths[(g, r)] = max(1, min(MAX_TOKENS, round(base * rng.lognormvariate(0, 0.3))))
    return lengths


@dataclass
class SyntheticEngine:
    """Two workers that lease from the book, and report one tick later with made-up tokens."""

    book: LeaseBook
    clock: FakeClock
    lengths: dict[tuple[int, int], int]
    max_chunks: int = 16
    kv_tokens: int = 1500  # small enough that the book's KV admission binds
    workers: list[str] = field(default_factory=list)
    held: dict[str, list] = field(default_factory=dict)
    # (time, worker id, KV the book had reserved for it, leases it held), after each lease call.
    samples: list[tuple[float, str, int, int]] = field(default_factory=list)
    hung: set[tuple[int, int]] = field(default_factory=set)  # (chunk, epoch) never reported: they expire
    # The first chunk a worker holds from then on is never reported (hang) or given back (release).
    hang_next: bool = True
    release_next: bool = True

    def register(self, count: int = 2) -> None:
        self.workers = [self.book.register(rank=i, address="synthetic", max_chunks=self.max_chunks,
                                           kv_capacity_tokens=self.kv_tokens, worker_id=f"w{i}",
                                           now=self.clock.now).id for i in range(count)]
        self.held = {w: [] for w in self.workers}

    def _report(self, grant) -> ChunkReport:  # noqa: ANN001
        request = self.book.state.requests[grant.request_id]
        target = self.lengths[(self.book.state.groups[request.group_id].index, request.response_index)]
        n = min(grant.max_tokens, target - request.generated)
        return ChunkReport(grant.chunk_id, grant.epoch, [7] * n, [-0.5] * n,
                           "stop" if request.generated + n == target else "length")

    def tick(self) -> None:
        """Every worker reports what it held, heartbeats, and leases again; then time moves."""
        for worker in self.workers:
            grants = [g for g in self.held[worker] if (g.chunk_id, g.epoch) not in self.hung]
            if self.hang_next and grants:
                gone = grants.pop()
                self.hung.add((gone.chunk_id, gone.epoch))
                self.hang_next = False
            elif self.release_next and grants:
                gone = grants.pop()
                assert self.book.release(worker, gone.chunk_id, gone.epoch, "synthetic engine error",
                                         self.clock.now)
                self.release_next = False
            if grants:
                outcomes = self.book.report_many(worker, [self._report(g) for g in grants], self.clock.now)
                assert all(o.accepted for o in outcomes)
            running = [c for c in self.book.state.workers[worker].chunks
                       if (c, self.book.state.leases[c].epoch) not in self.hung]
            self.book.heartbeat(worker, running, self.clock.now)
            self.book.expire(self.clock.now)
            state = self.book.state.workers[worker]
            self.held[worker] = self.book.lease(worker, self.max_chunks - len(state.chunks), self.clock.now)
            self.samples.append((self.clock.now, worker, state.kv_reserved, len(state.chunks)))
            self.clock.advance(TICK_S)

    def run(self, *, until_finished: int | None = None, max_ticks: int = 400) -> None:
        goal = len(self.book.state.requests) if until_finished is None else until_finished
        for _ in range(max_ticks):
            if self.book.state.finished_requests >= goal:
                return
            self.tick()
        raise AssertionError("the synthetic run did not get there")


def prompt_rows() -> list[PromptRow]:
    return [PromptRow(f"p{g}", tuple(range(10 + g, 16 + g + g % 3 * 7)), N, MAX_TOKENS, {}, g + 1)
            for g in range(GROUPS)]


def start_run(run_dir: Path, lease_ttl_s: float = 2.0) -> SyntheticEngine:
    clock = FakeClock(1000.0)
    book = make_book(run_dir, policy="seer", chunk_tokens=CHUNK, lease_ttl_s=lease_ttl_s,
                     prompt_rows=prompt_rows(), now=clock.now)
    book.set_rollout_status(RolloutStatus.RUNNING, clock.now)
    engine = SyntheticEngine(book, clock, synthetic_lengths())
    clock.advance(5.0)  # engines start up: the report's clock starts at the first lease
    engine.register()
    return engine


def finish(engine: SyntheticEngine) -> None:
    engine.run()
    engine.book.set_rollout_status(RolloutStatus.FINISHED, engine.clock.now)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, SyntheticEngine]:
    """A whole run with the synthetic engine (one expired and one released lease), and its report."""
    run_dir = tmp_path_factory.mktemp("finished")
    engine = start_run(run_dir)
    finish(engine)
    engine.book.close()  # the coordinator is gone: -wal and -shm are removed
    engine.book.engine.dispose()
    out = run_dir / "report"
    write_report(run_dir, out)
    return run_dir, out, engine


def test_tail_start_is_when_ninety_percent_of_all_requests_had_finished() -> None:
    times = [float(t) for t in range(1, 11)]
    assert tail_start(times) == 9.0  # 9 of 10
    assert tail_start(times[:9], total=10) == 9.0  # an unfinished run that reached the tail
    assert tail_start(times[:8], total=10) is None  # not yet
    assert tail_start([5.0, 1.0, 3.0]) == 5.0  # ceil(2.7) = 3 of 3
    assert tail_start([]) is None


def test_synthetic_engine_run_report_writes_decodable_pngs_matching_the_db(finished_run) -> None:
    run_dir, out, _ = finished_run
    assert sorted(p.name for p in out.iterdir()) == sorted([*PLOT_FILES, "summary.md"])
    expected = assert_report_matches_run(run_dir, out)
    assert expected["finished"] == GROUPS * N and expected["re_leased"] == 2  # one expired, one released


def test_synthetic_engine_length_heatmap_is_groups_by_responses_of_the_db_lengths(finished_run) -> None:
    run_dir, _, engine = finished_run
    run = load_run(run_dir / "state.db")
    matrix = metrics.response_length_matrix(run)
    assert matrix.shape == (GROUPS, N)
    truth = np.array([[engine.lengths[(g, r)] for r in range(N)] for g in range(GROUPS)], dtype=float)
    np.testing.assert_array_equal(matrix, truth)
    unfinished, probe = metrics.request_cell_masks(run)
    assert not unfinished.any() and probe.sum(axis=1).tolist() == [1] * GROUPS  # seer: one probe per group
    fig = plot_length_heatmap(matrix, unfinished, probe, run.groups.index)
    drawn = fig.axes[0].images[0].get_array()
    assert drawn.shape == (GROUPS, N)
    np.testing.assert_array_equal(np.ma.filled(drawn, np.nan), truth)
    plt.close(fig)


def test_synthetic_engine_completion_cdf_marks_the_tail_computed_from_the_db(finished_run) -> None:
    run_dir, _, _ = finished_run
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        finishes = sorted(t for (t,) in db.execute("SELECT finished_at FROM requests"))
        first = db.execute("SELECT min(ts) FROM events WHERE kind = 'chunk_leased'").fetchone()[0]
    start = finishes[math.ceil(0.9 * len(finishes)) - 1]
    run = load_run(run_dir / "state.db")
    curve = metrics.completion_curve(run)
    assert curve.tail_start == pytest.approx(start - first, abs=1e-9)
    assert curve.fraction[-1] == 1.0 and len(curve.times) == len(finishes)
    fig = plot_completion_cdf(curve, metrics.timing(run).tail_s)
    (mark,) = [line for line in fig.axes[0].get_lines() if line.get_label() == TAIL_LABEL]
    assert mark.get_xdata()[0] == pytest.approx(start - first, abs=1e-9)
    plt.close(fig)
    assert metrics.timing(run).tail_s == pytest.approx(finishes[-1] - start)


def test_synthetic_engine_summary_figures_match_the_db(finished_run) -> None:
    run_dir, out, engine = finished_run
    stated = summary_figures((out / "summary.md").read_text())
    tokens = sum(engine.lengths.values())
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        first = db.execute("SELECT min(ts) FROM events WHERE kind = 'chunk_leased'").fetchone()[0]
        last = db.execute("SELECT max(finished_at) FROM requests").fetchone()[0]
    assert stated["output_tokens"] == tokens
    assert stated["throughput"] == pytest.approx(tokens / (last - first), abs=0.051)
    assert (stated["groups"], stated["responses"]) == (GROUPS, N)
    assert (stated["requests"], stated["finished"]) == (GROUPS * N, GROUPS * N)
    summary = (out / "summary.md").read_text()
    assert "leases expired: 1, released by a worker: 1, orphaned by a coordinator stop: 0" in summary


def test_synthetic_engine_kv_and_running_follow_the_lease_book(finished_run) -> None:
    """The step functions equal what the book itself had reserved and leased at every sample."""
    run_dir, _, engine = finished_run
    run = load_run(run_dir / "state.db")
    t0 = metrics.time_origin(run)
    series = {s.worker.id: s for s in metrics.worker_load(run, metrics.lease_intervals(run))}
    for now, worker, kv_reserved, leases in engine.samples:
        s = series[worker]
        i = np.searchsorted(s.times, now - t0 + 1e-9, side="right") - 1
        running, kv = (int(s.running[i]), int(s.kv_tokens[i])) if i >= 0 else (0, 0)
        assert (running, kv) == (leases, kv_reserved), f"{worker} at {now}"
    assert max(s.kv_fraction.max() for s in series.values()) <= 1.0  # seer admits within the KV
    assert max(s.kv_fraction.max() for s in series.values()) > 0.5  # ... and the small KV did bind


def test_synthetic_engine_chunk_timeline_lanes_never_overlap(finished_run) -> None:
    run_dir, _, engine = finished_run
    run = load_run(run_dir / "state.db")
    leases = metrics.lease_intervals(run)
    lanes = metrics.timeline_lanes(leases)
    assert sorted(set(leases.outcome)) == ["done", "expired", "released"]
    for worker in set(leases.worker.tolist()):
        for lane in set(lanes[leases.worker == worker].tolist()):
            pick = (leases.worker == worker) & (lanes == lane)
            order = np.argsort(leases.start[pick])
            assert (leases.start[pick][order][1:] >= leases.end[pick][order][:-1]).all()
        assert lanes[leases.worker == worker].max() < engine.max_chunks  # lanes = most leases held at once


def test_synthetic_engine_estimate_tracking_ends_at_the_true_longest(finished_run) -> None:
    run_dir, out, engine = finished_run
    tracking = metrics.estimate_tracking(load_run(run_dir / "state.db"))
    longest = {g: max(engine.lengths[(g, r)] for r in range(N)) for g in range(GROUPS)}
    assert tracking.groups_complete == tracking.groups_total == GROUPS
    # After the last finish every group's estimate is its longest finished response: its true longest.
    assert tracking.groups[-1] == GROUPS and tracking.median[-1] == 1.0 and tracking.share_covering[-1] == 1.0
    # Before any finish no group counts.
    assert tracking.groups[0] == 0 and np.isnan(tracking.median[0])
    # First estimates: the length of each group's first finished response over its longest.
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        first = {}
        for gi, length in db.execute(
                "SELECT g.group_index, r.generated_tokens FROM requests r "
                "JOIN prompt_groups g ON g.id = r.group_id ORDER BY r.finished_at, r.id"):
            first.setdefault(gi, length)
    truth = sorted(first[g] / longest[g] for g in range(GROUPS))
    assert sorted(tracking.first_ratio.tolist()) == pytest.approx(truth)
    assert "## Group estimates against the true longest response" in (out / "summary.md").read_text()


def test_synthetic_engine_interrupted_run_still_gets_a_report(tmp_path) -> None:
    engine = start_run(tmp_path)
    engine.run(until_finished=15)
    engine.book.set_rollout_status(RolloutStatus.INTERRUPTED, engine.clock.now, "synthetic stop")
    out = tmp_path / "out"
    written = write_report(tmp_path, out)
    assert len(written.plots) == len(PLOT_FILES)
    expected = assert_report_matches_run(tmp_path, out)
    assert 15 <= expected["finished"] < GROUPS * N and expected["tail_s"] is None
    matrix = metrics.response_length_matrix(written.run)
    assert np.isnan(matrix).sum() == GROUPS * N - expected["finished"]
    summary = (out / "summary.md").read_text()
    assert "The run is **interrupted**" in summary and "| tail time | - (not reached" in summary
    leases = metrics.lease_intervals(written.run)
    assert (leases.outcome == "open").sum() == len(engine.book.state.leases) > 0


def test_synthetic_engine_resumed_run_counts_orphans_and_leaves_out_the_downtime(tmp_path) -> None:
    engine = start_run(tmp_path)
    engine.run(until_finished=20)
    held = len(engine.book.state.leases)
    stopped = engine.clock.now
    engine.book.set_rollout_status(RolloutStatus.INTERRUPTED, stopped, "synthetic stop")
    engine.clock.advance(100.0)  # the coordinator is down
    engine.book = reopen(engine.book, engine.clock.now)  # orphans the leases of the old one
    with engine.book.sessions.begin() as session:
        add_event(session, engine.book.rollout_id, engine.clock.now, "rollout_resumed", data={})
    engine.book.set_rollout_status(RolloutStatus.RUNNING, engine.clock.now)
    engine.clock.advance(7.0)  # workers start again
    engine.register()
    restarted = engine.clock.now
    finish(engine)
    out = tmp_path / "out"
    written = write_report(tmp_path, out)
    expected = assert_report_matches_run(tmp_path, out)
    timing = metrics.timing(written.run)
    assert timing.downtime == ((stopped, restarted),)
    span = expected["end"] - expected["first_lease"]
    assert timing.generation_s == pytest.approx(span - (restarted - stopped))
    leases = metrics.lease_intervals(written.run)
    orphaned = leases.outcome == "orphaned"
    assert orphaned.sum() == held > 0
    assert (leases.end[orphaned] <= stopped).all()  # they died with the first coordinator
    assert f"orphaned by a coordinator stop: {held}" in (out / "summary.md").read_text()


def test_report_of_a_run_with_nothing_leased_yet(tmp_path) -> None:
    make_book(tmp_path, policy="seer", prompt_rows=prompt_rows())
    written = write_report(tmp_path, tmp_path / "out")
    assert all(p.stat().st_size > 0 for p in written.plots)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| throughput | - |" in summary and "| requests | 40 (0 finished) |" in summary


def test_synthetic_engine_report_reads_a_live_wal_database(tmp_path) -> None:
    """While the coordinator holds the database (WAL, committed rows not yet checkpointed), and
    after it closed (no -wal, no -shm): both read, the same rows."""
    engine = start_run(tmp_path)
    engine.run(until_finished=12)
    wal = tmp_path / "state.db-wal"
    assert wal.exists() and wal.stat().st_size > 0
    live = load_run(tmp_path / "state.db")
    assert int(live.requests.finished.sum()) == engine.book.state.finished_requests
    assert int(live.requests.generated.sum()) == engine.book.state.output_tokens
    engine.book.close()
    engine.book.engine.dispose()
    assert not wal.exists() and not (tmp_path / "state.db-shm").exists()
    closed = load_run(tmp_path / "state.db")
    np.testing.assert_array_equal(closed.requests.generated, live.requests.generated)
    assert len(closed.events) == len(live.events)
    # SQLite's mode=ro made the WAL index again to read: two files, the WAL empty.
    assert wal.exists() and wal.stat().st_size == 0


READ_IN_A_READ_ONLY_DIR = """
import sys
from pathlib import Path
from seerd.report import load_run
run = load_run(Path(sys.argv[1]))
print(int(run.requests.finished.sum()), len(run.events))
"""


def _read_without_write_permission(directory: Path) -> subprocess.CompletedProcess:
    """load_run in a child that may not write to `directory` (root: without its capabilities)."""
    directory.chmod(0o555)
    command = [sys.executable, "-c", READ_IN_A_READ_ONLY_DIR, str(directory / "state.db")]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv: cannot take away the write permission")
        command = [setpriv, "--inh-caps=-all", "--bounding-set=-all", *command]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    finally:
        directory.chmod(0o755)


def test_synthetic_engine_report_reads_a_run_in_a_read_only_directory(tmp_path) -> None:
    """Without -wal/-shm SQLite's mode=ro would have to create them: it falls back to immutable.
    With a WAL left by a killed coordinator it must read the WAL (immutable would skip it)."""
    engine = start_run(tmp_path / "live")
    engine.run(until_finished=12)
    finished, events = engine.book.state.finished_requests, len(load_run(tmp_path / "live" / "state.db").events)
    crashed = tmp_path / "crashed"  # what a killed coordinator leaves: db, -wal with rows, -shm
    crashed.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(tmp_path / "live" / f"state.db{suffix}", crashed / f"state.db{suffix}")
    assert (crashed / "state.db-wal").stat().st_size > 0
    engine.book.close()
    engine.book.engine.dispose()
    clean = tmp_path / "clean"
    clean.mkdir()
    shutil.copy(tmp_path / "live" / "state.db", clean / "state.db")
    for directory in (crashed, clean):
        done = _read_without_write_permission(directory)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [str(finished), str(events)], directory.name
    assert sorted(p.name for p in clean.iterdir()) == ["state.db"]  # nothing created


def test_synthetic_engine_run_of_an_older_schema_reports_without_an_upgrade(finished_run, tmp_path) -> None:
    """The report reads only the columns it needs: a run of schema 0003 (before workers.stats_json)
    reports as it is; a database without those columns asks for `seerd db upgrade`."""
    from alembic import command

    from seerd.db import make_engine
    from seerd.db.migrate import alembic_config, current_revision

    shutil.copy(finished_run[0] / "state.db", tmp_path / "state.db")
    engine = make_engine(tmp_path / "state.db", synchronous="NORMAL")
    config = alembic_config(engine)
    with engine.begin() as connection:
        config.attributes["connection"] = connection
        command.downgrade(config, "0003")
    assert current_revision(engine) == "0003"
    engine.dispose()
    assert_report_matches_run(tmp_path, write_report(tmp_path, tmp_path / "out").out_dir)
    (tmp_path / "bare").mkdir()
    with sqlite3.connect(tmp_path / "bare" / "state.db") as db:
        db.execute("CREATE TABLE rollouts (id INTEGER PRIMARY KEY, status TEXT)")
    with pytest.raises(ReportError, match="lacks .*seerd db upgrade"):
        load_run(tmp_path / "bare" / "state.db")


def test_report_cli_unknown_run_dir_exits_non_zero_with_a_clear_message(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == EXIT_BAD_INPUT
    assert "no run at" in result.output and "state.db" in result.output
    (tmp_path / "empty").mkdir()
    sqlite3.connect(tmp_path / "empty" / "state.db").close()  # a file, but no seerd run in it
    result = CliRunner().invoke(cli, ["report", str(tmp_path / "empty")])
    assert result.exit_code == EXIT_BAD_INPUT and "holds no seerd run" in result.output
    with pytest.raises(ReportError):
        write_report(tmp_path / "nowhere", tmp_path / "out")


def test_report_cli_out_dir_that_cannot_be_made_exits_non_zero(finished_run, tmp_path) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    result = CliRunner().invoke(cli, ["report", str(finished_run[0]), "--out", str(out)])
    assert result.exit_code == EXIT_BAD_INPUT
    assert "cannot write the report to" in result.output and "--out" in result.output


def test_report_cli_writes_into_run_dir_report_by_default(finished_run, tmp_path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run[0], run_dir, ignore=shutil.ignore_patterns("report"))
    result = CliRunner().invoke(cli, ["report", str(run_dir)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == sorted([*PLOT_FILES, "summary.md"])
    for name in PLOT_FILES:
        assert matplotlib.image.imread(run_dir / "report" / name).shape[2] in (3, 4)
    assert expected_figures(run_dir)["finished"] == GROUPS * N


# ------------------------------------------------------------- prefix cache and KV pool, hand-built chunks
# The figures of tests/unit/helpers.py HAND_CHUNKS, worked out by hand with 128-token blocks.
# Per continued chunk: context L = prompt + earlier chunks, cacheable = (L - 1) // 128 * 128.
#   same worker: (0,0,1) L 300 cacheable 256 cached 256; (0,1,2) L 400 cacheable 384 cached 256
#   moved:       (0,0,2) L 400 cacheable 384 cached 384 (a pool hit); (0,0,3) L 500 cacheable 384 cached
#                128 (the prompt's block only); (0,1,1) L 300 cacheable 256 cached 128; (1,0,1) L 110
#                cacheable 0 cached 0
#   left out:    (1,0,2) (cached tokens not reported); (1,0,3) and (1,1,0) are still leased.
HAND_SAME = kv_cache.CacheFigures(chunks=2, cacheable_tokens=640, cached_tokens=512,
                                 response_cacheable_tokens=56 + 184, response_cached_tokens=56 + 56,
                                 near_full=2)
HAND_MOVED = kv_cache.CacheFigures(chunks=4, cacheable_tokens=1024, cached_tokens=640,
                                  response_cacheable_tokens=184 + 184 + 56, response_cached_tokens=184,
                                  near_full=3)


@pytest.fixture(scope="module")
def hand_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hand_built_cache_run(tmp_path_factory.mktemp("hand"))


def test_max_cacheable_is_whole_blocks_short_of_the_last_token() -> None:
    cacheable = [kv_cache.max_cacheable(n) for n in (0, 1, 128, 129, 256, 257, 300)]
    assert cacheable == [0, 0, 0, 128, 128, 256, 256]
    assert kv_cache.max_cacheable(300, block_size=16) == 288


def test_continuation_cache_figures_of_hand_built_chunks(hand_run) -> None:
    cache = kv_cache.continuation_cache_figures(load_run(hand_run / "state.db"))
    assert (cache.same, cache.moved, cache.left_out, cache.block_size) == (HAND_SAME, HAND_MOVED, 1, 128)
    assert cache.returned == 1  # (0,0,3) went back to w0, which ran (0,0,0) and (0,0,1)
    assert cache.same.hit_rate == 512 / 640 and cache.same.response_hit_rate == 112 / 240
    assert cache.pool_hit_rate == 640 / 1024 and cache.pool_hit_rate_response == 184 / 424
    assert cache.moved.near_full_fraction == 3 / 4  # (0,0,3) missed: 128 < 384 - 128
    # Another block size changes what could be cached: 16-token blocks, L 300 -> 288.
    small = kv_cache.continuation_cache_figures(load_run(hand_run / "state.db"), block_size=16)
    assert small.same.cacheable_tokens == 288 + 384 and small.moved.cacheable_tokens == 384 + 496 + 288 + 96


def test_continuation_cache_figures_without_continued_chunks(tmp_path) -> None:
    run = load_run(hand_built_cache_run(tmp_path, tuple(c for c in HAND_CHUNKS if c[2] == 0)) / "state.db")
    cache = kv_cache.continuation_cache_figures(run)
    assert cache.same.chunks == cache.moved.chunks == cache.left_out == 0
    assert cache.pool_hit_rate is None and cache.pool_hit_rate_response is None
    assert cache.moved.near_full_fraction is None


def test_prefill_avoided_over_time_of_hand_built_chunks(hand_run) -> None:
    series = kv_cache.prefill_avoided_over_time(load_run(hand_run / "state.db"))
    # By finish: (0,0,0) (1,0,0) (0,1,0) (0,0,1) (0,1,1) (1,0,1) (0,0,2) (0,1,2) [(1,0,2) left out] (0,0,3)
    np.testing.assert_array_equal(series.times, [1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 10.0])
    np.testing.assert_array_equal(series.avoided, [0, 0, 0, 256, 384, 384, 768, 1024, 1152])
    np.testing.assert_array_equal(series.recomputed, [0, 0, 0, 44, 216, 326, 342, 486, 858])
    np.testing.assert_array_equal(series.unavoidable, [0, 0, 0, 44, 88, 198, 214, 230, 346])
    np.testing.assert_array_equal(series.prompt_avoided, [128] * 9)
    np.testing.assert_array_equal(series.prompt_computed, [72, 132, 332, 332, 332, 332, 332, 332, 332])
    assert series.left_out == 1
    # Every continued chunk's context is either avoided or recomputed.
    assert series.avoided[-1] + series.recomputed[-1] == 300 + 400 + 500 + 300 + 400 + 110


def test_report_of_hand_built_chunks_plots_and_states_the_cache_figures(hand_run, tmp_path) -> None:
    written = write_report(hand_run, tmp_path / "out")
    assert_report_matches_run(hand_run, tmp_path / "out")
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## Continued chunks: prefix cache and KV pool" in summary
    assert ("| same worker as the previous chunk | 2 | 640 | 512 | 0.800 | 240 | 112 | 0.467 | 2 (100%) |"
            in summary)
    assert "| moved to another worker | 4 | 1024 | 640 | 0.625 | 424 | 184 | 0.434 | 3 (75%) |" in summary
    assert ("Measured pool hit rate (moved chunks, token-weighted): 0.625; over response tokens only: 0.434"
            in summary)
    assert "Left out: 1 finished continued chunk(s)" in summary
    assert "Of the moved chunks, 1 went back to a worker that had run an earlier chunk" in summary
    series = kv_cache.prefill_avoided_over_time(written.run)
    fig = plot_prefill_avoided(series, (), metrics.time_origin(written.run))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    np.testing.assert_array_equal(lines[AVOIDED_LABEL].get_ydata(), np.r_[0, series.avoided])
    np.testing.assert_array_equal(lines[RECOMPUTED_LABEL].get_ydata(), np.r_[0, series.recomputed])
    np.testing.assert_array_equal(lines[AVOIDED_LABEL].get_xdata(), np.r_[0.0, series.times])
    assert "1,152 context tokens cached, 858 recomputed (57% avoided)" in fig.axes[0].get_title()
    plt.close(fig)


def test_report_without_reported_cached_tokens_says_so(finished_run) -> None:
    """The synthetic engine reports no cached tokens (as an older worker): nothing to count, no error."""
    run_dir, out, _ = finished_run
    run = load_run(run_dir / "state.db")
    cache = kv_cache.continuation_cache_figures(run)
    continued = int((run.chunks.done & (run.chunks.seq >= 1)).sum())
    assert cache.same.chunks == cache.moved.chunks == 0 and cache.left_out == continued > 0
    assert len(kv_cache.prefill_avoided_over_time(run).times) == 0
    assert "No continued chunk (seq >= 1) with reported cached tokens has finished yet." in (
        out / "summary.md").read_text()
