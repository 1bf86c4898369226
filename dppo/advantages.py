"""Advantage estimators (App. C): sequence rewards [B] -> sequence advantages [B].

Rewards come prompt-major: B = P·G with the G responses to each prompt contiguous. Estimators:
- "group_mean" (default, paper App. C): Â = R − mean of the group's rewards, no division by std.
- "group_zscore" (GRPO): (R − group mean) / (group std + eps), unbiased std as in GRPO implementations.
- "rloo": R − mean of the *other* G−1 rewards of the group (leave-one-out), = G/(G−1) · group_mean.
- "group_mean_batch_std": (R − group mean) / (std over the whole batch of those centred values + eps).
Groups whose rewards are all equal get zero advantage (for every estimator); `zero_adv_group_frac`
counts them. Each function returns (adv [B] float32, metrics dict of detached scalar tensors).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from dppo._checks import check_tensor

__all__ = ["ADVANTAGES", "compute_advantages", "group_mean", "group_zscore", "rloo", "group_mean_batch_std"]


STD_EPS = 1e-6
"""Added to a standard deviation before dividing by it (a numerical guard, not a setting of the run)."""

def _groups(rewards: Tensor, group_size: int) -> Tensor:
    check_tensor("rewards", rewards, floating=True)
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected shape [B], got {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size: expected an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"group_size: {group_size} does not divide the number of rewards {rewards.numel()}")
    return rewards.float().view(-1, group_size)


def _finish(adv: Tensor, grouped: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    flat = (grouped == grouped[:, :1]).all(-1)
    adv = torch.where(flat[:, None], torch.zeros_like(adv), adv)
    return adv.reshape(-1), {"zero_adv_group_frac": flat.float().mean()}


def group_mean(rewards: Tensor, group_size: int, *, eps: float = STD_EPS) -> tuple[Tensor, dict[str, Tensor]]:
    """Â = R − group mean (no std division)."""
    g = _groups(rewards, group_size)
    return _finish(g - g.mean(-1, keepdim=True), g)


def group_zscore(rewards: Tensor, group_size: int, *, eps: float = STD_EPS) -> tuple[Tensor, dict[str, Tensor]]:
    """Â = (R − group mean) / (group std + eps) (GRPO). G = 1 gives 0 (a lone response has no baseline)."""
    g = _groups(rewards, group_size)
    std = g.std(-1, keepdim=True) if group_size > 1 else torch.zeros_like(g[:, :1])
    return _finish((g - g.mean(-1, keepdim=True)) / (std + eps), g)


def rloo(rewards: Tensor, group_size: int, *, eps: float = STD_EPS) -> tuple[Tensor, dict[str, Tensor]]:
    """Â = R − mean of the other G−1 rewards (leave-one-out). Needs G ≥ 2."""
    g = _groups(rewards, group_size)
    if group_size < 2:
        raise ValueError(f"group_size: rloo needs >= 2 responses per prompt, got {group_size}")
    others = (g.sum(-1, keepdim=True) - g) / (group_size - 1)
    return _finish(g - others, g)


def group_mean_batch_std(rewards: Tensor, group_size: int, *, eps: float = STD_EPS) -> tuple[Tensor, dict[str, Tensor]]:
    """Â = (R − group mean) / (std over the batch of the centred rewards + eps)."""
    g = _groups(rewards, group_size)
    centred = g - g.mean(-1, keepdim=True)
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return _finish(centred / (std + eps), g)


ADVANTAGES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "group_mean": group_mean,
    "group_zscore": group_zscore,
    "rloo": rloo,
    "group_mean_batch_std": group_mean_batch_std,
}


def compute_advantages(name: str, rewards: Tensor, group_size: int, *, eps: float = STD_EPS) -> tuple[Tensor, dict[str, Tensor]]:
    """Look up `name` in ADVANTAGES (ValueError listing the valid names) and apply it."""
    if name not in ADVANTAGES:
        raise ValueError(f"advantage: unknown estimator {name!r}; valid: {', '.join(ADVANTAGES)}")
    return ADVANTAGES[name](rewards, group_size, eps=eps)
