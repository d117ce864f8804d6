#!/usr/bin/env python
"""End to end on real engines: seerd against the same two vLLM engines driven directly.

    python tools/bench/e2e.py [--workload flat|tail] [--repeats 3] [--json] [--plot DIR] [--configs A,B]

Configurations, interleaved repeat by repeat (direct, seerd-group, ..., direct, ...) on one
prompt file and one set of engine settings (seerd's own `engine_args`: KV, sequences, dtype):
  direct           veRL-style: the batch split into two contiguous shards of groups, each handed
                   whole to an offline vLLM engine in its own process (tools/bench/e2e_engine.py drives
                   it as `vllm.LLM.generate` does); both start together once both are loaded.
  seerd-group      `seerd run --workers 2 --policy group` (whole groups bound to workers).
  seerd-divided    `--policy divided --chunk-tokens K` (chunks continue in place, the default).
  seerd-seer       `--policy seer --chunk-tokens K` (seerd's default policy).
  seerd-seer-spec  the same with `--spec grouped` (adaptive grouped speculative decoding).
Workloads:
  flat  the tiny random-weight model (tests/fixtures/make_tiny_model.py); each group's length is its
        max_tokens (EOS ignored), drawn in [0.75, 1.25] x --mean-tokens: little tail.
  tail  the trained motif model (examples/motif_model/weights), natural EOS lengths (heavy tail),
        48 groups x 8, max_tokens 2048, temperature 1, chunk 256 (several chunks per long one).
Clock: for seerd, from the first lease to the last finished response (engine start-up excluded;
`--wait-for-workers`, so both engines are up when the first chunk is leased); for direct, from
the moment both engines start to the last finished response. Throughput = output tokens / that
makespan; tail = makespan minus the time when 90% of the responses had finished.
Same responses everywhere: direct samples response k of group g with the seed seerd gives that
response's first chunk (`chunk_seed`), which a response continued in place keeps to its end, and
vLLM's per-request generators do not depend on the batch; so the configurations generate the
same tokens (a response seerd stopped and ran again elsewhere samples on with another seed).

Columns besides throughput, makespan and tail (medians over the repeats; `per rep` = the median
of each repeat's ratio to direct, the two having run the same responses minutes apart): preempt = sequences
the engines' own schedulers evicted for lack of KV (recomputed later); resub = seerd's later
chunks that did not continue in place (stopped at a boundary and prefilled again, unless the
prefix cache still held them); running = sequences per engine step, summed over both engines;
ms/step = an engine's mean step (wall); step cpu = the stepping thread's CPU over that wall time
(below 100%: the step waited for a core or for the GIL); step runq = its wait for a core while
runnable (the kernel's schedstat), over that wall time: the cores other processes took; chunks; coord = the coordinator's CPU
share of the generation phase; loop cpu = the workers' event loop threads' CPU seconds (grants,
reports, heartbeats), summed; step max / commit max = the longest engine step and the longest
database write (stalls).
Beside them:
  bound  the workload's physical bound on these engines, measured in the same invocation: the
         larger of the longest response decoded alone at an engine's median step time with one
         sequence, and all output tokens at the two engines' peak tokens/s (both decoding
         max_num_seqs sequences at once). Prefill and every other cost are left out, so no
         configuration can beat it; `x bound` is each makespan as a multiple of it.
  sim    `seerd sim`'s prediction for the same lengths (the config's first repeat as a trace) on
         an engine profile measured here by tools/profile_engine.py (same model and dtype), two
         instances with the KV and sequences the workers registered, no chunk gap (chunks continue
         in place), no KV pool.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import engine_env, median, print_json  # noqa: E402

ENGINE_SCRIPT = REPO / "tools" / "bench" / "e2e_engine.py"
MOTIF_MODEL = REPO / "examples" / "motif_model" / "weights"
SIM_POLICY = {"seerd-group": "group", "seerd-divided": "divided", "seerd-seer": "seer", "seerd-seer-spec": "seer+sd"}
ALL_CONFIGS = ("direct", "seerd-group", "seerd-divided", "seerd-seer", "seerd-seer-spec")


@dataclass(frozen=True)
class Workload:
    name: str
    groups: int
    n: int
    max_tokens: int
    chunk_tokens: int
    temperature: float = 1.0


WORKLOADS = {
    "flat": Workload("flat", groups=64, n=4, max_tokens=512, chunk_tokens=128),
    "tail": Workload("tail", groups=48, n=8, max_tokens=2048, chunk_tokens=256),
}


# ----------------------------------------------------------------------------- the prompt file
def write_prompts(path: Path, workload: Workload, seed: int, mean_tokens: int) -> list[dict]:
    if workload.name == "tail":
        from examples.motif_model.corpus import make_prompts

        rows = [{"id": r["id"], "prompt_token_ids": r["prompt_token_ids"]} for r in make_prompts(workload.groups, seed)]
    else:
        rng = random.Random(seed)
        rows = [{"id": f"g{g}", "prompt_token_ids": [rng.randrange(4, 1000) for _ in range(rng.randrange(16, 64))],
                 "max_tokens": int(min(workload.max_tokens, mean_tokens * rng.uniform(0.75, 1.25))),
                 "ignore_eos": True} for g in range(workload.groups)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# ----------------------------------------------------------------------------- engine processes
def start_engines(mode: str, model: str, settings: Path, per_rank: list[list[str]], work: Path,
                  tag: str) -> tuple[list[subprocess.Popen], list[Path]]:
    """Two engine processes of tools/bench/e2e_engine.py; returns them once both are loaded."""
    procs, outs = [], []
    for rank, extra in enumerate(per_rank):
        out = work / f"{tag}-{rank}.json"
        for stale in (out, Path(f"{out}.ready"), Path(f"{out}.solo")):
            stale.unlink(missing_ok=True)
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), mode, model, str(settings), *extra[:1],
                                       str(out), *extra[1:]], env=engine_env(), stdout=subprocess.DEVNULL,
                                      stderr=open(work / f"{tag}-{rank}.log", "w")))
    deadline = time.time() + 600
    while not all(Path(f"{o}.ready").exists() for o in outs):
        if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.kill()
            raise RuntimeError(f"an engine failed to start; see {work}/{tag}-*.log")
        time.sleep(0.05)
    return procs, outs


def finish(procs: list[subprocess.Popen], work: Path, tag: str) -> None:
    for p in procs:
        if p.wait(timeout=3600) != 0:
            raise RuntimeError(f"an engine process failed; see {work}/{tag}-*.log")


def run_direct(model: str, settings: Path, rows: list[dict], workload: Workload, work: Path, seed: int) -> dict:
    from seerd.book.records import chunk_seed

    half = (len(rows) + 1) // 2
    shards = []
    for rank, shard_rows in enumerate((rows[:half], rows[half:])):  # veRL: contiguous data-parallel shards
        shard = work / f"shard{rank}.jsonl"
        lines = []
        for g, row in enumerate(shard_rows, start=0 if rank == 0 else half):
            for k in range(workload.n):
                # The seed seerd gives response k of group g for its first chunk, which a response
                # continued in place keeps to its end: both sides sample the same responses.
                sampling = {"max_tokens": row.get("max_tokens", workload.max_tokens),
                            "temperature": workload.temperature, "ignore_eos": row.get("ignore_eos", False),
                            "seed": chunk_seed(seed, g, k, 0)}
                lines.append(json.dumps({"prompt_token_ids": row["prompt_token_ids"], "sampling": sampling}))
        shard.write_text("\n".join(lines) + "\n")
        shards.append(shard)
    go = work / "go"
    go.unlink(missing_ok=True)
    procs, outs = start_engines("generate", model, settings, [[str(s), str(go)] for s in shards], work, "direct")
    go.touch()
    finish(procs, work, "direct")
    results = [json.loads(o.read_text()) for o in outs]
    start = min(r["start"] for r in results)
    finished = sorted(t - start for r in results for t in r["finished"])
    lengths = [(g, length, len(row["prompt_token_ids"]))
               for g, row in enumerate(rows) for length in ([*results[0]["lengths"], *results[1]["lengths"]]
                                                             [g * workload.n:(g + 1) * workload.n])]
    return {"tokens": sum(r["tokens"] for r in results), "finished": finished, "lengths": lengths,
            "preemptions": sum(r["preemptions"] or 0 for r in results),
            "longest_step_s": max(r["longest_step_s"] or 0.0 for r in results),
            "mean_running": [r["mean_running"] for r in results],
            "ms_per_step": [r.get("ms_per_step") for r in results],
            "step_cpu_share": [r.get("step_cpu_share") for r in results],
            "step_runq_share": [r.get("step_runq_share") for r in results]}


def measure_bound(model: str, settings: Path, work: Path) -> dict:
    go, batch_go = work / "profile-go", work / "profile-batch-go"
    for f in (go, batch_go):
        f.unlink(missing_ok=True)
    procs, outs = start_engines("profile", model, settings, [["0", str(go), str(batch_go)],
                                                             ["1", str(go), str(batch_go)]], work, "profile")
    go.touch()
    solo_file = Path(f"{outs[0]}.solo")
    while not solo_file.exists():
        if procs[0].poll() not in (None, 0):
            raise RuntimeError(f"the profile failed; see {work}/profile-0.log")
        time.sleep(0.05)
    batch_go.touch()
    finish(procs, work, "profile")
    solo = json.loads(solo_file.read_text())
    batches = [json.loads(o.read_text()) for o in outs]
    return {"solo_step_s": solo["median_step_s"], "peak_tokens_per_s": sum(b["tokens_per_s"] for b in batches)}


# ----------------------------------------------------------------------------- seerd
def run_seerd(config: str, model: str, prompts: Path, workload: Workload, engine: dict, work: Path, seed: int) -> dict:
    policy = "seer" if config.startswith("seerd-seer") else config.removeprefix("seerd-")
    run_dir = work / f"run-{config}-{time.time_ns()}"
    cmd = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model", model,
           "--run-dir", str(run_dir), "--workers", "2", "--wait-for-workers", "--policy", policy,
           "--chunk-tokens", str(workload.chunk_tokens if policy != "group" else 10**6), "--n", str(workload.n),
           "--max-tokens", str(workload.max_tokens), "--temperature", str(workload.temperature), "--seed", str(seed),
           "--kv-cache-gib", str(engine["kv_cache_gib"]), "--max-num-seqs", str(engine["max_num_seqs"]),
           "--dtype", engine["dtype"], "--kv-pool", "off", "--no-progress",
           "--spec", "grouped" if config.endswith("-spec") else "off"]
    done = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"seerd run failed ({run_dir}): {done.stderr[-2000:]}")
    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as db:
        first = db.execute("select min(leased_at) from chunks").fetchone()[0]
        finished = sorted(t - first for (t,) in db.execute("select finished_at from requests"))
        tokens = db.execute("select sum(generated_tokens) from requests").fetchone()[0]
        load = json.loads(db.execute("select data_json from events where kind='coordinator_load'").fetchone()[0])
        chunks = db.execute("select count(*) from chunks").fetchone()[0]
        # Later chunks that did not continue in place: their context was prefilled again (unless
        # the engine's prefix cache still held it), as a preemption's is.
        resubmitted = db.execute("select count(*) from chunks where seq > 0").fetchone()[0] - db.execute(
            "select count(*) from events where kind = 'chunk_leased' and json_extract(data_json, '$.in_place')"
        ).fetchone()[0]
        kv_tokens = db.execute("select max(kv_capacity_tokens) from workers").fetchone()[0]
        stats = [json.loads(s) for (s,) in db.execute("select stats_json from workers where stats_json is not null")]
        lengths = db.execute("select g.group_index, r.generated_tokens, g.prompt_len from requests r "
                             "join prompt_groups g on g.id = r.group_id").fetchall()
    engines = [s["engine"] for s in stats if s.get("engine")]
    spec = [s["spec"] for s in stats if s.get("spec")]
    return {"tokens": tokens, "finished": finished, "chunks": chunks, "coordinator_cpu_share": load["cpu_share"],
            "resubmitted": resubmitted,
            "kv_tokens": kv_tokens, "lengths": lengths,
            "preemptions": sum(e["preemptions"] for e in engines) if engines else None,
            "longest_step_s": max(e.get("longest_step_s", 0.0) for e in engines) if engines else None,
            "longest_commit_s": load.get("longest_commit_s"),
            "mean_running": [e["mean_running"] for e in engines],
            "ms_per_step": [1e3 * e["step_s"] / e["steps"] for e in engines if e.get("steps")],
            "step_cpu_share": [e["step_cpu_s"] / e["step_s"] for e in engines if e.get("step_s")],
            "step_runq_share": [e.get("step_runq_s", 0.0) / e["step_s"] for e in engines if e.get("step_s")],
            "worker_loop_cpu_s": sum(s.get("cpu", {}).get("loop_s", 0.0) for s in stats),
            "accepted_per_drafted": (sum(s["accepted"] for s in spec) / max(1, sum(s["drafted"] for s in spec))
                                     if spec else None)}


# ----------------------------------------------------------------------------- the simulator
def sim_prediction(policy: str, lengths: list, workload: Workload, engine: dict, kv_tokens: int, profile: Path,
                   work: Path) -> dict | None:
    trace = work / f"trace-{policy}.jsonl"
    trace.write_text("".join(json.dumps({"group": g, "length": max(1, n), "prompt_len": p,
                                         "max_tokens": workload.max_tokens}) + "\n" for g, n, p in lengths))
    cmd = [sys.executable, "-m", "seerd.cli.main", "sim", "--preset", "cpu-tiny", "--profile", str(profile),
           "--trace", str(trace), "--instances", "2", "--kv-tokens", str(kv_tokens),
           "--max-num-seqs", str(engine["max_num_seqs"]), "--chunk-tokens",
           str(workload.chunk_tokens if policy != "group" else 10**6), "--chunk-gap-ms", "0",
           "--pool-hit-rate", "0", "--policies", policy, "--json"]
    done = subprocess.run(cmd, env=engine_env(), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:  # e.g. a policy this simulator does not model
        print(f"# sim {policy}: {done.stderr.strip()[-300:] or done.stdout.strip()[-300:]}", file=sys.stderr)
        return None
    figures = json.loads(done.stdout)["policies"][policy]
    return {"tok_s": figures["throughput_tok_s"], "tail_s": figures["tail_time_s"],
            "seconds": figures["total_time_s"], "preemptions": figures["preemptions"],
            "mean_batch": figures["mean_batch"]}


# ----------------------------------------------------------------------------- report
def tail_of(finished: list[float]) -> float:
    """Makespan minus the time when 90% of the responses had finished."""
    return finished[-1] - finished[math.ceil(0.9 * len(finished)) - 1]


def print_table(document: dict) -> None:
    configs, bound = document["configs"], document["bound"]
    base = configs["direct"]
    base_tok_s, base_tail = median(base["tok_s"]), median(base["tail_s"])
    print(f"workload {document['workload']}: {document['requests']} requests, {document['output_tokens_median']:,.0f} "
          f"output tokens (median), longest {document['longest_median']:.0f}; chunk {document['chunk_tokens']}; "
          f"{document['repeats']} repeats interleaved; 2 engines, {document['engine']}")
    print(f"bound {bound['seconds']:.2f} s (longest alone {bound['longest_alone_s']:.2f} s at "
          f"{1e3 * bound['solo_step_s']:.2f} ms/step; all tokens {bound['all_tokens_s']:.2f} s at peak "
          f"{bound['peak_tokens_per_s']:,.0f} tok/s)")
    head = (f"{'config':<16} {'tok/s':>7} {'x direct':>8} {'per rep':>7} {'makespan':>8} {'x bound':>7} {'tail s':>6} "
            f"{'tail x dir':>10} {'preempt':>7} {'resub':>5} {'running':>7} {'ms/step':>7} {'step cpu':>8} {'step runq':>9} "
            f"{'chunks':>6} {'coord':>6} {'loop cpu':>8} {'step max':>8} "
            f"{'commit max':>10} "
            f"{'sim tok/s':>9} {'sim tail':>8}  samples tok/s")
    print(head)
    for name, c in configs.items():
        tok_s, seconds, tail = median(c["tok_s"]), median(c["seconds"]), median(c["tail_s"])
        sim = c.get("sim") or {}
        cell = lambda key, fmt: "-" if c.get(key) is None else format(c[key], fmt)  # noqa: E731
        per_repeat = median([a / b for a, b in zip(c["tok_s"], base["tok_s"])])  # same responses, same moment
        print(f"{name:<16} {tok_s:>7.0f} {tok_s / base_tok_s:>8.2f} {per_repeat:>7.2f} {seconds:>8.2f} "
              f"{seconds / bound['seconds']:>7.2f} "
              f"{tail:>6.2f} {tail / base_tail if base_tail else float('nan'):>10.2f} {cell('preemptions', '.0f'):>7} "
              f"{cell('resubmitted', '.0f'):>5} "
              f"{cell('mean_running', '.1f'):>7} {cell('ms_per_step', '.1f'):>7} {cell('step_cpu_share', '.0%'):>8} {cell('step_runq_share', '.0%'):>9} "
              f"{cell('chunks', '.0f'):>6} {cell('coordinator_cpu_share', '.1%'):>6} {cell('worker_loop_cpu_s', '.2f'):>8} "
              f"{cell('longest_step_s', '.2f'):>8} {cell('longest_commit_s', '.2f'):>10} "
              f"{format(sim['tok_s'], '.0f') if sim else '-':>9} {format(sim['tail_s'], '.2f') if sim else '-':>8}  "
              f"{[round(x) for x in c['tok_s']]}")


def plot(document: dict, runs: dict[str, list[dict]], out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(document["configs"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        samples = document["configs"][name]["tok_s"]
        left.scatter([i] * len(samples), samples, color=f"C{i}", alpha=0.6)
        left.hlines(median(samples), i - 0.3, i + 0.3, color=f"C{i}")
        for j, run in enumerate(runs[name]):
            done = run["finished"]
            right.plot(done, [(k + 1) / len(done) for k in range(len(done))], color=f"C{i}", alpha=0.8,
                       linewidth=1.2, label=name if j == 0 else None)
    left.set_xticks(range(len(names)), names, rotation=20)
    left.set_ylabel("output tokens/s (each repeat; line: median)")
    left.set_title(f"throughput, workload {document['workload']}")
    right.axvline(document["bound"]["seconds"], color="grey", linestyle=":", label="physical bound")
    right.set_xlabel("seconds since the start")
    right.set_ylabel("responses finished (fraction)")
    right.set_title("completion CDF (every repeat)")
    right.legend(fontsize=8)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"e2e_{document['workload']}.png"
    fig.savefig(path, dpi=110)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="tail")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS), help="comma-separated; direct always runs")
    parser.add_argument("--groups", type=int, help="prompt groups (default: the workload's)")
    parser.add_argument("--mean-tokens", type=int, default=256, help="flat: the mean response length")
    parser.add_argument("--chunk-tokens", type=int, help="chunk size (default: the workload's)")
    parser.add_argument("--kv-cache-gib", type=float, default=0.5)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="prompts; repeat r samples with seed + r")
    parser.add_argument("--no-sim", action="store_true", help="skip the simulator's predictions")
    parser.add_argument("--plot", type=Path, default=REPO / "runs" / "bench_e2e", help="where the PNG goes")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args()
    workload = WORKLOADS[args.workload]
    workload = Workload(workload.name, args.groups or workload.groups, workload.n, workload.max_tokens,
                        args.chunk_tokens or workload.chunk_tokens, workload.temperature)
    configs = ["direct", *[c for c in args.configs.split(",") if c and c != "direct"]]
    unknown = set(configs) - set(ALL_CONFIGS)
    if unknown:
        parser.error(f"unknown configurations {sorted(unknown)}; known: {', '.join(ALL_CONFIGS)}")
    work = Path(tempfile.mkdtemp(prefix="seerd-e2e-"))
    if workload.name == "tail":
        model = str(MOTIF_MODEL)
    else:
        sys.path.insert(0, str(REPO))
        from tests.fixtures.make_tiny_model import make_tiny_model

        model = str(make_tiny_model(work / "model"))
    engine = {"kv_cache_gib": args.kv_cache_gib, "max_num_seqs": args.max_num_seqs, "dtype": "float32"}
    prompts = work / "prompts.jsonl"
    rows = write_prompts(prompts, workload, args.seed, args.mean_tokens)
    bound_engine = work / "engine-bound.json"
    bound_engine.write_text(json.dumps({"engine": engine, "seed": args.seed}))
    print(f"# work dir {work}; measuring the engines' bound", file=sys.stderr, flush=True)
    bound = measure_bound(model, bound_engine, work)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for repeat in range(args.repeats):  # interleaved: drift on a noisy machine hits every config alike
        seed = args.seed + repeat
        settings = work / f"engine-{repeat}.json"
        settings.write_text(json.dumps({"engine": engine, "seed": seed}))
        for name in configs:
            if name == "direct":
                result = run_direct(model, settings, rows, workload, work, seed)
            else:
                result = run_seerd(name, model, prompts, workload, engine, work, seed)
            result["seconds"] = result["finished"][-1]
            result["tail_s"] = tail_of(result["finished"])
            result["tok_s"] = result["tokens"] / result["seconds"]
            runs[name].append(result)
            (work / "runs.json").write_text(json.dumps(runs))  # what a later failure must not lose
            print(f"# repeat {repeat + 1} {name}: {result['tokens']} tokens in {result['seconds']:.2f} s = "
                  f"{result['tok_s']:.0f} tok/s, tail {result['tail_s']:.2f} s", file=sys.stderr, flush=True)
    tokens = [r["tokens"] for rs in runs.values() for r in rs]
    longest = [max(length for _, length, _ in r["lengths"]) for rs in runs.values() for r in rs]
    longest_alone = median(longest) * bound["solo_step_s"] if longest else 0.0
    all_tokens = median(tokens) / bound["peak_tokens_per_s"]
    document = {
        "workload": workload.name, "requests": workload.groups * workload.n, "chunk_tokens": workload.chunk_tokens,
        "repeats": args.repeats, "engine": f"{engine['kv_cache_gib']} GiB KV, {engine['max_num_seqs']} seqs, "
                                          f"{engine['dtype']}",
        "output_tokens_median": median(tokens), "longest_median": median(longest) if longest else float("nan"),
        "bound": {**bound, "longest_alone_s": longest_alone, "all_tokens_s": all_tokens,
                  "seconds": max(longest_alone, all_tokens)},
        "configs": {},
    }
    profile = None
    if not args.no_sim and any(name in SIM_POLICY for name in configs):
        profile = work / "profile.json"
        print("# profiling the engine for the simulator (tools/profile_engine.py)", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, str(REPO / "tools" / "profile_engine.py"), "--model", model, "--dtype",
                               engine["dtype"], "--out", str(profile), "--batches",
                               f"1,8,32,{engine['max_num_seqs']}"], env=engine_env(), capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            print(f"# no simulator predictions: the profile failed: {done.stderr[-1000:]}", file=sys.stderr)
            profile = None
    for name, rs in runs.items():
        entry = {"tok_s": [r["tok_s"] for r in rs], "seconds": [r["seconds"] for r in rs],
                 "tail_s": [r["tail_s"] for r in rs], "tokens": [r["tokens"] for r in rs]}
        for key in ("preemptions", "resubmitted", "chunks", "coordinator_cpu_share", "accepted_per_drafted",
                    "longest_step_s", "longest_commit_s", "worker_loop_cpu_s"):
            values = [r[key] for r in rs if r.get(key) is not None]
            entry[key] = median(values) if values else None
        running = [sum(r["mean_running"]) for r in rs if r.get("mean_running")]
        entry["mean_running"] = median(running) if running else None
        for key in ("ms_per_step", "step_cpu_share", "step_runq_share"):  # the mean of the engines, median over repeats
            values = [sum(r[key]) / len(r[key]) for r in rs if r.get(key)]
            entry[key] = median(values) if values else None
        if profile is not None and name in SIM_POLICY:
            entry["sim"] = sim_prediction(SIM_POLICY[name], rs[0]["lengths"], workload, engine, rs[0]["kv_tokens"],
                                          profile, work)
        document["configs"][name] = entry
    document["plot"] = str(plot(document, runs, args.plot))
    if args.json:
        print_json(document, indent=1)
    else:
        print_table(document)
        print(f"plot: {document['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
