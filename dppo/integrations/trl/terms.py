"""The terms of GRPOTrainer's objective that are orthogonal to the trust region, for DPPOTrainer: the off-policy
sequence mask (DeepSeek-V3.2's OPSM, on `dppo.sequence_mask`), the selection of the tokens a filter keeps, the entropy
bonus and the adaptive entropy coefficient (Skywork-OR1). Pure functions of tensors and scalars; the controller's state
(the coefficient, the last window's entropy) stays on the trainer under GRPOTrainer's names, so TRL's checkpoints
carry it.

How they compose with Eq. 23 (as in GRPOTrainer, where they multiply the per-token loss): a token that the entropy
filter or the off-policy mask drops gets advantage 0 in `dppo.losses.policy_loss`, so its term and its gradient are 0,
while the aggregation's normaliser still counts it; the entropy bonus is subtracted from the aggregated loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dppo.sequence_mask import sequence_keep

__all__ = ["entropy_mean", "next_entropy_coef", "off_policy_keep", "select_advantages"]


@torch.no_grad()
def off_policy_keep(logp: Tensor, rollout_logp: Tensor, adv: Tensor, response_mask: Tensor, *,
                    threshold: float) -> Tensor:
    """GRPOTrainer's off-policy sequence mask, [B, T] bool: a sequence with Â < 0 whose mean over its active tokens of
    log µ − log π exceeds `threshold` is dropped. `rollout_logp` NaN (a token the engine could not score) counts as
    log µ = log π (no evidence), as in TRL. `dppo.sequence_mask.sequence_keep` with statistic "mean_k1", sides
    "negative"."""
    anchor = torch.where(torch.isnan(rollout_logp), logp.detach().to(rollout_logp.dtype), rollout_logp)
    keep, _ = sequence_keep(logp, anchor, adv, response_mask, statistic="mean_k1", delta=float(threshold),
                            sides="negative")
    return keep


def select_advantages(adv: Tensor, selected: Tensor | None) -> Tensor:
    """Â [B] or [B, T] with 0 where `selected` ([B, T] bool) drops a token ([B, T]); unchanged when None (all)."""
    if selected is None:
        return adv
    adv = (adv[:, None] if adv.dim() == 1 else adv).expand(selected.shape)
    return torch.where(selected, adv, torch.zeros_like(adv))


def entropy_mean(entropy: Tensor, response_mask: Tensor) -> Tensor:
    """Mean per-token entropy over `response_mask` (0 when empty), with entropy's gradient: the bonus is
    −coef · this / (gradient accumulation steps)."""
    mask = response_mask.to(entropy.dtype)
    return (entropy * mask).sum() / mask.sum().clamp(min=1.0)


def next_entropy_coef(coef: float, entropy: float, *, target: float, step: float, low: float, high: float) -> float:
    """Skywork-OR1's adaptive coefficient after one optimiser step: coef + step when the step's entropy is at or
    below `target`, coef − step otherwise, clamped to [low, high].

    >>> next_entropy_coef(0.01, 0.1, target=0.2, step=0.005, low=0.0, high=1.0)
    0.015
    >>> next_entropy_coef(0.003, 0.5, target=0.2, step=0.005, low=0.0, high=1.0)
    0.0
    """
    return min(coef + step, high) if entropy <= target else max(coef - step, low)
