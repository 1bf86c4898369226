"""The engine protocol and the result types every rollout engine returns.

An engine samples `n` responses per prompt and records, for each response token a_t, the log-probability
log µ(a_t|s_t) of the distribution it actually sampled from (after temperature), and optionally µ's top-K
ids and log-probs in the fixed [T, K+1] layout of spec §2 (top-K sorted by µ, plus the sampled token in the
last slot when it is not among them; `topk_valid` marks used slots). The trainer uses `rollout_logp` as the
trust-region anchor and the top-K cells for the Top-K divergences (Eqs. 15-16).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

FinishReason = Literal["eos", "length", "stop"]
EnginePrompt = Sequence[int] | Sequence[dict]
"""What an engine samples from: token ids (used as they are) or chat messages ([{"role": ..., "content": ...}, ...],
rendered by the engine's chat template with the generation prompt). A task's `dppo.example.Prompt` (text or
messages) becomes one through `dppo.episodes.single.engine_prompts`."""


@dataclass(frozen=True)
class SamplingParams:
    """What to sample. Validated on construction; engines check the engine-specific limits (K cap, context)."""

    n: int = 1
    """Responses per prompt (the group size G)."""
    temperature: float = 1.0
    """Sampling temperature; the recorded log-probs are those of softmax(logits / temperature)."""
    max_new_tokens: int = 64
    """Maximum response length T."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end a response (the tokenizer's EOS always does). The stop token is kept."""
    top_k_logprobs: int = 0
    """K: record µ's top-K ids/log-probs per token (0 = off). Needed by the Top-K trust regions."""
    top_p: float = 1.0
    """Nucleus truncation. < 1 changes µ; refused together with top_k_logprobs > 0."""
    top_k: int = 0
    """Top-k truncation of sampling (0 = off). Changes µ; refused together with top_k_logprobs > 0."""
    min_p: float = 0.0
    """Min-p truncation (0 = off): after the temperature, tokens with probability below min_p × the most likely
    token's are dropped (before top_k / top_p, as vLLM applies it). Changes µ; refused with top_k_logprobs > 0."""
    seed: int | None = None
    """Seed for this call (HF engine). The vLLM engine is seeded at construction (see its module)."""

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n: expected >= 1, got {self.n}")
        if not self.temperature > 0:
            raise ValueError(f"temperature: expected > 0, got {self.temperature}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {self.max_new_tokens}")
        if self.top_k_logprobs < 0:
            raise ValueError(f"top_k_logprobs: expected >= 0, got {self.top_k_logprobs}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: expected in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: expected >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p: expected in [0, 1], got {self.min_p}")
        if self.top_k_logprobs > 0 and (self.top_p < 1 or self.top_k > 0 or self.min_p > 0):
            raise ValueError(
                "top_p/top_k/min_p: truncated sampling changes µ, so the recorded top-K log-probs would not be "
                "those of the sampled distribution; use top_p=1, top_k=0 and min_p=0 with top_k_logprobs > 0"
            )


@dataclass
class Episode:
    """What a rollout's episode recorded besides its tokens: its counters, its transcript, its contained error.

    Every rollout the sources return is an episode: a single answer is a one-turn episode
    (`dppo.episodes.single`), whose counters stay 0 except `env_errors` / `env_timeouts` (its reward raised or
    timed out); a multi-turn episode (`dppo.episodes.env_loop`, `dppo.episodes.agent_loop`) fills them."""

    completion: str = ""
    """The text the samples file shows: the decoded response (single-turn), or the whole transcript with the
    environment's messages marked `[env]` and a contained error appended (multi-turn)."""
    messages: list[dict] = field(default_factory=list)
    """The transcript as chat messages (multi-turn; empty for a single answer)."""
    error: str | None = None
    """The environment's contained error, if the episode ended on one."""
    turns: float = 1.0
    """Assistant turns."""
    turns_truncated: float = 0.0
    """Turns cut by their max_new_tokens."""
    tool_calls: float = 0.0
    tool_errors: float = 0.0
    tool_timeouts: float = 0.0
    tool_truncated: float = 0.0
    env_errors: float = 0.0
    """1 when the environment (or a single answer's reward) raised: counted as a reward failure of the step."""
    env_timeouts: float = 0.0
    """1 when the environment (or a single answer's reward) ran past its limit: a reward timeout of the step."""
    truncated: float = 0.0
    """1 when the episode ran out of turns or tokens."""
    env_tokens: float = 0.0
    """Response tokens the environment wrote (loss mask 0)."""
    refused_calls: float = 0.0
    """Calls of an agent's episode that the proxy refused (`dppo.episodes.proxy`)."""
    success: float = math.nan
    """1.0 / 0.0 when the environment said whether the episode succeeded (`EnvStep.info["success"]`, the last
    value given), else NaN: then the reward decides (`dppo.episodes.results.episode_success`: reward >= 1)."""


@dataclass
class Rollout:
    """One sampled response. T = number of response tokens (including a final EOS/stop token)."""

    prompt_index: int
    """Index of the prompt in the `generate` call (responses come prompt-major: prompt 0's n, then 1's ...)."""
    prompt_ids: Tensor
    """[P] int64, the prompt's token ids (after the chat template)."""
    response_ids: Tensor
    """[T] int64."""
    rollout_logp: Tensor
    """[T] float32, log µ(a_t|s_t) of the temperature-scaled distribution sampled from."""
    finish_reason: FinishReason
    weight_version: int = 0
    """The engine's weight version when this response started (incremented by every `load_weights`; an async
    rollout worker sets it to the published version: optimiser steps behind the weights)."""
    token_versions: Tensor | None = None
    """[T] int64: the weight version that sampled each token (differs from `weight_version` only after an
    in-flight weight update, rollout.in_flight_updates; engines that do not record it leave None)."""
    rollout_topk_ids: Tensor | None = None
    """[T, K+1] int64: µ's top-K ids sorted by µ descending, then the sampled id if not among them (else 0)."""
    rollout_topk_logp: Tensor | None = None
    """[T, K+1] float32: µ's log-probs at topk_ids (0 where invalid)."""
    rollout_topk_valid: Tensor | None = None
    """[T, K+1] bool: True where the slot is used (first K always; the last only for an out-of-top-K token)."""
    rollout_kept_size: Tensor | None = None
    """[T] int64: the size of the kept set each token was sampled from, under top_k/top_p truncation (the tokens the
    truncation leaves; `rollout_logp` is then log µ_S, of the truncated and renormalised distribution; the replay:
    `dppo.kept_set`). None = untruncated sampling, or an engine that does not record it."""
    loss_mask: Tensor | None = None
    """[T] bool: True where the policy sampled the token (multi-turn episodes: False on the environment's tokens,
    whose `rollout_logp` is 0 and top-K cells invalid). None = every token was sampled (single-turn)."""
    turn_index: Tensor | None = None
    """[T] int64: the assistant turn each token belongs to (episodes; None for single-turn responses)."""
    reward: float | None = None
    """The episode's reward (set by its environment; every rollout a `RolloutSource` returns has one; an engine's
    raw `generate` leaves None)."""
    episode: Episode = field(default_factory=Episode)
    """The episode's record (its counters, transcript and contained error)."""
    engine: int = 0
    """The fleet member that sampled it (rollout.fleet, `dppo.rollout.fleet`; 0 for a single engine)."""
    row: int = 0
    """The row's place in its episode: 0 for the first (or only) row, which carries the episode's record. An agent's
    episode through the proxy (`dppo.episodes.agent_rows`) may be several rows (a call that does not extend an earlier
    row starts one); its rows follow each other and share its reward and advantage."""


def topk_cells(tokens: Tensor, logp: Tensor, top_ids: Tensor, top_logp: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """µ's cells in the fixed [..., K+1] layout (spec §2), from the sampled tokens [...] with their log-probs and
    µ's top-K ids/log-probs [..., K] (sorted by µ): the top-K, then the sampled token in the last slot when it is
    not among them (id 0 and log-prob 0 otherwise); `valid` marks the used slots (the first K always). Every engine
    and adapter builds the layout here."""
    in_topk = (top_ids == tokens[..., None]).any(-1)
    valid = torch.ones(top_ids.shape[:-1] + (top_ids.shape[-1] + 1,), dtype=torch.bool, device=top_ids.device)
    valid[..., -1] = ~in_topk
    ids = torch.cat([top_ids, torch.where(in_topk, 0, tokens)[..., None]], -1)
    cells = torch.cat([top_logp, torch.where(in_topk, 0.0, logp.to(top_logp.dtype))[..., None]], -1)
    return ids, cells, valid


def prompt_token_ids(
    prompts: Sequence[EnginePrompt],
    params: SamplingParams,
    *,
    tokenizer,
    vocab_size: int,
    max_logprobs: int,
    max_context: int | None,
) -> list[list[int]]:
    """Token ids of every prompt (chat messages go through the tokenizer's chat template with the generation
    prompt), validated against the engine's limits before anything is generated. Every failure is a
    ValueError naming the parameter: empty list, K above the cap, stop ids or prompt ids outside the
    vocabulary, raw strings, an empty prompt, prompt + max_new_tokens longer than the context."""
    if len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list")
    if params.top_k_logprobs > max_logprobs:
        raise ValueError(f"top_k_logprobs: {params.top_k_logprobs} exceeds this engine's max_logprobs {max_logprobs}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids: ids {bad} outside the vocabulary [0, {vocab_size})")
    ids = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, Tensor):
            p = [int(t) for t in prompt.reshape(-1).tolist()]
        elif isinstance(prompt, str):
            raise ValueError(f"prompts: prompt {i} is a string; pass token ids or chat messages")
        elif len(prompt) > 0 and isinstance(prompt[0], Mapping):
            if tokenizer is None:
                raise ValueError(f"prompts: prompt {i} is chat messages, but the engine has no tokenizer")
            out = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            p = list(out["input_ids"] if isinstance(out, Mapping) else out)
        else:
            p = [int(t) for t in prompt]
        if not p:
            raise ValueError(f"prompts: prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompts: prompt {i} has token ids outside the vocabulary [0, {vocab_size})")
        if max_context is not None and len(p) + params.max_new_tokens > max_context:
            raise ValueError(
                f"max_new_tokens: prompt {i} has {len(p)} tokens; {len(p)} + max_new_tokens "
                f"{params.max_new_tokens} exceeds the model's context {max_context}"
            )
        ids.append(p)
    return ids


@runtime_checkable
class Engine(Protocol):
    """What the trainer needs from an inference engine, optional capabilities included: an engine without one
    declares it in the neutral form (`between_chunks = None`, `enable_prefix_cache` a no-op), so no caller probes
    for a method."""

    max_logprobs: int
    """Largest K the engine can return (top_k_logprobs above it is refused before generation)."""
    weight_version: int
    tokenizer: Any
    """The tokenizer of the engine's model (chat templates, decoding; episodes tokenise through it)."""
    between_chunks: Callable[[], bool] | None
    """In-flight weight updates: called between decode chunks (and between an episode's turns) to load newer
    weights, returning True when it did (an async rollout worker sets it; None = off, and engines that cannot
    take weights mid-call leave it None)."""

    def generate(self, prompts: Sequence[EnginePrompt], params: SamplingParams) -> list[Rollout]:
        """Sample params.n responses per prompt; returns len(prompts) * n rollouts, prompt-major."""
        ...

    def enable_prefix_cache(self, max_tokens: int) -> None:
        """Keep the KV of generated sequences (up to `max_tokens` positions; 0 = off) so a later prompt that extends
        one prefills only its new tokens (episodes' later turns). A no-op for an engine without such a cache."""
        ...

    def load_weights(self, weights) -> None:
        """Sync weights: a state dict (name -> tensor, HF parameter names) or a torch.nn.Module."""
        ...

    def metrics(self) -> dict[str, float]:
        """The engine's own counters for the step's metrics (the vllm-server engine's server faults; {} for an engine
        without any)."""
        ...

    def close(self) -> None:
        """Free the engine's resources."""
        ...
