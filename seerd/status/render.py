"""Draw a status snapshot (seerd/status/snapshot.py) with rich: one frame of `seerd status`.

Pure: a snapshot in, a renderable out; no clock, no database. So a frame can be pinned as text
in a test, and `--once`, the live view and the JSON all show the same figures.
"""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

BAR_WIDTH = 30
STATE_STYLES = {"running": "bold green", "finished": "bold blue", "interrupted": "bold yellow",
                "failed": "bold red", "created": "bold"}


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def percent(part: float | None, whole: float | None) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


def bar(done: float, total: float, width: int = BAR_WIDTH) -> str:
    """A text bar: the same in every terminal, and in a pinned test."""
    filled = 0 if total <= 0 else min(width, round(width * done / total))
    return "#" * filled + "-" * (width - filled)


def header(s: dict) -> Group:
    grid = Table.grid(padding=(0, 2))
    grid.add_column()
    grid.add_column()
    state = Text(s["state"].upper(), style=STATE_STYLES.get(s["state"], "bold"))
    coordinator = s["coordinator"]
    lost = s["state"] == "running" and not coordinator["reachable"]
    if coordinator["reachable"]:
        where = f"coordinator up, {coordinator.get('leases', '-')} leases"
        if coordinator.get("accepting") is False:
            where += ", draining"
        if s.get("read_through_coordinator"):  # its database is another host's (seerd.db.sharing)
            where += ", read through its API"
    else:
        where = "coordinator unreachable" if lost else "coordinator stopped"
    title = Text.assemble(("seerd ", "bold"), f"rollout {s['rollout_id']}  policy {s['policy']}  ", state)
    grid.add_row(title, Text(where, style="bold yellow" if lost else "dim"))
    left = "done" if s["state"] == "finished" else f"~{duration(s['eta_s'])}" if s["eta_s"] is not None else "-"
    grid.add_row(f"elapsed {duration(s['elapsed_s'])}   left {left}",
                 f"tokens/s now {rate(s['tokens_per_s_now'])}   avg {rate(s['tokens_per_s_avg'])}")
    lines: list[RenderableType] = [grid]
    if lost:
        lines.append(Text("the coordinator is killed or hung: `seerd resume` continues the run",
                          style="yellow"))
    if s.get("state_reason"):  # its first line: a worker's log lines follow in "worker exits"
        first, *more = s["state_reason"].splitlines()
        lines.append(Text(f"reason: {first}" + (" (...)" if more else ""), style="yellow"))
    return Group(*lines)


def progress(s: dict) -> Table:
    table = Table.grid(padding=(0, 1))
    for _ in range(3):
        table.add_column()
    table.add_row("groups  ", bar(s["groups_done"], s["groups_total"]), f"{s['groups_done']:,}/{s['groups_total']:,}")
    table.add_row("requests", bar(s["requests_done"], s["requests_total"]),
                  f"{s['requests_done']:,}/{s['requests_total']:,}  ({s['requests_running']:,} running"
                  + (f", {s['requests_failed']:,} failed)" if s.get("requests_failed") else ")"))
    expected = s["output_tokens_expected"]
    table.add_row("tokens  ", bar(s["output_tokens"], expected),
                  f"{s['output_tokens']:,}/~{expected:,}" if s["requests_done"] < s["requests_total"]
                  else f"{s['output_tokens']:,}")
    return table


def tail_banner(s: dict) -> Text | None:
    phase = s["tail_phase"]
    if phase is None:
        return None
    if phase["requests_left"]:
        return Text(f" TAIL PHASE {duration(phase['duration_s'])}: {phase['requests_left']:,} requests left "
                    "after 90% finished ", style="bold black on yellow")
    return Text(f" tail phase took {duration(phase['duration_s'])} (last 10% of requests) ", style="bold")


def tail_table(s: dict) -> Table:
    shown = len(s["tail"])
    title = f"running requests, longest first ({shown} of {s['tail_total']:,})" if s["tail_total"] > shown \
        else f"running requests, longest first ({s['tail_total']:,})"
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    for name, justify in [("group", "right"), ("resp", "right"), ("tokens", "right"), ("group est", "right"),
                          ("done", "right"), ("chunks", "right"), ("worker", "left"), ("idle", "right")]:
        table.add_column(name, justify=justify, no_wrap=True)
    for t in s["tail"]:
        idle = duration(t["since_progress_s"])
        table.add_row(f"{t['group_index']}", f"{t['response_index']}" + (" P" if t["probe"] else ""),
                      f"{t['tokens']:,}", f"{t['group_estimate']:,}", f"{t['group_finished']}/{t['group_size']}",
                      f"{t['chunks']}", t["worker"] or "-", idle)
    return table


def size(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def pool_line(s: dict) -> Text | None:
    pool = s["coordinator"].get("kv_pool") if s["coordinator"]["reachable"] else None
    if not pool:
        return None
    used, capacity = pool.get("bytes_used"), pool.get("capacity_bytes")
    parts = [f"KV pool {size(used)} of {size(capacity)}", f"{pool.get('keys', '-')} blocks"]
    if pool.get("trimmed_requests"):  # over budget: the requests queued longest lost their blocks
        parts.append(f"trimmed {pool['trimmed_requests']} queued ({size(pool.get('trimmed_bytes'))})")
    if pool.get("evicted_keys"):  # Mooncake's own eviction, in its order, not ours
        parts.append(f"evicted {pool['evicted_keys']} blocks")
    if pool.get("restarts"):
        parts.append(f"restarted {pool['restarts']}x")
    return Text("   ".join(parts), style="dim")


def workers_table(s: dict) -> Table:
    spec = any(w["spec"] for w in s["workers"])
    pool = any(w.get("kv_pool") for w in s["workers"])
    table = Table(title="workers", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    columns = [("worker", "left"), ("state", "left"), ("chunks", "right"), ("KV res", "right"),
               ("KV eng", "right"), ("tok/s", "right"), ("heartbeat", "right")]
    if spec:
        columns.append(("accept", "right"))
    if pool:
        columns += [("pool hit", "right"), ("blocks in/out", "right"), ("moved", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify, no_wrap=True)
    for w in s["workers"]:
        style = "red" if w["stale"] and s["state"] == "running" else None
        state = "taken out" if w.get("taken_out") else w["state"]
        row = [w["worker_id"], state, f"{w['running_chunks']}/{w['max_chunks']}",
               percent(w["kv_reserved_tokens"], w["kv_capacity_tokens"]),
               "-" if w["kv_usage"] is None else f"{100 * w['kv_usage']:.0f}%",
               rate(w["tokens_per_s"]), f"{duration(w['heartbeat_age_s'])} ago"]
        if spec:
            row.append("-" if not w["spec"] or w["spec"]["acceptance"] is None
                       else f"{100 * w['spec']['acceptance']:.0f}%")
        if pool:
            p = w.get("kv_pool")
            row += ["-", "-", "-"] if not p else [
                "-" if p["hit_rate"] is None else f"{100 * p['hit_rate']:.0f}%",
                f"{p['blocks_loaded']:,}/{p['blocks_saved']:,}" + _bad_blocks(p),
                size(p["bytes_loaded"] + p["bytes_saved"])]
        table.add_row(*row, style=style)
    return table


def exits_part(s: dict) -> Group | None:
    """The latest worker exits: when (since the run was created), what killed it, the fix, and the
    last lines of its log (the JSON has more)."""
    exits = s.get("worker_exits") or []
    if not exits:
        return None
    lines: list[RenderableType] = [Text("worker exits", style="bold")]
    for e in exits:
        then = "not restarted" if e.get("restart") is None else f"restarted {e['restart']}"
        lines.append(Text(f"  {duration(e['ts'] - s['created_at'])}  worker {e['rank']} {e['summary']}  ({then})",
                          style="red" if e.get("signal") else "yellow"))
        lines.extend(Text(f"      {line}", style="dim") for line in _telling_lines(e.get("log_tail") or []))
    return Group(*lines)


def _telling_lines(tail: list[str], count: int = 3) -> list[str]:
    """Of a log's last lines, the few that tell most: from a native crash's report (faulthandler's
    "Fatal Python error" and the innermost frames after it) when there is one, else the last."""
    fatal = next((i for i, line in enumerate(tail) if line.startswith("Fatal Python error")), None)
    return tail[-count:] if fatal is None else [tail[fatal], *tail[fatal + 2:fatal + 1 + count]]


def _bad_blocks(pool: dict) -> str:
    """Loaded blocks that failed a check, and of those the ones whose MAC failed (forged, or
    corrupted in the pool): recomputed, never used."""
    if not pool["load_failures"]:
        return ""
    rejected = pool.get("blocks_rejected", 0)
    return f" ({pool['load_failures']} bad" + (f", {rejected} failed MAC)" if rejected else ")")


def render(s: dict) -> RenderableType:
    parts: list[RenderableType] = [header(s), progress(s)]
    banner = tail_banner(s)
    if banner is not None:
        parts.append(banner)
    if s["tail_total"]:
        parts.append(tail_table(s))
    if s["workers"]:
        parts.append(workers_table(s))
    for part in (pool_line(s), exits_part(s)):
        if part is not None:
            parts.append(part)
    return Group(*parts)
