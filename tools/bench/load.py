#!/usr/bin/env python
"""Load test of the control plane: the real coordinator with many simulated workers.

`seerd run --engine-api sim` on a generated workload: the real coordinator (its SQLite database
with synchronous FULL, its HTTP API on loopback) and W workers that register, lease, heartbeat,
report and continue in place exactly as vLLM workers do, each on the simulator's model of an
engine (seerd/worker/sim_engine.py) run `--time-scale` times faster than real time, 128 workers
per process. Lengths are the preset's (`seerd.sim.workload.generate`), given to the workers as
target lengths (the scheduler never sees them).

It runs R requests to the end, then checks that every request finished exactly once (one output
row each, chunk tokens adding up to the target, chunk sequence numbers 0..k-1 without a gap or
a double) and reports: lease and report latency as the workers measured them (p50 / p99, a
lease's long-poll wait taken out), the coordinator's CPU share, RSS and open files over time,
the database's size, and commits per second (durable ones are fsyncs).

    .venv/bin/python tools/bench/load.py --workers 512 --requests 100000 [--preset cpu-tiny] [--time-scale 20]
                                   [--policy seer] [--chunk-tokens N] [--max-num-seqs N] [--compare-sim] [--json]
                                   [--hosts-nice N] [--api-processes N]

`--compare-sim` also runs `seerd sim` on the same workload and cluster and prints both runs'
makespan, tail and chunks in modelled engine seconds: the engines are the same model, so what
differs is the daemon's control plane (its latency counts, scaled by the time scale) and the
simulator's stand-in for it (`chunk_gap_s`).

`--json` prints one object: {"workers", "requests", "exactly_once", "lease_p99_ms",
"report_p99_ms" (a lease's long-poll wait for work out: until the work it got was queued), "serving_lease_p99_ms"
and "serving_report_p99_ms" (each worker's registration and first lease, the start-up fill, out),
"coordinator_cpu_share", "coordinator_rss_mb", "db_mb", ...}. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import print_json  # noqa: E402

from seerd.protocol import LEASE  # noqa: E402
from seerd.sim.presets import get_preset  # noqa: E402
from seerd.sim.workload import generate  # noqa: E402
from seerd.tail import tail_start  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def write_workload(path: Path, preset_name: str, requests: int, seed: int) -> tuple[int, dict[tuple[int, int], int]]:
    """The preset's groups as a prompt file with target lengths; (max_tokens, target per response)."""
    preset = get_preset(preset_name)
    workload = generate(preset, seed, requests=requests)
    targets = {}
    with open(path, "w") as handle:
        for group in workload.groups:
            prompt = [4 + (group.index * 31 + i * 7) % 900 for i in range(group.prompt_len)]
            handle.write(json.dumps({"id": f"g{group.index}", "prompt_token_ids": prompt, "n": len(group.lengths),
                                     "max_tokens": group.max_tokens, "target_lengths": list(group.lengths)}) + "\n")
            targets.update({(group.index, r): length for r, length in enumerate(group.lengths)})
    return preset.max_tokens, targets


class ProcessSampler(threading.Thread):
    """The coordinator process's CPU seconds, RSS, open files and the database's size, every `interval_s`."""

    def __init__(self, pid: int, db_path: Path, interval_s: float = 0.5, hosts_nice: int = 0) -> None:
        super().__init__(daemon=True)
        self.pid, self.db_path, self.interval_s = pid, db_path, interval_s
        self.hosts_nice = hosts_nice
        self.samples: list[dict] = []
        self.host_cpu_s: dict[int, float] = {}  # the simulated workers' processes: pid -> CPU seconds
        self.stopped = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stopped.wait(self.interval_s):
            coordinator = process_figures(self.pid)
            if coordinator is None:
                return
            # Its API fronts count as the coordinator (seerd/server/front.py): their CPU, RSS and fds added.
            fronts = [f for pid in processes_with(b"seerd.server.front") if (f := process_figures(pid))]
            cpu_s, rss_kb, fds = (sum(figures) for figures in zip(coordinator, *fronts))
            hosts = {pid: figures[0] for pid in processes_with(b"seerd.worker.sim_host")
                     if (figures := process_figures(pid)) is not None}
            if self.hosts_nice:
                for pid in hosts.keys() - self.host_cpu_s.keys():  # new ones (a restarted host too)
                    yield_cores(pid, self.hosts_nice)
            self.host_cpu_s.update(hosts)
            db_bytes = sum(p.stat().st_size for p in self.db_path.parent.glob(self.db_path.name + "*") if p.exists())
            self.samples.append({"t": time.monotonic() - started, "cpu_s": cpu_s, "rss_mb": rss_kb / 1024,
                                 "fds": fds, "db_mb": db_bytes / 2**20, "written_mb": written_bytes(self.pid) / 2**20})


def yield_cores(pid: int, nice: int) -> None:
    """Process `pid` at `nice`: each of its threads (Linux's nice is per thread) and its autogroup.
    The launcher starts each host in a session of its own (seerd/launch/local.py), and with the
    kernel's autogroups (`sched_autogroup_enabled`, on here) the cores are shared fairly between
    sessions first: a thread's nice only weighs it against its own session's. Niced by thread
    alone, four hosts still took a core share each against the coordinator's whole process."""
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def processes_with(marker: bytes) -> list[int]:
    """Processes whose command line holds `marker`: the hosts of simulated workers (they compete
    with the coordinator for the cores: the latencies they measure include their own event
    loops' delays), the coordinator's API fronts."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def process_figures(pid: int) -> tuple[float, int, int] | None:
    """A process's CPU seconds, RSS in kB and open files; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    rss_kb = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS, rss_kb, fds


def written_bytes(pid: int) -> int:
    """What a process has written towards the disk so far (its WAL and checkpoints: the disk's
    load, which its commits' count does not tell: each commit writes every page it touched)."""
    with contextlib.suppress(OSError, StopIteration):
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
        return int(next(line.split()[1] for line in lines if line.startswith("write_bytes:")))
    return 0


def exactly_once(run_dir: Path, targets: dict[tuple[int, int], int]) -> list[str]:
    """What is wrong with the run's outputs (empty: every request finished exactly once)."""
    problems = []
    rows = [json.loads(line) for line in (run_dir / "rollouts.jsonl").read_text().splitlines()]
    keys = [(r["group_index"], r["response_index"]) for r in rows]
    if len(keys) != len(set(keys)):
        problems.append(f"{len(keys) - len(set(keys))} responses appear more than once")
    if set(keys) != set(targets):
        problems.append(f"{len(set(targets) - set(keys))} responses missing, {len(set(keys) - set(targets))} unknown")
    wrong = [(k, len(r["token_ids"])) for k, r in zip(keys, rows) if len(r["token_ids"]) != targets.get(k)]
    if wrong:
        problems.append(f"{len(wrong)} responses not at their target length, e.g. {wrong[:3]}")
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        unfinished = db.execute("select count(*) from requests where status != 'finished'").fetchone()[0]
        # Per request: its done chunks are seq 0..k-1 once each, their tokens its generated count.
        bad = db.execute("""
            select count(*) from (
                select r.id, r.generated_tokens g, r.num_chunks k, count(c.id) n, count(distinct c.seq) s,
                       min(c.seq) lo, max(c.seq) hi, sum(c.num_tokens) t
                from requests r join chunks c on c.request_id = r.id and c.status = 'done' group by r.id)
            where n != k or s != k or lo != 0 or hi != k - 1 or t != g""").fetchone()[0]
    if unfinished:
        problems.append(f"{unfinished} requests not finished in the database")
    if bad:
        problems.append(f"{bad} requests whose done chunks do not add up (a gap, a double, or tokens)")
    return problems


def percentiles(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "calls": 0}
    ordered = sorted(seconds)
    return {"p50_ms": 1e3 * ordered[len(ordered) // 2], "p99_ms": 1e3 * ordered[min(len(ordered) - 1,
                                                                                   int(0.99 * len(ordered)))],
            "max_ms": 1e3 * ordered[-1], "calls": len(ordered)}


def call_times(run_dir: Path) -> dict[str, list[tuple[float, float, bool]]]:
    """Every answered call the simulated workers timed: endpoint -> [(sent at, seconds, its
    worker's first call of that endpoint)], long-poll waits out."""
    merged: dict[str, list[tuple[float, float, bool]]] = {}
    for path in (run_dir / "logs").glob("sim-calls-*.json"):
        for endpoint, calls in json.loads(path.read_text()).items():
            merged.setdefault(endpoint, []).extend(map(tuple, calls))
    return merged


def latency_figures(calls: dict[str, list[tuple[float, float, bool]]], window_s: float = 5.0,
                    settle_s: float = 80.0) -> dict:
    """Percentiles per endpoint over the whole run; while serving (every call but each worker's
    joining ones: its registration and its first lease, which W workers make at once and which
    hands out the whole first fill, W x max-num-seqs chunks); and after the first `settle_s`
    seconds (also past the first chunk boundaries, which engines started together reach
    together). Also the joining leases' own figures and the slowest call of every `window_s`
    window (to line tails up with events)."""
    every = [call for endpoint_calls in calls.values() for call in endpoint_calls]
    first_sent = min((sent for sent, _, _ in every), default=0.0)
    joined = [sent + took for sent, took, first in calls.get(LEASE.path, []) if first]
    worst: dict[int, tuple[float, str]] = {}
    for endpoint, endpoint_calls in calls.items():
        for sent, took, _ in endpoint_calls:
            window = int((sent - first_sent) // window_s)
            worst[window] = max(worst.get(window, (0.0, "")), (took, endpoint))
    return {
        "calls": {endpoint: percentiles([took for _, took, _ in c]) for endpoint, c in sorted(calls.items())},
        "calls_serving": {endpoint: percentiles([took for _, took, first in c if not first])
                          for endpoint, c in sorted(calls.items()) if endpoint != "/v1/register"},
        "calls_after_settling": {endpoint: percentiles([took for sent, took, _ in c if sent - first_sent > settle_s])
                                 for endpoint, c in sorted(calls.items()) if endpoint != "/v1/register"},
        "joining_leases": percentiles([took for _, took, first in calls.get(LEASE.path, []) if first]),
        # When each worker had its first work, from the first call: what a wait in the first fill
        # costs, whichever call (registration or first lease) it is spent in.
        "joined_p50_s": statistics.median(joined) - first_sent if joined else 0.0,
        "all_joined_s": max(joined, default=first_sent) - first_sent, "settle_s": settle_s,
        "slowest_by_window": [{"t": window * window_s, "ms": 1e3 * took, "endpoint": endpoint}
                              for window, (took, endpoint) in sorted(worst.items())],
    }


def run(args: argparse.Namespace, work: Path) -> dict:
    from tests.fixtures.make_tiny_model import make_tiny_model

    model = make_tiny_model(work / "model", seed=0)
    prompts = work / "prompts.jsonl"
    max_tokens, targets = write_workload(prompts, args.preset, args.requests, args.seed)
    preset = get_preset(args.preset)
    run_dir = work / "run"
    command = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model", str(model),
               "--run-dir", str(run_dir), "--workers", str(args.workers), "--engine-api", "sim",
               "--sim-preset", args.preset, "--time-scale", str(args.time_scale), "--policy", args.policy,
               "--chunk-tokens", str(args.chunk_tokens or preset.chunk_tokens), "--max-tokens", str(max_tokens),
               "--max-num-seqs", str(args.max_num_seqs or preset.max_num_seqs), "--seed", str(args.seed),
               "--no-progress"] + ([] if args.api_processes is None else ["--api-processes", str(args.api_processes)])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    log_path = work / "seerd.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        sampler = ProcessSampler(process.pid, run_dir / "state.db", hosts_nice=args.hosts_nice)
        sampler.start()
        code = process.wait()
        sampler.stopped.set()
    wall_s = time.monotonic() - started
    if code != 0:
        raise SystemExit(f"seerd run exited {code}; see {log_path}:\n{log_path.read_text()[-3000:]}")
    problems = exactly_once(run_dir, targets)
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        load = json.loads(db.execute("select data_json from events where kind = 'coordinator_load'").fetchone()[0])
        chunks = db.execute("select count(*) from chunks").fetchone()[0]
        tokens = db.execute("select sum(generated_tokens) from requests").fetchone()[0]
        first_lease = db.execute("select min(leased_at) from chunks").fetchone()[0]
        finishes = [t - first_lease for (t,) in db.execute("select finished_at from requests")]
    latency = latency_figures(call_times(run_dir), settle_s=args.settle_s)
    samples = sampler.samples
    generation_s = load["generation_s"]
    return {
        "workers": args.workers, "api_processes": args.api_processes, "requests": len(targets), "exactly_once": not problems, "problems": problems,
        "lease_p99_ms": latency["calls"].get("/v1/lease", percentiles([]))["p99_ms"],
        "report_p99_ms": latency["calls"].get("/v1/report", percentiles([]))["p99_ms"],
        "serving_lease_p99_ms": latency["calls_serving"].get(LEASE.path, percentiles([]))["p99_ms"],
        "serving_report_p99_ms": latency["calls_serving"].get("/v1/report", percentiles([]))["p99_ms"],
        "coordinator_cpu_share": load["cpu_share"],
        "coordinator_rss_mb": max((s["rss_mb"] for s in samples), default=None),
        "db_mb": (run_dir / "state.db").stat().st_size / 2**20,
        "coordinator_written_mb": max((s["written_mb"] for s in samples), default=None),
        **latency,
        # The coordinator's own answer times (seerd/server/latency.py): beside the workers'
        # figures, they tell its queueing from the simulated workers' processes' own delays.
        "server_calls": load.get("server_calls", {}),
        # The state thread's turns: the oldest call's wait for one, its run time, the largest.
        "state_turns": load.get("state_turns", {}), "largest_state_turn": load.get("largest_state_turn"),
        "slowest_state_turns": load.get("slowest_state_turns", {}),
        # ... and their seconds by kind: wall, the thread's CPU, its wait for a core.
        "state_turn_seconds": load.get("state_turn_seconds", {}),
        "chunks": chunks, "output_tokens": tokens, "generation_s": generation_s, "wall_s": wall_s,
        "coordinator_cpu_s": load["generation_cpu_s"], "cpu_ms_per_chunk": 1e3 * load["generation_cpu_s"] / chunks,
        "durable_commits_per_s": load.get("durable_commits", 0) / generation_s,
        "relaxed_commits_per_s": load.get("relaxed_commits", 0) / generation_s,
        # Reports commit relaxed and are made durable by these fsyncs of the WAL (db/wal_sync.py).
        "wal_syncs_per_s": load.get("wal_syncs", 0) / generation_s,
        "longest_commit_s": load["longest_commit_s"], "api_calls": load["api_calls"],
        "max_fds": max((s["fds"] for s in samples), default=None),
        "simulated_workers_cpu_s": sum(sampler.host_cpu_s.values()),
        "series": samples[:: max(1, len(samples) // 20)],
        # In modelled engine seconds (wall x time scale), to set beside `seerd sim`'s.
        "model_total_s": max(finishes) * args.time_scale,
        "model_tail_s": (max(finishes) - tail_start(finishes)) * args.time_scale,
        "settings": {"preset": args.preset, "time_scale": args.time_scale, "policy": args.policy,
                     "seed": args.seed, "hosts_nice": args.hosts_nice},
    }


def simulated(args: argparse.Namespace, requests: int) -> dict:
    """`seerd sim` on the same workload and cluster: W instances of the preset's engine model,
    the same policy, chunk and sequences, no KV pool (the simulated workers have none)."""
    preset = get_preset(args.preset)
    command = [sys.executable, "-m", "seerd.cli.main", "sim", "--preset", args.preset, "--requests", str(requests),
               "--instances", str(args.workers), "--max-num-seqs", str(args.max_num_seqs or preset.max_num_seqs),
               "--chunk-tokens", str(args.chunk_tokens or preset.chunk_tokens), "--policies", args.policy,
               "--pool-hit-rate", "0", "--seed", str(args.seed), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    figures = json.loads(done.stdout)["policies"][args.policy]
    return {"total_s": figures["total_time_s"], "tail_s": figures["tail_time_s"], "chunks": figures["chunks"],
            "chunk_gap_s": json.loads(done.stdout)["cluster"]["chunk_gap_s"]}


def print_latencies(calls: dict, title: str) -> None:
    print(f"{title}:\n| call | calls | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|")
    for endpoint, figures in calls.items():
        if figures["calls"]:
            print(f"| {endpoint} | {figures['calls']} | {figures['p50_ms']:.1f} | {figures['p99_ms']:.1f} "
                  f"| {figures['max_ms']:.1f} |")


def print_table(result: dict) -> None:
    print(f"{result['workers']} workers, {result['requests']} requests ({result['output_tokens']} tokens, "
          f"{result['chunks']} chunks), preset {result['settings']['preset']}, time scale "
          f"{result['settings']['time_scale']}, policy {result['settings']['policy']}")
    print(f"exactly once: {result['exactly_once']}" + "".join(f"\n  {p}" for p in result["problems"]))
    print(f"generation {result['generation_s']:.1f} s (wall {result['wall_s']:.1f} s with start-up)")
    print_latencies(result["calls"], "every call")
    joining = result["joining_leases"]
    if joining["calls"]:
        print(f"joining: {joining['calls']} first leases (the first fill), p50 {joining['p50_ms']:.0f} ms, "
              f"p99 {joining['p99_ms']:.0f} ms, max {joining['max_ms']:.0f} ms; workers had their first work "
              f"{result['joined_p50_s']:.2f} s after the first call (median), every worker "
              f"{result['all_joined_s']:.2f} s")
    print_latencies(result["calls_serving"], "serving (every call but each worker's registration and first lease)")
    print_latencies(result["calls_after_settling"], f"after the first {result['settle_s']:.0f} s (the first fill "
                                                    "and the first chunk boundaries past)")
    print_latencies(result["server_calls"], "inside the coordinator (signature check to answer, long-poll waits out)")
    print_latencies(result["state_turns"], f"the state thread's turns (largest: {result['largest_state_turn']} calls) "
                                           "and how late the event loop woke a 20 ms sleep")
    turns = result["slowest_state_turns"]
    if turns:
        def described(turn: dict) -> str:
            return f"{turn['at_s']:.0f}s {turn['ran_ms']:.0f}ms " + ", ".join(
                f"{name} {count}x {ms:.0f}ms" for name, (count, ms) in turn["held"].items())
        print("the slowest turns: " + "; ".join(described(turn) for turn in turns["slowest"][:10]))
        print("the slowest turn per 10 s: " + "; ".join(described(turn) for turn in turns["by_window"]))
    for kind, seconds in result["state_turn_seconds"].items():
        blocked = seconds["wall"] - seconds["cpu"] - seconds["run_queue"]
        print(f"the state thread's {kind} turns: {seconds['wall']:.1f} s, of which its CPU {seconds['cpu']:.1f} s, "
              f"waiting for a core {seconds['run_queue']:.1f} s, blocked (the GIL, the disk) {blocked:.1f} s; "
              f"put on a core {seconds.get('slices', 0):.0f} times")
    print(f"coordinator: {100 * result['coordinator_cpu_share']:.0f}% of a core over generation, "
          f"{result['cpu_ms_per_chunk']:.2f} ms CPU per chunk, peak RSS {result['coordinator_rss_mb']:.0f} MB, "
          f"peak open files {result['max_fds']}; the simulated workers' processes "
          f"{result['simulated_workers_cpu_s']:.1f} s CPU in all")
    print(f"database {result['db_mb']:.1f} MB; commits/s durable {result['durable_commits_per_s']:.0f}, "
          f"relaxed {result['relaxed_commits_per_s']:.0f}, WAL fsyncs {result['wal_syncs_per_s']:.0f}; longest commit {result['longest_commit_s']:.2f} s; "
          f"the coordinator wrote {result['coordinator_written_mb']:.0f} MB towards the disk")
    if "sim" in result:
        sim = result["sim"]
        print(f"against `seerd sim` (same workload, {result['workers']} instances, control-plane gap "
              f"{1e3 * sim['chunk_gap_s']:.0f} ms per chunk), in modelled engine seconds:")
        print("| | makespan s | tail s | chunks |\n|---|---|---|---|")
        print(f"| daemon + simulated engines | {result['model_total_s']:.1f} | {result['model_tail_s']:.1f} "
              f"| {result['chunks']} |")
        print(f"| seerd sim | {sim['total_s']:.1f} | {sim['tail_s']:.1f} | {sim['chunks']} |")
    print("slowest call per 5 s: " + ", ".join(f"{w['t']:.0f}s {w['ms']:.0f}ms {w['endpoint'].rpartition('/')[2]}"
                                                for w in result["slowest_by_window"]))
    print("| t s | CPU s | RSS MB | open files | db MB | written MB |\n|---|---|---|---|---|---|")
    for sample in result["series"]:
        print(f"| {sample['t']:.0f} | {sample['cpu_s']:.1f} | {sample['rss_mb']:.0f} | {sample['fds']} "
              f"| {sample['db_mb']:.1f} | {sample['written_mb']:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--preset", default="cpu-tiny")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--policy", default="seer")
    parser.add_argument("--chunk-tokens", type=int, help="default: the preset's")
    parser.add_argument("--max-num-seqs", type=int, help="default: the preset's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path,
                        help="keep the run here, in a directory without one yet (default: a temporary directory)")
    parser.add_argument("--compare-sim", action="store_true",
                        help="also run `seerd sim` on the same workload and cluster, and set them side by side")
    parser.add_argument("--hosts-nice", type=int, default=0,
                        help="run the simulated workers' processes (every thread, and their sessions' "
                             "autogroups) at this nice value: the load generator yields the cores to the "
                             "coordinator, as workers on other nodes would")
    parser.add_argument("--settle-s", type=float, default=80.0,
                        help="also report latencies of the calls sent after this many seconds: at time scale "
                             "0.005 the first fill and the first chunk boundaries of the 512 engines (started "
                             "together) are over by ~70 s")
    parser.add_argument("--api-processes", type=int,
                        help="the coordinator's API front processes (default: seerd's choice for the worker count)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="seerd-load-"))
    if (work / "run").exists():  # `seerd run` would resume it (or find it finished) and this report its old calls
        parser.error(f"{work} already holds a run: give a new --work-dir")
    work.mkdir(parents=True, exist_ok=True)
    result = run(args, work)
    if args.compare_sim:
        result["sim"] = simulated(args, result["requests"])
    if args.json:
        print_json(result)
    else:
        print_table(result)
        print(f"(run kept in {work})")
    return 0 if result["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
