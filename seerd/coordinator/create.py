"""Turn a validated prompt file into a rollout's groups and requests (one transaction)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from seerd.config import RunConfig
from seerd.coordinator.model_identity import fingerprint_json
from seerd.coordinator.prior import PriorLengths, seed_from_prior
from seerd.db import Session, add_event, queries
from seerd.db.codec import pack_ints
from seerd.io.prompts import PromptRow
from seerd.settings import SAMPLING_KEYS, Sampling


def prompt_hash(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(pack_ints(token_ids)).hexdigest()


def group_sampling(config: RunConfig, row: PromptRow) -> Sampling:
    """The run's sampling with the row's own settings over it."""
    own = {k: v for k, v in row.sampling.items() if k in SAMPLING_KEYS}
    if "stop_token_ids" in own:
        own["stop_token_ids"] = tuple(own["stop_token_ids"])
    return msgspec.structs.replace(config.sampling, **own)


def create_rollout(session: Session, config: RunConfig, rows: Sequence[PromptRow], *,
                   input_sha256: str, now: float, prior: PriorLengths | None = None,
                   model_fingerprint: dict | None = None) -> int:
    """Insert the rollout, a group per row and n requests per group; the caller commits.

    With `prior` (lengths of an earlier run, `--prior`), matched groups start from its estimate.
    `model_fingerprint` (coordinator/model_identity.py) is what every later start compares the
    model directory with.
    """
    conn = session.connection()
    rollout_id = queries.rollouts.insert(conn, {
        "policy": config.policy, "seed": config.seed, "model_path": config.model_path,
        "input_path": config.input_path, "input_sha256": input_sha256, "config_json": config.to_json(),
        "created_at": now,
        "model_fingerprint": None if model_fingerprint is None else fingerprint_json(model_fingerprint)})
    id_of = queries.groups.insert_all(session, rollout_id, [
        {
            "group_index": index, "prompt_id": row.prompt_id,
            "prompt_token_ids": pack_ints(row.prompt_token_ids), "prompt_len": len(row.prompt_token_ids),
            "prompt_hash": prompt_hash(row.prompt_token_ids), "n": row.n, "max_tokens": row.max_tokens,
            "sampling_json": msgspec.json.encode(group_sampling(config, row)).decode(),
            # Until a response of the group finishes, assume it is long (the paper's rule).
            "length_estimate": row.max_tokens, "finished_requests": 0,
        }
        for index, row in enumerate(rows)
    ])
    queries.requests.insert_queued(conn, [
        {
            "rollout_id": rollout_id, "group_id": id_of[index], "response_index": k,
            "is_probe": k == 0, "generated_tokens": 0, "num_chunks": 0, "queued_at": now,
        }
        for index, row in enumerate(rows) for k in range(row.n)
    ])
    queries.groups.set_probes(session, rollout_id)
    _insert_targets(session, rollout_id, rows, id_of)
    seeded = 0 if prior is None else seed_from_prior(session, rollout_id, prior, model_path=config.model_path,
                                                     now=now)
    add_event(session, rollout_id, now, "rollout_created",
              data={"groups": len(rows), "requests": sum(r.n for r in rows), "policy": config.policy,
                    "groups_seeded_from_prior": seeded})
    return rollout_id


def _insert_targets(session: Session, rollout_id: int, rows: Sequence[PromptRow], group_id_of: dict[int, int]) -> None:
    """Target lengths go to their own table, which only the grant-building code reads."""
    targeted = {group_id_of[index]: row.target_lengths for index, row in enumerate(rows) if row.target_lengths}
    if not targeted:
        return
    requests = queries.requests.ids_by_response(session, rollout_id)
    queries.targets.insert_all(session, [
        {"request_id": rid, "target_length": targeted[gid][k]} for rid, gid, k in requests if gid in targeted])
