#!/usr/bin/env python
"""GRPO-style RL on the motif model, every iteration's rollout through `seerd serve`.

The task is verifiable: a motif prompt's length token asks for a number of steps (its length
scale, rounded: 1-3 steps for the prompts used here), and a response earns 1 when it ends (EOS)
after exactly that many steps, 0 otherwise. The base model follows the length token only roughly
(its step counts spread around it), so there is room to learn.

Each iteration: the serve samples G responses per prompt from the current checkpoint (the first
from the base model, then each one the trainer just wrote: the engines load it in place, and every
row names the weights it came from); rewards are scored per group; the policy takes one step of
REINFORCE with group baselines (advantage = reward - group mean, token-level mean of
-advantage * log-prob, Adam), computed by transformers' Llama on the same tokens; the new weights
are written as a checkpoint directory (safetensors beside the base model's config and tokenizer).
Also printed: how far the trainer's log-probs of the sampled tokens are from the ones vLLM
reported (`logprob_gap`, mean absolute): close to zero when every token was sampled from the
weights the trainer holds (strictly on-policy).

    .venv/bin/python examples/grpo_motif.py [--iterations 20] [--json] [--work-dir DIR] [--plot FILE]

`--json` prints one object per iteration: {"iteration", "reward", "rollout_s", "weight_version",
"train_s", "logprob_gap", "responses"}. `make rl-demo` runs it with its defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from examples.motif_model.corpus import is_marker, length_scale, sample_prompt  # noqa: E402

from seerd.serve.client import Client  # noqa: E402

BASE_MODEL = REPO / "examples" / "motif_model" / "weights"
MAX_LEVEL = 9  # length tokens <len_00>..<len_09>: 1.0 to 2.7 steps asked for
KEPT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def make_prompts(groups: int, rng: random.Random) -> list[dict]:
    rows = []
    while len(rows) < groups:
        prompt = sample_prompt(rng)
        if prompt["level"] <= MAX_LEVEL:
            rows.append({"id": f"q{len(rows)}", "prompt_token_ids": prompt["ids"],
                         "steps": round(length_scale(prompt["level"]))})
    return rows


def reward(row: dict, steps: int) -> float:
    """1 for a response that ended (EOS) after exactly `steps` step markers."""
    return float(row["finish_reason"] == "stop" and sum(map(is_marker, row["token_ids"])) == steps)


class Trainer:
    """The policy in torch: one REINFORCE step with group baselines per batch of rows."""

    def __init__(self, model_dir: Path, lr: float, threads: int) -> None:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        torch.set_num_threads(threads)
        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)

    def step(self, samples: list[tuple[list[int], list[int], list[float], float]], micro_batch: int = 32) -> float:
        """samples: (prompt ids, response ids, vLLM's logprobs, advantage). Returns the mean
        absolute gap between the trainer's and vLLM's log-probs of the sampled tokens."""
        torch = self.torch
        tokens_total = sum(len(response) for _, response, _, _ in samples)
        self.optimizer.zero_grad()
        gaps = []
        for start in range(0, len(samples), micro_batch):
            part = samples[start:start + micro_batch]
            width = max(len(p) + len(r) for p, r, _, _ in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)
            mask = torch.zeros(len(part), width)
            for i, (prompt, response, _, _) in enumerate(part):
                ids[i, :len(prompt) + len(response)] = torch.tensor(prompt + response)
                mask[i, :len(prompt) + len(response)] = 1
            logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
            logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = torch.zeros(())
            for i, (prompt, response, reported, advantage) in enumerate(part):
                if not response:
                    continue
                mine = logprobs[i, len(prompt) - 1:len(prompt) - 1 + len(response)]
                gaps.extend((mine.detach() - torch.tensor(reported)).abs().tolist())
                loss = loss - advantage * mine.sum()
            (loss / tokens_total).backward()
        self.optimizer.step()
        return statistics.fmean(gaps) if gaps else 0.0

    def save(self, base: Path, out: Path) -> Path:
        from safetensors.torch import save_file

        out.mkdir(parents=True)
        for name in KEPT_FILES:  # the same config: the serve loads the weights into the same model
            if (base / name).exists():
                shutil.copy2(base / name, out / name)
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--groups", type=int, default=16, help="prompts per iteration")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (the group)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, help="default: a new temporary directory")
    parser.add_argument("--plot", type=Path, help="reward per iteration as a PNG (default: WORK_DIR/reward.png)")
    parser.add_argument("--json", action="store_true", help="one JSON object per iteration")
    args = parser.parse_args()
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="grpo-motif-"))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "serve.log", "ab")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    serve = subprocess.Popen(
        [sys.executable, "-m", "seerd.cli.main", "serve", "--model", str(BASE_MODEL), "--run-dir", str(work / "serve"),
         "--workers", str(args.workers), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
         "--temperature", "1.0", "--kv-cache-gib", "0.25", "--max-num-seqs", "64", "--chunk-tokens", "64",
         "--dtype", "float32"],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    history = []
    try:
        trainer = Trainer(BASE_MODEL, args.lr, threads=2)
        client = Client(work / "serve", patience_s=600)
        rng = random.Random(args.seed)
        weights = None  # the serve's own --model for the first iteration
        for iteration in range(1, args.iterations + 1):
            prompts = make_prompts(args.groups, rng)
            started = time.monotonic()
            rows = client.rollout([{k: v for k, v in p.items() if k != "steps"} for p in prompts],
                                  weights=weights, seed=args.seed * 1000 + iteration)
            rollout_s = time.monotonic() - started
            samples, rewards = [], []
            for index, prompt in enumerate(prompts):
                group = [row for row in rows if row["group_index"] == index]
                scores = [reward(row, prompt["steps"]) for row in group]
                baseline = statistics.fmean(scores)
                rewards.extend(scores)
                samples.extend((prompt["prompt_token_ids"], row["token_ids"], row["logprobs"], score - baseline)
                               for row, score in zip(group, scores))
            started = time.monotonic()
            gap = trainer.step(samples)
            weights = trainer.save(BASE_MODEL, work / f"ckpt-{iteration}")
            record = {"iteration": iteration, "reward": statistics.fmean(rewards), "rollout_s": round(rollout_s, 3),
                      "weight_version": rows[0]["weight_version"], "train_s": round(time.monotonic() - started, 3),
                      "logprob_gap": float(f"{gap:.3g}"), "responses": len(rows)}
            history.append(record)
            if args.json:
                print(json.dumps(record), flush=True)
            else:
                print(f"iteration {iteration:3d}: reward {record['reward']:.3f}, rollout {rollout_s:.1f}s, train "
                      f"{record['train_s']:.1f}s, logprob gap {gap:.2e}, weights {record['weight_version']}", flush=True)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(timeout=120)
    plot(history, args.plot or work / "reward.png")
    if not args.json:
        print(f"reward {history[0]['reward']:.3f} -> {history[-1]['reward']:.3f}; plot {args.plot or work / 'reward.png'};"
              f" work in {work}")
    return 0


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([h["iteration"] for h in history], [h["reward"] for h in history], marker="o")
    axis.set_xlabel("iteration")
    axis.set_ylabel("mean reward (exact step count)")
    axis.set_title("GRPO on the motif model, rollouts through seerd serve")
    axis.set_ylim(0, 1)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
