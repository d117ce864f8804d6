"""Benchmark of the coordinator's control plane: lease/report round trips over real HTTP.

What is measured: the real `Coordinator` (FastAPI on uvicorn, lease book, SQLite in WAL mode with
the configured `synchronous`) runs in its own process on 127.0.0.1. No vLLM engine runs; this
process plays C simulated workers that each loop

    POST /v1/lease {wanted: B}  ->  POST /v1/report with all granted chunks (16 tokens each)

as fast as the coordinator answers. One *round trip* is one chunk leased and then acknowledged by
a report; requests have a huge `max_tokens`, so no request finishes during the measurement and
every chunk is a fresh 16-token continuation (policy `divided`, 500 groups x n=8 by default).

Each configuration (batch B x SQLite synchronous FULL/NORMAL) gets a fresh run directory and a
fresh coordinator, a warm-up, then a fixed measurement window; configurations are interleaved and
repeated R times. After each sample the coordinator is stopped and the database is checked: done
chunks must equal acknowledged round trips, and no chunk may stay leased (nothing lost, nothing
counted twice), so the figure only counts durable, acknowledged work.

How to read the table: `rt/s` is the median over repeats of acknowledged round trips per second in
the window (all samples in brackets); `lease`/`report` are p50/p99 latencies in ms of single HTTP
calls, pooled over repeats (one report call carries B chunks); `cpu srv/cli` is the CPU use, in %
of one core, of the coordinator process (~100%: the single-threaded coordinator is the bottleneck)
and of this load generator (both share the machine's cores: mind the load average in the header);
`srv ms/rt` is the coordinator's CPU time per round trip, the figure least disturbed by other load
(1000 / it is what one dedicated core could sustain if nothing else waited);
`x2000` is the ratio to the 2,000 round trips/s target, `xbase` the ratio to the first config
(B=1, FULL).

    python tools/bench_control_plane.py [--duration 8] [--repeats 3] [--concurrency 4] [--quick]
                                        [--json] [--profile DIR]   # cProfile of each coordinator
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from seerd.config import RunConfig
from seerd.coordinator.create import create_rollout
from seerd.coordinator.daemon import Coordinator
from seerd.event_loop import run_event_loop
from seerd.db import ChunkStatus, make_engine, make_sessionmaker
from seerd.db.migrate import upgrade
from seerd.io.prompts import PromptRow
from seerd.machine import machine_facts
from seerd.ownership import take_ownership
from seerd.rundir import RunDir, RunDirError

TARGET_RT_S = 2000.0
CHUNK_TOKENS = 16
PROMPT_TOKENS = 64
HUGE_MAX_TOKENS = 1_000_000


def build_run(path: Path, mode: str, groups: int, n: int, chunk_tokens: int = CHUNK_TOKENS,
              prompt_tokens: int = PROMPT_TOKENS) -> None:
    RunDir(path).create()
    # No engine runs; the coordinator reads only the vocabulary it checks reported tokens against.
    model = path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000, "max_position_embeddings": 4096}))
    engine = make_engine(RunDir(path).db_path, synchronous=mode)
    upgrade(engine)
    config = RunConfig(input_path="bench.jsonl", model_path=str(model), policy="divided",
                       chunk_tokens=chunk_tokens, sqlite_synchronous=mode, lease_ttl_s=60)
    rows = [PromptRow(f"p{g}", tuple((g * 7 + i) % 1000 for i in range(prompt_tokens)), n,
                      HUGE_MAX_TOKENS, {}, g + 1) for g in range(groups)]
    with make_sessionmaker(engine).begin() as session:
        create_rollout(session, config, rows, input_sha256="0" * 64, now=time.time())
    engine.dispose()


def serve(path: Path, profile: str | None) -> None:
    """Child process: the real coordinator until SIGTERM (optionally under cProfile)."""
    with take_ownership(path) as ownership:
        coordinator = Coordinator(RunDir(path), ownership)
        if profile is None:
            run_event_loop(coordinator.serve())
            return
        import cProfile
        cProfile.runctx("run_event_loop(coordinator.serve())", globals(), {"coordinator": coordinator,
                        "run_event_loop": run_event_loop}, profile)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@dataclass
class Stats:
    acked_total: int = 0  # every acknowledged chunk, warm-up and tail included
    acked_window: int = 0  # acknowledged inside the measurement window
    lease_ms: list[float] = field(default_factory=list)
    report_ms: list[float] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


async def simulated_worker(base: str, secret: str, index: int, batch: int, stats: Stats,
                           window: tuple[float, float]) -> None:
    from seerd.signing import Signer, call_key, httpx_auth

    start, end = window
    auth = httpx_auth(Signer(call_key(secret, base.partition("://")[2])))  # signed, as the workers' calls
    async with httpx.AsyncClient(base_url=base, auth=auth, timeout=30.0) as http:
        worker_id = f"bench-{index}"
        response = await http.post("/v1/register", json={
            "worker_id": worker_id, "rank": index, "address": "127.0.0.1:0", "max_chunks": batch,
            "kv_capacity_tokens": 10**12})
        response.raise_for_status()
        while time.monotonic() < end:
            t0 = time.monotonic()
            response = await http.post("/v1/lease", json={"worker_id": worker_id, "wanted": batch})
            t1 = time.monotonic()
            response.raise_for_status()
            grants = response.json()["chunks"]
            if not grants:
                await asyncio.sleep(response.json().get("retry_after_s", 0.05))
                continue
            reports = [{"chunk_id": g["chunk_id"], "epoch": g["epoch"], "token_ids": [7] * g["max_tokens"],
                        "logprobs": [-1.0] * g["max_tokens"], "finish_reason": "length"} for g in grants]
            t2 = time.monotonic()
            response = await http.post("/v1/report", json={"worker_id": worker_id, "reports": reports})
            t3 = time.monotonic()
            response.raise_for_status()
            results = response.json()["results"]
            accepted = sum(1 for r in results if r["accepted"] and not r["duplicate"])
            stats.rejected += [str(r) for r in results if not r["accepted"] or r["duplicate"]]
            stats.acked_total += accepted
            if start <= t3 < end:  # by acknowledgement time: unbiased at the window's edges
                stats.acked_window += accepted
            if start <= t0 < end:
                stats.lease_ms.append((t1 - t0) * 1e3)
                stats.report_ms.append((t3 - t2) * 1e3)


def verify(db_path: Path, stats: Stats, chunk_tokens: int) -> str | None:
    """Compare the database with what the workers saw acknowledged; None when they agree."""
    with closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db:
        done, tokens = db.execute("SELECT count(*), coalesce(sum(num_tokens), 0) FROM chunks "
                                  "WHERE status = ?", (ChunkStatus.DONE.value,)).fetchone()
        leased = db.execute("SELECT count(*) FROM chunks WHERE status = ?",
                            (ChunkStatus.LEASED.value,)).fetchone()[0]
        generated = db.execute("SELECT coalesce(sum(generated_tokens), 0) FROM requests").fetchone()[0]
    problems = []
    if done != stats.acked_total:
        problems.append(f"{done} done chunks in the database but {stats.acked_total} acknowledged")
    if leased:
        problems.append(f"{leased} chunks still leased")
    if not tokens == generated == chunk_tokens * done:
        problems.append(f"token totals disagree: chunks {tokens}, requests {generated}, "
                        f"expected {chunk_tokens * done}")
    if stats.rejected:
        problems.append(f"{len(stats.rejected)} rejected reports, e.g. {stats.rejected[0]}")
    return "; ".join(problems) or None


async def measure_cpu(pid: int, window: tuple[float, float]) -> tuple[float, float]:
    """CPU use in % of one core of the coordinator and of this process during the window."""
    await asyncio.sleep(max(0.0, window[0] - time.monotonic()))
    server0, client0 = cpu_seconds(pid), time.process_time()
    await asyncio.sleep(max(0.0, window[1] - time.monotonic()))
    span = window[1] - window[0]
    return (100 * (cpu_seconds(pid) - server0) / span, 100 * (time.process_time() - client0) / span)


def run_sample(batch: int, mode: str, args: argparse.Namespace, tag: str) -> dict:
    path = Path(tempfile.mkdtemp(prefix="seerd-bench-"))
    run_dir = RunDir(path)
    build_run(path, mode, args.groups, args.n, args.chunk_tokens, args.prompt_tokens)
    command = [sys.executable, os.path.abspath(__file__), "--serve", str(path)]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        command += ["--profile", str(Path(args.profile) / f"{tag}.prof")]
    log = open(path / "coordinator.log", "w")
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                host, port = run_dir.read_address()
                break
            except RunDirError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"coordinator did not start: {(path / 'coordinator.log').read_text()}")
                time.sleep(0.05)
        assert host == "127.0.0.1", host
        stats = Stats()

        async def drive() -> tuple[float, float]:
            start = time.monotonic() + args.warmup
            window = (start, start + args.duration)
            tasks = [simulated_worker(f"http://{host}:{port}", run_dir.read_secret(), i, batch, stats, window)
                     for i in range(args.concurrency)]
            cpu = asyncio.create_task(measure_cpu(server.pid, window))
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.warmup + args.duration + 60)
            return await cpu

        server_cpu, client_cpu = asyncio.run(drive())
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    problem = verify(run_dir.db_path, stats, args.chunk_tokens)
    if problem is None and not args.keep:
        shutil.rmtree(path, ignore_errors=True)
    return {"batch": batch, "synchronous": mode, "rt_per_s": stats.acked_window / args.duration,
            "acked_total": stats.acked_total, "lease_ms": stats.lease_ms, "report_ms": stats.report_ms,
            "server_cpu_pct": server_cpu, "client_cpu_pct": client_cpu, "loadavg_1m": os.getloadavg()[0],
            "verified": problem is None, "problem": problem,
            "run_dir": str(path) if problem or args.keep else None}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(samples: list[dict], configs: list[tuple[int, str]]) -> list[dict]:
    rows = []
    for batch, mode in configs:
        mine = [s for s in samples if s["batch"] == batch and s["synchronous"] == mode]
        lease = [x for s in mine for x in s["lease_ms"]]
        report = [x for s in mine for x in s["report_ms"]]
        rows.append({
            "config": f"B={batch} {mode}", "batch": batch, "synchronous": mode,
            "rt_per_s_median": statistics.median(s["rt_per_s"] for s in mine),
            "rt_per_s_samples": [round(s["rt_per_s"], 1) for s in mine],
            "lease_p50_ms": pct(lease, 0.5), "lease_p99_ms": pct(lease, 0.99),
            "report_p50_ms": pct(report, 0.5), "report_p99_ms": pct(report, 0.99),
            "server_cpu_pct": statistics.median(s["server_cpu_pct"] for s in mine),
            # CPU cost per round trip: robust to other load on the machine, unlike rt/s.
            "server_cpu_ms_per_rt": statistics.median(10 * s["server_cpu_pct"] / max(s["rt_per_s"], 1e-9)
                                                      for s in mine),
            "client_cpu_pct": statistics.median(s["client_cpu_pct"] for s in mine),
            "loadavg_1m_max": max(s["loadavg_1m"] for s in mine),
            "verified": all(s["verified"] for s in mine),
            "problems": [s["problem"] for s in mine if s["problem"]],
        })
    base = rows[0]["rt_per_s_median"] or float("nan")
    for row in rows:
        row["vs_target"] = row["rt_per_s_median"] / TARGET_RT_S
        row["vs_base"] = row["rt_per_s_median"] / base
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"coordinator control plane: C={args.concurrency} workers, {args.groups}x{args.n} requests, "
          f"{args.chunk_tokens}-token chunks after {args.prompt_tokens}-token prompts, {args.duration:g}s window after {args.warmup:g}s warm-up, "
          f"{args.repeats} repeat(s); {os.cpu_count()} cores, 1-min load average up to "
          f"{max(r['loadavg_1m_max'] for r in rows):.1f}")
    table = [("config", "rt/s", "samples", "lease p50/p99 ms", "report p50/p99 ms", "cpu srv/cli",
              "srv ms/rt", "x2000", "xbase", "verified")]
    for r in rows:
        table.append((
            r["config"], f"{r['rt_per_s_median']:.0f}",
            "[" + ",".join(f"{x:.0f}" for x in r["rt_per_s_samples"]) + "]",
            f"{r['lease_p50_ms']:.2f}/{r['lease_p99_ms']:.2f}",
            f"{r['report_p50_ms']:.2f}/{r['report_p99_ms']:.2f}",
            f"{r['server_cpu_pct']:.0f}%/{r['client_cpu_pct']:.0f}%", f"{r['server_cpu_ms_per_rt']:.2f}",
            f"{r['vs_target']:.3f}", f"{r['vs_base']:.2f}",
            "ok" if r["verified"] else "FAILED: " + "; ".join(r["problems"])))
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
    for k, line in enumerate(table):
        print("  ".join(cell.ljust(w) if i in (0, 2) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(line, widths))) + "  " + line[-1])
        if k == 0:
            print("-" * (sum(widths) + 2 * len(widths) + len("verified")))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", metavar="RUN_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=8.0, help="measurement window per sample (s)")
    parser.add_argument("--warmup", type=float, default=1.0, help="warm-up before the window (s)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4, help="simulated workers")
    parser.add_argument("--batches", default="1,8", help="chunks per lease/report call, comma-separated")
    parser.add_argument("--modes", default="FULL,NORMAL", help="SQLite synchronous modes, comma-separated")
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--chunk-tokens", type=int, default=CHUNK_TOKENS,
                        help="tokens per chunk (each grant carries the prompt and every earlier chunk)")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 2 s windows")
    parser.add_argument("--json", action="store_true", help="print the summary and samples as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--profile", metavar="DIR", help="cProfile each coordinator into DIR (slows it)")
    args = parser.parse_args()
    if args.serve:
        serve(Path(args.serve), args.profile)
        return 0
    if args.quick:
        args.duration, args.warmup, args.repeats = 2.0, 0.5, 1
    configs = [(int(b), m.upper()) for m in args.modes.split(",") for b in args.batches.split(",")]
    samples = []
    for repeat in range(args.repeats):
        for batch, mode in configs:  # interleaved, so that drift hits every config alike
            samples.append(run_sample(batch, mode, args, f"B{batch}-{mode}-r{repeat}"))
            print(f"  repeat {repeat + 1}/{args.repeats} B={batch} {mode}: "
                  f"{samples[-1]['rt_per_s']:.0f} rt/s", file=sys.stderr, flush=True)
    rows = summarize(samples, configs)
    if args.json:
        compact = [{k: v for k, v in s.items() if not k.endswith("_ms")} for s in samples]
        print(json.dumps({"machine": machine_facts(),
                          "target_rt_per_s": TARGET_RT_S, "concurrency": args.concurrency,
                          "duration_s": args.duration, "summary": rows, "samples": compact}, indent=2))
    else:
        print_table(rows, args)
    return 0 if all(r["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
