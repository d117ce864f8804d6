"""The typed settings a run hands its parts: what each worker's engine runs with, its drafter, the
job's KV pool, and a chunk's sampling. Each default is stated here once: the run's configuration
(`seerd.config.RunConfig`) holds these types, the wire protocol (`seerd.protocol`) carries them to
the workers as they are, and the workers read their fields. Validation of the values a user gives
lives with the options (`seerd.config`); this module imports nothing else from seerd."""

from __future__ import annotations

import msgspec


class Sampling(msgspec.Struct, frozen=True):
    """How a chunk samples: the run's options, a prompt row's own where it gives them, and per
    chunk a seed derived from (rollout or row seed, group, response, chunk index)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off (vLLM's)
    seed: int | None = None  # a row's own seed; None: the rollout's
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate past the model's EOS, as vLLM's option


SAMPLING_KEYS = Sampling.__struct_fields__  # what a prompt row may set for its own group


class EngineConfig(msgspec.Struct, frozen=True):
    """Settings of each worker's engine."""

    kv_cache_gib: float = 1.0
    max_model_len: int | None = None  # None: the model's own maximum
    max_num_seqs: int = 64
    # auto: on a CPU worker a float32 checkpoint runs in float32, else vLLM's own choice
    # (seerd.worker.vllm_args.engine_dtype)
    dtype: str = "auto"
    api: str = "auto"  # "stepped" (LLMEngine in-process), "async" (AsyncLLM); auto: async with CUDA;
    # "sim": the simulator's model of an engine (seerd/worker/sim_engine.py), no vLLM
    extra_args: dict = msgspec.field(default_factory=dict)  # passed to vLLM's engine arguments as given
    sim_preset: str = "cpu-tiny"  # api "sim": the `seerd sim` preset whose engine model (costs, KV) runs
    time_scale: float = 1.0  # api "sim": modelled engine seconds per wall second
    # GPUs per worker (its tensor parallel size): local workers each see their own (rank r: GPUs
    # r*g .. r*g+g-1 of the node's visible ones); 0: CPU workers, or devices left as they are.
    gpus_per_worker: int = 0


class SpecConfig(msgspec.Struct, frozen=True):
    """Speculative decoding in each worker's engine (see seerd/drafts/)."""

    mode: str = "off"  # off | ngram (vLLM's) | suffix (vLLM's, needs arctic-inference) | grouped | request
    gamma_max: int = 8  # most draft tokens per request per step
    probe_weight: float = 2.0  # lambda: a probe's accepted token counts this much more when sharing depth
    adaptive: bool = True  # grouped/request: pick the depth per step from the step-time profile
    profile_path: str | None = None  # the engine's T(B, gamma) profile; None: the one shipped for this device
    history_run_dir: str | None = None  # an earlier rollout of the same prompts: its responses seed the groups


class KVPoolConfig(msgspec.Struct, frozen=True):
    """The job's global KV pool (see seerd/kvpool/): a chunk continues on any worker without
    recomputing its context. `seerd run` resolves its `auto` before the config is stored."""

    mode: str = "off"  # off | mooncake (runs stored before the pool existed read as off)
    protocol: str = "tcp"  # mooncake's transfer protocol: tcp, or rdma on clusters
    devices: str = ""  # RDMA devices (e.g. "mlx5_0,mlx5_1"), empty for tcp
    segment_bytes: int | None = None  # pool memory per node; None: from the node's free RAM at start
    gpu_workers: bool = False  # the workers' engines run on GPUs (known to slurm-run and submit)


class PoolSettings(KVPoolConfig, frozen=True):
    """The pool as a worker's engine connects to it: the run's pool settings, and what scopes its
    blocks' keys (the coordinator's tag for the run and the model's revision)."""

    run_tag: str = ""
    model_revision: str = ""
    local_host: str | None = None  # the address the engine's store client announces; None: its own
