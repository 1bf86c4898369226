"""Trust-region masks (spec §3): which tokens keep their policy-gradient term.

Every mask has the same signature

    mask(logp, anchor_logp, adv, response_mask, divergence, **params) -> keep  [B, T] bool, detached

with logp = log π(a_t) of the current policy, anchor_logp = log of the anchor policy at a_t (the rollout
policy µ by default, or the recomputed pre-update policy π_old for the `recompute` anchor), adv [B, T],
response_mask [B, T] bool (True = real token), divergence [B, T] (a precomputed estimate, used by the
Top-K regions; None otherwise). r_t = π/anchor. δ_high / ε_high apply where Â_t > 0, δ_low / ε_low where
Â_t < 0; tokens with Â_t = 0 are kept (their term is zero anyway).

`TRUST_REGIONS` maps a name to a `TrustRegion(fn, defaults, divergence)`: `defaults` lists every scalar
parameter the mask takes with its default (None = must be given), `divergence` names the estimate the
mask is defined on ("binary_tv", "binary_kl", "topk_tv", "topk_kl" or None). Adding a trust region is one
function and one entry here; the shared tests are parametrised over this dict.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from dppo.divergence import binary_kl, binary_tv

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


class TrustRegion(NamedTuple):
    fn: Callable[..., Tensor]
    defaults: dict
    """Every keyword parameter of `fn` with its default (None = no default: must be given)."""
    divergence: str | None
    """The divergence estimate the mask is defined on (for metrics and for callers that precompute it)."""


_DPPO_TV = {"delta_low": 0.15, "delta_high": 0.15}
_DPPO_KL = {"delta_low": 0.05, "delta_high": 0.05}
_CLIP = {"eps_low": 0.2, "eps_high": 0.28}

TRUST_REGIONS: dict[str, TrustRegion] = {
    "dppo_binary_tv": TrustRegion(dppo_binary_tv, _DPPO_TV, "binary_tv"),
    "dppo_binary_kl": TrustRegion(dppo_binary_kl, _DPPO_KL, "binary_kl"),
    "dppo_topk_tv": TrustRegion(dppo_topk_tv, _DPPO_TV, "topk_tv"),
    "dppo_topk_kl": TrustRegion(dppo_topk_kl, _DPPO_KL, "topk_kl"),
    "ppo_clip": TrustRegion(ppo_clip, _CLIP, None),
    "ppo_clip_relax": TrustRegion(ppo_clip_relax, {**_CLIP, "relax_alpha": None, "relax_side": "both"}, None),
    "none": TrustRegion(no_mask, {}, None),
    "cppo": TrustRegion(
        cppo,
        {"delta_low": 0.15, "delta_high": 0.15, "cppo_w_min": 0.8, "cppo_delta_b_min": 0.02, "cppo_q": 0.9, "cppo_k": 1.0},
        "binary_tv",
    ),
}


def needs_divergence(name: str) -> bool:
    """True for trust regions whose mask reads a caller-computed `divergence` (the Top-K ones)."""
    return TRUST_REGIONS[name].divergence in ("topk_tv", "topk_kl")
