"""Benchmark of grouped drafting: the draft server's appends and fetches, a worker's local suffix
index (extend, propose) and what both hold in memory. Pure Python, one process, no engine.

Data: synthetic "motif" groups, like the corpus of the tiny model in
../shared/reference/platform.md: a group has 3-6 motifs of 4-12 tokens (vocabulary 512); a response
is a run of steps, each step the group's motifs in order (a motif skipped or repeated with 4%
chance each, each token substituted with 5% and followed by an inserted token with 5% chance)
and a step-marker token; lengths are uniform in 1,000-2,000 tokens, the prompt 16-32 tokens.

What is measured (each figure the median over --repeats repeats; throughputs in CPU time of this
process, latencies in wall time):
- server append: tok/s of `DraftServer.append` with 16-token appends, round-robin over 64 groups
  x 16 requests (each request's next 16 tokens in turn; target >= 500K tok/s).
- server fetch: one client holding all 64 groups fetches after every round of appends (16 new
  tokens per request): tok/s delivered, and the size of the JSON reply per token.
- index extend: tok/s of `SuffixIndex.extend` building a 16-response group in batches of B tokens
  per call, round-robin over the responses (B=1: a request's own tokens as a step accepts them;
  16 and 256: fetched deltas; whole: a rebuild from the logs).
- propose: a replay of speculative decoding. For n finished siblings, the index holds the prompt
  and the n responses; one more response of the group is "generated": each step proposes up to 8
  tokens for its tokens so far, accepts the draft's longest prefix that equals the true tokens,
  plus one (the verifier's own token), and extends the index with them. Latency per call (us,
  medians over repeats of the median and p99 over calls; also of the calls that drafted
  something, the others end at the first dictionary lookup) and tokens per step (the paper's acceptance
  length: 1.70 / 2.04 / 2.32 / 2.53 at n = 0 / 1 / 5 / 15 on real text, Table 2 in
  ../shared/reference/seer.md; motif data is more repetitive, so expect more).
- memory: bytes per million tokens held, `DraftServer.stats()` (int32 logs) and
  `SuffixIndex.nbytes()` (the index of a 16-response group).

    python tools/bench/drafts.py [--repeats 5] [--groups 8] [--seed 0] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tools.bench.runner import print_json  # noqa: E402

from seerd.drafts import DraftServer, SuffixIndex  # noqa: E402

# Throughputs count this process's CPU time: the machine is shared, and a process waiting for a
# core is not slower code. Per-call latencies are wall time (a CPU-time clock costs ~0.8 us here).
cpu = time.process_time
VOCAB = 512
SERVER_GROUPS, SERVER_REQUESTS, APPEND_TOKENS = 64, 16, 16
DRAFT_TOKENS = 8


def motif_group(rng: random.Random, responses: int) -> tuple[list[int], list[list[int]]]:
    """(prompt, responses) of one synthetic group (see the module docstring)."""
    motifs = [[rng.randrange(8, VOCAB) for _ in range(rng.randint(4, 12))] for _ in range(rng.randint(3, 6))]
    marker = rng.randrange(8, VOCAB)
    prompt = [rng.randrange(8, VOCAB) for _ in range(rng.randint(16, 32))]
    out = []
    for _ in range(responses):
        length = rng.randint(1000, 2000)
        tokens: list[int] = []
        while len(tokens) < length:
            for motif in motifs:
                roll = rng.random()
                for _ in range(0 if roll < 0.04 else 2 if roll > 0.96 else 1):
                    for token in motif:
                        tokens.append(rng.randrange(8, VOCAB) if rng.random() < 0.05 else token)
                        if rng.random() < 0.05:
                            tokens.append(rng.randrange(8, VOCAB))
            tokens.append(marker)
        out.append(tokens[:length])
    return prompt, out


# ---- server ----------------------------------------------------------------------------------

def bench_server(rng: random.Random, rounds: int) -> dict:
    streams = {(g, r): [rng.randrange(VOCAB) for _ in range(rounds * APPEND_TOKENS)]
               for g in range(SERVER_GROUPS) for r in range(SERVER_REQUESTS)}
    server = DraftServer()
    for group in range(SERVER_GROUPS):
        server.register(group, ttl_s=3600)
    cursors: dict[int, dict[int, tuple[int, int]]] = {g: {} for g in range(SERVER_GROUPS)}
    append_s = fetch_s = 0.0
    fetched = json_bytes = 0
    for round_ in range(rounds):
        start = round_ * APPEND_TOKENS
        t0 = cpu()
        for (group, request), stream in streams.items():
            server.append(group, request, start, stream[start:start + APPEND_TOKENS])
        t1 = cpu()
        result = server.fetch(cursors)
        t2 = cpu()
        append_s += t1 - t0
        fetch_s += t2 - t1
        for group, requests in result.changes.items():
            for request, (gen, begin, tokens) in requests.items():
                cursors[group][request] = (gen, begin + len(tokens))
                fetched += len(tokens)
        if round_ % 16 == 0:
            json_bytes += len(msgspec.json.encode(result))  # the fetch reply as the API sends it
    stats = server.stats()
    total = rounds * SERVER_GROUPS * SERVER_REQUESTS * APPEND_TOKENS
    assert stats["tokens"] == total == fetched, (stats["tokens"], total, fetched)
    sampled = len(range(0, rounds, 16)) * SERVER_GROUPS * SERVER_REQUESTS * APPEND_TOKENS
    return {"append_tok_s": total / append_s, "fetch_tok_s": fetched / fetch_s,
            "fetch_json_bytes_per_token": json_bytes / sampled,
            "server_bytes_per_mtok": stats["bytes_per_million_tokens"]}


# ---- local index -----------------------------------------------------------------------------

def bench_extend(groups: list, batch: int | None) -> float:
    """tok/s of building each group's index in batches of `batch` tokens (None: whole)."""
    elapsed = 0.0
    tokens = 0
    for prompt, responses in groups:
        index = SuffixIndex()
        t0 = cpu()
        index.extend("prompt", prompt)
        if batch is None:
            for i, response in enumerate(responses):
                index.extend(i, response)
        else:
            longest = max(map(len, responses))
            for start in range(0, longest, batch):
                for i, response in enumerate(responses):
                    if start < len(response):
                        index.extend(i, response[start:start + batch])
        elapsed += cpu() - t0
        tokens += index.num_tokens
    return tokens / elapsed


def replay(prompt: list[int], siblings: list[list[int]], target: list[int], max_candidates: int,
           calls: list[tuple[float, bool]], every_position: bool = False) -> tuple[int, int, SuffixIndex]:
    """Generate `target` with drafts from an index of the prompt and `siblings`; returns
    (steps, tokens, the index). Appends (latency in s, drafted?) of each propose to `calls`.
    `every_position`: propose before every token, whatever was accepted (a harder mix: the
    replay's steps skip the easy stretches a long draft covers)."""
    index = SuffixIndex(max_candidates=max_candidates)
    index.extend("prompt", prompt)
    for i, sibling in enumerate(siblings):
        index.extend(i, sibling)
    context = list(prompt[-index.max_match:])  # the request's tokens so far, after its prompt's tail
    pos = steps = 0
    clock = time.perf_counter
    while pos < len(target):
        t0 = clock()
        draft = index.propose(context, DRAFT_TOKENS)
        calls.append((clock() - t0, bool(draft.tokens)))
        accepted = 0
        for token in draft.tokens:
            if pos + accepted >= len(target) or token != target[pos + accepted]:
                break
            accepted += 1
        # the accepted draft and the verifier's own token
        emitted = target[pos:pos + (1 if every_position else accepted + 1)]
        index.extend("me", emitted)
        context.extend(emitted)
        pos += len(emitted)
        steps += 1
    return steps, pos, index


def bench_propose(groups: list, siblings: int, max_candidates: int, every_position: bool = False) -> dict:
    calls: list[tuple[float, bool]] = []
    steps = tokens = 0
    nbytes = indexed = 0
    for prompt, responses in groups:
        s, t, index = replay(prompt, responses[1:1 + siblings], responses[0], max_candidates, calls,
                             every_position)
        steps += s
        tokens += t
        if siblings == len(responses) - 1:
            nbytes += index.nbytes()
            indexed += index.num_tokens
    latencies = sorted(latency for latency, _ in calls)
    drafted = sorted(latency for latency, made in calls if made)
    return {"calls": len(calls), "median_us": 1e6 * _quantile(latencies, 0.5),
            "p99_us": 1e6 * _quantile(latencies, 0.99), "drafted_share": len(drafted) / len(calls),
            "drafted_median_us": 1e6 * _quantile(drafted, 0.5), "tokens_per_step": tokens / steps,
            "index_bytes_per_mtok": 1e6 * nbytes / indexed if indexed else None}


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[int(q * (len(ordered) - 1))] if ordered else float("nan")


# ---- driver ----------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict:
    samples: dict[str, list] = {}

    def add(name: str, value) -> None:
        samples.setdefault(name, []).append(value)

    sibling_counts = (0, 1, 5, 15)
    for repeat in range(args.repeats):
        rng = random.Random(args.seed + repeat)
        groups = [motif_group(rng, 16) for _ in range(args.groups)]
        for key, value in bench_server(rng, args.server_rounds).items():
            add(key, value)
        for batch in (1, 16, 256, None):
            add(f"extend_{batch or 'whole'}", bench_extend(groups, batch))
        for n in sibling_counts:
            add(f"propose_{n}", bench_propose(groups, n, 32))
        add("propose_15_c16", bench_propose(groups, 15, 16))
        add("propose_15_every", bench_propose(groups, 15, 32, every_position=True))
        print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    summary = {}
    for name, values in samples.items():
        if isinstance(values[0], dict):
            summary[name] = {k: None if values[0][k] is None else statistics.median(v[k] for v in values)
                             for k in values[0]}
            summary[name]["median_us_all"] = [round(v["median_us"], 1) for v in values]
        else:
            summary[name] = {"median": statistics.median(values), "all": values}
    return summary


def print_table(summary: dict, args: argparse.Namespace) -> None:
    def k(x: float) -> str:
        return f"{x / 1e3:,.0f}K"

    def spread(name: str) -> str:
        return "[" + " ".join(k(v) for v in summary[name]["all"]) + "]"

    print(f"# bench_drafts: {args.repeats} repeat(s), {args.groups} groups of 16 responses, "
          f"seed {args.seed}; {os.cpu_count()} cores, 1-min load average {os.getloadavg()[0]:.1f}")
    print()
    print("| what | figure | all repeats |")
    print("|---|---|---|")
    print(f"| server append, 16-token appends, 64 groups x 16 requests | "
          f"{k(summary['append_tok_s']['median'])} tok/s | {spread('append_tok_s')} |")
    print(f"| server fetch, all 64 groups after each round | {k(summary['fetch_tok_s']['median'])} tok/s, "
          f"{summary['fetch_json_bytes_per_token']['median']:.1f} JSON bytes/token | "
          f"{spread('fetch_tok_s')} |")
    for batch in (1, 16, 256, "whole"):
        name = f"extend_{batch}"
        label = "whole responses (a rebuild)" if batch == "whole" else f"batches of {batch}"
        print(f"| index extend, {label} | {k(summary[name]['median'])} tok/s | {spread(name)} |")
    server_mb = summary["server_bytes_per_mtok"]["median"] / 1e6
    print(f"| server memory | {server_mb:.1f} MB per million tokens | |")
    index_mb = summary["propose_15"]["index_bytes_per_mtok"] / 1e6
    print(f"| index memory (16 responses + prompt) | {index_mb:.0f} MB per million tokens | |")
    print()
    print(f"propose, up to {DRAFT_TOKENS} tokens, replaying one response per group (max_candidates 32 "
          "unless said):")
    print()
    print("| finished siblings | calls | median us | p99 us | drafted | median us of drafting calls "
          "| tokens/step | per-repeat medians (us) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = [(f"propose_{n}", str(n)) for n in (0, 1, 5, 15)] + [
        ("propose_15_c16", "15, max_candidates 16"), ("propose_15_every", "15, before every token")]
    for name, label in rows:
        row = summary[name]
        steps = "-" if name.endswith("every") else f"{row['tokens_per_step']:.2f}"
        print(f"| {label} | {row['calls']:.0f} | {row['median_us']:.1f} | {row['p99_us']:.1f} | "
              f"{100 * row['drafted_share']:.0f}% | {row['drafted_median_us']:.1f} | {steps} | "
              f"{' '.join(map(str, row['median_us_all']))} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--groups", type=int, default=8, help="motif groups (16 responses each) per repeat")
    parser.add_argument("--server-rounds", type=int, default=125, help="16-token appends per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, 2 groups, 16 rounds")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.groups, args.server_rounds = 1, 2, 16
    summary = run(args)
    if args.json:
        print_json(summary, indent=2)
    else:
        print_table(summary, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
