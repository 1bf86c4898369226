"""Sequence-level masks: drop a whole response — or one turn of a multi-turn episode — whose divergence statistic
exceeds a threshold. They compose with any token-level trust region (`dppo.trust_region`): the loss keeps a token
only when both masks keep it.

Why: the bounds of the paper's Thm 3.2 grow with the horizon T, so a long response with a few tokens far from µ can
cost more than the per-token region admits ("Trust Region Masking", arXiv 2512.23075, which masks a sequence on its
largest token divergence or its mean k3 estimate; DeepSeek-V3.2's off-policy sequence mask, which masks a sequence
with negative advantage whose mean log(µ/π) is too large, is `mean_k1` with sides "negative").

A *unit* is a response, or with `turn_index` one turn of an episode (the tokens of one response that share a turn
index). Per unit u with active tokens t ∈ u, a = the anchor (µ, or π_old for the recompute anchor), r_t = π/a:
- `max_divergence`: S_u = max_{t∈u} D_t, D_t a per-token divergence estimate (the caller's `divergence`; Binary-TV
  |a(a_t) − π(a_t)| when None);
- `mean_k3`:        S_u = mean_{t∈u} [(r_t − 1) − log r_t]  (Schulman's k3 estimate of KL(a‖π), ≥ 0);
- `mean_k1`:        S_u = mean_{t∈u} [log a(a_t) − log π(a_t)]  (the k1 estimate of KL(a‖π); can be negative);
- `geometric`:      S_u = exp(mean_{t∈u} log q_t), the geometric mean of the unit's rollout-correction ratios
                    q_t = π_old/µ (π/µ under the rollout anchor; the loss passes them as logp/anchor_logp), dropped
                    when outside [1 − δ, 1 + δ] (two-sided; SkyRL's geometric sequence mask, `geo_mask_low/high`
                    0.99 / 1.01 = δ 0.01: `skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`
                    L220-236; verl's `rollout_rs="seq_mean_k1"` geo_rs presets, 0.999_1.001 = δ 0.001, on the log
                    of the same mean: `verl/trainer/ppo/rollout_corr_helper.py` L235-236, L301-308).
keep_t = 0 for every token of u iff S_u > δ (geometric: |S_u − 1| > δ) and (sides = "both", or sides = "negative"
and Â_u < 0). A unit's
advantage sign is that of its tokens (one advantage per response). Tensors in, tensors out, detached; a NaN
statistic never masks (comparisons are False) — the token-level loss turns NaN inputs into a NaN loss anyway.

Which parts are whose: the statistics are the cited papers'; the per-turn unit, the shared implementation and the
`sides` switch are this project's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dppo._checks import check_choice, check_same, check_tensor
from dppo.divergence import binary_tv

__all__ = ["SEQUENCE_MASKS", "SEQUENCE_SIDES", "SEQUENCE_UNITS", "sequence_keep", "unit_index", "unit_shares"]

SEQUENCE_MASKS = ("none", "max_divergence", "mean_k3", "mean_k1", "geometric")
"""The names `loss.sequence_mask` accepts ("none" = no sequence mask)."""
SEQUENCE_SIDES = ("both", "negative")
SEQUENCE_UNITS = ("response", "turn")
MAX_LOG_RATIO = 20.0


def unit_index(response_mask: Tensor, turn_index: Tensor | None = None, n_turns: int | None = None) -> tuple[Tensor, int]:
    """(index [B, T] long, number of units): unit b·n_turns + turn of each token (turn 0 without `turn_index`).
    Inactive tokens get a valid index too; callers weight by the mask. `n_turns` (an upper bound of the turn count,
    e.g. env.max_turns) saves the one host sync that finding it from `turn_index` costs."""
    B, T = response_mask.shape
    if turn_index is None:
        return torch.arange(B, device=response_mask.device)[:, None].expand(B, T), B
    check_same("turn_index", turn_index, "response_mask", response_mask, dtype=False)
    turns = turn_index.long().clamp(min=0)
    if n_turns is None:
        n_turns = int(turns.max()) + 1 if turns.numel() else 1
    turns = turns.clamp(max=n_turns - 1)
    return torch.arange(B, device=response_mask.device)[:, None] * n_turns + turns, B * n_turns


def _per_unit(values: Tensor, mask: Tensor, index: Tensor, n_units: int, reduce: str) -> Tensor:
    """Per-unit max or mean of `values` over active tokens, gathered back to [B, T]."""
    flat_i, flat_m = index.reshape(-1), mask.reshape(-1)
    if reduce == "max":
        fill = torch.full_like(values, -torch.inf).reshape(-1)
        v = torch.where(flat_m, values.reshape(-1), fill)
        out = torch.full((n_units,), -torch.inf, dtype=values.dtype, device=values.device)
        out = out.scatter_reduce(0, flat_i, v, reduce="amax")
    else:
        v = torch.where(flat_m, values.reshape(-1), torch.zeros_like(values).reshape(-1))
        total = torch.zeros(n_units, dtype=values.dtype, device=values.device).index_add(0, flat_i, v)
        count = torch.zeros(n_units, dtype=values.dtype, device=values.device).index_add(0, flat_i, flat_m.to(values.dtype))
        out = total / count.clamp(min=1)
    return out[index]


@torch.no_grad()
def sequence_keep(
    logp: Tensor,
    anchor_logp: Tensor,
    adv: Tensor,
    response_mask: Tensor,
    *,
    statistic: str,
    delta: float,
    sides: str = "both",
    divergence: Tensor | None = None,
    turn_index: Tensor | None = None,
    n_turns: int | None = None,
) -> tuple[Tensor, Tensor]:
    """(keep [B, T] bool, S [B, T]: each token's unit statistic) of the sequence mask `statistic` (module docstring).

    logp, anchor_logp: [B, T] log π and log of the anchor at a_t; adv: [B] or [B, T]; response_mask [B, T] bool;
    delta: the threshold δ on S_u; divergence: [B, T] per-token estimate for `max_divergence` (None = Binary-TV);
    turn_index: [B, T] turn of each token (units = turns) or None (units = responses); n_turns: see `unit_index`.
    `statistic` "none" keeps every token (S = 0)."""
    check_choice("sequence_mask", statistic, SEQUENCE_MASKS)
    check_choice("sequence_sides", sides, SEQUENCE_SIDES)
    check_tensor("logp", logp, floating=True)
    check_same("anchor_logp", anchor_logp, "logp", logp, dtype=False)
    check_same("response_mask", response_mask, "logp", logp, dtype=False)
    if not (isinstance(delta, (int, float)) and not isinstance(delta, bool)):
        raise ValueError(f"sequence_delta: expected a number, got {delta!r}")
    mask = response_mask.bool()
    if statistic == "none":
        return torch.ones_like(mask), torch.zeros_like(logp)
    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp, anchor_logp = logp.detach().to(dtype), anchor_logp.detach().to(dtype)
    adv = adv.detach()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(logp)
    index, n_units = unit_index(mask, turn_index, n_turns)
    if statistic == "max_divergence":
        if divergence is None:
            divergence = binary_tv(logp, anchor_logp)
        check_same("divergence", divergence, "logp", logp, dtype=False)
        stat = _per_unit(divergence.detach().to(dtype), mask, index, n_units, "max")
    elif statistic == "mean_k3":
        log_r = (logp - anchor_logp).clamp(max=MAX_LOG_RATIO)
        stat = _per_unit(torch.expm1(log_r) - log_r, mask, index, n_units, "mean")
    elif statistic == "geometric":
        stat = _per_unit(logp - anchor_logp, mask, index, n_units, "mean").clamp(max=MAX_LOG_RATIO).exp()
    else:  # mean_k1
        stat = _per_unit(anchor_logp - logp, mask, index, n_units, "mean")
    drop = ((stat > 1.0 + delta) | (stat < 1.0 - delta)) if statistic == "geometric" else stat > delta
    if sides == "negative":
        drop &= adv < 0
    return ~drop, torch.where(mask, stat, torch.zeros_like(stat))


@torch.no_grad()
def unit_shares(keep: Tensor, adv: Tensor, response_mask: Tensor, turn_index: Tensor | None = None,
                n_turns: int | None = None) -> dict[str, Tensor]:
    """What a sequence mask removed, by sign of the advantage: the share of units (responses or turns with at least
    one active token) and of active tokens with keep 0, among those with Â > 0 and Â < 0, plus the counts to weight
    them by (n_units_pos/neg, n_tokens_pos/neg). Detached scalar tensors."""
    mask = response_mask.bool()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(mask)
    index, n_units = unit_index(mask, turn_index, n_turns)
    dropped = (~keep) & mask
    out: dict[str, Tensor] = {}
    for side, sel in (("pos", adv > 0), ("neg", adv < 0)):
        tok = mask & sel
        n_tok = tok.sum().float()
        out[f"removed_token_frac_{side}"] = (dropped & sel).sum().float() / n_tok.clamp(min=1)
        out[f"n_tokens_{side}"] = n_tok
        present = torch.zeros(n_units, dtype=torch.bool, device=mask.device)
        present = present.index_put((index[tok],), torch.ones_like(index[tok], dtype=torch.bool))
        removed = torch.zeros(n_units, dtype=torch.bool, device=mask.device)
        removed = removed.index_put((index[dropped & sel],), torch.ones_like(index[dropped & sel], dtype=torch.bool))
        n_units_side = present.sum().float()
        out[f"removed_frac_{side}"] = removed.sum().float() / n_units_side.clamp(min=1)
        out[f"n_units_{side}"] = n_units_side
    return out
