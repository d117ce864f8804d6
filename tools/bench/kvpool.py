"""The KV pool, measured side by side (docs/kvpool.md has the figures and how they were taken).

1. Time to first token of a continued chunk: a context of L tokens computed on one engine, continued
   on another (a fresh process, nothing of it in its prefix cache) that loads the context's blocks
   from the pool; against an engine without the pool that recomputes the context, and against a
   pool-enabled engine whose lookup misses (what the pool costs when it cannot help: the lookup and
   the saves). Medians over repeats, each repeat on fresh prompts.
2. Rollouts that migrate often (2 workers, `--policy divided --no-in-place`, chunks well below the response
   length, greedy with ignore_eos so both runs produce the same tokens), with `--kv-pool mooncake`
   and `off`, alternating: throughput, prefill tokens recomputed and avoided by continued chunks,
   moved chunks and the pool hit rate over their response tokens, bytes moved and load bandwidth.

    .venv/bin/python tests/fixtures/make_tiny_model.py models/gqa24m --shape gqa-24m
    .venv/bin/python tools/profile_engine.py --model models/gqa24m --out runs/gqa24m-profile.json
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/kvpool.py --model models/gqa24m [--repeats 3] \
        [--contexts 256,512,1024,2048] [--rollout-repeats 2] [--skip-ttft] [--skip-rollout] \
        [--profile runs/gqa24m-profile.json --write-pool-load]

3. With --profile: the simulator on the last pool run's lengths, with that engine profile (and
   the pool load cost part 1 measured, --write-pool-load), at the pool hit rate the run measured
   and at none, beside the real ratio.

At most two engines run at once. Needs a quiet machine: figures are medians, ratios side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from seerd.kvpool.holder import HolderProcess  # noqa: E402
from seerd.kvpool.service import PoolService  # noqa: E402
from seerd.rundir import RunDir  # noqa: E402


class Engine:
    """tests/fixtures/kvpool_engine.py in its own process."""

    def __init__(self, run_dir: Path, model: Path, name: str, **settings: object) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
        self.log = open(run_dir / f"{name}.log", "ab")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "fixtures" / "kvpool_engine.py"), str(run_dir),
                                      str(model), json.dumps({"dtype": "float32", **settings})],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self._answer()

    def _answer(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"engine exited; see {self.log.name}")
            if line.startswith("{"):
                return json.loads(line)

    def chunk(self, engine_id: str, prompt: list[int], max_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"id": engine_id, "prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.log.close()


def tokens(seed: int | str, length: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def context(kind: str, rep: int, length: int) -> list[int]:
    """A fresh context per (kind, repeat, length): no engine has any of it in its prefix cache (an
    earlier version drew the seeds of different kinds from overlapping ranges, so some repeats'
    "pool loads" and "misses" were local prefix hits)."""
    return tokens(f"{kind}/{rep}/{length}", length)


def ttft(args: argparse.Namespace, work: Path) -> None:
    RunDir(work).rotate_secret()  # as a coordinator does before it starts its pool: engines key blocks by it
    service = PoolService(work, "127.0.0.1", log_dir=work)
    service.start()
    holder = HolderProcess(work, 2 << 30, log_path=work / "holder.log")
    holder.spawn()
    time.sleep(1.5)
    rows: dict[str, dict[int, list]] = {"pool": {}, "miss": {}, "plain": {}, "local": {}}
    try:
        saver = Engine(work, args.model, "saver")
        loader = Engine(work, args.model, "loader")
        saver.chunk("c0e0g0r0p8", tokens(0, 8), 1)  # warm-up
        loader.chunk("c0e0g0r1p8", tokens(1, 8), 1)
        gid = 1
        for rep in range(args.repeats):
            for length in args.contexts:
                gid += 1
                prompt = context("pool", rep, length)
                first = saver.chunk(f"c{gid}e0g{gid}r1p{length}", prompt, 1)
                before = loader.chunk(f"c0e0g0r{gid}p4", tokens(gid, 4), 1)["stats"]  # counters now
                after = loader.chunk(f"c{gid}e1g{gid}r1p{length}", prompt + first["tokens"], 1)
                stats = after["stats"]
                rows["pool"].setdefault(length, []).append(
                    (after["s"], after["cached"], stats["bytes_loaded"] - before["bytes_loaded"],
                     stats["load_s"] - before["load_s"]))
                miss = loader.chunk(f"c{gid}e2g{gid + 500}r1p{length + 1}", context("miss", rep, length + 1), 1)
                rows["miss"].setdefault(length, []).append((miss["s"], miss["cached"], 0, 0.0))
                # The same continuation from the loader's own prefix cache: what a chunk that
                # stays on its worker costs, the floor a pool load is measured against.
                own = context("local", rep, length)
                first = loader.chunk(f"c{gid}e0g{gid + 900}r1p{length}", own, 1)
                local = loader.chunk(f"c{gid}e1g{gid + 900}r1p{length}", own + first["tokens"], 1)
                rows["local"].setdefault(length, []).append((local["s"], local["cached"], 0, 0.0))
        saver.close()
        loader.close()
        plain = Engine(work, args.model, "plain", no_pool=True)
        plain.chunk("c0e0g0r0p8", tokens(0, 8), 1)
        for rep in range(args.repeats):
            for length in args.contexts:
                result = plain.chunk(f"c1e0g1r1p{length + 1}", context("plain", rep, length + 1), 1)
                rows["plain"].setdefault(length, []).append((result["s"], result["cached"], 0, 0.0))
        plain.close()
    finally:
        holder.stop()
        service.stop()
    fit_pool_load(args, {length: statistics.median(r[0] for r in rows["pool"][length]) for length in args.contexts})
    print(f"\n## Time to first token of a continued chunk ({args.model.name}, medians of {args.repeats})\n")
    print("| context | recompute (no pool) | pool miss | local prefix hit | pool load | load / recompute "
          "| load - local | cached | loaded | GB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for length in args.contexts:
        plain_s = statistics.median(r[0] for r in rows["plain"][length])
        miss_s = statistics.median(r[0] for r in rows["miss"][length])
        pool = rows["pool"][length]
        pool_s = statistics.median(r[0] for r in pool)
        cached = statistics.median(r[1] or 0 for r in pool)
        loaded = statistics.median(r[2] for r in pool)
        local_s = statistics.median(r[0] for r in rows["local"][length])
        rate = sum(r[2] for r in pool) / max(sum(r[3] for r in pool), 1e-9) / 1e9
        print(f"| {length + 1} | {1e3 * plain_s:.1f} ms | {1e3 * miss_s:.1f} ms | {1e3 * local_s:.1f} ms | "
              f"{1e3 * pool_s:.1f} ms | {pool_s / plain_s:.2f}x | {1e3 * (pool_s - local_s):+.1f} ms | {cached:.0f} | "
              f"{loaded / 1e6:.1f} MB | {rate:.2f} |")


def fit_pool_load(args: argparse.Namespace, medians: dict[int, float]) -> None:
    """L(c) = h + k * c over the pool-load medians; written into --profile with --write-pool-load
    (the simulator then costs a pool load so instead of as a recompute)."""
    import numpy as np

    contexts = np.array(sorted(medians), dtype=float)
    k, h = np.polyfit(contexts, np.array([medians[int(c)] for c in contexts]), 1)
    print(f"pool load fit: {1e3 * h:.2f} ms + {1e6 * k:.2f} us/token", file=sys.stderr)
    if args.write_pool_load:
        profile = json.loads(args.profile.read_text())
        profile["pool_load"] = {"h": float(h), "k": float(k), "model": args.model.name,
                                "measured": time.strftime("%Y-%m-%d"), "source": "tools/bench/kvpool.py"}
        args.profile.write_text(json.dumps(profile, indent=2) + "\n")


def rollout_figures(run_dir: Path) -> dict:
    from seerd.db import ChunkStatus
    from seerd.report.cache import continuation_cache_figures, prefill_avoided_over_time
    from seerd.report.source import load_run

    import sqlite3

    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as conn:
        first, last, out = conn.execute(
            "select min(leased_at), max(finished_at), sum(num_tokens) from chunks where status = ?",
            (ChunkStatus.DONE.value,)).fetchone()
        stats = [json.loads(s) for (s,) in conn.execute("select stats_json from workers") if s]
    run = load_run(run_dir / "state.db")
    cache = continuation_cache_figures(run)
    prefill = prefill_avoided_over_time(run)
    pools = [s["kv_pool"] for s in stats if "kv_pool" in s]
    loaded = sum(p["bytes_loaded"] for p in pools)
    return {"tok_s": out / (last - first), "recomputed": float(prefill.recomputed[-1]) if len(prefill.recomputed) else 0,
            "avoided": float(prefill.avoided[-1]) if len(prefill.avoided) else 0, "moved": cache.moved.chunks,
            "hit": cache.pool_hit_rate_response, "bytes": loaded + sum(p["bytes_saved"] for p in pools),
            "gbs": loaded / max(sum(p["load_s"] for p in pools), 1e-9) / 1e9 if pools else None,
            # The workers' time in synchronous saves and loads, over their wall time together:
            # what asynchronous saves could win back at most.
            "io_share": sum(p["save_s"] + p["load_s"] for p in pools) / (len(stats) * (last - first)) if pools else None}


def rollouts(args: argparse.Namespace, work: Path) -> None:
    prompts = work / "prompts.jsonl"
    with open(prompts, "w") as handle:
        for g in range(args.groups):
            handle.write(json.dumps({"id": f"g{g}", "prompt_token_ids": tokens(g, args.prompt_len),
                                     "ignore_eos": True}) + "\n")
    results: dict[str, list[dict]] = {"off": [], "mooncake": []}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for rep in range(args.rollout_repeats):
        for mode in (("off", "mooncake") if rep % 2 == 0 else ("mooncake", "off")):
            run_dir = work / f"{mode}-{rep}"
            command = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model",
                       str(args.model), "--run-dir", str(run_dir), "--workers", "2", "--policy", "divided",
                       "--chunk-tokens", str(args.chunk_tokens), "--n", str(args.n), "--max-tokens",
                       str(args.max_tokens), "--temperature", "0", "--dtype", "float32", "--kv-cache-gib", "0.5",
                       "--max-num-seqs", str(args.max_num_seqs), "--wait-for-workers", "--no-progress", "--kv-pool", mode,
                       "--no-in-place"]  # re-submitted chunks move; continued in place, they stay
            done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
            if done.returncode != 0:
                raise SystemExit(f"{mode} run failed:\n{done.stderr[-3000:]}")
            results[mode].append(rollout_figures(run_dir))
            print(f"  {mode} run {rep}: {results[mode][-1]}", file=sys.stderr)
    off_rate = statistics.median(r["tok_s"] for r in results["off"])
    sim = simulated(args, work / f"mooncake-{args.rollout_repeats - 1}", work) if args.profile else None
    print(f"\n## Rollouts that migrate ({args.groups}x{args.n} requests, prompt {args.prompt_len}, "
          f"{args.max_tokens} tokens in chunks of {args.chunk_tokens}, 2 workers of {args.max_num_seqs} sequences, "
          f"divided; medians of "
          f"{args.rollout_repeats})\n")
    print("| kv pool | tok/s | x off | prefill recomputed | prefill avoided | moved chunks | pool hit (response) "
          "| bytes moved | load GB/s | save+load time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode, runs in results.items():
        rate = statistics.median(r["tok_s"] for r in runs)
        hit = [r["hit"] for r in runs if r["hit"] is not None]
        gbs = [r["gbs"] for r in runs if r["gbs"] is not None]
        print(f"| {mode} | {rate:.0f} | {rate / off_rate:.2f} | {statistics.median(r['recomputed'] for r in runs):,.0f} | "
              f"{statistics.median(r['avoided'] for r in runs):,.0f} | {statistics.median(r['moved'] for r in runs):.0f} | "
              f"{f'{100 * statistics.median(hit):.0f}%' if hit else '-'} | "
              f"{statistics.median(r['bytes'] for r in runs) / 1e6:.0f} MB | "
              f"{f'{statistics.median(gbs):.2f}' if gbs else '-'} | {share(runs)} |")
    if sim is not None:
        real = statistics.median(r["tok_s"] for r in results["mooncake"]) / off_rate
        print(f"\n## The simulator on the last pool run's lengths ({args.profile.name})\n")
        print("| | pool / no pool | pool hit rate |")
        print("|---|---|---|")
        print(f"| real runs (medians) | {real:.2f} | measured |")
        print(f"| simulator | {sim['measured'] / sim['none']:.2f} | {sim['measured_hit']:.2f} vs 0 |")


def share(runs: list[dict]) -> str:
    shares = [r["io_share"] for r in runs if r["io_share"] is not None]
    return f"{100 * statistics.median(shares):.1f}%" if shares else "-"


def simulated(args: argparse.Namespace, run_dir: Path, work: Path) -> dict[str, float]:
    """The simulator on this run's lengths and cluster with the profile: tok/s with the pool hit
    rate the run measured, and with none."""
    import sqlite3

    with sqlite3.connect(f"file:{run_dir / 'state.db'}?mode=ro", uri=True) as conn:
        rows = conn.execute("select r.group_id, r.generated_tokens, g.prompt_len from requests r "
                            "join prompt_groups g on g.id = r.group_id").fetchall()
        kv_tokens = min(k for (k,) in conn.execute("select kv_capacity_tokens from workers"))
    trace = work / "trace.jsonl"
    trace.write_text("".join(json.dumps({"group": g, "length": n, "prompt_len": p}) + "\n" for g, n, p in rows))
    rates = {}
    for name, pool in (("measured", ["--pool-hit-rate-from", str(run_dir)]), ("none", ["--pool-hit-rate", "0"])):
        done = subprocess.run([sys.executable, "-m", "seerd.cli.main", "sim", "--preset", "cpu-tiny", "--profile",
                               str(args.profile), "--kv-tokens", str(kv_tokens), "--instances", "2",
                               "--max-num-seqs", str(args.max_num_seqs), "--chunk-tokens", str(args.chunk_tokens),
                               "--trace", str(trace),
                               "--policies", "divided", *pool, "--json"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"sim failed:\n{done.stderr[-2000:]}{done.stdout[-2000:]}")
        report = json.loads(done.stdout)
        rates[name] = report["policies"]["divided"]["throughput_tok_s"]
        rates[f"{name}_hit"] = report["cluster"]["pool_hit_rate"]
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "gqa24m")
    parser.add_argument("--contexts", default="256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--chunk-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--rollout-repeats", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=6,
                        help="Sequences per worker in the rollouts: below the request count, so neither worker can "
                             "take every request back after its chunks and chunks move whatever the timing.")
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--keep", type=Path, default=None, help="Keep the runs here (default: a temporary directory).")
    parser.add_argument("--profile", type=Path, default=None,
                        help="This model's engine profile (tools/profile_engine.py): the simulator runs beside "
                             "the real rollouts with it.")
    parser.add_argument("--write-pool-load", action="store_true",
                        help="Write the measured pool load cost into --profile (pool_load: h + k * tokens).")
    args = parser.parse_args()
    args.model = args.model.resolve()
    args.contexts = [int(x) for x in args.contexts.split(",")]
    if args.write_pool_load and args.profile is None:
        parser.error("--write-pool-load needs --profile")
    with tempfile.TemporaryDirectory(prefix="bench-kvpool-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        os.chmod(work, 0o700)
        if not args.skip_ttft:
            (work / "ttft").mkdir(exist_ok=True)
            ttft(args, work / "ttft")
        if not args.skip_rollout:
            rollouts(args, work)


if __name__ == "__main__":
    main()
