"""What a step costs on a modelled instance: decode, prefill, KV moves, and KV capacity.

Every constant comes from a public figure or is a stated assumption; none was fitted to the
Seer paper's results. The formulas (per instance of N GPUs):

    decode step (B sequences, C context tokens in the batch):
        T(B, C) = t_overhead + t_comm(B) + max(mem(B, C) / (N * hbm_bw * mem_eff),
                                               flops(B, C) / (N * peak_flops * mfu))
        mem(B, C)   = weight bytes read + C * kv_bytes_per_token
                      (a MoE reads its dense part plus the experts the B tokens touch:
                       expert_bytes * (1 - (1 - k/E) ** B), each token picking k of E experts)
        flops(B, C) = 2 * active_params * B + 4 * layers * attn_dim * C
    prefill of p new tokens after c cached ones (compute bound):
        2 * active_params * p + 4 * layers * attn_dim * (p * c + p * p / 2),
        at N * peak_flops * prefill_mfu, plus one read of the weights
    KV pool load of a context of c tokens:
        c * kv_bytes_per_token / (N * nic_bw * nic_eff)

T is linear in C inside each regime, so a segment of k steps at constant B whose context grows by
B per step is summed exactly (`segment_time`), and the simulator jumps from event to event instead
of stepping token by token.

Speculative decoding (`drafts` > 0, D draft tokens in the batch): one step verifies Q = B + D
tokens in a single forward, so everything that scales with the tokens of a step scales with Q:
    flops = 2 * active_params * Q + 4 * layers * attn_dim * C * Q / B   (each query token attends
            to its sequence's context: exact when every sequence drafts alike)
    MoE expert bytes for the experts Q tokens touch; communication per token for Q tokens;
while the weights and the KV are still read once per step. On a memory-bound decode step extra
verified tokens are therefore nearly free until compute binds. The drafter's own CPU time,
`draft_s_per_request` per sequence, is added to a step that drafts. The context then grows by the
tokens accepted, `growth` per step (B without drafts).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seerd.drafts.policy import StepTimeModel


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    peak_flops: float  # dense BF16 FLOP/s
    nic_bw: float  # bytes/s per GPU to other nodes (RDMA)


# H800 SXM: the H100 SXM die and memory (80 GB HBM3, 3.35 TB/s, 989 TFLOP/s dense BF16 per
# NVIDIA's H100 datasheet) with NVLink cut to 400 GB/s; one ConnectX-7 400 Gb/s NIC per GPU,
# ~50 GB/s usable (DeepEP's README, measured on H800).
H800 = Gpu("H800-SXM", hbm_bytes=80e9, hbm_bw=3.35e12, peak_flops=989e12, nic_bw=50e9)


@dataclass(frozen=True)
class Efficiency:
    """Assumptions, not measurements: round figures commonly reached by tuned kernels."""

    mem_eff: float = 0.80  # achieved / peak HBM bandwidth in decode (GEMV, paged attention)
    decode_mfu: float = 0.50  # only binds at very large batches
    prefill_mfu: float = 0.50  # long-prompt prefill on Hopper
    nic_eff: float = 0.80  # achieved / usable NIC bandwidth for bulk KV transfers
    step_overhead_s: float = 0.003  # scheduler, sampling, launch per engine step (CUDA graphs)
    gpu_memory_utilization: float = 0.90  # vLLM's default
    activation_reserve_bytes: float = 4e9  # per GPU: activations, CUDA graphs, NCCL buffers
    # Drafting on the host per sequence per step that drafts: seerd's suffix index proposes in
    # 13-17 us at the median (tools/bench/drafts.py, docs/speculative.md); the paper gives none.
    draft_s_per_request: float = 15e-6


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    attn_dim: int  # query heads x head dim (attention FLOPs per context token)
    kv_bytes_per_token: int  # over all layers, as vLLM caches it
    total_params: float
    active_params: float  # per token
    weight_bytes: float  # on the GPUs, whole model
    expert_bytes: float = 0.0  # the routed experts' share of weight_bytes (MoE only)
    experts: int = 0
    experts_per_token: int = 0


@dataclass(frozen=True)
class Parallelism:
    gpus: int  # per instance
    # per-layer communication per decode step: a fixed latency and bytes per token in the batch
    comm_latency_per_layer_s: float = 0.0
    comm_bytes_per_token_per_layer: float = 0.0
    comm_bw: float = 1.0  # bytes/s of the link the per-token bytes cross
    replicated_bytes: float = 0.0  # weight bytes every GPU reads in full (data-parallel attention)


class InstanceCosts:
    """The cost model of one instance (N GPUs running one engine)."""

    def __init__(self, model: ModelShape, par: Parallelism, gpu: Gpu = H800,
                 eff: Efficiency = Efficiency()) -> None:
        self.model, self.par, self.gpu, self.eff = model, par, gpu, eff
        n = par.gpus
        self._bw = n * gpu.hbm_bw * eff.mem_eff
        self._decode_flops = n * gpu.peak_flops * eff.decode_mfu
        self._prefill_flops = n * gpu.peak_flops * eff.prefill_mfu
        self._attn = 4.0 * model.layers * model.attn_dim
        self._kv = float(model.kv_bytes_per_token)
        # Data-parallel attention reads its replicated weights on every GPU: N times the bytes.
        self._dense_bytes = model.weight_bytes - model.expert_bytes + par.replicated_bytes * (n - 1)

    # ------------------------------------------------------------- capacity
    def kv_capacity_tokens(self) -> int:
        """What vLLM would allocate: memory x utilization, minus weights and a reserve."""
        n = self.par.gpus
        per_gpu_weights = self.model.weight_bytes / n + self.par.replicated_bytes * (n - 1) / n
        free = self.gpu.hbm_bytes * self.eff.gpu_memory_utilization - per_gpu_weights - self.eff.activation_reserve_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {n} x {self.gpu.name}")
        return int(free * n / self._kv)

    # ------------------------------------------------------------- decode
    def _weight_bytes(self, batch: int) -> float:
        m = self.model
        if not m.experts:
            return self._dense_bytes
        touched = 1.0 - (1.0 - m.experts_per_token / m.experts) ** batch
        return self._dense_bytes + m.expert_bytes * touched

    def _comm(self, batch: int) -> float:
        p = self.par
        return self.model.layers * (p.comm_latency_per_layer_s + batch * p.comm_bytes_per_token_per_layer / p.comm_bw)

    def _linear_terms(self, batch: int, drafts: int = 0) -> tuple[float, float, float, float, float]:
        """T(B, C) = fixed + max(m0 + m1 * C, f0 + f1 * C), for a step verifying B + drafts tokens."""
        tokens = batch + drafts
        fixed = self.eff.step_overhead_s + self._comm(tokens)
        if drafts:
            fixed += self.eff.draft_s_per_request * batch
        m0, m1 = self._weight_bytes(tokens) / self._bw, self._kv / self._bw
        f0 = 2.0 * self.model.active_params * tokens / self._decode_flops
        f1 = self._attn * (tokens / batch) / self._decode_flops
        return fixed, m0, m1, f0, f1

    def step_time(self, batch: int, context: float, drafts: int = 0) -> float:
        fixed, m0, m1, f0, f1 = self._linear_terms(batch, drafts)
        return fixed + max(m0 + m1 * context, f0 + f1 * context)

    def segment_time(self, batch: int, context: float, steps: int, drafts: int = 0,
                     growth: float | None = None) -> float:
        """Time of `steps` decode steps at `batch` with `drafts` draft tokens per step, the context
        growing by `growth` tokens each step (`batch` when None: one token per sequence)."""
        if steps <= 0 or batch <= 0:
            return 0.0
        fixed, m0, m1, f0, f1 = self._linear_terms(batch, drafts)
        growth = batch if growth is None else growth
        # Term i (0-based) has context context + i * growth; both regimes are linear in i.
        a_mem, b_mem = m0 + m1 * context, m1 * growth
        a_flop, b_flop = f0 + f1 * context, f1 * growth

        def arith(a: float, b: float, i0: int, i1: int) -> float:  # sum_{i=i0}^{i1-1} a + b*i
            count = i1 - i0
            return a * count + b * (i0 + i1 - 1) * count / 2.0 if count > 0 else 0.0

        # gap(i) = mem(i) - flops(i) is linear: the max switches regime at most once.
        gap_a, gap_b = a_mem - a_flop, b_mem - b_flop
        if gap_b == 0.0:
            mem_first, split = gap_a >= 0, steps
        else:
            crossing = -gap_a / gap_b  # gap(crossing) == 0
            mem_first = gap_b < 0  # a shrinking gap: memory-bound until the crossing
            split = min(steps, max(0, math.floor(crossing) + 1 if mem_first else math.ceil(crossing)))
        if mem_first:
            body = arith(a_mem, b_mem, 0, split) + arith(a_flop, b_flop, split, steps)
        else:
            body = arith(a_flop, b_flop, 0, split) + arith(a_mem, b_mem, split, steps)
        return fixed * steps + body

    def steps_within(self, batch: int, context: float, max_steps: int, budget_s: float, drafts: int = 0,
                     growth: float | None = None) -> int:
        """The largest k <= max_steps whose segment_time fits in budget_s (binary search)."""
        lo, hi = 0, max_steps
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.segment_time(batch, context, mid, drafts, growth) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ------------------------------------------------------------- prefill and moves
    def prefill_time(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """Compute-bound prefill of new_tokens after cached_tokens already in KV."""
        if new_tokens <= 0:
            return 0.0
        p, c = new_tokens, cached_tokens
        flops = 2.0 * self.model.active_params * p + self._attn * (p * c + p * p / 2.0)
        return flops / self._prefill_flops + self.model.weight_bytes / self._bw

    def pool_load_time(self, tokens: float) -> float:
        """Pull a context's KV from the global pool over the instance's NICs."""
        return tokens * self._kv / (self.par.gpus * self.gpu.nic_bw * self.eff.nic_eff)

    def describe(self) -> dict:
        return {
            "gpu": self.gpu.name, "gpus_per_instance": self.par.gpus, "model": self.model.name,
            "kv_bytes_per_token": self.model.kv_bytes_per_token, "kv_capacity_tokens": self.kv_capacity_tokens(),
            "decode_step_ms_b1_c4k": round(1e3 * self.step_time(1, 4096), 2),
            "decode_step_ms_b128_c1m": round(1e3 * self.step_time(128, 1_000_000), 2),
            "prefill_s_8k": round(self.prefill_time(8192), 3),
        }


class ProfiledCosts:
    """A cost model measured on a real engine (`tools/profile_engine.py`) instead of derived:

        decode step  T(B, C) = a + b * B + c * C        (least squares over measured steps)
        prefill      P(p)    = f + g * p                 (per admission batch of p new tokens)

        pool load   L(c)    = h + k * c                 (optional: a context of c tokens from the KV pool)

    Same interface as `InstanceCosts`, so the simulator can predict a run on this machine's
    vLLM-CPU workers. A profile without `pool_load` (taken before the pool existed) costs a pool
    load as a recompute; `tools/bench/kvpool.py --write-pool-load PROFILE` measures it.

    Steps with drafts need a spec profile (`tools/profile_spec_steps.py`, a
    `seerd.drafts.policy.StepTimeModel`: S(B, gamma) measured with gamma drafts per sequence):
        T(B, C, D) = T(B, C) * S(B, D/B) / S(B, 0) + draft_s_per_request * B
    The spec profile was taken on another model and context than the decode profile, so only
    its relative cost of verifying drafts is used (S between whole depths is linear in the
    depth; past the profile's largest batch, that batch's ratio); the drafting time is the spec
    profile's, absolute. The profile's noise (at B=2 the
    shipped CPU profile has depth 3 faster than depth 0) is removed by a running maximum over
    the depth, so a draft token never makes a step cheaper.
    """

    def __init__(self, profile: dict, kv_capacity_tokens: int, spec_profile: StepTimeModel | None = None) -> None:
        self.profile = profile
        self.a, self.b, self.c = profile["decode"]["a"], profile["decode"]["b"], profile["decode"]["c"]
        self.f, self.g = profile["prefill"]["f"], profile["prefill"]["g"]
        self._kv_capacity = kv_capacity_tokens
        self.spec_profile = spec_profile
        self._verify = None if spec_profile is None else _monotone_verification(spec_profile)

    @classmethod
    def load(cls, path: Path, kv_capacity_tokens: int, spec_profile: StepTimeModel | None = None) -> ProfiledCosts:
        return cls(json.loads(Path(path).read_text()), kv_capacity_tokens, spec_profile)

    def kv_capacity_tokens(self) -> int:
        return self._kv_capacity

    def _draft_factor(self, batch: int, drafts: int) -> tuple[float, float]:
        """(the verification time of a step with `drafts` over one without, the drafting time)."""
        if self._verify is None:
            raise ValueError(f"profile {self.profile.get('name', 'measured')} has no spec profile: "
                             "steps with drafts cannot be costed")
        depth = drafts / batch
        low = min(int(depth), self._verify.gamma_max)
        high = min(low + 1, self._verify.gamma_max)
        measured = min(batch, self._verify.batch_sizes[-1])  # past the profile: its largest batch's ratio
        s_low, s_high = self._verify.step_time(measured, low), self._verify.step_time(measured, high)
        drafted = s_low + (s_high - s_low) * (depth - low)
        return drafted / self._verify.step_time(measured, 0), self.spec_profile.draft_s_per_request * batch

    def step_time(self, batch: int, context: float, drafts: int = 0) -> float:
        plain = self.a + self.b * batch + self.c * context
        if not drafts:
            return plain
        factor, drafting = self._draft_factor(batch, drafts)
        return plain * factor + drafting

    def segment_time(self, batch: int, context: float, steps: int, drafts: int = 0,
                     growth: float | None = None) -> float:
        if steps <= 0 or batch <= 0:
            return 0.0
        growth = batch if growth is None else growth
        plain = steps * self.step_time(batch, context) + self.c * growth * steps * (steps - 1) / 2.0
        if not drafts:
            return plain
        factor, drafting = self._draft_factor(batch, drafts)
        return plain * factor + drafting * steps

    steps_within = InstanceCosts.steps_within

    def prefill_time(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        return self.f + self.g * new_tokens if new_tokens > 0 else 0.0

    def pool_load_time(self, tokens: float) -> float:
        load = self.profile.get("pool_load")
        if load is None:
            return self.prefill_time(tokens)
        return load["h"] + load["k"] * tokens

    def describe(self) -> dict:
        return {"profile": self.profile.get("name", "measured"), "kv_capacity_tokens": self._kv_capacity,
                "pool_load_ms_1k": round(1e3 * self.pool_load_time(1024), 2),
                "decode_step_ms_b1_c100": round(1e3 * self.step_time(1, 100), 2),
                "decode_step_ms_b32_c8k": round(1e3 * self.step_time(32, 8192), 2),
                "prefill_ms_256": round(1e3 * self.prefill_time(256), 2)}


def _monotone_verification(spec_profile: StepTimeModel) -> StepTimeModel:
    """The profile's verification time alone (drafting is charged apart), non-decreasing in depth."""
    rows = []
    for row in spec_profile.seconds:
        running, out = 0.0, []
        for seconds in row:
            running = max(running, seconds)
            out.append(running)
        rows.append(tuple(out))
    return replace(spec_profile, seconds=tuple(rows), draft_s_per_request=0.0)
