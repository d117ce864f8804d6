#!/usr/bin/env python
"""Train the motif model: a tiny Llama worth drafting for (see corpus.py for the data).

Its responses repeat the prompt's motifs step after step, so a suffix-matching drafter can
predict them from sibling responses, and their lengths are heavy-tailed across prompts but
correlated within a group. One CPU thread, three time-boxed stages on freshly sampled data:

  1. from scratch, plain next-token loss on response tokens;
  2. 5x loss weight on the step structure: step-end, marker and echoed length tokens and EOS
     (where the length is decided; the weight on EOS also raises the stop probability, so
     lengths after this stage are short);
  3. plain loss again (recalibrates the stop probability), the learning rate decaying to zero.

The result (config.json, model.safetensors, tokenizer files) is written atomically to OUT_DIR
after each stage: built in a temp dir next to it, then renamed into place.

Usage: python examples/motif_model/train.py [--out OUT_DIR] [--minutes-per-stage 14,13,5] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import corpus as C  # noqa: E402  (no torch inside; works as a script and from the repo root)

DEFAULT_OUT = HERE / "weights"


def build_tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(C.vocab())}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Plain-text prompts get BOS prepended, like the token-id prompts of make_prompts.
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", C.BOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", model_max_length=4096)


def build_model(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=512, vocab_size=C.VOCAB_SIZE, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=C.BOS_ID, eos_token_id=C.EOS_ID,
        pad_token_id=C.PAD_ID, dtype="float32",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32)


def save(model, out: Path, meta: dict) -> None:
    """Write model + tokenizer to `out` atomically (temp dir, then rename)."""
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)  # safetensors (transformers >= 5 writes nothing else)
        if not (tmp / "model.safetensors").is_file():
            raise RuntimeError("save_pretrained did not write model.safetensors")
        build_tokenizer().save_pretrained(tmp)
        gen = {"bos_token_id": C.BOS_ID, "eos_token_id": C.EOS_ID, "pad_token_id": C.PAD_ID}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        (tmp / "training.json").write_text(json.dumps(meta, indent=2) + "\n")
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            out.rename(old / "d")
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def batches(rng: random.Random, batch_tokens: int, max_len: int, pool: int = 512):
    """Endless padded batches of (ids, response_start) lists, bucketed by length."""
    while True:
        seqs = []
        for _ in range(pool):
            p = C.sample_prompt(rng)
            ids = p["ids"] + C.sample_response(rng, p)
            seqs.append((ids[:max_len], len(p["ids"])))
        seqs.sort(key=lambda s: len(s[0]))
        out, cur = [], []
        for s in seqs:
            if cur and (len(cur) + 1) * len(s[0]) > batch_tokens:
                out.append(cur)
                cur = []
            cur.append(s)
        if cur:
            out.append(cur)
        rng.shuffle(out)
        yield from out


def to_tensors(batch, weight_special: float):
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), C.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (seq, _) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
    # Loss on predicting response tokens only (the prompt is random by design).
    weights = torch.zeros((len(batch), width - 1))
    for i, (seq, start) in enumerate(batch):
        weights[i, start - 1 : len(seq) - 1] = 1.0
    tgt = ids[:, 1:]
    # The step structure, where the length is decided: step end, marker, echoed length, EOS.
    echo = (tgt >= C.LEN0) & (tgt < C.LEN0 + C.N_LEN)
    marker = (tgt >= C.STEP0) & (tgt < C.STEP0 + C.MAX_STEPS)
    special = (tgt == C.EOS_ID) | (tgt == C.STEP_END) | marker | echo
    if weight_special != 1.0:
        weights = torch.where(special & (weights > 0), weights * weight_special, weights)
    return ids, mask, weights, special, echo


def train(out: Path, minutes: list[float], seed: int, batch_tokens: int, lr: float,
          max_len: int, log_every: int) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    random.seed(seed)
    torch.manual_seed(seed)
    model = build_model(seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  stages (min) {minutes}  batch_tokens {batch_tokens}  lr {lr}", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    data = batches(random.Random(f"motif-train-{seed}"), batch_tokens, max_len)
    # (loss weight on EOS/markers, lr at stage start, lr at stage end); cosine within a stage.
    stages = [(1.0, lr, 0.5 * lr), (5.0, 0.5 * lr, 0.25 * lr), (1.0, 0.25 * lr, 0.0)]
    warmup = 200
    step, t_all = 0, time.time()
    history = []
    model.train()
    for si, ((w_special, lr0, lr1), mins) in enumerate(zip(stages, minutes), start=1):
        t0 = time.time()
        budget = mins * 60
        tok_seen = tok_pad = 0
        acc = {"loss": 0.0, "special": 0.0, "n": 0, "nspec": 0, "echo": 0.0, "necho": 0}
        while time.time() - t0 < budget:
            frac = (time.time() - t0) / budget
            cur = lr1 + (lr0 - lr1) * 0.5 * (1 + math.cos(math.pi * frac))
            if step < warmup:
                cur *= (step + 1) / warmup
            for g in opt.param_groups:
                g["lr"] = cur
            ids, mask, weights, special, echo = to_tensors(next(data), w_special)
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1),
                                 reduction="none").view_as(weights)
            counted = weights > 0
            loss = (ce * weights).sum() / counted.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tok_pad += ids.numel()
            tok_seen += int(mask.sum())
            with torch.no_grad():
                acc["loss"] += float(ce[counted].sum())
                acc["n"] += int(counted.sum())
                sp = special & counted
                acc["special"] += float(ce[sp].sum())
                acc["nspec"] += int(sp.sum())
                ec = echo & counted
                acc["echo"] += float(ce[ec].sum())
                acc["necho"] += int(ec.sum())
            if step % log_every == 0:
                el = time.time() - t0
                print(f"stage {si} step {step:6d} t {el / 60:5.1f}m lr {cur:.2e} "
                      f"loss {acc['loss'] / max(1, acc['n']):.4f} "
                      f"eos/marker/echo loss {acc['special'] / max(1, acc['nspec']):.4f} "
                      f"echo loss {acc['echo'] / max(1, acc['necho']):.4f} "
                      f"padded tok/s {tok_pad / el:,.0f}", flush=True)
                history.append({"stage": si, "step": step, "loss": acc["loss"] / max(1, acc["n"]),
                                "special_loss": acc["special"] / max(1, acc["nspec"]),
                                "echo_loss": acc["echo"] / max(1, acc["necho"])})
                acc = {"loss": 0.0, "special": 0.0, "n": 0, "nspec": 0, "echo": 0.0, "necho": 0}
        meta = {"seed": seed, "minutes_per_stage": minutes, "stages_done": si, "steps": step,
                "batch_tokens": batch_tokens, "lr": lr, "params": n_params,
                "wall_seconds": round(time.time() - t_all, 1), "history_tail": history[-5:]}
        save(model, out, meta)
        print(f"stage {si} done: {step} steps, {tok_seen:,} tokens ({tok_pad:,} padded) in "
              f"{(time.time() - t0) / 60:.1f} min; saved to {out}", flush=True)
    print(f"total wall {(time.time() - t_all) / 60:.1f} min", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--minutes-per-stage", default="14,13,5",
                   help="durations of the three stages in minutes, comma separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--max-len", type=int, default=2560, help="training sequences are cut here")
    p.add_argument("--log-every", type=int, default=50)
    a = p.parse_args(argv)
    minutes = [float(x) for x in a.minutes_per_stage.split(",")]
    if len(minutes) != 3 or any(m < 0 for m in minutes):
        p.error("--minutes-per-stage needs three non-negative numbers")
    train(a.out, minutes, a.seed, a.batch_tokens, a.lr, a.max_len, a.log_every)


if __name__ == "__main__":
    main()
