#!/usr/bin/env python
"""Chaos runs: rollouts on the tiny model with faults injected at random moments, then checked.

Each run is a local `seerd run` (2 workers, greedy sampling, small chunks, a short lease TTL and
the Mooncake KV pool) of the same prompts, with one fault, chosen in turn from `--faults` and
injected after a random number of finished chunks (drawn from `--seed`, counted in the run's
database read-only, so the moment is reproducible in progress, not in wall time):

  coordinator-kill   kill -9 of the `seerd run` process (coordinator and worker supervisor),
                     then `seerd resume RUN_DIR` as a user would
  worker-kill        kill -9 of a worker process (its supervisor starts it again)
  engine-stop        SIGSTOP of a worker's engine for 2.5 lease TTLs, then SIGCONT (the stepped
                     engine runs in the worker's process: heartbeats stop with it)
  pool-holder-kill   kill -9 of the KV pool's holder (the process that gives the pool memory)
  pool-master-kill   kill -9 of the pool's `mooncake_master`
  poison             one group's stored temperature made one vLLM refuses (as an engine whose
                     rules differ from the checked ones would), then `seerd resume`

Every run is checked against an unfaulted reference run of the same prompts: every response
exactly once and token-identical (greedy; a response may part from the reference only where both
picked their token at a near-tie, logprobs within 1e-4 nats: the random test model's logits are
nearly flat and a faulted run decodes in other batches, whose float rounding can break a tie the
other way; such partings are counted, not failed), except the poison group's, which must be
exported as failed with vLLM's message; the exit code the README documents (0, or 3 with failed requests);
the database consistent (each request's chunks 0..k-1, all done, tokens adding up); and no
process of the run left behind. Prints a table (fault, when, time to recover, retries, verdict);
exits 1 if any check failed.

    .venv/bin/python tools/bench/chaos.py --runs N --seed S [--json] [--faults F1,F2] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import engine_env, print_json, read_rows, seerd_command  # noqa: E402


FAULTS = ("coordinator-kill", "worker-kill", "engine-stop", "pool-holder-kill", "pool-master-kill", "poison")
GROUPS, N, MAX_TOKENS, CHUNK_TOKENS, LEASE_TTL_S = 6, 2, 96, 16, 4
EXIT_OK, EXIT_FAILED_REQUESTS = 0, 3
POISON_GROUP = 2
RUN_TIMEOUT_S = 600


@dataclass
class Outcome:
    run: int
    fault: str
    injected_after_chunks: int | None = None  # None: the run ended before the fault was due
    injected_at_s: float | None = None  # since the run's first lease
    recovered_s: float | None = None  # from the fault to the next finished chunk
    retries: dict = field(default_factory=dict)
    exit_codes: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    ties: list[str] = field(default_factory=list)  # responses that part from the reference at a near-tie

    @property
    def ok(self) -> bool:
        return not self.problems


def done_chunks(run_dir: Path) -> int:
    rows = read_rows(run_dir, "select count(*) from chunks where status = 'done'")
    return rows[0][0] if rows else 0


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live (not zombie) process."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if stat[0] not in ("Z", "X"):
            found[int(entry)] = (int(stat[1]), cmdline)
    return found


def descendants(root: int) -> set[int]:
    procs, found, frontier = processes(), set(), {root}
    while frontier:
        children = {pid for pid, (ppid, _) in procs.items() if ppid in frontier} - found
        found |= children
        frontier = children
    return found


def run_processes(run_dir: Path, extra: set[int]) -> list[str]:
    """What of this run is still alive: processes naming its directory, and `extra` pids."""
    alive = processes()
    return [f"{pid} {cmd[:120]}" for pid, (_, cmd) in alive.items()
            if (str(run_dir) in cmd or pid in extra) and pid != os.getpid()]


def write_prompts(path: Path, seed: int) -> None:
    rng = random.Random(seed)
    rows = [{"id": f"g{g}", "prompt_token_ids": [rng.randrange(4, 1000) for _ in range(rng.randrange(6, 30))]}
            for g in range(GROUPS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_args(prompts: Path, model: Path, run_dir: Path) -> list[str]:
    return ["--input", str(prompts), "--model", str(model), "--run-dir", str(run_dir), "--workers", "2",
            "--n", str(N), "--max-tokens", str(MAX_TOKENS), "--chunk-tokens", str(CHUNK_TOKENS),
            "--temperature", "0", "--lease-ttl", str(LEASE_TTL_S), "--kv-cache-gib", "0.25",
            "--max-num-seqs", "16", "--dtype", "float32", "--wait-for-workers", "--no-progress"]


def exported(run_dir: Path) -> list[dict]:
    path = run_dir / "rollouts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(seerd_command(*args), stdout=log.open("ab"), stderr=subprocess.STDOUT, env=engine_env(), cwd=REPO)


def wait_done(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -1


def worker_pid(run_dir: Path) -> int | None:
    """A live worker that has finished chunks (its pid from the address it registered)."""
    rows = read_rows(run_dir, "select w.address from workers w where w.status = 'alive' and exists "
                            "(select 1 from chunks c where c.lease_holder = w.id and c.status = 'done') order by w.rank")
    alive = processes()
    for (address,) in rows:
        pid = int(address.rsplit(":", 1)[1])
        if pid in alive:
            return pid
    return None


def pool_process(root: int, marker: str) -> int | None:
    alive = processes()
    return next((pid for pid in descendants(root) if marker in alive.get(pid, (0, ""))[1]), None)


def inject(fault: str, proc: subprocess.Popen, run_dir: Path) -> tuple[int | None, set[int]]:
    """Strike; returns the pid struck (None: nothing to strike) and pids to check for leftovers."""
    if fault == "coordinator-kill":
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        return proc.pid, tree
    if fault in ("worker-kill", "engine-stop"):
        pid = worker_pid(run_dir)
        if pid is None:
            return None, set()
        if fault == "worker-kill":
            os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(2.5 * LEASE_TTL_S)
            os.kill(pid, signal.SIGCONT)
        return pid, {pid}
    marker = {"pool-holder-kill": "seerd.kvpool.holder", "pool-master-kill": "mooncake_master"}[fault]
    pid = pool_process(proc.pid, marker)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)
    return pid, set() if pid is None else {pid}


def make_poison(prompts: Path, model: Path, run_dir: Path) -> None:
    """Create the run, then make one group's stored temperature one that vLLM refuses."""
    from seerd.config import ROLLOUT_DEFAULTS, build_config
    from seerd.launch.prepare import prepare_run
    from seerd.rundir import RunDir

    options = {**ROLLOUT_DEFAULTS, "n": N, "max_tokens": MAX_TOKENS, "chunk_tokens": CHUNK_TOKENS,
               "temperature": 0.0, "lease_ttl": LEASE_TTL_S, "kv_cache_gib": 0.25, "max_num_seqs": 16,
               "wait_for_workers": True}
    config = build_config(workers=2, input_path=prompts, model_path=model, **options)
    prepare_run(RunDir(run_dir), config, prompts).ownership.release()
    with sqlite3.connect(run_dir / "state.db") as db:
        (sampling,) = db.execute("select sampling_json from prompt_groups where group_index = ?",
                                 (POISON_GROUP,)).fetchone()
        db.execute("update prompt_groups set sampling_json = ? where group_index = ?",
                   (json.dumps({**json.loads(sampling), "temperature": 2.5}), POISON_GROUP))


TIE_NATS = 1e-4  # greedy picks that close are decided by float rounding, which batch shapes change


def tie_break(row: dict, reference: dict) -> int | None:
    """Where a greedy response first parts from the reference's, if both picked their token there
    with logprobs within TIE_NATS (a near-tie: the random test model's logits are nearly flat,
    and a faulted run decodes in other batches, whose float rounding may break a tie otherwise);
    None for any other difference."""
    tokens, expected = row["token_ids"], reference["token_ids"]
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if first is None:  # one is a prefix of the other: a length differs, not a pick
        return None
    return first if abs(row["logprobs"][first] - reference["logprobs"][first]) <= TIE_NATS else None


def check(outcome: Outcome, run_dir: Path, reference: dict, leftovers: set[int]) -> None:
    poison = outcome.fault == "poison"
    expected_exit = EXIT_FAILED_REQUESTS if poison else EXIT_OK
    if outcome.exit_codes[-1] != expected_exit:
        outcome.problems.append(f"exit {outcome.exit_codes[-1]}, expected {expected_exit}")
    rows = exported(run_dir)
    keys = [(r["group_index"], r["response_index"]) for r in rows]
    if len(keys) != len(set(keys)):
        outcome.problems.append("a response is exported twice")
    if set(keys) != set(reference):
        outcome.problems.append(f"{len(set(reference) - set(keys))} responses missing from the export")
    for row in rows:
        key = (row["group_index"], row["response_index"])
        if poison and row["group_index"] == POISON_GROUP:
            if row["finish_reason"] != "error" or "temperature" not in (row["error"] or ""):
                outcome.problems.append(f"poison response {key} not failed with vLLM's message")
        elif key in reference and row["token_ids"] != reference[key]["token_ids"]:
            parted = tie_break(row, reference[key])
            if parted is None:
                outcome.problems.append(f"response {key} differs from the unfaulted run")
            else:
                outcome.ties.append(f"{key} at token {parted}")
    bad = read_rows(run_dir, """
        select r.id from requests r join chunks c on c.request_id = r.id where r.status = 'finished'
        group by r.id having count(c.id) != r.num_chunks or max(c.seq) != r.num_chunks - 1
            or sum(c.num_tokens) != r.generated_tokens or sum(c.status != 'done') > 0""")
    if bad:
        outcome.problems.append(f"{len(bad)} requests whose chunks do not add up")
    deadline = time.monotonic() + 30  # a supervisor's children may take a moment to be reaped
    while (left := run_processes(run_dir, leftovers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        outcome.problems.append(f"processes left: {left[:3]}")


def retries(run_dir: Path) -> dict:
    kinds = dict(read_rows(run_dir, "select kind, count(*) from events where kind in ('lease_expired', "
                                  "'lease_revoked', 'lease_orphaned', 'lease_released', 'chunk_failed', "
                                  "'request_failed', 'worker_stale', 'worker_retired', 'kv_pool_restarted') "
                                  "group by kind"))
    registered = read_rows(run_dir, "select count(*) from workers")
    kinds["workers_registered"] = registered[0][0] if registered else 0
    return kinds


def one_run(index: int, fault: str, rng: random.Random, base: Path, prompts: Path, model: Path,
            reference: dict, total_chunks: int) -> Outcome:
    outcome = Outcome(index, fault)
    run_dir = base / f"run-{index}-{fault}"
    log = base / f"run-{index}-{fault}.log"
    args = run_args(prompts, model, run_dir)
    if fault == "poison":
        make_poison(prompts, model, run_dir)
        outcome.exit_codes.append(wait_done(start(["resume", str(run_dir), "--no-progress"], log)))
        outcome.retries = retries(run_dir)
        check(outcome, run_dir, reference, set())
        return outcome
    due = rng.randint(2, max(3, total_chunks // 2))
    proc = start(["run", *args], log)
    leftovers: set[int] = set()
    while proc.poll() is None and done_chunks(run_dir) < due:
        time.sleep(0.05)
    if proc.poll() is None:
        first = read_rows(run_dir, "select min(leased_at) from chunks")[0][0]
        struck_at = time.time()
        struck, leftovers = inject(fault, proc, run_dir)
        if struck is not None:
            outcome.injected_after_chunks = done_chunks(run_dir)
            outcome.injected_at_s = struck_at - first
    if fault == "coordinator-kill" and outcome.injected_after_chunks is not None:
        outcome.exit_codes.append(proc.wait())
        proc = start(["resume", str(run_dir), "--no-progress"], log)
    outcome.exit_codes.append(wait_done(proc))
    if outcome.injected_after_chunks is not None:
        after = read_rows(run_dir, "select min(finished_at) from chunks where status = 'done' and finished_at > ?",
                        (struck_at,))
        if after and after[0][0] is not None:
            outcome.recovered_s = after[0][0] - struck_at
    outcome.retries = retries(run_dir)
    check(outcome, run_dir, reference, leftovers)
    return outcome


def print_table(outcomes: list[Outcome]) -> None:
    header = f"{'run':>3}  {'fault':<17}{'after chunks':>13}{'at s':>7}{'recovered s':>12}  {'retries':<62}verdict"
    print(header)
    print("-" * len(header))
    for o in outcomes:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(o.retries.items()) if v) or "-"
        when = "-" if o.injected_after_chunks is None else str(o.injected_after_chunks)
        at = "-" if o.injected_at_s is None else f"{o.injected_at_s:.1f}"
        rec = "-" if o.recovered_s is None else f"{o.recovered_s:.1f}"
        verdict = "ok" if o.ok else "FAILED: " + "; ".join(o.problems)
        if o.ok and o.injected_after_chunks is None and o.fault != "poison":
            verdict = "ok (the run ended before the fault was due)"
        if o.ties:
            verdict += f" ({len(o.ties)} response(s) parted at a near-tie)"
        print(f"{o.run:>3}  {o.fault:<17}{when:>13}{at:>7}{rec:>12}  {shown[:61]:<62}{verdict}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=len(FAULTS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, taken in turn: {FAULTS}")
    parser.add_argument("--model", type=Path, help="model directory (default: the tiny model, made here)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and logs")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown or not faults:
        parser.error(f"unknown faults {unknown}; choose from {FAULTS}")
    base = Path(tempfile.mkdtemp(prefix="seerd-chaos-"))
    try:
        model = args.model
        if model is None:
            from tests.fixtures.make_tiny_model import make_tiny_model

            model = make_tiny_model(base / "model", seed=0)
        prompts = base / "prompts.jsonl"
        write_prompts(prompts, args.seed)
        reference_dir = base / "reference"
        code = wait_done(start(["run", *run_args(prompts, model, reference_dir)], base / "reference.log"))
        if code != EXIT_OK:
            print(f"the unfaulted reference run failed (exit {code}); see {base}/reference.log", file=sys.stderr)
            return 1
        reference = {(r["group_index"], r["response_index"]): r for r in exported(reference_dir)}
        total_chunks = done_chunks(reference_dir)
        outcomes = []
        for index in range(args.runs):
            fault = faults[index % len(faults)]
            outcomes.append(one_run(index, fault, random.Random(args.seed * 1000 + index), base, prompts, model,
                                    reference, total_chunks))
        for outcome in outcomes:  # what a failed run printed, for a CI log that keeps no files
            if not outcome.ok:
                log = base / f"run-{outcome.run}-{outcome.fault}.log"
                tail = log.read_text(errors="replace").splitlines()[-40:] if log.exists() else []
                print(f"--- run {outcome.run} ({outcome.fault}) failed; the end of its log:", *tail, sep="\n",
                      file=sys.stderr)
        if args.json:
            print_json({"seed": args.seed, "reference_chunks": total_chunks,
                        "runs": [{**asdict(o), "ok": o.ok} for o in outcomes]}, indent=1)
        else:
            print(f"chaos: {args.runs} runs, seed {args.seed}, {GROUPS} groups x {N}, greedy, chunk {CHUNK_TOKENS}, "
                  f"lease TTL {LEASE_TTL_S}s; reference run: {total_chunks} chunks; logs in {base}")
            print_table(outcomes)
        return 0 if all(o.ok for o in outcomes) else 1
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
