"""slime's rollout function on `seerd serve`: `--rollout-function-path seerd.adapters.slime.generate_rollout`.

slime calls `generate_rollout(args, rollout_id, data_source, evaluation=False)` and trains on what
it returns: exactly `args.rollout_batch_size` groups of `args.n_samples_per_prompt` samples, taken
from `data_source.get_samples(n)` (../shared/reference/trainers.md). This sends those groups to a
running `seerd serve` (its run directory: `args.seerd_server` or the environment's
`SEERD_SERVER`) as one batch and fills each sample as slime's own rollout does: `tokens` (prompt +
response), `response_length`, `loss_mask`, `rollout_log_probs`, `status` (completed, truncated at
the budget, failed), `weight_versions`, and `response` (decoded when the adapter has the model's
tokenizer, `args.hf_checkpoint`). Rewards stay slime's to compute.

Weights: slime pushes new weights to its engines after each training step; with seerd the step's
weights must be a checkpoint directory the serve can read. `args.seerd_weights`: a path, or a
function of `rollout_id` returning one (None: the serve's `--model`).

slime is not on PyPI; seerd is tested against a data source and `Sample` written to the contract
above (tests/integration/test_adapters.py), not against slime itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import SimpleNamespace

from seerd.serve.client import Client

STATUS = {"stop": "COMPLETED", "length_target": "COMPLETED", "length": "TRUNCATED", "error": "FAILED"}


def generate_rollout(args: object, rollout_id: int, data_source: object, evaluation: bool = False) -> object:
    server = getattr(args, "seerd_server", None) or os.environ.get("SEERD_SERVER")
    if not server:
        raise ValueError("no seerd serve to send rollouts to: set args.seerd_server (its run directory) or SEERD_SERVER")
    n = int(args.n_samples_per_prompt)
    groups = data_source.get_samples(int(args.rollout_batch_size))
    if len(groups) != int(args.rollout_batch_size) or any(len(group) != n for group in groups):
        raise ValueError(f"the data source gave {[len(g) for g in groups]} samples per group; "
                         f"{args.rollout_batch_size} groups of {n} were asked for")
    rows = [{"id": f"g{i}", **_prompt_of(group[0]), "n": n} for i, group in enumerate(groups)]
    weights = getattr(args, "seerd_weights", None)
    if callable(weights):
        weights = weights(rollout_id)
    sampling = {key: getattr(args, attr) for key, attr in (("temperature", "rollout_temperature"),
                                                           ("top_p", "rollout_top_p"), ("top_k", "rollout_top_k"),
                                                           ("max_tokens", "rollout_max_response_len"))
                if getattr(args, attr, None) is not None}
    decode = _decoder(getattr(args, "hf_checkpoint", None))
    for answered in Client(server).stream(rows, weights=weights, **sampling):
        group = groups[answered["group_index"]]
        for row in answered["rows"]:
            _fill(group[row["response_index"]], answered["prompt_token_ids"], row, decode)
    metrics = {"seerd/groups": len(groups)}
    return _train_output(groups, metrics) if not evaluation else _eval_output(groups, metrics)


def _prompt_of(sample: object) -> dict:
    tokens = list(getattr(sample, "tokens", None) or ())
    if tokens:  # slime tokenized the prompt already
        return {"prompt_token_ids": [int(t) for t in tokens]}
    prompt = sample.prompt
    return {"prompt": prompt if isinstance(prompt, str) else list(prompt)}


def _fill(sample: object, prompt_ids: Sequence[int], row: dict, decode) -> None:  # noqa: ANN001
    response = list(row["token_ids"])
    sample.tokens = list(prompt_ids) + response
    sample.response_length = len(response)
    sample.response = decode(response) if decode else ""
    sample.loss_mask = [1] * len(response)
    sample.rollout_log_probs = list(row["logprobs"])
    sample.weight_versions = [row["weight_version"]]
    sample.status = _status(sample, STATUS.get(row["finish_reason"], "COMPLETED"))
    metadata = getattr(sample, "metadata", None)
    if isinstance(metadata, dict):
        metadata["seerd"] = {"finish_reason": row["finish_reason"], "num_chunks": row["num_chunks"]}


def _status(sample: object, name: str) -> object:
    """slime's `Sample.Status` member when the sample's class has one, else the name."""
    status_type = getattr(type(sample), "Status", None)
    return getattr(status_type, name) if status_type is not None else name


def _decoder(checkpoint: str | None):  # noqa: ANN202
    if not checkpoint:
        return None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _train_output(groups: list, metrics: dict) -> object:
    try:
        from slime.rollout.base_types import RolloutFnTrainOutput
    except ImportError:  # slime itself is not installed here: the same fields
        return SimpleNamespace(samples=groups, metrics=metrics)
    return RolloutFnTrainOutput(samples=groups, metrics=metrics)


def _eval_output(groups: list, metrics: dict) -> object:
    try:
        from slime.rollout.base_types import RolloutFnEvalOutput
    except ImportError:
        return SimpleNamespace(data={"seerd": {"samples": groups}}, metrics=metrics)
    return RolloutFnEvalOutput(data={"seerd": {"samples": groups}}, metrics=metrics)
