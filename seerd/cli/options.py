"""The options that describe a rollout, shared by `seerd run`, `seerd slurm-run` and `seerd submit`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import click

from seerd.config import DEFAULT_CHUNK_TOKENS, EngineConfig, KVPoolConfig, RunConfig, SamplingDefaults, SpecConfig
from seerd.kvpool.store import parse_size

ROLLOUT_OPTIONS = [
    click.option("--input", "input_path", required=True, type=click.Path(path_type=Path),
                 help="Prompt file: .jsonl or .parquet (veRL's layout loads)."),
    click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
                 help="Model directory (Hugging Face layout) that vLLM loads."),
    click.option("--run-dir", required=True, type=click.Path(path_type=Path),
                 help="Where the run's database, secret, logs and outputs live."),
    click.option("--policy", default="seer", show_default=True, type=click.Choice(["seer", "divided", "group"]),
                 help="seer: context-aware (probes first, then longest estimate); divided: chunked FCFS; "
                      "group: veRL baseline."),
    click.option("--chunk-tokens", default=DEFAULT_CHUNK_TOKENS, show_default=True,
                 help="Tokens per chunk before a request goes back to the queue."),
    click.option("--n", "n", default=4, show_default=True, help="Responses per prompt (rows may override)."),
    click.option("--max-tokens", default=1024, show_default=True, help="Response budget (rows may override)."),
    click.option("--temperature", default=1.0, show_default=True),
    click.option("--top-p", default=1.0, show_default=True),
    click.option("--top-k", default=-1, show_default=True),
    click.option("--seed", default=0, show_default=True),
    click.option("--kv-cache-gib", default=1.0, show_default=True, help="KV cache per worker engine."),
    click.option("--max-num-seqs", default=64, show_default=True, help="Concurrent sequences per engine."),
    click.option("--max-model-len", default=None, type=int, help="Engine context limit (default: the model's)."),
    click.option("--dtype", default="auto", show_default=True, help="Engine dtype (auto, float32, bfloat16)."),
    click.option("--engine-api", default="auto", show_default=True, type=click.Choice(["auto", "stepped", "async"]),
                 help="vLLM driver: stepped = LLMEngine in the worker process; async = AsyncLLM "
                      "(auto: async with CUDA)."),
    click.option("--lease-ttl", default=30.0, show_default=True, help="Seconds a lease lives without a heartbeat."),
    click.option("--wait-for-workers", is_flag=True,
                 help="Hand out no work until every worker is up (always so for --policy group)."),
    click.option("--spec", "spec_mode", default="off", show_default=True,
                 type=click.Choice(["off", "ngram", "suffix", "grouped", "request"]),
                 help="Speculative decoding: grouped = drafts from all sibling responses of the group (Seer); "
                      "request = the response's own tokens only; ngram/suffix = vLLM's own methods."),
    click.option("--spec-depth", default=8, show_default=True, help="Most draft tokens per request per step."),
    click.option("--spec-probe-weight", default=2.0, show_default=True,
                 help="How much more a probe's accepted token counts when draft depth is shared out."),
    click.option("--spec-fixed-depth", is_flag=True,
                 help="Always draft --spec-depth tokens (no adaptive depth; for comparisons)."),
    click.option("--spec-profile", default=None, type=click.Path(path_type=Path),
                 help="Step-time profile T(B, gamma) of this engine (tools/profile_spec_steps.py writes one)."),
    click.option("--spec-history", "spec_history_dir", default=None, type=click.Path(path_type=Path),
                 help="An earlier rollout of the same prompts: its responses seed each group's draft index."),
    click.option("--kv-pool", "kv_pool_mode", default="auto", show_default=True,
                 type=click.Choice(["auto", "off", "mooncake"]),
                 help="Global KV pool: a chunk continues on any worker loading its context's KV instead of "
                      "recomputing it (auto: mooncake with more than one worker, except --policy group)."),
    click.option("--kv-pool-size", default=None, metavar="BYTES",
                 help="Pool memory per node, e.g. 8GiB (default: a quarter of the node's free RAM, at most 64GiB)."),
    click.option("--kv-pool-protocol", default="tcp", show_default=True, type=click.Choice(["tcp", "rdma"]),
                 help="Mooncake's transfer protocol between nodes."),
    click.option("--kv-pool-devices", default="", help="RDMA devices for --kv-pool-protocol rdma (e.g. mlx5_0,mlx5_1)."),
    click.option("--prior", "prior_dir", default=None, type=click.Path(path_type=Path),
                 help="A finished earlier run of the same prompts: its longest response per prompt seeds each "
                      "group's length estimate (matched by a hash of the prompt tokens)."),
]

ENGINE_ARG_OPTION = click.option(
    "--engine-arg", "engine_args", multiple=True, metavar="KEY=VALUE",
    help="Passed to vLLM's engine arguments as given (VALUE is read as JSON when it parses, e.g. "
         "enable_prefix_caching=false); repeatable.")


def rollout_options(command: Callable) -> Callable:
    for option in reversed(ROLLOUT_OPTIONS):
        command = option(command)
    return command


def rollout_defaults() -> dict:
    """Each rollout option's default, by parameter name (what `seerd.submit(...)` also uses)."""
    params = rollout_options(lambda **_: None).__click_params__
    return {param.name: (param.default is True) if getattr(param, "is_flag", False) else param.default
            for param in params if param.name not in ("input_path", "model_path", "run_dir")}


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


def build_config(*, workers: int, input_path: Path, model_path: Path, policy: str, chunk_tokens: int, n: int,
                 max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int, kv_cache_gib: float,
                 max_num_seqs: int, max_model_len: int | None, dtype: str, engine_api: str, lease_ttl: float,
                 wait_for_workers: bool, prior_dir: Path | None, engine_args: dict | None = None,
                 spec_mode: str = "off", spec_depth: int = 8, spec_probe_weight: float = 2.0,
                 spec_fixed_depth: bool = False, spec_profile: Path | None = None,
                 spec_history_dir: Path | None = None, kv_pool_mode: str = "auto", kv_pool_size: str | None = None,
                 kv_pool_protocol: str = "tcp", kv_pool_devices: str = "", gpus_per_worker: int = 0,
                 **_launcher_options: object) -> RunConfig:
    """The RunConfig the rollout options describe (not yet validated)."""
    return RunConfig(
        input_path=str(input_path.resolve()), model_path=str(model_path.resolve()), policy=policy,
        workers=workers, chunk_tokens=chunk_tokens, n=n, max_tokens=max_tokens, seed=seed,
        sampling=SamplingDefaults(temperature=temperature, top_p=top_p, top_k=top_k),
        engine=EngineConfig(kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                            dtype=dtype, api=engine_api, extra_args=dict(engine_args or {})),
        lease_ttl_s=lease_ttl, wait_for_workers=wait_for_workers,
        prior_run_dir=str(prior_dir.resolve()) if prior_dir is not None else None,
        spec=SpecConfig(mode=spec_mode, gamma_max=spec_depth, probe_weight=spec_probe_weight,
                        adaptive=not spec_fixed_depth,
                        profile_path=str(spec_profile.resolve()) if spec_profile is not None else None,
                        history_run_dir=str(spec_history_dir.resolve()) if spec_history_dir else None),
        kv_pool=KVPoolConfig(mode=KVPoolConfig.resolve_mode(kv_pool_mode, workers=workers, policy=policy,
                                                            gpus_per_worker=gpus_per_worker),
                             protocol=kv_pool_protocol, devices=kv_pool_devices,
                             segment_bytes=_pool_size(kv_pool_size), gpu_workers=bool(gpus_per_worker)),
    )


def _pool_size(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--kv-pool-size") from None
