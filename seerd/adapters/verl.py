"""veRL's rollout stage on `seerd serve`: a class for
`actor_rollout_ref.rollout.agent.agent_loop_manager_class=seerd.adapters.verl.SeerdAgentLoopManager`.

veRL's trainer calls `AgentLoopManager.create(config, llm_client, ...)` once and then
`generate_sequences(prompts: DataProto) -> DataProto` every step, with the prompts already repeated
n times and a non-tensor `uid` per group (../shared/reference/trainers.md). This manager sends each
step's batch to a running `seerd serve` (its run directory: `actor_rollout_ref.rollout.seerd.server`,
or the environment's `SEERD_SERVER`) as one batch, every group whole, and returns what veRL's own
agent loop returns: tensors `prompts` (left-padded), `responses` (right-padded), `response_mask`,
`input_ids`, `attention_mask`, `position_ids`, `rollout_log_probs`; the input's non-tensors (`uid`
...) passed through, plus `__num_turns__` and `weight_version`; `meta_info["timing"]`.

Weights: veRL pushes new weights to its own rollout replicas; with seerd, the step's weights must
be a checkpoint directory the serve can read (an HF model directory of the policy). Name it in
`prompts.meta_info["seerd_weights"]` (or `rollout.seerd.weights`); without one the serve samples
from its `--model`. Prompt token ids are read from the non-tensor `raw_prompt_ids` when present,
else from `input_ids` under `attention_mask`; chat messages in `raw_prompt` are sent as such (the
serve renders them with the model's chat template).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
import torch

from seerd.serve.client import Client

SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}


def setting(config: object, path: str, default: object = None) -> object:
    """`config.a.b.c` of an OmegaConf DictConfig, a dict or an object; `default` where absent."""
    node = config
    for name in path.split("."):
        if node is None:
            return default
        node = node.get(name) if hasattr(node, "get") else getattr(node, name, None)
    return default if node is None else node


class SeerdAgentLoopManager:
    def __init__(self, config: object, llm_client: object = None, teacher_client: object = None,
                 reward_loop_worker_handles: object = None) -> None:
        self.config = config
        rollout = setting(config, "actor_rollout_ref.rollout")
        server = setting(rollout, "seerd.server") or os.environ.get("SEERD_SERVER")
        if not server:
            raise ValueError("no seerd serve to send rollouts to: set actor_rollout_ref.rollout.seerd.server "
                             "(its run directory) or SEERD_SERVER")
        self.client = Client(server)
        self.rollout = rollout
        self.pad_token_id = int(setting(rollout, "seerd.pad_token_id", 0))

    @classmethod
    def create(cls, config: object, llm_client: object = None, teacher_client: object = None,
               reward_loop_worker_handles: object = None) -> SeerdAgentLoopManager:
        return cls(config, llm_client, teacher_client, reward_loop_worker_handles)

    def generate_sequences(self, prompts):  # noqa: ANN001, ANN201 - verl.DataProto in and out
        from verl import DataProto

        started = time.monotonic()
        groups = _groups(prompts.non_tensor_batch["uid"])
        sources = [_prompt_of(prompts, members[0]) for members in groups]
        validate = bool(prompts.meta_info.get("validate", False))
        sampling = {option: setting(self.rollout, ("val_kwargs." if validate else "") + key)
                    for option, key in SAMPLING.items()}
        sampling = {k: v for k, v in sampling.items() if v is not None}
        if setting(self.rollout, "response_length") is not None:
            sampling["max_tokens"] = int(setting(self.rollout, "response_length"))
        rows = [{"id": f"g{i}", **source, "n": len(members)} for i, (source, members) in enumerate(zip(sources, groups))]
        weights = prompts.meta_info.get("seerd_weights") or setting(self.rollout, "seerd.weights")
        by_sample: list[dict] = [{}] * len(prompts)
        prompt_ids: list[list[int]] = [[]] * len(prompts)
        for group in self.client.stream(rows, weights=weights, **sampling):
            members = groups[group["group_index"]]
            for row in group["rows"]:
                by_sample[members[row["response_index"]]] = row
            for sample in members:
                prompt_ids[sample] = group["prompt_token_ids"]  # as the serve tokenized it
        batch = self._tensors(prompt_ids, by_sample)
        non_tensors = dict(prompts.non_tensor_batch)
        non_tensors["__num_turns__"] = np.full(len(prompts), 2, dtype=np.int32)
        non_tensors["weight_version"] = np.array([row["weight_version"] for row in by_sample], dtype=object)
        elapsed = time.monotonic() - started
        return DataProto.from_dict(tensors=batch, non_tensors=non_tensors, meta_info={
            **prompts.meta_info, "timing": {"agent_loop/generate_sequences/mean": elapsed,
                                            "agent_loop/generate_sequences/max": elapsed}})

    def _tensors(self, prompt_ids: Sequence[Sequence[int]], rows: Sequence[dict]) -> dict[str, torch.Tensor]:
        prompt_width = max(int(setting(self.rollout, "prompt_length", 0)), max(len(p) for p in prompt_ids))
        response_width = max(int(setting(self.rollout, "response_length", 0)), max(len(r["token_ids"]) for r in rows), 1)
        size = len(rows)
        prompts = torch.full((size, prompt_width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((size, prompt_width), dtype=torch.long)
        responses = torch.full((size, response_width), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((size, response_width), dtype=torch.long)
        logprobs = torch.zeros((size, response_width), dtype=torch.float32)
        for i, (prompt, row) in enumerate(zip(prompt_ids, rows)):
            if prompt:  # left-padded
                prompts[i, prompt_width - len(prompt):] = torch.tensor(prompt)
                prompt_mask[i, prompt_width - len(prompt):] = 1
            count = len(row["token_ids"])
            if count:  # right-padded
                responses[i, :count] = torch.tensor(row["token_ids"])
                response_mask[i, :count] = 1
                logprobs[i, :count] = torch.tensor(row["logprobs"], dtype=torch.float32)
        attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
        position_ids = torch.clamp(torch.cumsum(attention_mask, dim=1) - 1, min=0)
        return {"prompts": prompts, "responses": responses, "response_mask": response_mask,
                "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
                "position_ids": position_ids, "rollout_log_probs": logprobs}


def _groups(uids: Sequence[object]) -> list[list[int]]:
    """Sample positions per group, groups in order of first appearance (veRL repeats each prompt n
    times in a row, but a shuffled batch groups the same)."""
    members: dict[object, list[int]] = {}
    for position, uid in enumerate(uids):
        members.setdefault(uid, []).append(position)
    return list(members.values())


def _prompt_of(prompts, sample: int) -> dict:  # noqa: ANN001
    """A prompt row for the serve: token ids where veRL has them, else chat messages."""
    non_tensors = prompts.non_tensor_batch
    if "raw_prompt_ids" in non_tensors:
        return {"prompt_token_ids": [int(t) for t in non_tensors["raw_prompt_ids"][sample]]}
    if prompts.batch is not None and "input_ids" in prompts.batch.keys():
        ids, mask = prompts.batch["input_ids"][sample], prompts.batch["attention_mask"][sample]
        return {"prompt_token_ids": ids[mask.bool()].tolist()}
    if "raw_prompt" in non_tensors:
        return {"prompt": list(non_tensors["raw_prompt"][sample])}
    raise ValueError("a veRL batch without raw_prompt_ids, input_ids or raw_prompt: nothing to send")
