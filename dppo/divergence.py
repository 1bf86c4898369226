"""Per-token divergence estimates between the rollout policy µ and the current policy π (Eqs. 13–16, App. B).

All functions are pure, take log-probabilities and return D(µ ‖ π) (direction µ first):

- `binary_tv`  (Eq. 13): |m − p| with m = µ(a_t), p = π(a_t): TV of the partition {a_t, everything else}.
- `binary_kl`  (Eq. 14): m log(m/p) + (1−m) log((1−m)/(1−p)), in log space (log1p/expm1) so that m or p
  near 0 or 1 stays finite and accurate in float32.
- `topk_tv` / `topk_kl` (Eqs. 15–16): over the cells S_t = µ's top-K ∪ {a_t} plus one "other" bucket
  holding the remaining mass 1 − Σ_S q (clamped ≥ 0).
- `full_tv` / `full_kl`: exact, over a full last-dimension distribution (tests, diagnostics, small V).

Each partition estimate is a lower bound of the full divergence (App. B, data-processing inequality).
Inputs of 16-bit float dtypes are computed and returned in float32; float32/float64 stay as they are.
NaN inputs propagate to NaN outputs (nothing is silently made finite), except in Top-K slots marked
invalid, which are ignored. A probability of exactly 0 where µ has mass (log π = −inf) gives KL = inf, the
true value; µ = 0 contributes 0 (0 log 0 = 0). The complement masses 1 − q (Binary-KL, and the Top-K
"other" cell) are clamped to ≥ the dtype's smallest normal number, so π(a_t) = 1 exactly, or π's cells
summing to ≥ 1 after rounding, gives a large finite KL term (≈ µ(rest)·(log µ(rest) + 87) in float32)
instead of inf.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dppo._checks import check_same, check_tensor

__all__ = ["binary_tv", "binary_kl", "topk_tv", "topk_kl", "full_tv", "full_kl", "log1mexp"]


def _prep(logp: Tensor, rollout_logp: Tensor) -> tuple[Tensor, Tensor]:
    check_tensor("logp", logp, floating=True)
    check_tensor("rollout_logp", rollout_logp, floating=True)
    check_same("rollout_logp", rollout_logp, "logp", logp)
    if logp.dtype in (torch.float16, torch.bfloat16):
        return logp.float(), rollout_logp.float()
    return logp, rollout_logp


def log1mexp(x: Tensor) -> Tensor:
    """log(1 − exp(x)) for x ≤ 0, accurate over the whole range (Mächler 2012).

    x is clamped to ≤ −tiny so that x = 0 (probability 1) gives a large negative finite value instead of −inf.
    """
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def binary_tv(logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Binary TV (Eq. 13): |µ(a_t) − π(a_t)|, elementwise over any shape."""
    logp, rollout_logp = _prep(logp, rollout_logp)
    return (rollout_logp.exp() - logp.exp()).abs()


def binary_kl(logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Binary KL(µ‖π) (Eq. 14): m log(m/p) + (1−m) log((1−m)/(1−p)), elementwise over any shape.

    The second term uses log(1−q) = log1mexp(log q) and (1−m) = −expm1(log m); the result is clamped ≥ 0
    (rounding can make it a hair negative when µ ≈ π).
    """
    logp, rollout_logp = _prep(logp, rollout_logp)
    one_minus_m = -torch.expm1(rollout_logp)
    kl = _kl_terms(rollout_logp, logp) + one_minus_m * (log1mexp(rollout_logp) - log1mexp(logp))
    return kl.clamp(min=0.0)


def _topk_cells(logp: Tensor, rollout_logp: Tensor, valid: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Validate and return (logp, rollout_logp, valid, log other-mass of π, log other-mass of µ)."""
    logp, rollout_logp = _prep(logp, rollout_logp)
    if logp.dim() < 1 or logp.shape[-1] < 1:
        raise ValueError(f"logp: expected shape [..., S] with S >= 1, got {tuple(logp.shape)}")
    if valid is None:
        valid = torch.ones_like(logp, dtype=torch.bool)
    else:
        check_tensor("valid", valid, dtype=torch.bool)
        check_same("valid", valid, "logp", logp, dtype=False)
    neg_inf = torch.full_like(logp, float("-inf"))  # a fill on logp's device, no host-to-device copy
    # log Σ_S q over valid cells, then log(1 − Σ) = log1mexp(·), in float64: when the cells hold almost all the mass
    # the other bucket is far below float32's rounding of Σ (a tail of 2e-8 beside a cell of 0.8 rounds to 0, and a
    # KL term µ(other)·log(µ(other)/tiny) then overstates Top-K KL by ~0.02); the [..., S] cells make it cheap.
    wide = torch.float64 if logp.device.type != "mps" else logp.dtype  # (MPS has no float64)
    lse_p = torch.logsumexp(torch.where(valid, logp, neg_inf).to(wide), dim=-1)
    lse_m = torch.logsumexp(torch.where(valid, rollout_logp, neg_inf).to(wide), dim=-1)
    other_p = log1mexp(lse_p.clamp(max=0.0)).to(logp.dtype)
    other_m = log1mexp(lse_m.clamp(max=0.0)).to(logp.dtype)
    return logp, rollout_logp, valid, other_p, other_m


def topk_tv(logp: Tensor, rollout_logp: Tensor, valid: Tensor | None = None) -> Tensor:
    """Top-K TV (Eq. 15): ½ Σ_{a ∈ S ∪ {other}} |µ(a) − π(a)|.

    logp, rollout_logp: [..., S] log π and log µ at the same S token ids (µ's top-K plus the sampled token
    when it is not among them); valid: [..., S] bool, False for unused slots. Returns [...].
    The "other" cell holds q(other) = max(0, 1 − Σ_valid q).
    """
    logp, rollout_logp, valid, other_p, other_m = _topk_cells(logp, rollout_logp, valid)
    cells = torch.where(valid, (rollout_logp.exp() - logp.exp()).abs(), torch.zeros_like(logp)).sum(-1)
    return 0.5 * (cells + (other_m.exp() - other_p.exp()).abs())


def _kl_terms(log_m: Tensor, log_p: Tensor) -> Tensor:
    """µ log(µ/π) per cell with 0 log 0 = 0 (µ = 0 contributes nothing, whatever finite or −inf π is).

    NaN in either input gives NaN (the test is `m == 0`, not `m > 0`, so a NaN µ is not dropped as zero).
    """
    m = log_m.exp()
    return torch.where((m == 0) & ~torch.isnan(log_p), torch.zeros_like(m), m * (log_m - log_p))


def topk_kl(logp: Tensor, rollout_logp: Tensor, valid: Tensor | None = None) -> Tensor:
    """Top-K KL(µ‖π) (Eq. 16): Σ_{a ∈ S ∪ {other}} µ(a) log(µ(a)/π(a)), shapes as `topk_tv`.

    Clamped ≥ 0 (a partition KL is non-negative; rounding can make the sum a hair negative).
    """
    logp, rollout_logp, valid, other_p, other_m = _topk_cells(logp, rollout_logp, valid)
    cells = torch.where(valid, _kl_terms(rollout_logp, logp), torch.zeros_like(logp)).sum(-1)
    return (cells + _kl_terms(other_m, other_p)).clamp(min=0.0)


def full_tv(logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Exact TV over the last dimension: ½ Σ_v |µ(v) − π(v)|. [..., V] -> [...]."""
    logp, rollout_logp = _prep(logp, rollout_logp)
    return 0.5 * (rollout_logp.exp() - logp.exp()).abs().sum(-1)


def full_kl(logp: Tensor, rollout_logp: Tensor) -> Tensor:
    """Exact KL(µ‖π) over the last dimension: Σ_v µ(v) log(µ(v)/π(v)). [..., V] -> [...]."""
    logp, rollout_logp = _prep(logp, rollout_logp)
    return _kl_terms(rollout_logp, logp).sum(-1).clamp(min=0.0)
