"""What the trainer and the evaluation read of a batch of scored episodes: its episodes among its rows, their rewards,
whether each succeeded, and the step's episode metrics.

    rewards, stats = episode_rewards(rollouts)     # [E] per episode (`first_rows`), reward failures and timeouts
    success = episode_success(rollouts, rewards)   # [E] bool: pass@1 and reward/accuracy are its mean
    row_episodes(rollouts)                         # [B] each row's episode (an agent's episode may be several rows)
    episode_metrics(rollouts, counters)            # episode/*: the same computation for every multi-turn kind
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dppo.rollout.base import Rollout


def first_rows(rollouts: Sequence[Rollout]) -> list[Rollout]:
    """Each episode's first row (`Rollout.row` 0): the episodes, in order (one per rollout but for an agent's
    multi-row episodes)."""
    return [r for r in rollouts if r.row == 0]


def row_episodes(rollouts: Sequence[Rollout]) -> Tensor:
    """[B] int64: the episode (index into `first_rows`) of each row. ValueError when the first rollout is not a first
    row (an episode's rows follow its first)."""
    if rollouts and rollouts[0].row != 0:
        raise ValueError("rollouts: the first rollout is not its episode's first row (Rollout.row 0)")
    return torch.cumsum(torch.tensor([r.row == 0 for r in rollouts], dtype=torch.long), 0) - 1


def episode_rewards(rollouts: Sequence[Rollout]) -> tuple[Tensor, dict[str, int]]:
    """[E] float32 rewards of the scored episodes (`first_rows`) and the step's reward counts (failures: the
    environment or the reward raised; timeouts). ValueError for an unscored episode or a non-finite reward."""
    episodes = first_rows(rollouts)
    missing = [i for i, r in enumerate(episodes) if r.reward is None]
    if missing:
        raise ValueError(f"rollouts: {len(missing)} responses were not scored by their environment, e.g. #{missing[0]}")
    out = torch.tensor([float(r.reward) for r in episodes], dtype=torch.float32)
    if not bool(torch.isfinite(out).all()):
        raise ValueError("rollouts: an environment returned a non-finite reward")
    return out, {"failures": int(sum(r.episode.env_errors for r in episodes)),
                 "timeouts": int(sum(r.episode.env_timeouts for r in episodes))}


SUCCESS_REWARD = 1.0
"""An episode without the environment's own verdict succeeded when its reward reached this (to 1e-6)."""


def episode_success(rollouts: Sequence[Rollout], rewards: Tensor) -> Tensor:
    """[E] bool: whether each scored episode (`first_rows`) succeeded — the environment's verdict where it gave one
    (`Episode.success`, from `EnvStep.info["success"]`), else reward >= SUCCESS_REWARD. pass@1 and
    `reward/accuracy` are its mean, in evaluation and in training alike; the mean reward is reported beside it."""
    verdict = torch.tensor([r.episode.success for r in first_rows(rollouts)], dtype=torch.float32)
    return torch.where(torch.isnan(verdict), rewards >= SUCCESS_REWARD - 1e-6, verdict > 0.5)


def episode_metrics(rollouts: Sequence[Rollout], counters: Sequence[str]) -> dict[str, float]:
    """The step's episode metrics of multi-turn episodes (an environment's or an agent's): the mean per episode
    (`episode/<name>_mean`) of each of `counters` — the `Episode` counters the episodes' kind fills, and `rows`, an
    episode's rows —; the truncated share; the share of inserted tokens among all rows' response tokens and the
    generated tokens per episode; the environment's (or agent's) errors and timeouts (totals)."""
    episodes = [r.episode for r in first_rows(rollouts)]
    n = len(episodes)
    tokens = sum(int(r.response_ids.numel()) for r in rollouts)
    inserted = sum(e.env_tokens for e in episodes)  # (an episode's record counts the tokens of all its rows)
    out = {f"episode/{k}_mean": (len(rollouts) if k == "rows" else sum(getattr(e, k) for e in episodes)) / n
           for k in counters}
    out["episode/truncated_frac"] = sum(e.truncated for e in episodes) / n
    out["episode/env_token_frac"] = inserted / max(tokens, 1)
    out["episode/generated_tokens_mean"] = (tokens - inserted) / n
    out["episode/env_errors"] = float(sum(e.env_errors for e in episodes))
    out["episode/env_timeouts"] = float(sum(e.env_timeouts for e in episodes))
    return out


__all__ = ["SUCCESS_REWARD", "episode_metrics", "episode_rewards", "episode_success", "first_rows", "row_episodes"]
