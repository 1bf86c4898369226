"""The policy losses: the masked, importance-weighted surrogate of Eq. 23, DRPO, aggregation.

Eq. 23, per token:  ℓ_t = − keep_t · sg(min(r_t, C)) · Â_t · log π(a_t|s_t),
so ∇ℓ_t = − keep_t · min(r_t, C) · Â_t · ∇log π(a_t|s_t), with r_t = exp(clamp(log π − log µ, max=20))
(by default the importance weight is π/µ, µ = the rollout policy; only the trust-region mask may be anchored
elsewhere) and keep_t from `dppo.trust_region.TRUST_REGIONS`. PG-IS, CISPO/PG-TIS, GRPO clip, MiniRL and
every DPPO variant are this one function with a different mask, anchor and cap. The field's rollout corrections
replace min(r_t, C) by another weight (`dppo.loss_spec.IS_WEIGHTS`: verl's/TRL's decoupled token TIS
min(π_old/µ, C)·π/π_old, the bare PPO ratio, GSPO's sequence ratio), always detached and multiplying ∇log π.

Aggregation modes (docs/library.md, "Decisions where the paper left room"), over a [B, T] per-token loss and
`response_mask`:
- "token-mean":              Σ_{b,t} ℓ / (number of active tokens)
- "seq-mean-token-mean":     mean over sequences of (Σ_t ℓ / active tokens of the sequence)
- "seq-mean-token-sum":      mean over sequences of Σ_t ℓ
- "seq-mean-token-sum-norm": mean over sequences of Σ_t ℓ / max_response_len (default, as in the paper)
In the seq-mean modes a sequence with no active token is left out of the count. The denominator can be
given explicitly (`denominator`, computed over the whole mini-batch and all ranks with
`aggregation_denominator`) so that summing the losses of micro-batches gives exactly the mini-batch loss.

Settings and inputs: every loss of `LOSSES` takes a `LossSpec` (`dppo.loss_spec.loss_spec`: trust region and its
parameters, anchor, C, aggregation, sequence mask, DRPO's δ, resolved and checked once there) and a `TokenInputs`
(the per-token tensors a spec needs). A region that reads a statistic of the whole optimiser batch (SAT's tail
quantile: `TrustRegion.batch_stats`) gets it in `TokenInputs.batch_stats`, computed once per optimiser batch with
`batch_stat_values` / `batch_statistics`, so that the loss of micro-batches sums to the loss of their union.

Precision: ratios, coefficients and the aggregated loss are computed in float32 for 16-bit `logp` (the
gradient still reaches `logp` in its own dtype), in logp's dtype otherwise.

NaN/inf in an active token's inputs (logp, rollout_logp, adv, or the Top-K `divergence`) propagate to the
loss as NaN (masking multiplies, it never selects them away; a NaN divergence, which no comparison would
mask, is turned into a NaN coefficient). Padding positions are dropped with `torch.where`, both in the loss
and in the coefficient that multiplies logp, so garbage there reaches neither the loss nor any gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from dppo._checks import check_choice, check_positive, check_same, check_tensor
from dppo.divergence import binary_kl, binary_tv
from dppo.loss_spec import AGGREGATIONS, ANCHORS, SEQUENCE_DELTAS, LossSpec, loss_spec
from dppo.sequence_mask import sequence_keep, unit_index, unit_shares
from dppo.trust_region import MAX_SEQ_LOG_RATIO, TRUST_REGIONS, sequence_log_ratio

__all__ = ["AGGREGATIONS", "ANCHORS", "LOSSES", "SEQUENCE_DELTAS", "LossSpec", "TokenInputs", "aggregate",
           "aggregation_denominator", "batch_stat_values", "batch_statistics", "drpo_loss", "loss_spec", "policy_loss"]
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


@dataclass(frozen=True)
class TokenInputs:
    """The per-token inputs of a loss besides logp, rollout_logp, adv and response_mask (B sequences, T positions);
    which are required depends on the spec (`LossSpec.region`'s `needs_topk`, `inputs` and `batch_stats`)."""

    divergence: Tensor | None = None
    """[B, T] precomputed divergence, required by the Top-K regions (against the mask's anchor: µ's top-K cells for
    "rollout", π_old's for "recompute")."""
    old_logp: Tensor | None = None
    """[B, T] recomputed log π_old; required by anchor "recompute"."""
    staleness: Tensor | None = None
    """[B, T], [B] or one value: each token's version lag τ_t in training steps; required by the regions whose
    `TrustRegion.inputs` name it (dppo_stale_*), ignored by the others."""
    turn_index: Tensor | None = None
    """[B, T] turn of each token (sequence_unit "turn")."""
    n_turns: int | None = None
    """An upper bound of the turn count (saves a host sync; `dppo.sequence_mask.unit_index`)."""
    batch_stats: Mapping[str, Tensor] | None = None
    """The statistics of the whole optimiser batch the region declares (`TrustRegion.batch_stats`, e.g. SAT's
    "sat_threshold"), from `batch_statistics` over every micro-batch of it. None = computed over this call's tokens
    (right when the call is the whole batch; with micro-batches the mask would depend on the split)."""


DEFAULT_SPEC = loss_spec()
"""`loss_spec()`: DPPO-Binary-TV, δ 0.15, anchor rollout, C 10, seq-mean-token-sum-norm."""


def batch_statistics(spec: LossSpec, values: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The region's batch statistics (`TrustRegion.batch_stats`) from each one's per-token values over the whole
    optimiser batch (`values[name]`: `BatchStat.values` of every active token, NaN elsewhere, any shape)."""
    return {name: stat.reduce(values[name], **{p: spec.params[p] for p in stat.params})
            for name, stat in spec.region.batch_stats.items()}


def batch_stat_values(spec: LossSpec, logp: Tensor, anchor_logp: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """Each batch statistic's per-token values [B, T] (detached, NaN at inactive tokens) of one micro-batch: join
    those of every micro-batch (and rank) of the optimiser batch, then `batch_statistics`."""
    out = {}
    with torch.no_grad():
        for name, stat in spec.region.batch_stats.items():
            v = stat.values(logp.detach(), anchor_logp.detach())
            out[name] = torch.where(response_mask.bool(), v, torch.full_like(v, float("nan")))
    return out


def _staleness(staleness: Tensor | None, spec: LossSpec, logp: Tensor) -> Tensor:
    if staleness is None:
        raise ValueError(f"staleness: required by trust_region {spec.trust_region!r} ([B, T] version lag of each "
                         "token, in training steps; 0 = sampled by the weights being trained)")
    check_tensor("staleness", staleness)
    if staleness.dim() == 0:
        staleness = staleness.reshape(1, 1).expand(logp.shape[0], 1)
    elif staleness.shape == logp.shape[:1]:
        staleness = staleness[:, None]
    if staleness.dim() != 2 or staleness.shape[0] != logp.shape[0] or staleness.shape[1] not in (1, logp.shape[1]):
        raise ValueError(f"staleness: expected shape [B] or [B, T]={tuple(logp.shape)}, got {tuple(staleness.shape)}")
    return staleness.expand_as(logp)


def _region_inputs(spec: LossSpec, inputs: TokenInputs, logp: Tensor, anchor_logp: Tensor,
                   mask: Tensor) -> dict[str, Tensor]:
    """The keyword tensors of the region's mask: its per-token inputs and its batch statistics."""
    region = spec.region
    out = {}
    if "staleness" in region.inputs:
        out["staleness"] = _staleness(inputs.staleness, spec, logp)
    if region.batch_stats:
        stats = inputs.batch_stats
        if stats is None:  # the call is the batch
            stats = batch_statistics(spec, batch_stat_values(spec, logp, anchor_logp, mask))
        missing = sorted(set(region.batch_stats) - set(stats))
        if missing:
            raise ValueError(f"batch_stats: {missing[0]} required by trust_region {spec.trust_region!r} (a statistic "
                             "of the whole optimiser batch: dppo.losses.batch_statistics)")
        out.update({name: stats[name] for name in region.batch_stats})
    return out


def _anchor(spec: LossSpec, inputs: TokenInputs, logp: Tensor, rollout_logp: Tensor) -> Tensor:
    if spec.region.needs_topk:
        if inputs.divergence is None:
            raise ValueError(f"divergence: required by trust_region {spec.trust_region!r} ([B, T] Top-K estimate)")
        check_same("divergence", inputs.divergence, "logp", logp, dtype=False)
    if spec.anchor == "rollout":
        return rollout_logp.detach()
    if inputs.old_logp is None:
        raise ValueError("old_logp: required when anchor='recompute' ([B, T] log-probs of the pre-update policy)")
    check_same("old_logp", inputs.old_logp, "logp", logp, dtype=False)
    return inputs.old_logp.detach()


def policy_loss(
    logp: Tensor,
    rollout_logp: Tensor,
    adv: Tensor,
    response_mask: Tensor,
    spec: LossSpec = DEFAULT_SPEC,
    inputs: TokenInputs | None = None,
    *,
    max_response_len: int | None = None,
    denominator: Tensor | float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The masked importance-weighted surrogate (Eq. 23), aggregated to a scalar.

    Args (B sequences, T response positions):
        logp: [B, T] log π(a_t|s_t) of the current policy, with gradient.
        rollout_logp: [B, T] log µ(a_t|s_t) recorded by the engine (any float dtype; detached).
        adv: [B] (sequence-level) or [B, T] advantages.
        response_mask: [B, T] bool, True = the token counts.
        spec: the resolved settings (`dppo.loss_spec.loss_spec`): trust region and its parameters, anchor, is_cap C in
            min(r, C), aggregation, and the sequence mask (`dppo.sequence_mask`: also drop every token of a unit — a
            response, or a turn with sequence_unit "turn" and `inputs.turn_index` — whose statistic against the mask's
            anchor exceeds sequence_delta; max_divergence reads the trust region's own per-token divergence,
            Binary-TV when the region has none).
        inputs: the per-token inputs the spec needs (`TokenInputs`: the Top-K divergence, π_old's log-probs,
            staleness, turns, the optimiser batch's statistics); None = none.
        max_response_len, denominator: see `aggregate`.

    Returns (loss scalar, metrics): metrics are detached scalar tensors — masked_frac, masked_frac_pos,
    masked_frac_neg (over active tokens, all/Â>0/Â<0), ratio_mean, ratio_max, ratio_above_cap_frac, and
    the counts n_tokens, n_pos, n_neg to weight them when combining micro-batches, and `keep` itself
    ([B, T] bool, the trust-region mask) for per-token diagnostics.
    """
    inputs = TokenInputs() if inputs is None else inputs
    adv = _check_inputs(logp, rollout_logp, adv, response_mask)
    anchor_logp = _anchor(spec, inputs, logp, rollout_logp)
    mask, divergence, is_cap = response_mask.bool(), inputs.divergence, spec.is_cap

    dtype = _compute_dtype(logp)
    with torch.no_grad():
        logp_d = logp.detach().to(dtype)
        rollout_d = rollout_logp.detach().to(dtype)
        log_ratio = (logp_d - rollout_d).clamp(max=MAX_LOG_RATIO)
        ratio = log_ratio.exp()
        adv_c = adv.detach().to(dtype)
        anchor_d = anchor_logp.to(dtype)
        units = _units(spec, inputs, mask) if spec.is_weight == "sequence" or "units" in spec.region.reads else None
        weight = _weight(spec, ratio, logp_d, rollout_d, anchor_d, mask, units)
        keyword = _region_inputs(spec, inputs, logp_d, anchor_d, mask)
        keyword.update(_region_reads(spec, rollout_d, anchor_d, units))
        keep = spec.region.fn(logp_d, anchor_d, adv_c, mask, divergence, **keyword, **spec.params)
        seq_stats = {}
        if spec.sequence_mask != "none":
            seq_keep, seq_stats = _sequence_keep(spec, inputs, logp_d, anchor_d, adv_c, mask, rollout_d)
            keep = keep & seq_keep
        coef = keep.to(dtype) * weight * adv_c
        if divergence is not None and spec.region.needs_topk:
            # A NaN divergence never masks (comparisons are False); make it poison the loss instead.
            coef = torch.where(torch.isnan(divergence), torch.full_like(coef, float("nan")), coef)
        # Padding gets coefficient 0, so garbage there (NaN/inf µ or Â) cannot reach logp's gradient.
        coef = torch.where(mask, coef, torch.zeros_like(coef))

    loss_tok = -(coef * logp.to(dtype))
    loss = aggregate(loss_tok, mask, spec.aggregation, max_response_len=max_response_len, denominator=denominator)
    return loss, {**_metrics(mask, keep, adv_c, ratio, is_cap), **seq_stats}


def _units(spec: LossSpec, inputs: TokenInputs, mask: Tensor) -> tuple[Tensor, int]:
    """(unit index [B, T], unit count): responses, or turns with sequence_unit "turn" (`unit_index`)."""
    turns = inputs.turn_index if spec.sequence_unit == "turn" else None
    return unit_index(mask, turns, inputs.n_turns if turns is not None else None)


def _weight(spec: LossSpec, ratio: Tensor, logp: Tensor, rollout_logp: Tensor, anchor_logp: Tensor, mask: Tensor,
            units: tuple[Tensor, int] | None) -> Tensor:
    """The detached importance weight w_t of `spec.is_weight` (`dppo.loss_spec.IS_WEIGHTS`), C = spec.is_cap."""
    cap = spec.is_cap
    if spec.is_weight == "policy":
        w = ratio
    elif spec.is_weight == "decoupled":  # min(π_old/µ, C) · π/π_old (anchor = π_old)
        roll = (anchor_logp - rollout_logp).clamp(max=MAX_LOG_RATIO).exp()
        return (roll.clamp(max=cap) if math.isfinite(cap) else roll) * (logp - anchor_logp).clamp(max=MAX_LOG_RATIO).exp()
    elif spec.is_weight == "anchor":
        w = (logp - anchor_logp).clamp(max=MAX_LOG_RATIO).exp()
    else:  # sequence: GSPO's s_u
        w = sequence_log_ratio(logp, anchor_logp, mask, units).clamp(max=MAX_SEQ_LOG_RATIO).exp()
    return w.clamp(max=cap) if math.isfinite(cap) else w


def _region_reads(spec: LossSpec, rollout_logp: Tensor, anchor_logp: Tensor,
                  units: tuple[Tensor, int] | None) -> dict[str, object]:
    """What the region's mask takes from the loss itself (`TrustRegion.reads`)."""
    have = {"rollout_logp": rollout_logp, "old_logp": anchor_logp if spec.anchor == "recompute" else None,
            "units": units}
    return {name: have[name] for name in spec.region.reads}


def _sequence_keep(spec: LossSpec, inputs: TokenInputs, logp: Tensor, anchor_logp: Tensor, adv: Tensor,
                   mask: Tensor, rollout_logp: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The sequence mask's keep [B, T] and what it removed (`unit_shares`, keys prefixed "seq_"). The geometric mask
    reads the rollout correction π_old/µ (π/µ under the rollout anchor), the others π against the mask's anchor."""
    units = inputs.turn_index if spec.sequence_unit == "turn" else None
    if spec.sequence_mask == "geometric":
        logp, anchor_logp = (anchor_logp if spec.anchor == "recompute" else logp), rollout_logp
    seq_keep, _ = sequence_keep(logp, anchor_logp, adv, mask, statistic=spec.sequence_mask,
                                delta=spec.sequence_delta, sides=spec.sequence_sides, turn_index=units,
                                n_turns=inputs.n_turns,
                                divergence=_token_divergence(spec.trust_region, logp, anchor_logp, inputs.divergence))
    shares = unit_shares(seq_keep, adv, mask, units, inputs.n_turns)
    return seq_keep, {f"seq_{k}": v for k, v in shares.items()}


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


def _drpo(logp: Tensor, rollout_logp: Tensor, adv: Tensor, response_mask: Tensor, spec: LossSpec = DEFAULT_SPEC,
          inputs: TokenInputs | None = None, *, max_response_len: int | None = None,
          denominator: Tensor | float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """`drpo_loss` under the LOSSES signature: δ = spec.drpo_delta, spec.aggregation; DRPO has no mask, so the trust
    region's settings and the per-token inputs do not apply (`loss_spec` refuses a recompute anchor or a sequence
    mask with it)."""
    return drpo_loss(logp, rollout_logp, adv, response_mask, delta=spec.drpo_delta, aggregation=spec.aggregation,
                     max_response_len=max_response_len, denominator=denominator)


LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "masked_is": policy_loss,
    "drpo": _drpo,
}
"""Every loss has one signature: fn(logp, rollout_logp, adv, response_mask, spec, inputs, *, max_response_len,
denominator) -> (loss, metrics), `spec` a `LossSpec` (`loss_spec`: the `loss` config section's settings resolved),
`inputs` a `TokenInputs`. `masked_is` is Eq. 23 with a trust-region mask (every method but DRPO), `drpo` the
quadratic penalty; `LOSSES[spec.loss]` is the spec's."""
