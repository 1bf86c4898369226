"""Replay of truncated sampling (top-k, top-p, min-p): π renormalised over the set µ sampled from (issue 62, step 1).

An engine that truncates samples a_t from µ_S = µ / µ(S_t) on the kept set S_t ⊆ V (the tokens top-k / top-p /
min-p leave), not from µ. The trainer replays the same set, so that the ratio and the trust region compare two
distributions on the same support (docs/library.md, "Truncated sampling"):

    log π_S(a_t) = log π(a_t) − log Σ_{v ∈ S_t} π(v)            (the replayed log-probability)
    log µ_S(a_t) = log µ(a_t) − log Σ_{v ∈ S_t} µ(v)            (when the engine recorded µ before truncation)

Every trust region and baseline then works on (log π_S, log µ_S) as it does on (log π, log µ): the ratio
π_S/µ_S, Binary-TV |µ_S(a) − π_S(a)|, Binary-KL. The Top-K divergences take µ's recorded cells (top-K ∪ {a_t},
spec §2) restricted to S_t and renormalised, with the "other" bucket holding S_t's mass outside the cells: when
S_t ⊆ the cells (a kept set no larger than the recorded top-K) the bucket is empty and Top-K TV/KL over S_t is
the exact divergence between µ_S and π_S, not a lower bound.

Representation: truncation keeps a prefix of the sampling distribution sorted by probability, so a kept set of
n ≤ K tokens is `kept_size` n, the first n of µ's top-K cells (sorted by µ); 0 means no truncation (the whole
vocabulary: log mass 0, nothing changes). A kept set larger than the recorded top-K needs its ids; the functions
here take π's (or µ's) log-probabilities at the set's ids and a membership mask, so both forms go through the same
code.

All functions are pure (tensors in, tensors out); log-sums are taken in float64 (a set holding almost all the mass
must not round its complement away, as `dppo.divergence` does for the Top-K other bucket).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dppo._checks import check_same, check_tensor
from dppo.divergence import _kl_terms, topk_kl, topk_tv

__all__ = ["check_kept_size", "prefix_members", "set_log_mass", "replay", "kept_cells", "kept_topk_tv", "kept_topk_kl"]


def _wide(x: Tensor) -> torch.dtype:
    return torch.float64 if x.device.type != "mps" else x.dtype  # (MPS has no float64)


def check_kept_size(kept_size: Tensor, width: int) -> None:
    """Refuse sizes outside [0, width], naming `kept_size`: a check where sizes enter (once per batch, when rollouts
    are collated: it reads the values on the host), not in the loss's hot path."""
    check_tensor("kept_size", kept_size, dtype=torch.int64)
    if kept_size.numel() and (int(kept_size.min()) < 0 or int(kept_size.max()) > width):
        raise ValueError(f"kept_size: each value must be in [0, {width}] (a kept set larger than the recorded top-K "
                         f"is given by its ids, not a size), got [{int(kept_size.min())}, {int(kept_size.max())}]")


def prefix_members(kept_size: Tensor, width: int) -> Tensor:
    """[..., width] bool: slot j is in the kept set when j < kept_size (the set is a prefix of µ's sorted cells);
    kept_size 0 (no truncation) gives no members. kept_size: [...] int64, each in [0, width] (`check_kept_size`)."""
    return torch.arange(width, device=kept_size.device) < kept_size.unsqueeze(-1)


def set_log_mass(logp_at: Tensor, members: Tensor) -> Tensor:
    """log Σ_{j: members[..., j]} exp(logp_at[..., j]), the log-mass of a kept set, [..., C] -> [...].

    A row with no members is an untruncated token: its set is the whole vocabulary and its log-mass 0. Summed in
    float64, clamped ≤ 0, returned in logp_at's dtype (float32 for 16-bit inputs)."""
    check_tensor("logp_at", logp_at, floating=True)
    check_tensor("members", members, dtype=torch.bool)
    check_same("members", members, "logp_at", logp_at, dtype=False)
    out = logp_at.float() if logp_at.dtype in (torch.float16, torch.bfloat16) else logp_at
    wide = out.to(_wide(out))
    lse = torch.logsumexp(torch.where(members, wide, torch.full_like(wide, float("-inf"))), dim=-1)
    lse = torch.where(members.any(-1), lse.clamp(max=0.0), torch.zeros_like(lse))
    return lse.to(out.dtype)


def replay(logp: Tensor, log_mass: Tensor) -> Tensor:
    """log π_S(a) = log π(a) − log π(S): the log-probability renormalised over the kept set (elementwise)."""
    check_same("log_mass", log_mass, "logp", logp, dtype=False)
    return logp - log_mass.to(logp.dtype)


def kept_cells(logp_cells: Tensor, rollout_logp_cells: Tensor, valid: Tensor, members: Tensor,
               log_mass_p: Tensor, log_mass_m: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """µ's recorded cells [..., S] restricted to the kept set and renormalised: (log π_S, log µ_S, valid ∧ member)
    for `dppo.divergence.topk_tv` / `topk_kl`. Where a token is untruncated (log masses 0 and no members) its cells
    are returned unchanged, as the untruncated Top-K divergence takes them."""
    truncated = members.any(-1, keepdim=True)
    cells_valid = torch.where(truncated, valid & members, valid)
    return (replay(logp_cells, log_mass_p.unsqueeze(-1).expand_as(logp_cells)),
            replay(rollout_logp_cells, log_mass_m.unsqueeze(-1).expand_as(rollout_logp_cells)), cells_valid)


def _covered(members: Tensor, valid: Tensor, set_size: Tensor | None) -> Tensor:
    """[...] bool: the kept set lies inside the cells (set_size None: the members are the whole set; else its size
    equals its member cells), so no bucket is left."""
    truncated = members.any(-1)
    return truncated if set_size is None else truncated & ((members & valid).sum(-1) == set_size)


def kept_topk_tv(logp_cells: Tensor, rollout_logp_cells: Tensor, valid: Tensor, members: Tensor,
                 log_mass_p: Tensor, log_mass_m: Tensor, set_size: Tensor | None = None) -> Tensor:
    """Top-K TV between µ_S and π_S over µ's cells within the kept set, plus one bucket for the set's mass outside
    them; exact (no bucket) when the set lies inside the cells. set_size [...] int64: |S_t| when the set may be
    larger than its member cells (None: the members are the whole set)."""
    lp, lm, v = kept_cells(logp_cells, rollout_logp_cells, valid, members, log_mass_p, log_mass_m)
    with_bucket = topk_tv(lp, lm, v)
    exact = 0.5 * torch.where(v, (lm.exp() - lp.exp()).abs(), torch.zeros_like(lp)).sum(-1)
    return torch.where(_covered(members, valid, set_size), exact, with_bucket)


def kept_topk_kl(logp_cells: Tensor, rollout_logp_cells: Tensor, valid: Tensor, members: Tensor,
                 log_mass_p: Tensor, log_mass_m: Tensor, set_size: Tensor | None = None) -> Tensor:
    """Top-K KL(µ_S ‖ π_S), shapes and bucket as `kept_topk_tv`."""
    lp, lm, v = kept_cells(logp_cells, rollout_logp_cells, valid, members, log_mass_p, log_mass_m)
    with_bucket = topk_kl(lp, lm, v)
    exact = torch.where(v, _kl_terms(lm, lp), torch.zeros_like(lp)).sum(-1).clamp(min=0.0)
    return torch.where(_covered(members, valid, set_size), exact, with_bucket)
