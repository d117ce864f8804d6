#!/usr/bin/env python
"""An RL loop's rollouts: `seerd serve` across iterations against one `seerd run` per iteration.

Each iteration samples the same prompts from a new checkpoint (the model's own weights, every float
tensor perturbed, seeded per iteration: what a trainer's step does to them). With `seerd serve`
the engines start once and load each checkpoint in place; with `seerd run` every iteration starts
its coordinator and engines again. Both on the same engines settings and workers, one after the
other (two engines at a time on this machine). Prints, per iteration, the wall time a trainer
waits for its rows (submit to rows; `seerd run`: the whole command), the generation phase as the
coordinator measured it (first lease to last report: engine start excluded), and the in-place
reload time the workers reported, and the generation phase of a second batch on the same weights
(no reload: the batch after a reload against a warm one); then medians over the iterations after
the first and ratios.

    .venv/bin/python tools/bench/serve.py [--model examples/motif_model/weights] [--iterations 5]
                                          [--groups 16] [--n 4] [--max-tokens 128] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import MOTIF_MODEL, engine_env, seerd_command  # noqa: E402

from seerd.serve.client import Client  # noqa: E402
from tests.fixtures.perturb import perturbed_copy  # noqa: E402


def generation_s(db: Path, rollout_id: int) -> float:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        (data,) = conn.execute("select data_json from events where kind = 'coordinator_load' and rollout_id = ?",
                               (rollout_id,)).fetchone()
    return json.loads(data)["generation_s"]


def reload_s(db: Path, rollout_id: int) -> float:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        rows = conn.execute("select data_json from events where kind = 'worker_registered' and rollout_id = ?",
                            (rollout_id,)).fetchall()
    return max((json.loads(data).get("weights_loaded_s", 0.0) for (data,) in rows), default=0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MOTIF_MODEL)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    rng = random.Random(0)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{g}", "prompt_token_ids": [rng.randrange(4, 60) for _ in range(8)]})
                               + "\n" for g in range(args.groups)))
    checkpoints = [args.model.resolve()] + [perturbed_copy(args.model, work / f"step-{i}", seed=i)
                                            for i in range(1, args.iterations)]
    engine = ["--workers", str(args.workers), "--kv-cache-gib", "0.25", "--max-num-seqs", "32", "--dtype", "float32",
              "--n", str(args.n), "--max-tokens", str(args.max_tokens), "--temperature", str(args.temperature)]

    serve_dir = work / "serve"
    started = time.monotonic()
    log = open(work / "serve.log", "wb")
    serve = subprocess.Popen(seerd_command("serve", "--model", str(args.model.resolve()), "--run-dir", str(serve_dir), *engine),
                             stdout=log, stderr=subprocess.STDOUT, env=engine_env(), cwd=REPO)
    served, warm = [], []
    try:
        client = Client(serve_dir, patience_s=600)

        def batch(checkpoint: Path, seed: int) -> tuple[float, int]:
            began = time.monotonic()
            state = client.submit(prompts, weights=checkpoint, seed=seed)
            rows = [row for group in client.groups(state.batch) for row in group["rows"]]
            assert len(rows) == args.groups * args.n
            return time.monotonic() - began, state.batch

        for i, checkpoint in enumerate(checkpoints):
            wall, batch_id = batch(checkpoint, i)
            served.append((wall + (time.monotonic() - started - wall if i == 0 else 0.0), batch_id))
            # The same weights again (no reload): what the batch after a reload is compared with.
            warm.append(batch(checkpoint, 1000 + i)[1])
        while client.state(warm[-1]).status != "finished":  # its figures are written at its end
            time.sleep(0.1)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=300)
    db = serve_dir / "state.db"
    served = [(wall, generation_s(db, batch), reload_s(db, batch)) for wall, batch in served]
    warm_generation = [generation_s(db, batch) for batch in warm]

    runs = []
    for i, checkpoint in enumerate(checkpoints):
        run_dir = work / f"run-{i}"
        began = time.monotonic()
        done = subprocess.run(seerd_command("run", "--input", str(prompts), "--model", str(checkpoint), "--run-dir",
                                    str(run_dir), *engine, "--seed", str(i), "--no-progress"),
                              capture_output=True, text=True, env=engine_env(), cwd=REPO)
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append((time.monotonic() - began, generation_s(run_dir / "state.db", 1)))

    print(f"{args.iterations} iterations of {args.groups} groups x {args.n} responses, max {args.max_tokens} tokens, "
          f"{args.workers} workers, model {args.model}")
    print("| iteration | serve: wall s | serve: generation s | serve: reload s | serve, same weights again: "
          "generation s | run: wall s | run: generation s |")
    print("|---|---|---|---|---|---|---|")
    for i, ((s_wall, s_gen, s_reload), w_gen, (r_wall, r_gen)) in enumerate(zip(served, warm_generation, runs), 1):
        print(f"| {i} | {s_wall:.2f} | {s_gen:.2f} | {s_reload:.3f} | {w_gen:.2f} | {r_wall:.2f} | {r_gen:.2f} |")
    later = slice(1, None)
    s_wall = statistics.median(w for w, _, _ in served[later])
    r_wall = statistics.median(w for w, _ in runs[later])
    s_gen = statistics.median(g for _, g, _ in served[later])
    r_gen = statistics.median(g for _, g in runs[later])
    print(f"medians over iterations 2..{args.iterations}: wall serve {s_wall:.2f} s, run {r_wall:.2f} s "
          f"(run / serve {r_wall / s_wall:.2f}x); generation serve {s_gen:.2f} s, run {r_gen:.2f} s "
          f"(run / serve {r_gen / s_gen:.2f}x); reload {statistics.median(r for _, _, r in served[later]):.3f} s; "
          f"the batch after a reload against the same weights again: generation "
          f"{s_gen:.2f} s / {statistics.median(warm_generation[later]):.2f} s "
          f"({s_gen / statistics.median(warm_generation[later]):.2f}x)")
    print(f"(work kept in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
