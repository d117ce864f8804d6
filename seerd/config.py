"""The run's configuration: what `seerd run` was asked to do, persisted so `resume` can repeat it.

Also the rollout options' defaults and `build_config`, which turns those options into a RunConfig
for the CLI (cli/options.py declares the flags) and for `seerd.submit()` alike.
"""

from __future__ import annotations

import importlib.util
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType

import msgspec

from seerd.scheduler.registry import DAEMON_POLICIES
from seerd.settings import EngineConfig, KVPoolConfig, Sampling, SpecConfig

DEFAULT_CHUNK_TOKENS = 8192
# Slurm: after the warning signal, seconds in-flight chunks may still report before the requeue.
DEFAULT_DRAIN_GRACE_S = 120.0


class ConfigError(ValueError):
    """An impossible setting: reported to the user before any state is created."""


# Bounds of the numeric settings; each message says why. The sampling settings' ranges are vLLM's
# own (launch/engine_rules.py checks them through its SamplingParams), so none are repeated here.
MAX_TOKEN_COUNT = 2**31 - 1
MAX_RESPONSES_PER_PROMPT = 16384  # vLLM's VLLM_MAX_N_SEQUENCES default
MAX_WORKERS = 4096
MAX_NUM_SEQS = 4096
MAX_KV_CACHE_GIB = 4096.0
LEASE_TTL_RANGE_S = (1.0, 3600.0)
SEED_RANGE = (-(2**63), 2**63 - 1)

N_WHY = "vLLM's own limit on responses per prompt"
TOKENS_WHY = "vLLM keeps token positions in 32-bit integers"
WORKERS_WHY = "each worker is a vLLM engine of its own (a guard against typos)"
MAX_NUM_SEQS_WHY = ("vLLM sets aside max_model_len token slots for each sequence when the engine starts, and "
                    "batches beyond a few thousand sequences gain nothing")
KV_CACHE_WHY = "more memory than any single engine has (a guard against typos)"
LEASE_TTL_WHY = ("workers renew their leases four times per TTL but at most every 0.2 s, so a shorter TTL "
                 "expires healthy leases, and a longer one keeps a dead worker's chunks waiting that long")
SEED_WHY = "the run's database stores it as a 64-bit integer"
CONTEXT_WHY = f"room for one prompt and one generated token, and {TOKENS_WHY}"


def number_problem(flag: str, value: object, *, integer: bool = False, at_least: float | None = None,
                   above: float | None = None, at_most: float | None = None, why: str = "") -> str | None:
    """Why `value` is not a setting `flag` accepts (None if it is): the type (an int, or any real
    number for a float setting; never a bool), finite (NaN and infinity compare false with every
    bound, so they would slip past a plain range check), then the range."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        return f"{flag} must be {'an integer' if integer else 'a number'} (got {value!r})"
    if not integer and not _fits_a_float(value):
        return f"{flag} must be a finite number (got {_show(value)})"
    if ((at_least is not None and value < at_least) or (above is not None and value <= above)
            or (at_most is not None and value > at_most)):
        return f"{flag} must be {_range_text(integer, at_least, above, at_most)} (got {_show(value)})" + (
            f": {why}" if why else "")
    return None


def _range_text(integer: bool, at_least: float | None, above: float | None, at_most: float | None) -> str:
    """"in 1..16384", "in [1, 3600]", "in (0, 4096]", ">= 1" or "> 0"."""
    if at_most is None:
        return f">= {_show(at_least)}" if at_least is not None else f"> {_show(above)}"
    if integer and at_least is not None:
        return f"in {_show(at_least)}..{_show(at_most)}"
    low = f"[{_show(at_least)}" if at_least is not None else f"({_show(above)}"
    return f"in {low}, {_show(at_most)}]"


def _fits_a_float(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int too large for a float
        return False


def _show(number: float) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


ENGINE_APIS = ("auto", "stepped", "async", "sim")
KV_POOL_MODES = ("off", "mooncake")
KV_POOL_PROTOCOLS = ("tcp", "rdma")


def spec_problems(spec: SpecConfig) -> list[str]:
    from seerd.drafts.modes import SPEC_MODES

    found = []
    if spec.mode not in SPEC_MODES:
        found.append(f"--spec must be one of {', '.join(SPEC_MODES)} (got {spec.mode!r})")
    if spec.mode == "suffix" and importlib.util.find_spec("arctic_inference") is None:
        found.append("--spec suffix is vLLM's suffix decoding, which needs arctic-inference (not installed "
                     "here; see docs/speculative.md)")
    found.extend(filter(None, [
        number_problem("--spec-depth", spec.gamma_max, integer=True, at_least=1, at_most=16),
        number_problem("--spec-probe-weight", spec.probe_weight, above=0)]))
    if spec.profile_path is not None and not Path(spec.profile_path).is_file():
        found.append(f"--spec-profile {spec.profile_path} is not a file")
    if spec.history_run_dir is not None:
        if spec.mode != "grouped":
            found.append("--spec-history needs --spec grouped")
        elif not (Path(spec.history_run_dir) / "state.db").is_file():
            found.append(f"--spec-history {spec.history_run_dir}: no run there (no state.db)")
    return found


def pool_problems(pool: KVPoolConfig) -> list[str]:
    found = []
    if pool.mode not in KV_POOL_MODES:
        found.append(f"--kv-pool must be auto, {' or '.join(KV_POOL_MODES)} (got {pool.mode!r})")
    if pool.protocol not in KV_POOL_PROTOCOLS:
        found.append(f"--kv-pool-protocol must be tcp or rdma (got {pool.protocol!r})")
    if pool.protocol == "rdma" and not pool.devices:
        found.append("--kv-pool-protocol rdma needs --kv-pool-devices (e.g. mlx5_0,mlx5_1)")
    if pool.segment_bytes is not None and pool.segment_bytes < (64 << 20):
        found.append(f"--kv-pool-size must be at least 64MiB (got {pool.segment_bytes} bytes)")
    if pool.mode == "mooncake" and importlib.util.find_spec("mooncake") is None:
        found.append("--kv-pool mooncake needs mooncake-transfer-engine in the workers' environment "
                     "(tools/setup.sh installs it); use --kv-pool off to run without the pool")
    return found


def resolve_pool_mode(mode: str, *, workers: int, policy: str, gpus_per_worker: int = 0, nodes: int = 1) -> str:
    """`auto`: the pool when chunks can move between workers on different nodes (more than one
    node, a policy that moves requests); the `group` baseline (veRL) binds each group to one
    worker, so it runs without (as does an unknown policy, which `validate` reports). One node of
    CPU workers runs without it: there it measured break-even in throughput while its copies took
    up to a quarter of an engine's stepping thread, and it opens unauthenticated listeners
    (docs/kvpool.md). GPU workers use it on one node too: there a moved chunk's recomputed context
    costs GPU time the copy does not (docs/gpu.md; not run on a GPU here: `tools/gpu_check.sh` is
    what to run first)."""
    if mode != "auto":
        return mode
    entry = DAEMON_POLICIES.get(policy)
    moves_requests = entry is not None and entry.traits.moves_requests
    return "mooncake" if workers > 1 and moves_requests and (nodes > 1 or gpus_per_worker > 0) else "off"


@dataclass(frozen=True)
class RunConfig:
    input_path: str
    model_path: str
    policy: str = "seer"
    workers: int = 2
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    n: int = 4
    max_tokens: int = 1024
    seed: int = 0
    sampling: Sampling = Sampling()
    engine: EngineConfig = EngineConfig()
    lease_ttl_s: float = 30.0
    # At the start, hold every lease until all workers registered (or worker_wait_s passed); once
    # open it stays open when a worker is lost. Always on for `group`, which binds groups to
    # workers once; optional for the others.
    wait_for_workers: bool = False
    worker_wait_s: float = 300.0
    # Continue a request in its engine across chunk boundaries when the scheduler keeps it on the
    # same worker (no stop, no re-submission); False re-submits every chunk with its own seed, so
    # a seeded run's tokens do not depend on where its chunks ran (docs/architecture.md).
    in_place: bool = True
    sqlite_synchronous: str = "FULL"
    # An earlier run whose lengths seeded the group estimates (`--prior`; see coordinator/prior.py).
    prior_run_dir: str | None = None
    spec: SpecConfig = SpecConfig()
    kv_pool: KVPoolConfig = KVPoolConfig()
    # `seerd serve`: the client's key for this batch (a submission sent twice creates one batch).
    batch_key: str = ""

    def validate(self) -> None:
        problems = []
        if self.policy not in DAEMON_POLICIES:
            problems.append(f"--policy must be one of {', '.join(DAEMON_POLICIES)} (got {self.policy!r})")
        problems.extend(self._number_problems())
        if self.engine.api not in ENGINE_APIS:
            problems.append(f"--engine-api must be {', '.join(ENGINE_APIS[:-1])} or sim (got {self.engine.api!r})")
        if self.engine.api == "sim":
            problems.extend(self._sim_problems())
        if not isinstance(self.engine.extra_args, dict):
            problems.append(f"engine_args must be a dict of vLLM engine arguments (got {self.engine.extra_args!r})")
        problems.extend(spec_problems(self.spec))
        problems.extend(pool_problems(self.kv_pool))
        if problems:
            raise ConfigError("; ".join(problems))

    def _sim_problems(self) -> list[str]:
        from seerd.sim.presets import PRESETS

        found = [number_problem("--time-scale", self.engine.time_scale, above=0, at_most=1e6)]
        if self.engine.sim_preset not in PRESETS:
            found.append(f"--sim-preset must be one of {', '.join(PRESETS)} (got {self.engine.sim_preset!r})")
        if self.spec.mode != "off":
            found.append("--engine-api sim models no drafting: use --spec off")
        if self.kv_pool.mode != "off":
            found.append("--engine-api sim models no KV pool: use --kv-pool off")
        return [problem for problem in found if problem]

    def _number_problems(self) -> list[str]:
        """Type, finiteness and range of every number. The sampling options' ranges are vLLM's own:
        only their types and finiteness are checked here (see launch/engine_rules.py)."""
        engine = self.engine
        found = [
            number_problem("--workers", self.workers, integer=True, at_least=1, at_most=MAX_WORKERS,
                           why=WORKERS_WHY),
            number_problem("--chunk-tokens", self.chunk_tokens, integer=True, at_least=1, at_most=MAX_TOKEN_COUNT,
                           why=TOKENS_WHY),
            number_problem("--n", self.n, integer=True, at_least=1, at_most=MAX_RESPONSES_PER_PROMPT, why=N_WHY),
            number_problem("--max-tokens", self.max_tokens, integer=True, at_least=1, at_most=MAX_TOKEN_COUNT,
                           why=TOKENS_WHY),
            number_problem("--seed", self.seed, integer=True, at_least=SEED_RANGE[0], at_most=SEED_RANGE[1],
                           why=SEED_WHY),
            number_problem("--temperature", self.sampling.temperature),
            number_problem("--top-p", self.sampling.top_p),
            number_problem("--top-k", self.sampling.top_k, integer=True),
            number_problem("--lease-ttl", self.lease_ttl_s, at_least=LEASE_TTL_RANGE_S[0],
                           at_most=LEASE_TTL_RANGE_S[1], why=LEASE_TTL_WHY),
            number_problem("worker_wait_s", self.worker_wait_s, above=0),
            number_problem("--kv-cache-gib", engine.kv_cache_gib, above=0, at_most=MAX_KV_CACHE_GIB, why=KV_CACHE_WHY),
            number_problem("--max-num-seqs", engine.max_num_seqs, integer=True, at_least=1, at_most=MAX_NUM_SEQS,
                           why=MAX_NUM_SEQS_WHY),
        ]
        if engine.max_model_len is not None:
            found.append(number_problem("--max-model-len", engine.max_model_len, integer=True, at_least=2,
                                        at_most=MAX_TOKEN_COUNT, why=CONTEXT_WHY))
        return [problem for problem in found if problem]

    def to_json(self) -> str:
        return json.dumps(msgspec.to_builtins(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        raw = {k: v for k, v in raw.items() if k in known}
        sampling = dict(raw.pop("sampling", {}))
        sampling["stop_token_ids"] = tuple(sampling.get("stop_token_ids", ()))
        engine = EngineConfig(**raw.pop("engine", {}))
        spec = SpecConfig(**raw.pop("spec", {}))  # runs from before speculative decoding: off
        kv_pool = KVPoolConfig(**raw.pop("kv_pool", {}))  # runs from before the KV pool: off
        return cls(sampling=Sampling(**sampling), engine=engine, spec=spec, kv_pool=kv_pool, **raw)

    @property
    def model_dir(self) -> Path:
        return Path(self.model_path)


# The settings' defaults, read off instances (a msgspec Struct's class attribute is its field's
# descriptor, not its default).
_SAMPLING, _ENGINE, _SPEC, _POOL = Sampling(), EngineConfig(), SpecConfig(), KVPoolConfig()

# The options that describe a rollout, by parameter name, with their defaults: `seerd run`,
# `slurm-run` and `submit` take them as flags (cli/options.py), `seerd.submit()` as keywords.
# Where an option is one field of the config, its default is that field's.
ROLLOUT_DEFAULTS: Mapping[str, object] = MappingProxyType({
    "policy": RunConfig.policy,
    "chunk_tokens": RunConfig.chunk_tokens,
    "n": RunConfig.n,
    "max_tokens": RunConfig.max_tokens,
    "temperature": _SAMPLING.temperature,
    "top_p": _SAMPLING.top_p,
    "top_k": _SAMPLING.top_k,
    "seed": RunConfig.seed,
    "kv_cache_gib": _ENGINE.kv_cache_gib,
    "max_num_seqs": _ENGINE.max_num_seqs,
    "max_model_len": _ENGINE.max_model_len,
    "dtype": _ENGINE.dtype,
    "engine_api": _ENGINE.api,
    "sim_preset": _ENGINE.sim_preset,
    "time_scale": _ENGINE.time_scale,
    "lease_ttl": RunConfig.lease_ttl_s,
    "wait_for_workers": RunConfig.wait_for_workers,
    "in_place": RunConfig.in_place,
    "spec_mode": _SPEC.mode,
    "spec_depth": _SPEC.gamma_max,
    "spec_probe_weight": _SPEC.probe_weight,
    "spec_fixed_depth": not _SPEC.adaptive,
    "spec_profile": None,
    "spec_history_dir": None,
    "kv_pool_mode": "auto",  # resolved by resolve_pool_mode before the config is stored
    "kv_pool_size": None,  # text such as "8GiB"; None: from the node's free RAM at start
    "kv_pool_protocol": _POOL.protocol,
    "kv_pool_devices": _POOL.devices,
    "prior_dir": None,
})


def build_config(*, workers: int, input_path: Path, model_path: Path, policy: str, chunk_tokens: int, n: int,
                 max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int, kv_cache_gib: float,
                 max_num_seqs: int, max_model_len: int | None, dtype: str, engine_api: str, sim_preset: str,
                 time_scale: float, lease_ttl: float,
                 wait_for_workers: bool, in_place: bool, prior_dir: Path | None, spec_mode: str, spec_depth: int,
                 spec_probe_weight: float, spec_fixed_depth: bool, spec_profile: Path | None,
                 spec_history_dir: Path | None, kv_pool_mode: str, kv_pool_size: str | int | None,
                 kv_pool_protocol: str, kv_pool_devices: str, engine_args: dict | None = None,
                 gpus_per_worker: int = 0, nodes: int = 1, **_launcher_options: object) -> RunConfig:
    """The RunConfig the rollout options describe (not yet validated; ConfigError for a size that
    does not parse). Every option is given: the CLI passes all of its flags (and its launcher's,
    such as run_dir, which are no part of the config), `seerd.submit()` fills in ROLLOUT_DEFAULTS."""
    return RunConfig(
        input_path=str(input_path.resolve()), model_path=str(model_path.resolve()), policy=policy,
        workers=workers, chunk_tokens=chunk_tokens, n=n, max_tokens=max_tokens, seed=seed,
        sampling=Sampling(temperature=temperature, top_p=top_p, top_k=top_k),
        engine=EngineConfig(kv_cache_gib=kv_cache_gib, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                            dtype=dtype, api=engine_api, extra_args=parallel_engine_args(engine_args, gpus_per_worker),
                            sim_preset=sim_preset, time_scale=time_scale, gpus_per_worker=gpus_per_worker),
        lease_ttl_s=lease_ttl, wait_for_workers=wait_for_workers, in_place=in_place,
        prior_run_dir=_absolute(prior_dir),
        spec=SpecConfig(mode=spec_mode, gamma_max=spec_depth, probe_weight=spec_probe_weight,
                        adaptive=not spec_fixed_depth,
                        profile_path=_absolute(spec_profile), history_run_dir=_absolute(spec_history_dir)),
        kv_pool=KVPoolConfig(mode="off" if engine_api == "sim" and kv_pool_mode == "auto" else
                             resolve_pool_mode(kv_pool_mode, workers=workers, policy=policy,
                                                       gpus_per_worker=gpus_per_worker, nodes=nodes),
                             protocol=kv_pool_protocol, devices=kv_pool_devices,
                             segment_bytes=_pool_size(kv_pool_size), gpu_workers=bool(gpus_per_worker)),
    )


def parallel_engine_args(engine_args: dict | None, gpus_per_worker: int) -> dict:
    """The engine arguments with a worker's GPUs as its tensor parallel size (unless set)."""
    args = dict(engine_args or {})
    if gpus_per_worker > 1:  # a worker's GPUs are one tensor-parallel vLLM instance
        args.setdefault("tensor_parallel_size", gpus_per_worker)
    return args


def _absolute(path: str | Path | None) -> str | None:
    return str(Path(path).resolve()) if path else None


def _pool_size(text: str | int | None) -> int | None:
    from seerd.kvpool.store import parse_size  # not at the top: it loads urllib, which config users need not

    if text is None:
        return None
    try:
        return parse_size(text)
    except ValueError as exc:
        raise ConfigError(f"--kv-pool-size: {exc}") from None
