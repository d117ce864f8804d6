#!/usr/bin/env python
"""The synthetic corpus of the motif model (examples/motif_model/train.py).

A prompt holds one length token and 3-6 key tokens among filler tokens; each key selects a
motif (4-12 content tokens) from a fixed global bank. A response is a number of numbered steps:
each step is the prompt's motifs in order, with some noise, ended by three tokens: the step-end
token (<f_00>, a filler reused), the step's marker and the prompt's length token echoed
(`... <f_00> <step_01> <len_17> ... <f_00> <step_02> <len_17>`); EOS follows the last echo.
The number of steps is set by the length token (a log-uniform scale in 1..24) times lognormal
noise (sigma 0.25) per response, so lengths are heavy-tailed across prompts and correlated
within a group, and sibling responses share long runs of tokens that a suffix-matching drafter
can predict.

The three tokens are there for the model (README.md has the attempts). Without them, the stop
decision at a marker needs the length token from the prompt, up to ~2000 positions back, and a
model of this size trained for half an hour on this CPU did not learn that (its lengths ignored
the length token). With them, each is predicted from a distinctive token just before it: the
step end from the motifs (where a step ends), the marker from the step end (the previous
marker's number plus one), the echo from the marker (a copy of the length token), and EOS or the
next step from the echo, with the step's number one position back: a (level, step) lookup.
Structure tokens predicted from a plain motif token (an echo before the marker, or a marker
right after the motifs) were learned slowly or not at all in the same time.

Noise per motif token: 5% substituted, 5% preceded by an inserted token (both random content
tokens). Per motif occurrence: 4% skipped, 4% repeated (8% skips/repeats).

This module imports no torch; `make_prompts` gives prompt rows in seerd's prompt-file format.

Usage: python examples/motif_model/corpus.py prompts OUT.jsonl --groups N --seed S [--n K]
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

# ---------------------------------------------------------------- vocabulary (512 ids)
VOCAB_SIZE = 512
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
SEP_ID = 4  # ends the prompt: the response starts after it
N_LEN, LEN0 = 32, 5  # length tokens <len_00>..<len_31>: ids 5..36
MAX_STEPS, STEP0 = 64, LEN0 + 32  # step markers <step_01>..<step_64>: ids 37..100
N_KEYS, KEY0 = 64, STEP0 + 64  # key tokens <key_00>..<key_63>: ids 101..164
N_FILL, FILL0 = 32, KEY0 + 64  # filler tokens <f_00>..<f_31>: ids 165..196
CONTENT0 = FILL0 + 32  # content tokens w000..: ids 197..511
STEP_END = FILL0  # <f_00> (a prompt filler) also ends every step of a response, before its marker
N_CONTENT = VOCAB_SIZE - CONTENT0

MIN_SCALE, MAX_SCALE = 1.0, 24.0  # steps per response, before the per-response noise
STEP_SIGMA = 0.25
P_SUB, P_INS, P_SKIP, P_REPEAT = 0.05, 0.05, 0.04, 0.04
PROMPT_LEN = (16, 32)  # tokens, BOS and SEP included
KEYS_PER_PROMPT = (3, 6)
MOTIF_LEN = (4, 12)
BANK_SEED = 20240611  # the motif bank is fixed: part of the model, not of a run


def vocab() -> list[str]:
    """Token strings by id."""
    toks = SPECIAL_TOKENS + ["<sep>"]
    toks += [f"<len_{i:02d}>" for i in range(N_LEN)]
    toks += [f"<step_{i + 1:02d}>" for i in range(MAX_STEPS)]
    toks += [f"<key_{i:02d}>" for i in range(N_KEYS)]
    toks += [f"<f_{i:02d}>" for i in range(N_FILL)]
    toks += [f"w{i:03d}" for i in range(N_CONTENT)]
    assert len(toks) == VOCAB_SIZE
    return toks


def motif_bank() -> list[list[int]]:
    """The fixed global bank: motif k (selected by <key_k>) as content token ids."""
    rng = random.Random(BANK_SEED)
    return [[CONTENT0 + rng.randrange(N_CONTENT) for _ in range(rng.randint(*MOTIF_LEN))]
            for _ in range(N_KEYS)]


_BANK = motif_bank()


def length_scale(level: int) -> float:
    """Steps per response (before noise) of length token level 0..N_LEN-1: log-uniform 1..24."""
    return MIN_SCALE * (MAX_SCALE / MIN_SCALE) ** (level / (N_LEN - 1))


def marker(step: int) -> int:
    """Token id of the marker ending step `step` (1-based)."""
    return STEP0 + step - 1


def is_marker(tok: int) -> bool:
    return STEP0 <= tok < STEP0 + MAX_STEPS


def is_length(tok: int) -> bool:
    return LEN0 <= tok < LEN0 + N_LEN


def sample_prompt(rng: random.Random) -> dict:
    """One prompt: token ids plus what it encodes (level, scale, keys)."""
    total = rng.randint(*PROMPT_LEN)
    keys = [rng.randrange(N_KEYS) for _ in range(rng.randint(*KEYS_PER_PROMPT))]
    level = rng.randrange(N_LEN)
    body = total - 2  # BOS ... SEP
    # The length token and the keys (in order) at random positions, filler elsewhere.
    slots = sorted(rng.sample(range(body), len(keys) + 1))
    len_at = rng.choice(slots)
    key_slots = [s for s in slots if s != len_at]
    ids = [FILL0 + rng.randrange(N_FILL) for _ in range(body)]
    ids[len_at] = LEN0 + level
    for s, k in zip(key_slots, keys):
        ids[s] = KEY0 + k
    return {"ids": [BOS_ID] + ids + [SEP_ID], "level": level, "scale": length_scale(level), "keys": keys}


def sample_steps(rng: random.Random, scale: float) -> int:
    return max(1, min(MAX_STEPS, round(scale * math.exp(rng.gauss(0.0, STEP_SIGMA)))))


def sample_response(rng: random.Random, prompt: dict, steps: int | None = None) -> list[int]:
    """One response to `prompt`: `steps` noisy steps, each ended by its marker and the prompt's
    length token echoed, then EOS."""
    if steps is None:
        steps = sample_steps(rng, prompt["scale"])
    out: list[int] = []
    for step in range(1, steps + 1):
        for k in prompt["keys"]:
            r = rng.random()
            if r < P_SKIP:
                continue
            for _ in range(2 if r < P_SKIP + P_REPEAT else 1):
                for tok in _BANK[k]:
                    if rng.random() < P_INS:
                        out.append(CONTENT0 + rng.randrange(N_CONTENT))
                    out.append(CONTENT0 + rng.randrange(N_CONTENT) if rng.random() < P_SUB else tok)
        out.append(STEP_END)
        out.append(marker(step))
        out.append(LEN0 + prompt["level"])  # the echo: see the module docstring
    out.append(EOS_ID)
    return out


def make_prompts(num_groups: int, seed: int) -> list[dict]:
    """`num_groups` prompt rows of the corpus's distribution, in seerd's prompt-file format.

    Each row is {"id", "prompt_token_ids"} plus "length_scale" (the steps per response the
    length token asks for; seerd ignores extra columns). Deterministic for a given seed.
    """
    rng = random.Random(f"motif-prompts-{seed}")
    rows = []
    for g in range(num_groups):
        p = sample_prompt(rng)
        rows.append({"id": f"motif-{seed}-{g}", "prompt_token_ids": p["ids"],
                     "length_scale": round(p["scale"], 4)})
    return rows


def parse_prompt(prompt_token_ids: list[int]) -> dict:
    """What a prompt encodes: {"level", "scale", "keys"} (as in sample_prompt)."""
    levels = [t - LEN0 for t in prompt_token_ids if LEN0 <= t < LEN0 + N_LEN]
    if len(levels) != 1:
        raise ValueError(f"expected one length token, found {len(levels)}")
    keys = [t - KEY0 for t in prompt_token_ids if KEY0 <= t < KEY0 + N_KEYS]
    return {"ids": list(prompt_token_ids), "level": levels[0], "scale": length_scale(levels[0]),
            "keys": keys}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Motif-model corpus tools.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prompts", help="write a JSONL prompt file for seerd")
    pp.add_argument("out", type=Path)
    pp.add_argument("--groups", type=int, required=True)
    pp.add_argument("--seed", type=int, default=0)
    pp.add_argument("--n", type=int, default=None, help="per-row n (responses per prompt)")
    a = p.parse_args(argv)
    rows = make_prompts(a.groups, a.seed)
    if a.n is not None:
        for r in rows:
            r["n"] = a.n
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {a.out}")


if __name__ == "__main__":
    main()
