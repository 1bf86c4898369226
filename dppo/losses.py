"""The policy losses (spec §4, §6): the masked, importance-weighted surrogate of Eq. 23, DRPO, aggregation.

Eq. 23, per token:  ℓ_t = − keep_t · sg(min(r_t, C)) · Â_t · log π(a_t|s_t),
so ∇ℓ_t = − keep_t · min(r_t, C) · Â_t · ∇log π(a_t|s_t), with r_t = exp(clamp(log π − log µ, max=20))
(the importance weight is always π/µ, µ = the rollout policy; only the trust-region mask may be anchored
elsewhere) and keep_t from `dppo.trust_region.TRUST_REGIONS`. PG-IS, CISPO/PG-TIS, GRPO clip, MiniRL and
every DPPO variant are this one function with a different mask, anchor and cap.

Aggregation modes (spec §6), over a [B, T] per-token loss and `response_mask`:
- "token-mean":              Σ_{b,t} ℓ / (number of active tokens)
- "seq-mean-token-mean":     mean over sequences of (Σ_t ℓ / active tokens of the sequence)
- "seq-mean-token-sum":      mean over sequences of Σ_t ℓ
- "seq-mean-token-sum-norm": mean over sequences of Σ_t ℓ / max_response_len (default, as in the paper)
In the seq-mean modes a sequence with no active token is left out of the count. The denominator can be
given explicitly (`denominator`, computed over the whole mini-batch and all ranks with
`aggregation_denominator`) so that summing the losses of micro-batches gives exactly the mini-batch loss.

Precision: ratios, coefficients and the aggregated loss are computed in float32 for 16-bit `logp` (the
gradient still reaches `logp` in its own dtype), in logp's dtype otherwise.

NaN/inf in an active token's inputs (logp, rollout_logp, adv, or the Top-K `divergence`) propagate to the
loss as NaN (masking multiplies, it never selects them away; a NaN divergence, which no comparison would
mask, is turned into a NaN coefficient). Padding positions are dropped with `torch.where`, both in the loss
and in the coefficient that multiplies logp, so garbage there reaches neither the loss nor any gradient.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import Tensor

from dppo._checks import check_choice, check_positive, check_same, check_tensor
from dppo.divergence import binary_kl, binary_tv
from dppo.sequence_mask import SEQUENCE_MASKS, SEQUENCE_UNITS, sequence_keep, unit_shares
from dppo.trust_region import TRUST_REGIONS, all_params, needs_topk, region_inputs, region_params

__all__ = ["AGGREGATIONS", "ANCHORS", "LOSSES", "aggregate", "aggregation_denominator", "policy_loss", "drpo_loss"]

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ANCHORS = ("rollout", "recompute")
MAX_LOG_RATIO = 20.0


def aggregation_denominator(response_mask: Tensor, aggregation: str) -> Tensor:
    """The number of units `aggregation` averages over: active tokens for "token-mean", sequences with at
    least one active token for the seq-mean modes. A float32 scalar tensor (sum it over micro-batches/ranks)."""
    check_choice("aggregation", aggregation, AGGREGATIONS)
    mask = response_mask.bool()
    if aggregation == "token-mean":
        return mask.sum().to(torch.float32)
    return mask.any(-1).sum().to(torch.float32)


def aggregate(
    loss_tok: Tensor,
    response_mask: Tensor,
    aggregation: str = "seq-mean-token-sum-norm",
    *,
    max_response_len: int | None = None,
    denominator: Tensor | float | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar (modes in the module docstring).

    max_response_len: the "norm" of seq-mean-token-sum-norm (default T = loss_tok.shape[-1]; pass the
    mini-batch's value when micro-batching). denominator: overrides the count from
    `aggregation_denominator(response_mask, aggregation)` (e.g. the whole mini-batch's). An all-padding
    batch gives 0 (not NaN).
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_tensor("loss_tok", loss_tok, floating=True)
    check_same("response_mask", response_mask, "loss_tok", loss_tok, dtype=False)
    mask = response_mask.bool()
    loss_tok = torch.where(mask, loss_tok, torch.zeros_like(loss_tok))
    if denominator is None:
        denominator = aggregation_denominator(mask, aggregation)
    if aggregation == "token-mean":
        total = loss_tok.sum()
    else:
        per_seq = loss_tok.sum(-1)
        if aggregation == "seq-mean-token-mean":
            per_seq = per_seq / mask.sum(-1).clamp(min=1)
        elif aggregation == "seq-mean-token-sum-norm":
            norm = loss_tok.shape[-1] if max_response_len is None else max_response_len
            check_positive("max_response_len", norm)
            per_seq = per_seq / norm
        total = per_seq.sum()
    if isinstance(denominator, Tensor):
        denominator = denominator.to(total.dtype)
        return total / denominator.clamp(min=1.0)
    return total / max(float(denominator), 1.0)


def _check_inputs(logp: Tensor, rollout_logp: Tensor, adv: Tensor, response_mask: Tensor) -> Tensor:
    """Validate the shared inputs; return adv broadcast to [B, T]."""
    check_tensor("logp", logp, floating=True)
    if logp.dim() != 2:
        raise ValueError(f"logp: expected shape [B, T], got {tuple(logp.shape)}")
    check_tensor("rollout_logp", rollout_logp, floating=True)
    check_same("rollout_logp", rollout_logp, "logp", logp, dtype=False)
    check_tensor("response_mask", response_mask)
    check_same("response_mask", response_mask, "logp", logp, dtype=False)
    check_tensor("adv", adv, floating=True)
    if adv.device != logp.device:
        raise ValueError(f"adv: expected device {logp.device} (as logp), got {adv.device}")
    if adv.shape == logp.shape[:1]:
        adv = adv[:, None]
    elif adv.shape != logp.shape:
        raise ValueError(f"adv: expected shape [B]={tuple(logp.shape[:1])} or [B, T]={tuple(logp.shape)}, got {tuple(adv.shape)}")
    return adv.expand_as(logp)


def policy_loss(
    logp: Tensor,
    rollout_logp: Tensor,
    adv: Tensor,
    response_mask: Tensor,
    *,
    trust_region: str = "dppo_binary_tv",
    delta_low: float | None = None,
    delta_high: float | None = None,
    eps_low: float | None = None,
    eps_high: float | None = None,
    is_cap: float = 10.0,
    aggregation: str = "seq-mean-token-sum-norm",
    divergence: Tensor | None = None,
    old_logp: Tensor | None = None,
    anchor: str = "rollout",
    max_response_len: int | None = None,
    denominator: Tensor | float | None = None,
    staleness: Tensor | None = None,
    sequence_mask: str = "none",
    sequence_delta: float | None = None,
    sequence_unit: str = "response",
    sequence_sides: str = "both",
    turn_index: Tensor | None = None,
    n_turns: int | None = None,
    **region_kwargs: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The masked importance-weighted surrogate (Eq. 23), aggregated to a scalar.

    Args (B sequences, T response positions):
        logp: [B, T] log π(a_t|s_t) of the current policy, with gradient.
        rollout_logp: [B, T] log µ(a_t|s_t) recorded by the engine (any float dtype; detached).
        adv: [B] (sequence-level) or [B, T] advantages.
        response_mask: [B, T] bool, True = the token counts.
        trust_region: a name in `TRUST_REGIONS`.
        delta_low, delta_high: divergence thresholds of the DPPO/CPPO regions (None = the region's default:
            0.15 for TV, 0.05 for KL). eps_low, eps_high: ratio-clip ε of the PPO regions (default 0.2/0.28).
        is_cap: C in min(r, C); float("inf") = uncapped.
        divergence: [B, T] precomputed divergence, required by the Top-K regions (compute it against the
            same anchor as the mask: µ's top-K cells for "rollout", π_old's values for "recompute").
        old_logp: [B, T] recomputed log π_old; required when anchor="recompute".
        anchor: "rollout" (mask against µ, the default) or "recompute" (mask against π_old; the importance
            weight stays π/µ).
        max_response_len, denominator: see `aggregate`.
        staleness: [B, T] (or [B], or one value) each token's version lag τ_t in training steps; required by the
            regions whose `TRUST_REGIONS[name].inputs` name it (dppo_stale_*), ignored by the others.
        sequence_mask: a name in `dppo.sequence_mask.SEQUENCE_MASKS` ("none", "max_divergence", "mean_k3",
            "mean_k1"): also drop every token of a unit (a response; a turn with sequence_unit="turn" and
            `turn_index`) whose statistic against the mask's anchor exceeds sequence_delta (default
            `SEQUENCE_DELTAS[sequence_mask]`); sides "both" or "negative" (only units with Â < 0). max_divergence
            reads the trust region's own per-token divergence (Binary-TV when the region has none).
        turn_index, n_turns: [B, T] turn of each token and an upper bound of the turn count (sequence_unit "turn").
        **region_kwargs: the other parameters of the trust region, by name (relax_alpha, relax_side of the
            relax-α ablation, CPPO's cppo_*, pg_is_neg_mask's neg_delta: `TRUST_REGIONS[name].params` lists
            each with its default and check). A name no trust region takes is an error; one that only other
            regions take is ignored, so one set of loss settings serves every region.

    Returns (loss scalar, metrics): metrics are detached scalar tensors — masked_frac, masked_frac_pos,
    masked_frac_neg (over active tokens, all/Â>0/Â<0), ratio_mean, ratio_max, ratio_above_cap_frac, and
    the counts n_tokens, n_pos, n_neg to weight them when combining micro-batches, and `keep` itself
    ([B, T] bool, the trust-region mask) for per-token diagnostics.
    """
    unknown = sorted(set(region_kwargs) - set(all_params()))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a parameter of any trust region; valid: {', '.join(sorted(all_params()))}")
    params = region_params(trust_region, dict(region_kwargs, delta_low=delta_low, delta_high=delta_high,
                                               eps_low=eps_low, eps_high=eps_high))
    check_choice("anchor", anchor, ANCHORS)
    check_choice("aggregation", aggregation, AGGREGATIONS)
    if not (isinstance(is_cap, (int, float)) and is_cap > 0):
        raise ValueError(f"is_cap: expected a number > 0 (float('inf') for no cap), got {is_cap!r}")
    adv = _check_inputs(logp, rollout_logp, adv, response_mask)
    if needs_topk(trust_region):
        if divergence is None:
            raise ValueError(f"divergence: required by trust_region {trust_region!r} ([B, T] Top-K estimate)")
        check_same("divergence", divergence, "logp", logp, dtype=False)
    check_choice("sequence_mask", sequence_mask, SEQUENCE_MASKS)
    check_choice("sequence_unit", sequence_unit, SEQUENCE_UNITS)
    if sequence_mask != "none":
        sequence_delta = SEQUENCE_DELTAS[sequence_mask] if sequence_delta is None else sequence_delta
        if not (isinstance(sequence_delta, (int, float)) and math.isfinite(sequence_delta)):
            raise ValueError(f"sequence_delta: expected a finite number, got {sequence_delta!r}")
    inputs = {}
    if "staleness" in region_inputs(trust_region):
        if staleness is None:
            raise ValueError(f"staleness: required by trust_region {trust_region!r} ([B, T] version lag of each token, "
                             "in training steps; 0 = sampled by the weights being trained)")
        check_tensor("staleness", staleness)
        if staleness.dim() == 0:
            staleness = staleness.reshape(1, 1).expand(logp.shape[0], 1)
        elif staleness.shape == logp.shape[:1]:
            staleness = staleness[:, None]
        if staleness.dim() != 2 or staleness.shape[0] != logp.shape[0] or staleness.shape[1] not in (1, logp.shape[1]):
            raise ValueError(f"staleness: expected shape [B] or [B, T]={tuple(logp.shape)}, got {tuple(staleness.shape)}")
        inputs["staleness"] = staleness.expand_as(logp)
    if anchor == "recompute":
        if old_logp is None:
            raise ValueError("old_logp: required when anchor='recompute' ([B, T] log-probs of the pre-update policy)")
        check_same("old_logp", old_logp, "logp", logp, dtype=False)
        anchor_logp = old_logp.detach()
    else:
        anchor_logp = rollout_logp.detach()
    mask = response_mask.bool()

    dtype = _compute_dtype(logp)
    with torch.no_grad():
        logp_d = logp.detach().to(dtype)
        log_ratio = (logp_d - rollout_logp.detach().to(dtype)).clamp(max=MAX_LOG_RATIO)
        ratio = log_ratio.exp()
        weight = ratio.clamp(max=is_cap) if math.isfinite(is_cap) else ratio
        adv_c = adv.detach().to(dtype)
        anchor_d = anchor_logp.to(dtype)
        keep = TRUST_REGIONS[trust_region].fn(logp_d, anchor_d, adv_c, mask, divergence, **inputs, **params)
        seq_stats = {}
        if sequence_mask != "none":
            units = turn_index if sequence_unit == "turn" else None
            seq_keep, _ = sequence_keep(logp_d, anchor_d, adv_c, mask, statistic=sequence_mask,
                                        delta=sequence_delta, sides=sequence_sides, turn_index=units, n_turns=n_turns,
                                        divergence=_token_divergence(trust_region, logp_d, anchor_d, divergence))
            seq_stats = {f"seq_{k}": v for k, v in unit_shares(seq_keep, adv_c, mask, units, n_turns).items()}
            keep = keep & seq_keep
        coef = keep.to(dtype) * weight * adv_c
        if divergence is not None and needs_topk(trust_region):
            # A NaN divergence never masks (comparisons are False); make it poison the loss instead.
            coef = torch.where(torch.isnan(divergence), torch.full_like(coef, float("nan")), coef)
        # Padding gets coefficient 0, so garbage there (NaN/inf µ or Â) cannot reach logp's gradient.
        coef = torch.where(mask, coef, torch.zeros_like(coef))

    loss_tok = -(coef * logp.to(dtype))
    loss = aggregate(loss_tok, mask, aggregation, max_response_len=max_response_len, denominator=denominator)
    return loss, {**_metrics(mask, keep, adv_c, ratio, is_cap), **seq_stats}


SEQUENCE_DELTAS = {"max_divergence": 0.2, "mean_k3": 0.1, "mean_k1": 0.05}
"""The default sequence_delta per sequence mask: max_divergence and mean_k3 tuned on seed 0 of the lag-4 study of
docs/paper.md (grids 0.2/0.35/0.5 and 0.02/0.05/0.1); mean_k1 not tuned."""


def _token_divergence(trust_region: str, logp: Tensor, anchor_logp: Tensor, divergence: Tensor | None) -> Tensor:
    """The per-token divergence a region is defined on (its Top-K `divergence`, else Binary-TV or -KL), for the
    max_divergence sequence mask; Binary-TV for the regions defined on none."""
    name = TRUST_REGIONS[trust_region].divergence
    if name in ("topk_tv", "topk_kl") and divergence is not None:
        return divergence
    return binary_kl(logp, anchor_logp) if name == "binary_kl" else binary_tv(logp, anchor_logp)


def _compute_dtype(logp: Tensor) -> torch.dtype:
    """float32 for 16-bit inputs (ratios and the aggregated sum in 16 bits lose ~3 digits), else logp's dtype."""
    return torch.promote_types(logp.dtype, torch.float32)


@torch.no_grad()
def _metrics(mask: Tensor, keep: Tensor, adv: Tensor, ratio: Tensor, is_cap: float) -> dict[str, Tensor]:
    maskf = mask.float()
    pos, neg = maskf * (adv > 0), maskf * (adv < 0)
    dropped = (~keep).float()
    n, n_pos, n_neg = maskf.sum(), pos.sum(), neg.sum()
    ratio_active = torch.where(mask, ratio, torch.zeros_like(ratio))
    return {
        "masked_frac": (dropped * maskf).sum() / n.clamp(min=1),
        "masked_frac_pos": (dropped * pos).sum() / n_pos.clamp(min=1),
        "masked_frac_neg": (dropped * neg).sum() / n_neg.clamp(min=1),
        "ratio_mean": ratio_active.sum() / n.clamp(min=1),
        "ratio_max": ratio_active.max() if ratio.numel() else ratio.new_zeros(()),
        "ratio_above_cap_frac": ((ratio > is_cap).float() * maskf).sum() / n.clamp(min=1),
        "n_tokens": n,
        "n_pos": n_pos,
        "n_neg": n_neg,
        "keep": keep,
    }


def drpo_loss(
    logp: Tensor,
    rollout_logp: Tensor,
    adv: Tensor,
    response_mask: Tensor,
    *,
    delta: float = 0.15,
    aggregation: str = "seq-mean-token-sum-norm",
    max_response_len: int | None = None,
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRPO (arXiv 2606.09821): no mask, a quadratic divergence penalty instead, r with gradient, no IS cap.

    ℓ_t = −[ r_t Â_t − |Â_t| / (2δ) · m_t · (r_t − 1)² ],  r_t = exp(clamp(log π − log µ, max=20)),
    m_t = µ(a_t|s_t). Shapes as `policy_loss`; metrics: ratio_mean, ratio_max, n_tokens.
    """
    check_choice("aggregation", aggregation, AGGREGATIONS)
    check_positive("delta", delta)
    adv = _check_inputs(logp, rollout_logp, adv, response_mask)
    mask = response_mask.bool()
    dtype = _compute_dtype(logp)
    # Padding replaced by 0 before any arithmetic: garbage there must not reach logp's gradient.
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    rollout_logp = torch.where(mask, rollout_logp.detach().to(dtype), zero)
    ratio = torch.exp((torch.where(mask, logp.to(dtype), zero) - rollout_logp).clamp(max=MAX_LOG_RATIO))
    adv = torch.where(mask, adv.detach().to(dtype), zero)
    loss_tok = -(ratio * adv - adv.abs() / (2.0 * delta) * rollout_logp.exp() * (ratio - 1.0) ** 2)
    loss = aggregate(loss_tok, mask, aggregation, max_response_len=max_response_len, denominator=denominator)
    with torch.no_grad():
        r = torch.where(mask, ratio.detach().float(), torch.zeros_like(ratio, dtype=torch.float32))
        n = mask.float().sum()
        metrics = {"ratio_mean": r.sum() / n.clamp(min=1), "ratio_max": r.max() if r.numel() else r.new_zeros(()), "n_tokens": n}
    return loss, metrics


def _drpo(logp, rollout_logp, adv, response_mask, *, aggregation="seq-mean-token-sum-norm", max_response_len=None,
          denominator=None, drpo_delta=0.15, divergence=None, old_logp=None, sequence_mask="none", **_other_settings):
    """`drpo_loss` under the LOSSES signature (drpo has no mask: the trust-region settings do not apply)."""
    if old_logp is not None:
        raise ValueError("old_logp: drpo has no mask to anchor; use anchor='rollout'")
    if sequence_mask != "none":
        raise ValueError("sequence_mask: drpo has no mask to combine a sequence mask with; use sequence_mask='none'")
    return drpo_loss(logp, rollout_logp, adv, response_mask, delta=drpo_delta, aggregation=aggregation,
                     max_response_len=max_response_len, denominator=denominator)


def _masked_is(logp, rollout_logp, adv, response_mask, *, drpo_delta=None, **settings):
    """`policy_loss` under the LOSSES signature (DRPO's δ does not apply)."""
    return policy_loss(logp, rollout_logp, adv, response_mask, **settings)


LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "masked_is": _masked_is,
    "drpo": _drpo,
}
"""Every loss has one signature: fn(logp, rollout_logp, adv, response_mask, *, aggregation, max_response_len,
denominator, divergence, old_logp, staleness, turn_index, n_turns, **settings) -> (loss, metrics), settings being
the `loss` config section's fields by name (each loss takes those it uses). `masked_is` is Eq. 23 with a trust-region
mask (every method but DRPO), `drpo` the quadratic penalty."""
