"""Checks of a `seerd report` against its run, for unit tests and for integration tests on real runs.

The figures are computed again here from the database with plain SQL (sqlite3, read-only), not
through `seerd.report`'s own reading code, and compared with what the report wrote.
"""

from __future__ import annotations

import math
import re
import sqlite3
from pathlib import Path

import numpy as np


def _rows(db: Path, sql: str, params: tuple = ()) -> list[tuple]:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10) as conn:
        return conn.execute(sql, params).fetchall()


def expected_figures(run_dir: Path) -> dict:
    """The report's figures, from the run's database by SQL."""
    db = Path(run_dir) / "state.db"
    (rollout_id,) = _rows(db, "SELECT max(id) FROM rollouts")[0]
    groups = _rows(db, "SELECT id, n FROM prompt_groups WHERE rollout_id = ? ORDER BY group_index",
                   (rollout_id,))
    width = max(n for _, n in groups)
    lengths = np.full((len(groups), width), np.nan)
    row_of = {gid: i for i, (gid, _) in enumerate(groups)}
    requests = _rows(db, "SELECT group_id, response_index, status, generated_tokens, finished_at "
                         "FROM requests WHERE rollout_id = ?", (rollout_id,))
    for gid, index, status, generated, _ in requests:
        if status == "finished":
            lengths[row_of[gid], index] = generated
    finishes = sorted(f for _, _, status, _, f in requests if status == "finished")
    tokens = sum(r[3] for r in requests)
    events = _rows(db, "SELECT ts, kind FROM events WHERE rollout_id = ?", (rollout_id,))
    leased = sorted(ts for ts, kind in events if kind == "chunk_leased")
    done = _rows(db, "SELECT max(c.finished_at) FROM chunks c JOIN requests r ON r.id = c.request_id "
                     "WHERE r.rollout_id = ? AND c.status = 'done'", (rollout_id,))[0][0]
    # A resumed run: from the stopped coordinator's last event to the first lease after the resume.
    downtime = []
    for resumed in sorted(ts for ts, kind in events if kind == "rollout_resumed"):
        stopped = max((ts for ts, _ in events if ts < resumed), default=None)
        restarted = min((ts for ts in leased if ts >= resumed), default=resumed)
        if stopped is not None and restarted > stopped:
            downtime.append((stopped, restarted))

    def down_within(lo: float, hi: float) -> float:
        return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in downtime)

    k = math.ceil(0.9 * len(requests))
    tail_start = finishes[k - 1] if len(finishes) >= k else None
    first = leased[0] if leased else None
    generation = done - first - down_within(first, done) if first is not None and done is not None else None
    re_leased = _rows(db, "SELECT count(*) FROM events WHERE rollout_id = ? AND kind = 'chunk_leased' "
                          "AND json_extract(data_json, '$.epoch') > 1", (rollout_id,))[0][0]
    return {
        "lengths": lengths,
        "groups": len(groups),
        "responses": width,
        "requests": len(requests),
        "finished": len(finishes),
        "output_tokens": tokens,
        "first_lease": first,
        "end": done,
        "throughput": tokens / generation if generation else None,
        "tail_start": tail_start,
        "tail_s": done - tail_start - down_within(tail_start, done) if tail_start is not None else None,
        "re_leased": re_leased,
    }


def summary_figures(summary: str) -> dict:
    """The figures summary.md states, parsed from its table."""
    def find(pattern: str) -> re.Match | None:
        return re.search(pattern, summary, flags=re.MULTILINE)

    groups = find(r"^\| groups x responses \| (\d+) x (\d+) \|")
    requests = find(r"^\| requests \| (\d+) \((\d+) finished\) \|")
    throughput = find(r"^\| throughput \| ([0-9.]+) tok/s \|")
    tail = find(r"^\| tail time \| ([0-9.]+) s ")
    return {
        "groups": int(groups[1]), "responses": int(groups[2]),
        "requests": int(requests[1]), "finished": int(requests[2]),
        "output_tokens": int(find(r"^\| output tokens \| (\d+) \|")[1]),
        "throughput": float(throughput[1]) if throughput else None,
        "tail_s": float(tail[1]) if tail else None,
        "re_leased": int(find(r"^\| chunks re-leased after expiry/release \| (\d+) ")[1]),
    }


def assert_report_matches_run(run_dir: Path, out_dir: Path) -> dict:
    """`seerd report RUN_DIR --out OUT_DIR` wrote decodable PNGs and a summary.md whose figures are
    the run's; the length heatmap's data is the run's groups x responses. Returns the expected
    figures (see `expected_figures`)."""
    import matplotlib.image

    from seerd.report import PLOT_FILES, SUMMARY_FILE, load_run
    from seerd.report.metrics import completion_curve, response_length_matrix, time_origin

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    expected = expected_figures(run_dir)
    for name in PLOT_FILES:
        path = out_dir / name
        assert path.is_file() and path.stat().st_size > 0, f"{path} missing or empty"
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100, f"{path}: {image.shape}"
        assert image.std() > 0, f"{path} is blank"
    summary = (out_dir / SUMMARY_FILE).read_text()
    for name in PLOT_FILES:
        assert f"]({name})" in summary, f"summary.md does not link {name}"
    stated = summary_figures(summary)
    for key in ("groups", "responses", "requests", "finished", "output_tokens", "re_leased"):
        assert stated[key] == expected[key], (
            f"summary.md says {key} = {stated[key]}, the run has {expected[key]}")
    for key in ("throughput", "tail_s"):
        if expected[key] is None:
            assert stated[key] is None, f"summary.md states a {key} the run does not have yet"
        else:
            # summary.md rounds: throughput to 0.1 tok/s, the tail to 0.01 s.
            assert stated[key] is not None and abs(stated[key] - expected[key]) <= 0.051, (
                f"summary.md says {key} = {stated[key]}, the run has {expected[key]}")

    run = load_run(run_dir / "state.db")
    matrix = response_length_matrix(run)
    assert matrix.shape == (expected["groups"], expected["responses"])
    np.testing.assert_array_equal(matrix, expected["lengths"])
    curve = completion_curve(run)
    if expected["tail_start"] is None:
        assert curve.tail_start is None
    else:
        assert math.isclose(curve.tail_start + time_origin(run), expected["tail_start"], abs_tol=1e-6)
    return expected
