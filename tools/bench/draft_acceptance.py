#!/usr/bin/env python
"""Accepted tokens per step by number of finished sibling responses (the paper's Table 2), per drafter.

Rollouts: a finished `seerd run` of the trained motif model (examples/motif_model/weights) at
temperature 1.0 with n=16 responses per prompt (`--run-dir`), or one made here (`--groups`, spec
off). Then each response is decoded again offline, step by step, as the engine would verify
drafts: at each step the drafter proposes up to k=8 tokens from what it knows, the longest prefix
that equals the response's real next tokens is accepted, plus one token the engine samples. With
point-mass drafts this is the same acceptance in distribution as vLLM's rejection sampler (a draft
token x is accepted with probability p(x), the chance the sampled token is x); platform.md saw
vLLM's own counters agree with such a replay (1.975 vs 1.982 tokens per step).

Drafters, all with the same k, each drafting for the response from:
- grouped:  seerd's SuffixIndex over the prompt, the n finished siblings and the response so far;
- request:  the same index over the prompt and the response so far only (no group context);
- ngram:    vLLM's own n-gram matcher over prompt + response so far (prompt_lookup 3..16, as
            `--spec ngram` configures it), and with vLLM's defaults (5..5);
- suffix:   vLLM's suffix decoding needs arctic-inference, which is not installed here: not run.
The responses decoded are the last `--targets` of each group; siblings are the first n of the rest.

    python tools/bench/draft_acceptance.py [--run-dir RUN] [--groups 24] [--targets 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tools.bench.runner import MOTIF_MODEL, print_json  # noqa: E402


MODEL = MOTIF_MODEL
SIBLINGS = (0, 1, 5, 15)
DEPTH = 8


def make_rollouts(groups: int, work: Path, seed: int) -> Path:
    from examples.motif_model.corpus import make_prompts

    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in make_prompts(groups, seed=seed)))
    run_dir = work / "rollouts"
    cmd = [sys.executable, "-m", "seerd.cli.main", "run", "--input", str(prompts), "--model", str(MODEL),
           "--run-dir", str(run_dir), "--workers", "2", "--n", "16", "--max-tokens", "2048",
           "--chunk-tokens", "2048", "--temperature", "1.0", "--seed", str(seed), "--dtype", "float32",
           "--no-progress"]
    environment = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=str(REPO))
    subprocess.run(cmd, env=environment, check=True, capture_output=True, timeout=3600)
    return run_dir


def load_groups(run_dir: Path) -> list[tuple[list[int], list[list[int]]]]:
    from sqlalchemy import select

    from seerd.db import Group, queries, read
    from seerd.db.codec import unpack_ints

    with read.reading(run_dir / "state.db") as conn:
        prompts = {gid: unpack_ints(blob)
                   for gid, blob in conn.execute(select(Group.id, Group.prompt_token_ids))}
        responses: dict[int, dict[int, list[int]]] = defaultdict(dict)
        for gid, _, rid, blob in queries.responses.finished_response_chunks(conn):  # what --spec-history reads
            responses[gid].setdefault(rid, []).extend(unpack_ints(blob))
    return [(list(prompts[gid]), list(by_request.values())) for gid, by_request in sorted(responses.items())]


def seerd_drafter(prompt: list[int], siblings: list[list[int]]):  # noqa: ANN201
    from seerd.drafts.index import SuffixIndex

    index = SuffixIndex()
    index.extend("prompt", prompt)
    for j, sibling in enumerate(siblings):
        index.extend(j, sibling)
    own: list[int] = []

    def propose(new_tokens: list[int]) -> list[int]:
        own.extend(new_tokens)
        index.extend("own", new_tokens)
        return index.propose(own, DEPTH).tokens

    return propose


def ngram_drafter(prompt: list[int], lookup_min: int, lookup_max: int):  # noqa: ANN201
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

    context = list(prompt)

    def propose(new_tokens: list[int]) -> list[int]:
        context.extend(new_tokens)
        draft = _find_longest_matched_ngram_and_propose_tokens(
            np.array(context, dtype=np.int32), lookup_min, lookup_max, 1 << 20, DEPTH)
        return [int(t) for t in draft]

    return propose


def replay(response: list[int], propose) -> tuple[int, int, float]:  # noqa: ANN001
    """Decode `response` with drafts: (accepted draft tokens, steps, seconds spent drafting)."""
    position, steps, accepted, drafting = 1, 0, 0, 0.0  # the first token comes from the prefill
    new = response[:1]
    while position < len(response):
        started = time.perf_counter()
        draft = propose(new)
        drafting += time.perf_counter() - started
        taken = 0
        while taken < len(draft) and position + taken < len(response) and draft[taken] == response[position + taken]:
            taken += 1
        new = response[position:position + taken + 1]
        position += len(new)
        accepted += taken
        steps += 1
    return accepted, steps, drafting


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", type=Path, help="a finished run with n=16 (default: make one)")
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--targets", type=int, default=4, help="responses decoded per group")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    run_dir = args.run_dir or make_rollouts(args.groups, Path(tempfile.mkdtemp(prefix="seerd-bench-accept-")),
                                            args.seed)
    groups = [g for g in load_groups(run_dir) if len(g[1]) >= max(SIBLINGS) + 1]
    if not groups:
        raise SystemExit(f"{run_dir}: no group has {max(SIBLINGS) + 1} finished responses")
    methods = {
        "grouped": lambda prompt, sibs: seerd_drafter(prompt, sibs),
        "request": lambda prompt, sibs: seerd_drafter(prompt, []),
        "vllm ngram 3..16": lambda prompt, sibs: ngram_drafter(prompt, 3, 16),
        "vllm ngram 5..5": lambda prompt, sibs: ngram_drafter(prompt, 5, 5),
    }
    table: dict[str, dict[int, dict]] = {m: {} for m in methods}
    for name, make in methods.items():
        for n in SIBLINGS:
            accepted = steps = tokens = 0
            per_response, drafting = [], []
            for prompt, responses in groups:
                for target in responses[-args.targets:]:
                    siblings = [r for r in responses if r is not target][:n]
                    a, s, d = replay(target, make(prompt, siblings))
                    accepted, steps, tokens = accepted + a, steps + s, tokens + len(target)
                    if s:
                        per_response.append(a / s)
                        drafting.append(d / s)
            table[name][n] = {"accepted_per_step": accepted / max(steps, 1), "tokens_per_step": (tokens - 1) / max(steps, 1),
                              "median_response": statistics.median(per_response),
                              "draft_us_per_step": 1e6 * statistics.median(drafting)}
    if args.json:
        print_json({"run_dir": str(run_dir), "groups": len(groups), "table": table}, indent=1)
        return 0
    decoded = len(groups) * args.targets
    print(f"{run_dir}: {len(groups)} groups, {decoded} responses decoded per cell, depth {DEPTH}")
    print("mean accepted draft tokens per step (tokens per step = this + 1), by finished siblings n")
    print(f"{'drafter':<18}" + "".join(f"{f'n={n}':>8}" for n in SIBLINGS) + f"{'us/step (n=5)':>15}")
    for name, cells in table.items():
        print(f"{name:<18}" + "".join(f"{cells[n]['accepted_per_step']:>8.2f}" for n in SIBLINGS)
              + f"{cells[5]['draft_us_per_step']:>15.1f}")
    grouped, request = table["grouped"], table["request"]
    print(f"{'grouped - request':<18}" + "".join(f"{grouped[n]['accepted_per_step'] - request[n]['accepted_per_step']:>+8.2f}"
                                               for n in SIBLINGS))
    print("vllm suffix: not run (arctic-inference is not installed in this environment)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
