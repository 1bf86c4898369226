"""What the trainer reads from multi-turn episodes (`dppo.rollout.episodes`): their rewards, their metrics and their
transcripts for the samples file. The environment scored each episode while it ran (the sum of its turns' rewards);
an environment's errors and timeouts count as the step's reward failures and timeouts.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dppo.rollout.base import Rollout
from dppo.rollout.episodes import transcript as _transcript

COUNTERS = ("turns", "turns_truncated", "tool_calls", "tool_errors", "tool_timeouts", "tool_truncated")
"""Per-episode counters reported as means per episode (`episode/<name>_mean`)."""


def rewards(rollouts: Sequence[Rollout]) -> tuple[Tensor, dict[str, int]]:
    """[B] float32 episode rewards and the reward-runner style counts (failures = environment errors, timeouts)."""
    missing = [i for i, r in enumerate(rollouts) if r.reward is None or r.episode is None]
    if missing:
        raise ValueError(f"rollouts: {len(missing)} responses are not episodes (no environment reward), e.g. #{missing[0]}")
    out = torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float32)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("rollouts: an environment returned a non-finite reward")
    return out, {"failures": int(sum(r.episode["env_errors"] for r in rollouts)),
                 "timeouts": int(sum(r.episode["env_timeouts"] for r in rollouts))}


def episode_stats(rollouts: Sequence[Rollout]) -> dict[str, float]:
    """The step's episode metrics: counters per episode, truncated share, the share of environment tokens among the
    response tokens, and the environment's errors and timeouts (totals)."""
    n = len(rollouts)
    eps = [r.episode for r in rollouts]
    tokens = sum(int(r.response_ids.numel()) for r in rollouts)
    out = {f"episode/{k}_mean": sum(e[k] for e in eps) / n for k in COUNTERS}
    out["episode/truncated_frac"] = sum(e["truncated"] for e in eps) / n
    out["episode/env_token_frac"] = sum(e["env_tokens"] for e in eps) / max(tokens, 1)
    out["episode/generated_tokens_mean"] = (tokens - sum(e["env_tokens"] for e in eps)) / n
    out["episode/env_errors"] = float(sum(e["env_errors"] for e in eps))
    out["episode/env_timeouts"] = float(sum(e["env_timeouts"] for e in eps))
    return out


def transcript(rollout: Rollout) -> str:
    """The whole episode as text (the environment's messages marked `[env]`, a contained error appended)."""
    text = _transcript(rollout.episode["messages"])
    return text + (f"\n<error> {rollout.episode['error']}" if rollout.episode.get("error") else "")
