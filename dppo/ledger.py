"""The trust-region ledger: per training step, the quantities that say why the policy moved away from µ (the
engine's distribution that sampled the batch), so a run that goes wrong can be read (`dppo doctor`).

Every function is pure (tensors in, detached tensors out, no `.item()`), like `dppo.metrics`, and returns means
with their weight ("n_tokens", "n_rows") or maxima, so micro-batches combine exactly (`dppo.metrics.merge`).
Shapes: B rows, T response tokens; `response_mask` [B, T] bool, True = a token the policy sampled.

- **Where the drift comes from** (`drift_parts`): per token, log π − log µ = (log π_old − log µ) + (log π − log π_old),
  π_old the trainer's recomputed policy at the step's start. The first part is the mismatch: on a token sampled
  by the trainer's own weights (staleness 0) it is the engine's numerics alone (*precision*: µ against π at the same
  weights); on a stale token it is the version lag plus that token's precision part (*staleness*; splitting the two
  would take a forward at µ's older weights, which no run makes). The second is the step's own *learning*. The
  ledger sums the magnitudes |part| of the three, so their shares add up to 1 exactly.
- **Why tokens were masked** (`masked_mass`): the gradient weight |Â_t|·r_t that the trust region removed, as a
  share of the step's total, split by which factor of π/µ = (π_old/µ)·(π/π_old) is the larger (the mask fired on
  the mismatch, or on the update's own push) and by the advantage's sign. Mass rather than a token count: a
  masked token with a large |Â|·r removes more of the gradient.
- **The paper's bound** (Thm. 3.2, spec §1: J(π) − J(µ) ≥ L′ − 4ξ E_{y~µ}[Σ_t D_TV(µ‖π)(s_t)] and
  ≥ L′ − 2ξ T(T−1) D_max²; ξ = max|R|): `bound_terms` evaluates both penalties on the step's measured divergence
  and response lengths, and the surrogate L′ = E_{y~µ}[R Σ_t (r_t − 1)] (`surrogate_gain`). The divergence given is
  an estimate (Binary or Top-K TV), a lower bound of the true TV (App. B), so the penalties are lower estimates
  too; they say how large the trust region let the error term grow, not a guarantee.
- **The groups** (`group_stats`): the mean within-group reward std and the advantage std (the share of groups with
  zero advantage is `advantage/zero_group_frac`, from `dppo.advantages`).
- **The gradient** (`grad_snr`): ‖ḡ‖² / (mean ‖g_i − ḡ‖² / M) over the step's M optimiser steps (the squared
  signal-to-noise ratio of the mean gradient; > 1: the mini-batches agree).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dppo.metrics import _acc, _on

__all__ = ["bound_penalties", "bound_terms", "drift_parts", "drift_shares", "grad_snr", "group_stats", "mass_shares",
           "masked_mass", "surrogate_gain"]

DRIFT_KEYS = ("ledger/drift_precision", "ledger/drift_staleness", "ledger/drift_learning")
"""`drift_parts`' means (weight "n_tokens"): mean |part| per token, in nats of log-probability."""
MASS_KEYS = ("ledger/masked_mass_mismatch_pos", "ledger/masked_mass_mismatch_neg",
             "ledger/masked_mass_update_pos", "ledger/masked_mass_update_neg")
"""`masked_mass`' sums over the masked tokens, by source and advantage sign (divided by "ledger/mass" at the end)."""


@torch.no_grad()
def drift_parts(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor,
                staleness: Tensor) -> dict[str, Tensor]:
    """Mean |part| per token of log π − log µ = (log π_old − log µ) + (log π − log π_old): "ledger/drift_precision"
    (the mismatch of tokens of staleness 0), "ledger/drift_staleness" (the mismatch of stale tokens, their precision
    part included), "ledger/drift_learning" (|log π − log π_old|), and "ledger/drift_net" (|log π − log µ|, at most
    their sum), each weighted by "n_tokens". staleness: [B] (per row) or [B, T] (per token) integer steps behind."""
    mask = response_mask.bool()
    stale = staleness[:, None].expand(mask.shape) if staleness.dim() == 1 else staleness
    logp, old_logp, rollout_logp = _acc(logp), _acc(old_logp), _acc(rollout_logp)
    n = mask.float().sum()
    mismatch = (old_logp - rollout_logp).abs()
    mean = lambda x, where: _on(x, where).sum() / n.clamp(min=1)  # noqa: E731
    return {DRIFT_KEYS[0]: mean(mismatch, mask & (stale == 0)), DRIFT_KEYS[1]: mean(mismatch, mask & (stale > 0)),
            DRIFT_KEYS[2]: mean((logp - old_logp).abs(), mask),
            "ledger/drift_net": mean((logp - rollout_logp).abs(), mask), "n_tokens": n}


@torch.no_grad()
def masked_mass(keep: Tensor, logp: Tensor, rollout_logp: Tensor, adv: Tensor, response_mask: Tensor,
                old_logp: Tensor | None = None) -> dict[str, Tensor]:
    """Sums of the gradient weight |Â_t|·r_t (r = π/µ, log-ratio capped at 20) over the tokens: "ledger/mass" over all,
    and over the masked ones (keep False) by source and sign (`MASS_KEYS`): "mismatch" where |log π_old − log µ| ≥
    |log π − log π_old|, "update" otherwise; without old_logp (no recompute) every masked token counts as
    "update" (the source needs π_old). adv: [B] or [B, T]. Sums add over micro-batches; the shares are the masked
    sums divided by "ledger/mass" (`mass_shares`)."""
    mask = response_mask.bool()
    adv = _acc(adv)
    adv = adv[:, None].expand(mask.shape) if adv.dim() == 1 else adv
    logp, rollout_logp = _acc(logp), _acc(rollout_logp)
    weight = _on(adv.abs() * (logp - rollout_logp).clamp(max=20.0).exp(), mask)
    masked = mask & ~keep.bool()
    if old_logp is None:
        from_mismatch = torch.zeros_like(mask)
    else:
        old_logp = _acc(old_logp)
        from_mismatch = (old_logp - rollout_logp).abs() >= (logp - old_logp).abs()
    out = {"ledger/mass": weight.sum()}
    for key, source in zip(MASS_KEYS, (from_mismatch, from_mismatch, ~from_mismatch, ~from_mismatch)):
        sign = adv > 0 if key.endswith("_pos") else adv < 0
        out[key] = _on(weight, masked & source & sign).sum()
    return out


def mass_shares(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """`masked_mass`' sums (added over the step) as shares of the step's gradient mass: each of `MASS_KEYS` and
    "ledger/masked_mass" (their total); 0 when the step has no mass."""
    total = _acc(sums["ledger/mass"]).clamp(min=1e-30)
    out = {k: _acc(sums[k]) / total for k in MASS_KEYS}
    out["ledger/masked_mass"] = sum(out[k] for k in MASS_KEYS)
    return out


def drift_shares(means: dict[str, Tensor]) -> dict[str, Tensor]:
    """The share of each of `drift_parts`' three sources in their sum ("ledger/drift_precision_share", ...): they
    add up to 1 (0 each when nothing moved)."""
    total = sum(_acc(means[k]) for k in DRIFT_KEYS).clamp(min=1e-30)
    return {f"{k}_share": _acc(means[k]) / total for k in DRIFT_KEYS}


@torch.no_grad()
def bound_terms(tv: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """What Thm. 3.2's penalties need from one micro-batch, given the token divergence `tv` [B, T] (D_TV(µ‖π) at each
    token, or an estimate): "ledger/tv_sum_per_row" = mean over rows of Σ_t D_t (weight "n_rows"), and the maxima
    "ledger/tv_max" (D_max) and "ledger/len_max" (T, the longest response). `bound_penalties` makes the penalties."""
    mask = response_mask.bool()
    tv = _on(_acc(tv), mask)
    rows = mask.any(-1)
    n_rows = rows.float().sum()
    peak = lambda x: x.max() if x.numel() else x.new_zeros(())  # noqa: E731
    return {"ledger/tv_sum_per_row": tv.sum(-1).sum() / n_rows.clamp(min=1), "n_rows": n_rows,
            "ledger/tv_max": peak(tv), "ledger/len_max": peak(mask.float().sum(-1))}


def bound_penalties(tv_sum_per_row: Tensor, tv_max: Tensor, len_max: Tensor, reward_abs_max: Tensor) -> dict[str, Tensor]:
    """Thm. 3.2's two penalties from `bound_terms` and ξ = max|R| of the step: "ledger/bound_sum" = 4ξ E[Σ_t D_t]
    and "ledger/bound_max" = 2ξ T(T−1) D_max² (the surrogate L′ minus either lower-bounds J(π) − J(µ))."""
    xi = _acc(reward_abs_max)
    return {"ledger/bound_sum": 4.0 * xi * tv_sum_per_row,
            "ledger/bound_max": 2.0 * xi * len_max * (len_max - 1).clamp(min=0) * tv_max.square()}


@torch.no_grad()
def surrogate_gain(logp: Tensor, rollout_logp: Tensor, rewards: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """L′ = E_{y~µ}[R(y) Σ_t (r_t − 1)] (Thm. 3.1) over one micro-batch's rows ("ledger/surrogate", weight "n_rows");
    rewards: [B], one per row."""
    mask = response_mask.bool()
    r = (_acc(logp) - _acc(rollout_logp)).clamp(max=20.0).exp()
    per_row = _on(r - 1.0, mask).sum(-1) * _acc(rewards)
    n_rows = mask.any(-1).float().sum()
    return {"ledger/surrogate": _on(per_row, mask.any(-1)).sum() / n_rows.clamp(min=1), "n_rows": n_rows}


@torch.no_grad()
def group_stats(rewards: Tensor, adv: Tensor, group_size: int) -> dict[str, Tensor]:
    """The step's groups (rewards [B] prompt-major, G = group_size contiguous; adv [B] each row's advantage):
    "ledger/group_reward_std" (the mean over groups of the rewards' population std) and "ledger/adv_std" (population
    std of the advantages)."""
    g = _acc(rewards).view(-1, group_size)
    return {"ledger/group_reward_std": g.std(-1, unbiased=False).mean(),
            "ledger/adv_std": _acc(adv).std(unbiased=False)}


def grad_snr(grad_sum_sq: Tensor, sq_norm_sum: Tensor, m: int) -> Tensor:
    """‖ḡ‖² / (mean_i ‖g_i − ḡ‖² / M) for M gradients g_i, from ‖Σ g_i‖² (`grad_sum_sq`) and Σ‖g_i‖² (`sq_norm_sum`):
    mean‖g_i − ḡ‖² = Σ‖g_i‖²/M − ‖ḡ‖². inf when every g_i is equal (no noise); NaN for M < 2 (undefined)."""
    if m < 2:
        return torch.full((), float("nan"))
    mean_sq = _acc(grad_sum_sq) / m**2
    var = (_acc(sq_norm_sum) / m - mean_sq).clamp(min=0)
    return mean_sq / (var / m)
