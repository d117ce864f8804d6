"""The options that describe a rollout, shared by `seerd run`, `seerd slurm-run` and `seerd submit`.

Only the flags: their defaults and the config they make live in seerd/config.py (ROLLOUT_DEFAULTS,
build_config), which `seerd.submit()` uses too; the policies and their traits in
seerd/scheduler/registry.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click

from seerd.config import ROLLOUT_DEFAULTS as DEFAULTS
from seerd.scheduler.registry import DAEMON_POLICIES, daemon_policies_where

_POLICY_HELP = "; ".join(f"{name}: {entry.summary}" for name, entry in DAEMON_POLICIES.items()) + "."
_WAITING_POLICIES = " or ".join(f"--policy {name}" for name in daemon_policies_where(
    lambda traits: traits.waits_for_every_worker))
_POOL_LESS_POLICIES = " or ".join(f"--policy {name}" for name in daemon_policies_where(
    lambda traits: not traits.moves_requests))

INPUT_OPTION = click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
                            help="Prompt file: .jsonl or .parquet (veRL's layout loads).")

# What the engines and the scheduler run with: `seerd serve` takes these, its batches the rest.
ENGINE_OPTIONS = [
    click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
                 help="Model directory (Hugging Face layout) that vLLM loads."),
    click.option("--run-dir", required=True, type=click.Path(path_type=Path),
                 help="Where the run's database, secret, logs and outputs live."),
    click.option("--policy", default=DEFAULTS["policy"], show_default=True,
                 type=click.Choice(list(DAEMON_POLICIES)), help=_POLICY_HELP),
    click.option("--chunk-tokens", default=DEFAULTS["chunk_tokens"], show_default=True,
                 help="Tokens per chunk before a request goes back to the queue."),
    click.option("--n", "n", default=DEFAULTS["n"], show_default=True,
                 help="Responses per prompt (rows may override)."),
    click.option("--max-tokens", default=DEFAULTS["max_tokens"], show_default=True,
                 help="Response budget (rows may override)."),
    click.option("--temperature", default=DEFAULTS["temperature"], show_default=True,
                 help="Rows may override it, as --top-p, --top-k and --seed; vLLM's own SamplingParams judges "
                      "them all before the run is created."),
    click.option("--top-p", default=DEFAULTS["top_p"], show_default=True),
    click.option("--top-k", default=DEFAULTS["top_k"], show_default=True),
    click.option("--seed", default=DEFAULTS["seed"], show_default=True),
    click.option("--kv-cache-gib", default=DEFAULTS["kv_cache_gib"], show_default=True,
                 help="KV cache per worker engine."),
    click.option("--max-num-seqs", default=DEFAULTS["max_num_seqs"], show_default=True,
                 help="Concurrent sequences per engine."),
    click.option("--max-model-len", default=DEFAULTS["max_model_len"], type=int,
                 help="Engine context length that every prompt plus max_tokens must fit (default: the model's, "
                      "as vLLM reads its config; --engine-arg max_model_len, where taken, wins)."),
    click.option("--dtype", default=DEFAULTS["dtype"], show_default=True,
                 help="Engine dtype (auto, float32, bfloat16)."),
    click.option("--engine-api", default=DEFAULTS["engine_api"], show_default=True,
                 type=click.Choice(["auto", "stepped", "async", "sim"]),
                 help="vLLM driver: stepped = LLMEngine in the worker process; async = AsyncLLM "
                      "(auto: async with CUDA); sim = no vLLM: the simulator's model of an engine "
                      "(--sim-preset), for load tests and trying policies (docs/simulator.md)."),
    click.option("--sim-preset", default=DEFAULTS["sim_preset"], show_default=True,
                 help="--engine-api sim: the `seerd sim` preset whose engine model each worker runs."),
    click.option("--time-scale", default=DEFAULTS["time_scale"], show_default=True, type=float,
                 help="--engine-api sim: modelled engine seconds per wall second."),
    click.option("--lease-ttl", default=DEFAULTS["lease_ttl"], show_default=True,
                 help="Seconds a lease lives without a heartbeat (1 to 3600)."),
    click.option("--wait-for-workers", is_flag=True, default=DEFAULTS["wait_for_workers"],
                 help=f"At the start, hand out no work until every worker is up (always so for {_WAITING_POLICIES}); "
                      "a worker lost later does not stop the others."),
    click.option("--in-place/--no-in-place", "in_place", default=DEFAULTS["in_place"], show_default=True,
                 help="Continue a request in its engine across chunk boundaries while the scheduler keeps "
                      "it on the same worker; --no-in-place re-submits every chunk with its own seed (seeded "
                      "runs then reproduce token for token whatever the timing)."),
    click.option("--spec", "spec_mode", default=DEFAULTS["spec_mode"], show_default=True,
                 type=click.Choice(["off", "ngram", "suffix", "grouped", "request"]),
                 help="Speculative decoding: grouped = drafts from all sibling responses of the group (Seer); "
                      "request = the response's own tokens only; ngram/suffix = vLLM's own methods."),
    click.option("--spec-depth", default=DEFAULTS["spec_depth"], show_default=True,
                 help="Most draft tokens per request per step."),
    click.option("--spec-probe-weight", default=DEFAULTS["spec_probe_weight"], show_default=True,
                 help="How much more a probe's accepted token counts when draft depth is shared out."),
    click.option("--spec-fixed-depth", is_flag=True, default=DEFAULTS["spec_fixed_depth"],
                 help="Always draft --spec-depth tokens (no adaptive depth; for comparisons)."),
    click.option("--spec-profile", default=DEFAULTS["spec_profile"], type=click.Path(path_type=Path),
                 help="Step-time profile T(B, gamma) of this engine (tools/profile_spec_steps.py writes one)."),
    click.option("--spec-history", "spec_history_dir", default=DEFAULTS["spec_history_dir"],
                 type=click.Path(path_type=Path),
                 help="An earlier rollout of the same prompts: its responses seed each group's draft index."),
    click.option("--kv-pool", "kv_pool_mode", default=DEFAULTS["kv_pool_mode"], show_default=True,
                 type=click.Choice(["auto", "off", "mooncake"]),
                 help="Global KV pool: a chunk continues on any worker loading its context's KV instead of "
                      f"recomputing it (auto: mooncake for CPU workers on more than one node, except "
                      f"{_POOL_LESS_POLICIES}; one node runs without it)."),
    click.option("--kv-pool-size", default=DEFAULTS["kv_pool_size"], metavar="BYTES",
                 help="Pool memory per node, e.g. 8GiB (default: a quarter of the node's free RAM, at most 64GiB)."),
    click.option("--kv-pool-protocol", default=DEFAULTS["kv_pool_protocol"], show_default=True,
                 type=click.Choice(["tcp", "rdma"]), help="Mooncake's transfer protocol between nodes."),
    click.option("--kv-pool-devices", default=DEFAULTS["kv_pool_devices"],
                 help="RDMA devices for --kv-pool-protocol rdma (e.g. mlx5_0,mlx5_1)."),
]
PRIOR_OPTION = click.option(
    "--prior", "prior_dir", default=DEFAULTS["prior_dir"], type=click.Path(path_type=Path),
    help="A finished earlier run of the same prompts: its longest response per prompt seeds each "
         "group's length estimate (matched by a hash of the prompt tokens).")
ROLLOUT_OPTIONS = [INPUT_OPTION, *ENGINE_OPTIONS, PRIOR_OPTION]
# `seerd submit`: a rollout (--input), or with --serve a serve (no input: batches come later).
SUBMIT_OPTIONS = [click.option("--input", "input_path", default=None, type=click.Path(path_type=Path),
                               help="Prompt file: .jsonl or .parquet (veRL's layout loads); not with --serve."),
                  *ENGINE_OPTIONS, PRIOR_OPTION]

ENGINE_ARG_OPTION = click.option(
    "--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
    help="Passed to vLLM's engine arguments as given (VALUE is read as JSON when it parses, e.g. "
         "enable_prefix_caching=false); repeatable.")

API_PROCESSES_OPTION = click.option(
    "--api-processes", type=click.IntRange(0, 64), default=None,
    help="Front processes that serve the coordinator's HTTP API (0: its own process). Default: "
         "none below 600 workers, 2 from there (docs/benchmarks.md).")

ALLOW_MODEL_CHANGE_OPTION = click.option(
    "--allow-model-change", is_flag=True,
    help="Resume even though the model directory's checkpoint changed since the run was created "
         "(refused otherwise); the change is recorded in the run.")


def rollout_options(command: Callable) -> Callable:
    for option in reversed(ROLLOUT_OPTIONS):
        command = option(command)
    return command


def submit_options(command: Callable) -> Callable:
    for option in reversed(SUBMIT_OPTIONS):
        command = option(command)
    return command


def engine_options(command: Callable) -> Callable:
    for option in reversed(ENGINE_OPTIONS):
        command = option(command)
    return command


def parse_engine_args(pairs: tuple[str, ...]) -> dict:
    parsed = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"expected KEY=VALUE, got {pair!r}", param_hint="--engine-arg")
        try:
            parsed[key.strip()] = json.loads(value)
        except ValueError:
            parsed[key.strip()] = value
    return parsed


LOCAL_GPUS_OPTION = click.option(
    "--gpus-per-worker", default=0, show_default=True, type=click.IntRange(min=0),
    help="GPUs of each local worker (its tensor parallel size); each worker sees only its own. 0: CPU workers.")
