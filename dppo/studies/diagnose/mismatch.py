"""Training–inference mismatch report, binned by the rollout probability µ(a_t) (paper Fig. 2 and §3; docs/cli.md).

Given, for the same sampled tokens, the engine's log µ(a_t) and the trainer's recomputed log π(a_t) (same
weights, different numerics: e.g. a bf16 engine and an fp32 trainer), `mismatch_report` shows why the ratio
is a poor trust-region signal: r − 1 spreads out without bound as µ → 0, while |π − µ| (Binary TV) stays
bounded by µ-scale mass. Per log-spaced µ bucket it reports the spread of r − 1, π − µ and |π − µ|, the
Binary and Top-K TV/KL estimates (`dppo.metrics.token_mismatch`, the per-token values the trainer's mismatch
metrics average), the top-K mass coverage Σ_{top-K} µ, and the fraction of tokens that PPO-clip and
DPPO-Binary-TV (`dppo.trust_region.TRUST_REGIONS`) would mask, for Â = +1 and Â = −1 separately.

**Simulated update.** The masks are evaluated with the recomputed π itself as the "updated" policy and µ as
the anchor: they show which tokens each trust region would already reject when the only difference between
π and µ is numerical mismatch (no optimiser step at all).

`token_metrics` returns the flat per-token values (for plots); `mismatch_report` summarises them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dppo._checks import check_same, check_tensor
from dppo.metrics import token_mismatch
from dppo.trust_region import TRUST_REGIONS

__all__ = ["DEFAULT_BUCKETS", "DEFAULT_TRUST_REGIONS", "METRICS", "bucket_labels", "mismatch_report", "pair_stats",
           "token_metrics"]

DEFAULT_BUCKETS: tuple[float, ...] = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
"""Bucket edges in µ: log-spaced decades [1e-6, 1e-5), ..., [0.1, 1], plus [0, 1e-6) for the tail."""

DEFAULT_TRUST_REGIONS: Mapping[str, Mapping[str, float]] = {"ppo_clip": {}, "dppo_binary_tv": {}}
"""Trust region name -> parameter overrides of its registry defaults (PPO ε 0.2/0.28, DPPO δ 0.15)."""

METRICS = ("ratio_minus_1", "prob_diff", "binary_tv", "binary_kl", "topk_tv", "topk_kl", "topk_coverage")
"""Per-token quantities summarised per bucket (the Top-K ones only when Top-K inputs are given):
r − 1 (r = π/µ, log-ratio clamped at 20 before exp), π − µ, |π − µ| (= Binary TV, Eq. 13), Binary KL(µ‖π)
(Eq. 14), Top-K TV / KL(µ‖π) (Eqs. 15–16) and Σ µ over the valid top-K slots."""

_QUANTILES = (0.05, 0.5, 0.95)


def _check_inputs(logp, rollout_logp, response_mask, topk_logp, rollout_topk_logp, topk_valid) -> bool:
    check_tensor("logp", logp, floating=True)
    check_tensor("rollout_logp", rollout_logp, floating=True)
    check_same("rollout_logp", rollout_logp, "logp", logp, dtype=False)
    check_tensor("response_mask", response_mask, dtype=torch.bool)
    check_same("response_mask", response_mask, "logp", logp, dtype=False)
    given = [t is not None for t in (topk_logp, rollout_topk_logp)]
    if any(given) and not all(given):
        raise ValueError("topk_logp: give topk_logp and rollout_topk_logp together (or neither)")
    if not all(given):
        if topk_valid is not None:
            raise ValueError("topk_valid: given without topk_logp / rollout_topk_logp")
        return False
    check_tensor("topk_logp", topk_logp, floating=True)
    check_tensor("rollout_topk_logp", rollout_topk_logp, floating=True)
    check_same("rollout_topk_logp", rollout_topk_logp, "topk_logp", topk_logp, dtype=False)
    if topk_logp.shape[:-1] != logp.shape or topk_logp.shape[-1] < 2:
        raise ValueError(f"topk_logp: expected shape {tuple(logp.shape)} + (K+1,) with K >= 1, got {tuple(topk_logp.shape)}")
    if topk_valid is not None:
        check_tensor("topk_valid", topk_valid, dtype=torch.bool)
        check_same("topk_valid", topk_valid, "topk_logp", topk_logp, dtype=False)
    return True


def _check_buckets(buckets: Sequence[float]) -> list[float]:
    edges = [float(b) for b in buckets]
    if len(edges) < 2 or edges[0] < 0 or edges[-1] < 1 or any(b >= a for a, b in zip(edges[1:], edges)):
        raise ValueError(f"buckets: expected >= 2 strictly increasing edges from >= 0 up to >= 1, got {list(buckets)}")
    return edges


def bucket_labels(buckets: Sequence[float] = DEFAULT_BUCKETS) -> list[str]:
    """Human labels of the buckets, e.g. "[1e-04, 1e-03)"; the last bucket is closed."""
    edges = _check_buckets(buckets)
    n = len(edges) - 1
    return [f"[{lo:.0e}, {hi:.0e}{']' if i == n - 1 else ')'}" for i, (lo, hi) in enumerate(zip(edges, edges[1:]))]


@torch.no_grad()
def token_metrics(
    logp: Tensor,
    rollout_logp: Tensor,
    response_mask: Tensor,
    *,
    topk_logp: Tensor | None = None,
    rollout_topk_logp: Tensor | None = None,
    topk_valid: Tensor | None = None,
    trust_regions: Mapping[str, Mapping[str, float]] = DEFAULT_TRUST_REGIONS,
) -> dict[str, Tensor]:
    """Flat float32 per-token values over the N active tokens (padding dropped), in row-major order.

    logp, rollout_logp, response_mask: [B, T] (log π, log µ, True = real token). topk_logp,
    rollout_topk_logp, topk_valid: [B, T, K+1] in `dppo.rollout.base`'s layout (µ's top-K slots, then the
    sampled token's slot, valid only when it is outside the top-K). Returns "mu" [N], every name of
    `METRICS` [N] (Top-K ones only with Top-K inputs) and "masked/<region>/pos", "masked/<region>/neg" [N]
    bool (masked for Â = +1 / −1, with π as the simulated update of µ).
    """
    has_topk = _check_inputs(logp, rollout_logp, response_mask, topk_logp, rollout_topk_logp, topk_valid)
    sel = response_mask
    lp, mlp = logp.float()[sel], rollout_logp.float()[sel]
    cells = {}
    if has_topk:
        tp, tm = topk_logp.float()[sel], rollout_topk_logp.float()[sel]  # [N, K+1]
        valid = topk_valid[sel] if topk_valid is not None else torch.ones_like(tp, dtype=torch.bool)
        cells = {"logp_cells": tp, "rollout_cells": tm, "cells_valid": valid}
    divergences = token_mismatch(lp, mlp, **cells)
    out = {
        "mu": mlp.exp(),
        "ratio_minus_1": torch.exp((lp - mlp).clamp(max=20.0)) - 1.0,
        "prob_diff": lp.exp() - mlp.exp(),
        "binary_tv": divergences["binary_tv"],
        "binary_kl": divergences["binary_kl"],
    }
    if has_topk:
        out["topk_tv"], out["topk_kl"] = divergences["topk_tv"], divergences["topk_kl"]
        top = valid[:, :-1]  # the K top slots (the last slot is the out-of-top-K sampled token)
        out["topk_coverage"] = torch.where(top, tm[:, :-1].exp(), torch.zeros_like(tm[:, :-1])).sum(-1)
    ones = torch.ones_like(lp)
    for name, overrides in trust_regions.items():
        if name not in TRUST_REGIONS:
            raise ValueError(f"trust_regions: unknown {name!r}; valid names: {', '.join(sorted(TRUST_REGIONS))}")
        region = TRUST_REGIONS[name]
        if region.inputs:  # e.g. the staleness regions: one engine's batch has no version lag to give them
            raise ValueError(f"trust_regions: {name!r} reads {', '.join(region.inputs)}, which a diagnosis of one "
                             "engine's batch does not have (its tokens are fresh: use the region it reduces to)")
        params = {**region.defaults, **overrides}
        missing = [k for k, v in params.items() if v is None]
        if missing:
            raise ValueError(f"trust_regions: {name!r} needs a value for {missing}")
        div = None
        if region.divergence in ("topk_tv", "topk_kl"):
            if not has_topk:
                raise ValueError(f"trust_regions: {name!r} needs the Top-K inputs (topk_logp, rollout_topk_logp)")
            div = out[region.divergence]
        active = torch.ones_like(lp, dtype=torch.bool)
        for sign, adv in (("pos", ones), ("neg", -ones)):
            out[f"masked/{name}/{sign}"] = ~region.fn(lp, mlp, adv, active, div, **params)
    return out


def _stats(x: Tensor) -> dict[str, float]:
    """mean, std (population), min, max and the 5/50/95% quantiles of a non-empty 1-D tensor (in float64;
    a non-finite result, e.g. an infinite KL, becomes None so that the JSON stays strict)."""
    x = x.double()
    q = torch.quantile(x, torch.tensor(_QUANTILES, dtype=x.dtype, device=x.device))
    values = torch.stack([x.mean(), x.std(correction=0), x.min(), x.max(), *q]).tolist()
    return {k: (v if math.isfinite(v) else None) for k, v in zip(("mean", "std", "min", "max", "q05", "q50", "q95"), values)}


def _summary(metrics: Mapping[str, Tensor], keep: Tensor) -> dict:
    n = int(keep.sum())
    row: dict = {"count": n, "mu": _stats(metrics["mu"][keep]) if n else None}
    for name in METRICS:
        if name in metrics:
            row[name] = _stats(metrics[name][keep]) if n else None
    masked = {}
    for key, value in metrics.items():
        if key.startswith("masked/"):
            _, region, sign = key.split("/")
            masked.setdefault(region, {})[sign] = float(value[keep].double().mean()) if n else None
    row["masked_frac"] = masked
    return row


@torch.no_grad()
def mismatch_report(
    logp: Tensor,
    rollout_logp: Tensor,
    response_mask: Tensor,
    *,
    topk_logp: Tensor | None = None,
    rollout_topk_logp: Tensor | None = None,
    topk_valid: Tensor | None = None,
    buckets: Sequence[float] = DEFAULT_BUCKETS,
    trust_regions: Mapping[str, Mapping[str, float]] = DEFAULT_TRUST_REGIONS,
) -> dict:
    """Per-µ-bucket mismatch statistics between the trainer's π and the engine's µ on the same tokens.

    Inputs as `token_metrics` (log π and log µ at the sampled tokens, [B, T]; optional Top-K cells
    [B, T, K+1]); padding (response_mask False) is ignored. buckets: edges in µ, strictly increasing from
    ≥ 0 to ≥ 1; a token with µ in [edges[i], edges[i+1]) goes to bucket i (the last bucket is closed at its
    top edge; µ below edges[0] is counted in no bucket, only in "overall"). trust_regions: name in
    `TRUST_REGIONS` -> parameter overrides (default: PPO-clip ε 0.2/0.28 and DPPO-Binary-TV δ 0.15).

    The masks use π (the recomputed policy) as the simulated update and µ as the anchor: the fraction of
    tokens each trust region would mask from numerical mismatch alone, for Â = +1 ("pos") and Â = −1 ("neg").

    Returns a JSON-ready dict: {"buckets": [{"lo", "hi", "label", "count", "mu" and each <metric>: {"mean",
    "std", "min", "max", "q05", "q50", "q95"} or None when empty, "masked_frac": {region: {"pos", "neg"}}}, ...],
    "overall": the same over all active tokens, "num_tokens", "trust_regions": the parameters used}.
    Metrics are those of `METRICS` (Top-K ones only with Top-K inputs).
    """
    edges = _check_buckets(buckets)
    metrics = token_metrics(logp, rollout_logp, response_mask, topk_logp=topk_logp,
                            rollout_topk_logp=rollout_topk_logp, topk_valid=topk_valid, trust_regions=trust_regions)
    mu = metrics["mu"]
    inner = torch.tensor(edges[1:-1], dtype=mu.dtype, device=mu.device)
    index = torch.bucketize(mu, inner, right=True)  # i such that edges[i] <= µ < edges[i+1]
    in_range = (mu >= edges[0]) & (mu <= edges[-1])
    rows = []
    for i, (lo, hi, label) in enumerate(zip(edges, edges[1:], bucket_labels(edges))):
        rows.append({"lo": lo, "hi": hi, "label": label, **_summary(metrics, in_range & (index == i))})
    return {
        "num_tokens": int(mu.numel()),
        "buckets": rows,
        "overall": _summary(metrics, torch.ones_like(mu, dtype=torch.bool)),
        "trust_regions": {name: {**TRUST_REGIONS[name].defaults, **o} for name, o in trust_regions.items()},
    }


@torch.no_grad()
def pair_stats(logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, delta: float = 0.15) -> dict[str, float]:
    """How far two scorings of the same tokens are (a trainer precision against an engine's µ, or one scoring against
    another at another batch shape), over the active tokens: the share with π(a)/µ(a) outside [0.9, 1.1] (verl #6280's
    statistic), the mean Binary TV |π(a) − µ(a)| and the share with Binary TV > `delta` (the most DPPO-Binary-TV could
    mask before any update), and the token count."""
    mask = response_mask.bool()
    pi, mu = logp.double()[mask], rollout_logp.double()[mask]
    ratio = (pi - mu).clamp(max=20.0).exp()
    tv = (pi.exp() - mu.exp()).abs()
    n = max(int(mask.sum()), 1)
    return {"out_0.9_1.1": float(((ratio < 0.9) | (ratio > 1.1)).sum()) / n, "binary_tv_mean": float(tv.sum()) / n,
            "tv_over_delta": float((tv > delta).sum()) / n, "tokens": int(mask.sum())}
