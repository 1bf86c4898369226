"""Trust-region masks (Eq. 12, and the baselines' rules of docs/library.md): which tokens keep their policy-gradient
term.

Every mask has the same signature

    mask(logp, anchor_logp, adv, response_mask, divergence, **params) -> keep  [B, T] bool, detached

with logp = log π(a_t) of the current policy, anchor_logp = log of the anchor policy at a_t (the rollout
policy µ by default, or the recomputed pre-update policy π_old for the `recompute` anchor), adv [B, T],
response_mask [B, T] bool (True = real token), divergence [B, T] (a precomputed estimate, used by the
Top-K regions; None otherwise). r_t = π/anchor. δ_high / ε_high apply where Â_t > 0, δ_low / ε_low where
Â_t < 0; tokens with Â_t = 0 are kept (their term is zero anyway).

`TRUST_REGIONS` maps a name to a `TrustRegion(fn, params, divergence, needs_topk)`, which carries everything
about a region: `params` names every scalar parameter of the mask with its default (None = must be given),
its check and its help text (the config fields `loss.<param>` and the CLI flags `--loss.<param>` are made
from them, and `region_params` is the one place they are checked: a value given for a parameter the region does not
take is an error naming the regions that take it); `divergence` names the estimate the mask
is defined on ("binary_tv", "binary_kl", "topk_tv", "topk_kl" or None); `needs_topk` says the engine must
record µ's top-K; `inputs` names the extra per-token tensors the mask takes by keyword ("staleness": each token's
measured version lag τ_t, in training steps); `batch_stats` names the statistics of the whole optimiser batch the
mask takes by keyword (SAT's "sat_threshold": the tail quantile), which `dppo.losses.batch_statistics` computes once
per optimiser batch so that the mask does not depend on the micro-batch split; `reads` names what the mask takes from
the loss itself by keyword ("rollout_logp": log µ; "old_logp": the recomputed log π_old, None under the rollout
anchor; "units": each token's unit index [B, T] and the unit count, responses or turns by `loss.sequence_unit`), which
no caller supplies; `weight` is the importance weight the region is defined with (`dppo.loss_spec.IS_WEIGHTS`; None
= the loss's default min(π/µ, C)); `masks_toward` says the mask may drop a token that moves back toward the anchor
(two-sided or sequence-level masks), which the shared property test then does not ask of it. Adding a trust region is one function
and one entry here (`pg_is_neg_mask`, the paper's Fig. 5 mask, was added that way); the shared tests are
parametrised over this dict.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

from dppo.divergence import binary_kl, binary_tv
from dppo.sequence_mask import _per_unit

__all__ = [
    "TRUST_REGIONS",
    "TrustRegion",
    "dppo_binary_tv",
    "dppo_binary_kl",
    "dppo_topk_tv",
    "dppo_topk_kl",
    "ppo_clip",
    "ppo_clip_relax",
    "no_mask",
    "cppo",
    "pg_is_neg_mask",
    "dppo_stale_tv",
    "dppo_stale_kl",
    "dppo_sat_tv",
    "dppo_sat_kl",
    "token_mis",
    "gspo",
    "region_params",
    "regions_taking",
    "BatchStat",
    "needs_topk",
    "DEFAULT_TOP_K",
]


def _dppo_keep(logp: Tensor, anchor_logp: Tensor, adv: Tensor, div: Tensor, delta_low: float, delta_high: float) -> Tensor:
    """Eq. 12: masked iff (Â>0, r>1, D>δ_high) or (Â<0, r<1, D>δ_low). NaN divergence never masks."""
    up = logp > anchor_logp
    down = logp < anchor_logp
    masked = ((adv > 0) & up & (div > delta_high)) | ((adv < 0) & down & (div > delta_low))
    return ~masked


@torch.no_grad()
def dppo_binary_tv(logp, anchor_logp, adv, response_mask, divergence, *, delta_low: float, delta_high: float) -> Tensor:
    """DPPO with Binary-TV (Eqs. 12–13): masked iff p − m > δ_high (Â>0) or m − p > δ_low (Â<0)."""
    return _dppo_keep(logp, anchor_logp, adv, binary_tv(logp, anchor_logp), delta_low, delta_high)


@torch.no_grad()
def dppo_binary_kl(logp, anchor_logp, adv, response_mask, divergence, *, delta_low: float, delta_high: float) -> Tensor:
    """DPPO with Binary-KL(anchor‖π) (Eqs. 12, 14)."""
    return _dppo_keep(logp, anchor_logp, adv, binary_kl(logp, anchor_logp), delta_low, delta_high)


@torch.no_grad()
def dppo_topk_tv(logp, anchor_logp, adv, response_mask, divergence, *, delta_low: float, delta_high: float) -> Tensor:
    """DPPO with the Top-K TV estimate (Eqs. 12, 15); `divergence` is `topk_tv` computed by the caller."""
    return _dppo_keep(logp, anchor_logp, adv, divergence, delta_low, delta_high)


@torch.no_grad()
def dppo_topk_kl(logp, anchor_logp, adv, response_mask, divergence, *, delta_low: float, delta_high: float) -> Tensor:
    """DPPO with the Top-K KL estimate (Eqs. 12, 16); `divergence` is `topk_kl` computed by the caller."""
    return _dppo_keep(logp, anchor_logp, adv, divergence, delta_low, delta_high)


@torch.no_grad()
def ppo_clip(logp, anchor_logp, adv, response_mask, divergence, *, eps_low: float, eps_high: float) -> Tensor:
    """PPO/GRPO ratio clip: masked iff (Â>0 and r > 1+ε_high) or (Â<0 and r < 1−ε_low).

    With the detached-ratio surrogate this has the gradient of min(rÂ, clip(r, 1−ε_low, 1+ε_high)Â).
    """
    r = torch.exp((logp - anchor_logp).clamp(max=20.0))
    masked = ((adv > 0) & (r > 1.0 + eps_high)) | ((adv < 0) & (r < 1.0 - eps_low))
    return ~masked


@torch.no_grad()
def ppo_clip_relax(
    logp, anchor_logp, adv, response_mask, divergence, *, eps_low: float, eps_high: float, relax_alpha: float, relax_side: str
) -> Tensor:
    """Relax-α ablation (§6): PPO clip, but tokens with anchor probability < α are never masked on the
    relaxed side(s) (`relax_side` ∈ {"high", "low", "both"}: high = the Â>0 side, low = the Â<0 side)."""
    if relax_side not in ("high", "low", "both"):
        raise ValueError(f"relax_side: expected 'high', 'low' or 'both', got {relax_side!r}")
    keep = ppo_clip(logp, anchor_logp, adv, response_mask, divergence, eps_low=eps_low, eps_high=eps_high)
    rare = anchor_logp.exp() < relax_alpha
    side = {"high": adv > 0, "low": adv < 0, "both": adv != 0}[relax_side]
    return keep | (rare & side)


@torch.no_grad()
def no_mask(logp, anchor_logp, adv, response_mask, divergence) -> Tensor:
    """No trust region: every token kept (PG-IS; CISPO / PG-TIS when the IS cap is finite)."""
    return torch.ones_like(logp, dtype=torch.bool)


@torch.no_grad()
def cppo(
    logp, anchor_logp, adv, response_mask, divergence, *,
    delta_low: float, delta_high: float, cppo_w_min: float, cppo_delta_b_min: float, cppo_q: float, cppo_k: float,
) -> Tensor:
    """CPPO (arXiv 2606.10968): a cumulative, position-weighted Binary-TV budget per sequence.

    w_t = w_min + (1−w_min)(T−t)/(T−1) over a sequence's T active tokens (t = 1..T), Z_t = w_t D_t,
    S_t = Σ_{j≤t} Z_j, W_t = Σ_{j≤t} w_j, c_t = min(δ, δ + δ_b W_{t−1} − S_{t−1}); keep iff
    Â_t (r_t − 1) ≤ 0 or Z_t ≤ c_t, with δ_b = clamp(k · quantile_q(D_{1:T}), δ_b,min, 2 δ_b,min) per
    sequence and δ = δ_high where Â_t > 0, δ_low where Â_t < 0. D_t = Binary TV. Tokens must be
    left-aligned (response_mask a prefix per row).
    """
    mask = response_mask.bool()
    div = binary_tv(logp, anchor_logp).to(torch.float64)
    length = mask.sum(-1, keepdim=True).to(torch.float64)  # [B, 1]
    pos = torch.cumsum(mask.to(torch.float64), dim=-1)  # t = 1..T at active tokens
    frac = torch.where(length > 1, (length - pos) / (length - 1).clamp(min=1.0), torch.ones_like(pos))
    w = torch.where(mask, cppo_w_min + (1.0 - cppo_w_min) * frac, torch.zeros_like(pos))
    z = w * torch.where(mask, div, torch.zeros_like(div))
    s_prev = torch.cumsum(z, -1) - z
    w_prev = torch.cumsum(w, -1) - w
    masked_div = torch.where(mask, div, torch.full_like(div, float("nan")))
    quant = torch.nanquantile(masked_div, cppo_q, dim=-1, keepdim=True).nan_to_num(0.0)
    delta_b = (cppo_k * quant).clamp(min=cppo_delta_b_min, max=2.0 * cppo_delta_b_min)
    delta = torch.where(adv > 0, torch.full_like(div, delta_high), torch.full_like(div, delta_low))
    budget = torch.minimum(delta, delta + delta_b * w_prev - s_prev)
    toward_anchor = adv * (logp - anchor_logp) <= 0
    return toward_anchor | (z <= budget)


@torch.no_grad()
def pg_is_neg_mask(logp, anchor_logp, adv, response_mask, divergence, *, neg_delta: float) -> Tensor:
    """Fig. 5 (§5.3): PG-IS plus a mask on negative samples only: masked iff Â_t < 0 and
    anchor(a_t) − π(a_t) ≥ neg_delta (the update has already pushed the token's probability down by δ)."""
    return ~((adv < 0) & (anchor_logp.exp() - logp.exp() >= neg_delta))


def stale_delta(delta: float, staleness: Tensor, stale_alpha: float) -> Tensor:
    """δ(τ) = δ / (1 + α·τ): δ for a fresh token (τ = 0), δ/2 at τ = 1/α, → 0 as τ grows (τ clamped ≥ 0)."""
    return delta / (1.0 + stale_alpha * staleness.clamp(min=0))


@torch.no_grad()
def dppo_stale_tv(logp, anchor_logp, adv, response_mask, divergence, *, staleness: Tensor, delta_low: float,
                  delta_high: float, stale_alpha: float) -> Tensor:
    """Staleness-adaptive DPPO-Binary-TV (this project's design): Eq. 12 with δ_t = δ(τ_t) = δ / (1 + α τ_t), τ_t the
    token's measured version lag (0 = sampled by the weights being trained); α = 0 or τ = 0 is DPPO-Binary-TV."""
    s = staleness.to(logp.dtype)
    return _dppo_keep(logp, anchor_logp, adv, binary_tv(logp, anchor_logp),
                      stale_delta(delta_low, s, stale_alpha), stale_delta(delta_high, s, stale_alpha))


@torch.no_grad()
def dppo_stale_kl(logp, anchor_logp, adv, response_mask, divergence, *, staleness: Tensor, delta_low: float,
                  delta_high: float, stale_alpha: float) -> Tensor:
    """Staleness-adaptive DPPO-Binary-KL: `dppo_stale_tv` on Binary-KL(anchor‖π)."""
    s = staleness.to(logp.dtype)
    return _dppo_keep(logp, anchor_logp, adv, binary_kl(logp, anchor_logp),
                      stale_delta(delta_low, s, stale_alpha), stale_delta(delta_high, s, stale_alpha))


def sat_values(logp: Tensor, anchor_logp: Tensor) -> Tensor:
    """|log π − log anchor| per token, in at least float32: the value whose batch quantile `sat_threshold` takes."""
    x = (logp - anchor_logp).abs()
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def sat_threshold(values: Tensor, *, sat_quantile: float) -> Tensor:
    """The `sat_quantile`-quantile of `values` ([...], NaN = not an active token, ignored): a scalar tensor, NaN when
    no value is active. Over a whole optimiser batch, it is the batch statistic the SAT-like masks read."""
    return torch.nanquantile(values.reshape(-1), sat_quantile)


def sat_tail(logp: Tensor, anchor_logp: Tensor, response_mask: Tensor, quantile: float,
             threshold: Tensor | None = None) -> Tensor:
    """The batch's high-staleness tail: active tokens whose |sg(log π − log anchor)| is strictly above `threshold`,
    the `quantile`-quantile of that value over the optimiser batch's active tokens (`sat_threshold`; None = over this
    call's active tokens: the call is the batch). [B, T] bool; none when all are equal."""
    x = (logp - anchor_logp).abs()
    if threshold is None:
        active = torch.where(response_mask.bool(), sat_values(logp, anchor_logp), torch.full_like(x, float("nan")))
        threshold = sat_threshold(active, sat_quantile=quantile)  # NaN when no active token
    return response_mask.bool() & (x > threshold.to(x.dtype))


def _sat_keep(logp, anchor_logp, adv, response_mask, div, delta_low, delta_high, sat_quantile, sat_shrink,
              sat_threshold) -> Tensor:
    tail = sat_tail(logp, anchor_logp, response_mask, sat_quantile, sat_threshold)
    shrink = torch.where(tail, torch.full_like(div, sat_shrink), torch.ones_like(div))
    return _dppo_keep(logp, anchor_logp, adv, div, delta_low * shrink, delta_high * shrink)


@torch.no_grad()
def dppo_sat_tv(logp, anchor_logp, adv, response_mask, divergence, *, delta_low: float, delta_high: float,
                sat_quantile: float, sat_shrink: float, sat_threshold: Tensor | None = None) -> Tensor:
    """SAT-like DPPO-Binary-TV (the tail detection follows "Stale but Stable", arXiv 2607.18722, whose abstract is all
    that is public; the kernel is this project's): tokens in the batch's tail of |sg(log π − log µ)| (`sat_tail`,
    above its `sat_quantile`-quantile) get the side of the region the advantage pushes against contracted,
    δ_high → κ δ_high where Â > 0 (the upper side: π(a_t) rising) and δ_low → κ δ_low where Â < 0 (the lower side);
    every other token keeps DPPO's δ. κ = `sat_shrink`; κ = 1, or an empty tail, is DPPO-Binary-TV. `sat_threshold`:
    the quantile over the whole optimiser batch (the batch statistic of the region's `TrustRegion.batch_stats`, which
    `dppo.losses.policy_loss` takes in `TokenInputs.batch_stats`); None = over this call's tokens."""
    return _sat_keep(logp, anchor_logp, adv, response_mask, binary_tv(logp, anchor_logp), delta_low, delta_high,
                     sat_quantile, sat_shrink, sat_threshold)


@torch.no_grad()
def dppo_sat_kl(logp, anchor_logp, adv, response_mask, divergence, *, delta_low: float, delta_high: float,
                sat_quantile: float, sat_shrink: float, sat_threshold: Tensor | None = None) -> Tensor:
    """SAT-like DPPO-Binary-KL: `dppo_sat_tv` on Binary-KL(anchor‖π)."""
    return _sat_keep(logp, anchor_logp, adv, response_mask, binary_kl(logp, anchor_logp), delta_low, delta_high,
                     sat_quantile, sat_shrink, sat_threshold)


@torch.no_grad()
def token_mis(logp, anchor_logp, adv, response_mask, divergence, *, rollout_logp: Tensor, old_logp: Tensor | None,
              mis_low: float, mis_high: float, eps_low: float, eps_high: float) -> Tensor:
    """Token-level masked importance sampling (IcePop): the PPO clip on r = π/anchor (ε = inf: none) and a two-sided
    mask on the rollout correction q_t = π_old(a_t)/µ(a_t), whatever the advantage's sign: masked iff q_t < mis_low
    or q_t > mis_high. π_old is the recomputed pre-update policy (`old_logp`, the recompute anchor: verl's decoupled
    mode) or, under the rollout anchor, the current π (verl's bypass mode, where π_old := µ and q = π/µ).

    Sources (the bounds on π_old/µ, both inclusive): verl `verl/trainer/ppo/rollout_corr_helper.py` L221-222, L271-275
    (`rollout_rs="token_k1"`, bounds "lower_upper" on log(µ/π_old): symmetric bounds as here; a 0/1 mask replacing
    response_mask); SkyRL `skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py` L170-179
    (`token_mask_is_threshold_low/high`, a 0/1 mask, the docs' IcePop 0.5 / 2.0); TRL `trl/trainer/grpo_trainer.py`
    1.16 L2660-2704 and slime `slime/backends/megatron_utils/loss.py` L908-931 (`icepop_function`) keep the weight
    q_t inside the bounds and 0 outside, which is this mask with `loss.is_weight` "decoupled"."""
    num = logp if old_logp is None else old_logp
    log_q = num - rollout_logp
    in_bounds = (log_q >= math.log(mis_low)) & (log_q <= math.log(mis_high))
    return in_bounds & ppo_clip(logp, anchor_logp, adv, response_mask, divergence, eps_low=eps_low, eps_high=eps_high)


def sequence_log_ratio(logp: Tensor, anchor_logp: Tensor, response_mask: Tensor, units: tuple[Tensor, int]) -> Tensor:
    """mean_{t ∈ u} (log π − log anchor) of each token's unit u, [B, T] (0 for a unit without an active token):
    GSPO's log s_u, the log of the geometric mean of the unit's ratios. `units` = (index [B, T], count) as
    `dppo.sequence_mask.unit_index` gives them."""
    index, n = units
    return _per_unit(logp - anchor_logp, response_mask.bool(), index, n, "mean")


@torch.no_grad()
def gspo(logp, anchor_logp, adv, response_mask, divergence, *, units: tuple[Tensor, int], eps_low: float,
         eps_high: float) -> Tensor:
    """GSPO's sequence-level clip (arXiv 2507.18071): s_u = exp(mean_{t∈u} log(π/anchor)) per response (or turn,
    `units`); every token of u is masked iff (Â > 0 and s_u > 1 + ε_high) or (Â < 0 and s_u < 1 − ε_low). With the
    region's weight "sequence" (w_t = sg(s_u)) and aggregation seq-mean-token-mean, the gradient is GSPO's:
    −keep_u · s_u · Â_u · mean_{t∈u} ∇log π(a_t).

    Sources: TRL `trl/trainer/grpo_trainer.py` 1.16 L3083-3095, L3113-3120 (`importance_sampling_level="sequence"`,
    coef_1 = exp(masked mean of log π − log π_old), −min(coef_1 Â, clip(coef_1) Â), `loss_type="grpo"`, ε 3e-4 /
    4e-4 in its GSPO recipe); verl `verl/trainer/ppo/core_algos.py` L1286-1313 (`compute_policy_loss_gspo`,
    s_{i,t} = sg(s_i) π_t / sg(π_t), log clamped at 10, seq-mean-token-mean). The anchor is µ (verl's bypass mode) or
    the recomputed π_old (the sources' own)."""
    log_s = sequence_log_ratio(logp, anchor_logp, response_mask, units).clamp(max=MAX_SEQ_LOG_RATIO)
    s = log_s.exp()
    masked = ((adv > 0) & (s > 1.0 + eps_high)) | ((adv < 0) & (s < 1.0 - eps_low))
    return ~masked


MAX_SEQ_LOG_RATIO = 10.0
"""Clamp of log s_u (verl's `compute_policy_loss_gspo`), so an extreme unit cannot overflow."""


class Param(NamedTuple):
    """One scalar parameter of a trust region: its default (None = must be given), the check its value must
    pass (`expect` says what it expects, for the error message) and its help text (the CLI's `--loss.NAME`)."""

    default: Any
    doc: str
    check: Callable[[Any], bool]
    expect: str


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _gt0(doc: str, default: float | None) -> Param:
    return Param(default, doc, lambda x: _number(x) and x > 0, "> 0")


def _unit(doc: str, default: float) -> Param:
    return Param(default, doc, lambda x: _number(x) and 0.0 <= x <= 1.0, "in [0, 1]")


_DELTA_DOC = "DPPO/CPPO divergence threshold where Â {} 0 (default per region: 0.15 for TV, 0.05 for KL)."
_EPS_DOC = "Ratio-clip ε where Â {} 0 (ppo_clip, ppo_clip_relax, token_mis: default {}; gspo, on the sequence ratio: {})."


def _dppo(delta: float) -> dict[str, Param]:
    return {"delta_low": _gt0(_DELTA_DOC.format("<"), delta), "delta_high": _gt0(_DELTA_DOC.format(">"), delta)}


_CLIP = {"eps_low": _gt0(_EPS_DOC.format("<", 0.2, 3e-4), 0.2),
         "eps_high": _gt0(_EPS_DOC.format(">", "0.28, clip-higher", 4e-4), 0.28)}


_STALE_ALPHA = Param(0.5, "dppo_stale_*: α of δ(τ) = δ / (1 + α τ), τ = the token's version lag in steps.",
                     lambda x: _number(x) and x >= 0, ">= 0")
_SAT = {
    "sat_quantile": Param(0.9, "dppo_sat_*: the tail is the tokens above this quantile of |log π − log µ| in the batch.",
                          lambda x: _number(x) and 0.0 < x < 1.0, "in (0, 1)"),
    "sat_shrink": _unit("dppo_sat_*: κ, the factor of δ on the advantage's side for tokens in the tail.", 0.5),
}


class BatchStat(NamedTuple):
    """A statistic of the whole optimiser (mini-)batch that a region's mask reads by keyword (e.g. SAT's tail
    quantile): `values(logp, anchor_logp)` gives each token's value [B, T] (at least float32), `reduce(values,
    **params)` the statistic (a scalar tensor) of the active tokens' values (NaN = not active; over every micro-batch
    and rank), `params` the region parameters `reduce` takes."""

    values: Callable[[Tensor, Tensor], Tensor]
    reduce: Callable[..., Tensor]
    params: tuple[str, ...]


_SAT_STATS = {"sat_threshold": BatchStat(sat_values, sat_threshold, ("sat_quantile",))}


class TrustRegion(NamedTuple):
    """Everything about a trust region: its mask, its parameters, the divergence it is defined on, and whether the
    engine must record µ's top-K log-probs for it."""

    fn: Callable[..., Tensor]
    params: dict[str, Param]
    """Every keyword parameter of `fn` (name -> Param); config fields and CLI flags are made from these."""
    divergence: str | None
    """The divergence estimate the mask is defined on ("binary_tv", "binary_kl", "topk_tv", "topk_kl" or None)."""
    needs_topk: bool = False
    """True when the mask reads a caller-computed Top-K `divergence`: the engine records µ's top-K log-probs."""
    inputs: tuple[str, ...] = ()
    """Extra [B, T] tensors the mask takes by keyword: "staleness" = each token's version lag τ_t (training steps)."""
    batch_stats: dict[str, BatchStat] = {}
    """Statistics of the whole optimiser batch the mask takes by keyword (name -> BatchStat): computed once per
    optimiser batch over all its active tokens and passed to every micro-batch (`dppo.losses.batch_statistics`), so
    the mask does not depend on how the batch is split."""

    reads: tuple[str, ...] = ()
    """What the mask takes from the loss itself by keyword (no caller supplies it): "rollout_logp" (log µ [B, T]),
    "old_logp" (log π_old [B, T] under the recompute anchor, else None), "units" ((index [B, T], count): responses,
    or turns with loss.sequence_unit "turn")."""
    weight: str | None = None
    """The importance weight the region is defined with (`dppo.loss_spec.IS_WEIGHTS`), used when `loss.is_weight` is
    unset; None = "policy", min(π/µ, C)."""
    masks_toward: bool = False
    """True when the mask may drop a token that moves back toward the anchor (a two-sided bound, a sequence-level
    clip): every other region never does."""

    @property
    def defaults(self) -> dict[str, Any]:
        """Each parameter's default (None = must be given)."""
        return {name: p.default for name, p in self.params.items()}


TRUST_REGIONS: dict[str, TrustRegion] = {
    "dppo_binary_tv": TrustRegion(dppo_binary_tv, _dppo(0.15), "binary_tv"),
    "dppo_binary_kl": TrustRegion(dppo_binary_kl, _dppo(0.05), "binary_kl"),
    "dppo_topk_tv": TrustRegion(dppo_topk_tv, _dppo(0.15), "topk_tv", needs_topk=True),
    "dppo_topk_kl": TrustRegion(dppo_topk_kl, _dppo(0.05), "topk_kl", needs_topk=True),
    "ppo_clip": TrustRegion(ppo_clip, _CLIP, None),
    "ppo_clip_relax": TrustRegion(ppo_clip_relax, {
        **_CLIP,
        "relax_alpha": _gt0("ppo_clip_relax: tokens with anchor probability < α are never masked on the relaxed side.", None),
        "relax_side": Param("both", "ppo_clip_relax: which side is relaxed (high = Â > 0, low = Â < 0, both).",
                            lambda x: x in ("high", "low", "both"), "'high', 'low' or 'both'"),
    }, None),
    "none": TrustRegion(no_mask, {}, None),
    "cppo": TrustRegion(cppo, {
        **_dppo(0.15),
        "cppo_w_min": _unit("cppo: smallest position weight w_min (the last token's).", 0.8),
        "cppo_delta_b_min": _gt0("cppo: lower bound δ_b,min of the per-token budget growth δ_b.", 0.02),
        "cppo_q": _unit("cppo: quantile q of a sequence's divergences that sets δ_b.", 0.9),
        "cppo_k": Param(1.0, "cppo: multiplier k of that quantile.", lambda x: _number(x) and x >= 0, ">= 0"),
    }, "binary_tv"),
    "pg_is_neg_mask": TrustRegion(pg_is_neg_mask, {
        "neg_delta": _gt0("pg_is_neg_mask (Fig. 5): mask a token with Â < 0 when anchor(a) − π(a) ≥ this.", 0.5),
    }, None),
    "dppo_stale_tv": TrustRegion(dppo_stale_tv, {**_dppo(0.15), "stale_alpha": _STALE_ALPHA}, "binary_tv",
                                 inputs=("staleness",)),
    "dppo_stale_kl": TrustRegion(dppo_stale_kl, {**_dppo(0.05), "stale_alpha": _STALE_ALPHA}, "binary_kl",
                                 inputs=("staleness",)),
    "dppo_sat_tv": TrustRegion(dppo_sat_tv, {**_dppo(0.15), **_SAT}, "binary_tv", batch_stats=_SAT_STATS),
    "dppo_sat_kl": TrustRegion(dppo_sat_kl, {**_dppo(0.05), **_SAT}, "binary_kl", batch_stats=_SAT_STATS),
    "token_mis": TrustRegion(token_mis, {
        "mis_low": _gt0("token_mis (IcePop): mask a token whose π_old/µ is below this (π/µ under the rollout anchor).", 0.5),
        "mis_high": _gt0("token_mis (IcePop): mask a token whose π_old/µ is above this.", 2.0),
        **_CLIP,
    }, None, reads=("rollout_logp", "old_logp"), masks_toward=True),
    "gspo": TrustRegion(gspo, {
        "eps_low": _CLIP["eps_low"]._replace(default=3e-4),
        "eps_high": _CLIP["eps_high"]._replace(default=4e-4),
    }, None, reads=("units",), weight="sequence", masks_toward=True),
}

DEFAULT_TOP_K = 20
"""K of µ's top-K log-probs recorded when a trust region needs them and the run does not set K (the paper's 20)."""


def region_params(trust_region: str, given: dict[str, Any]) -> dict[str, Any]:
    """The keyword parameters of `trust_region`'s mask: `given` values (None = the default), each checked.
    ValueError naming the parameter (an unknown region, a value given for a parameter the region does not take, a
    value failing its check, a missing required one)."""
    if trust_region not in TRUST_REGIONS:
        raise ValueError(f"trust_region: unknown value {trust_region!r}; valid: {', '.join(sorted(TRUST_REGIONS))}")
    own = TRUST_REGIONS[trust_region].params
    for name, value in given.items():
        if value is not None and name not in own:
            takers = regions_taking(name)
            raise ValueError(f"{name}: not a parameter of trust region {trust_region!r} (which takes "
                             f"{', '.join(own) or 'no parameter'}); "
                             + (f"it is taken by {', '.join(takers)}" if takers else "no trust region takes it"))
    out = {}
    for name, param in own.items():
        value = given.get(name)
        value = param.default if value is None else value
        if value is None:
            raise ValueError(f"{name}: required by trust_region {trust_region!r} (no default)")
        out[name] = _checked(name, param, value)
    return out


def check_param(name: str, value: Any) -> Any:
    """`value` if it passes the check of the trust-region parameter `name`, else ValueError naming it."""
    return _checked(name, all_params()[name], value)


def _checked(name: str, param: Param, value: Any) -> Any:
    if not param.check(value):
        raise ValueError(f"{name}: expected {param.expect}, got {value!r}")
    return value


def regions_taking(name: str) -> tuple[str, ...]:
    """The trust regions that take parameter `name`, in registry order."""
    return tuple(region for region, entry in TRUST_REGIONS.items() if name in entry.params)


def all_params() -> dict[str, Param]:
    """Every parameter name of every trust region, first definition wins (the config makes one field of each)."""
    out: dict[str, Param] = {}
    for region in TRUST_REGIONS.values():
        for name, param in region.params.items():
            out.setdefault(name, param)
    return out


def needs_topk(name: str) -> bool:
    """True for trust regions whose mask reads a caller-computed Top-K `divergence` (µ's top-K must be recorded)."""
    return TRUST_REGIONS[name].needs_topk

