"""One resolved loss specification: `loss_spec` turns loss settings into a frozen `LossSpec`, every value resolved.

The settings are those of the `loss` config section (`dppo.train.config.LossConfig`) and of TRL's `DPPOConfig`: the loss
(masked_is = Eq. 23 with a trust-region mask, drpo = DRPO's penalty), the trust region and its parameters
(`dppo.trust_region.TRUST_REGIONS`), the mask's anchor, the importance-weight cap C, the aggregation
(`dppo.losses.aggregate`), the sequence mask (`dppo.sequence_mask`) with its δ, unit and sides, and DRPO's δ. Each is
checked here, once, with a ValueError whose message starts with the setting's name; a default left unset (None) is
filled in here, once: the region's δ/ε/... from its registry entry, the sequence mask's δ from `SEQUENCE_DELTAS` (∞ for
"none": no unit is dropped), DRPO's δ 0.15. `dppo.losses.policy_loss` and the other `LOSSES` take the spec and check no
setting again.

Pure: no config objects, no tensors; the trainer, the TRL adapter and verl's build their spec with `loss_spec`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

from dppo._checks import check_choice
from dppo.sequence_mask import SEQUENCE_MASKS, SEQUENCE_SIDES, SEQUENCE_UNITS
from dppo.trust_region import TRUST_REGIONS, TrustRegion, all_params, region_params

__all__ = ["AGGREGATIONS", "ANCHORS", "DRPO_DELTA", "IS_WEIGHTS", "LOSS_KINDS", "SEQUENCE_DELTAS", "LossSpec", "loss_spec"]

LOSS_KINDS = ("masked_is", "drpo")
"""The names `loss` accepts (the keys of `dppo.losses.LOSSES`)."""
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
ANCHORS = ("rollout", "recompute")
DRPO_DELTA = 0.15
"""DRPO's δ in the penalty |Â|/(2δ)·µ·(r−1)² when unset."""
SEQUENCE_DELTAS = {"none": math.inf, "max_divergence": 0.2, "mean_k3": 0.1, "mean_k1": 0.05, "geometric": 0.01}
"""The default sequence_delta per sequence mask: max_divergence and mean_k3 tuned on seed 0 of the lag-4 study of
docs/paper.md (grids 0.2/0.35/0.5 and 0.02/0.05/0.1); mean_k1 not tuned; geometric SkyRL's [0.99, 1.01]; "none"
drops nothing (δ = ∞)."""
IS_WEIGHTS = ("policy", "decoupled", "anchor", "sequence")
"""The importance weight w_t of ℓ_t = −keep_t · sg(w_t) · Â_t · log π(a_t) (`dppo.losses`), C = is_cap:
- "policy":    min(π/µ, C), DPPO's (Eq. 23): one ratio to the rollout policy (verl's bypass-mode token TIS);
- "decoupled": min(π_old/µ, C) · π/π_old, the rollout-correction token TIS of verl (`rollout_is="token"`), TRL
               (`vllm_importance_sampling_mode="token_truncate"`), SkyRL and slime: the truncated π_old/µ times the PPO
               ratio (needs the recompute anchor: π_old);
- "anchor":    min(π/anchor, C), the PPO ratio alone (no rollout correction under the recompute anchor: verl's and
               SkyRL's masks without rollout_is);
- "sequence":  min(s_u, C), s_u = exp(mean_{t∈u} log(π/anchor)) of the token's response or turn (GSPO)."""


@dataclass(frozen=True)
class LossSpec:
    """The loss as a run computes it, every value resolved (build it with `loss_spec`, which checks it)."""

    loss: str
    """masked_is (Eq. 23 with the trust-region mask) or drpo (DRPO's penalty; no mask)."""
    trust_region: str
    """A name in `dppo.trust_region.TRUST_REGIONS`."""
    params: Mapping[str, Any]
    """The trust region's own parameters (δ's, ε's, relax_alpha, cppo_*, ...), each resolved and checked (read-only)."""
    anchor: str
    """The mask's anchor: "rollout" (µ) or "recompute" (π_old); the importance weight is π/µ either way."""
    is_cap: float
    """C in min(π/µ, C) (in the cap of `is_weight`); inf = uncapped."""
    is_weight: str
    """The importance weight's form, a name in `IS_WEIGHTS` (the region's own, else "policy", when unset)."""
    aggregation: str
    """A name in `AGGREGATIONS`."""
    sequence_mask: str
    """A name in `dppo.sequence_mask.SEQUENCE_MASKS` ("none" = no sequence mask)."""
    sequence_delta: float
    """The sequence mask's threshold δ (∞ for "none")."""
    sequence_unit: str
    """"response" or "turn": what the sequence mask drops."""
    sequence_sides: str
    """"both" or "negative": which units (by the advantage's sign) the sequence mask may drop."""
    drpo_delta: float
    """DRPO's δ."""

    @property
    def region(self) -> TrustRegion:
        """The trust region's registry entry (its mask, divergence, per-token inputs and batch statistics)."""
        return TRUST_REGIONS[self.trust_region]

    def to_dict(self) -> dict[str, Any]:
        """The spec as flat settings (the region's parameters beside the other fields): `loss_spec(**d)` gives it back."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "params"}
        return {**out, **self.params}


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _region(trust_region: str, given: dict[str, Any]) -> dict[str, Any]:
    """The region's parameters resolved and checked (`region_params`): a name no region takes, or a value (not None)
    for a parameter this region does not take, is an error naming the parameter."""
    unknown = sorted(set(given) - set(all_params()))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a parameter of any trust region; valid: {', '.join(sorted(all_params()))}")
    return region_params(trust_region, given)


def _sequence_delta(sequence_mask: str, sequence_delta: float | None) -> float:
    if sequence_delta is None:
        return SEQUENCE_DELTAS[sequence_mask]
    if not (_number(sequence_delta) and (math.isfinite(sequence_delta) or sequence_mask == "none")):
        raise ValueError(f"sequence_delta: expected a finite number, got {sequence_delta!r}")
    return sequence_delta


def loss_spec(*, loss: str = "masked_is", trust_region: str = "dppo_binary_tv", anchor: str = "rollout",
              is_cap: float = 10.0, is_weight: str | None = None, aggregation: str = "seq-mean-token-sum-norm",
              sequence_mask: str = "none",
              sequence_delta: float | None = None, sequence_unit: str = "response", sequence_sides: str = "both",
              drpo_delta: float | None = None, **region: Any) -> LossSpec:
    """The resolved, checked `LossSpec` of these settings (module docstring); `region`: the trust regions' own
    parameters by name (None = the region's default; a name no region takes is an error, and so is a value given for
    a parameter that only other regions take: it would have no effect). ValueError whose message starts with the
    setting's name."""
    check_choice("loss", loss, LOSS_KINDS)
    if trust_region not in TRUST_REGIONS:
        raise ValueError(f"trust_region: unknown value {trust_region!r}; valid: {', '.join(TRUST_REGIONS)}")
    check_choice("anchor", anchor, ANCHORS)
    check_choice("aggregation", aggregation, AGGREGATIONS)
    if not (_number(is_cap) and is_cap > 0):
        raise ValueError(f"is_cap: expected a number > 0 (float('inf') for no cap), got {is_cap!r}")
    drpo_delta = DRPO_DELTA if drpo_delta is None else drpo_delta
    if not (_number(drpo_delta) and drpo_delta > 0):
        raise ValueError(f"drpo_delta: expected a number > 0, got {drpo_delta!r}")
    params = _region(trust_region, region)
    is_weight = (TRUST_REGIONS[trust_region].weight or "policy") if is_weight is None else is_weight
    check_choice("is_weight", is_weight, IS_WEIGHTS)
    if is_weight == "decoupled" and anchor != "recompute":
        raise ValueError("is_weight: 'decoupled' weighs by the truncated π_old/µ, which needs π_old: set anchor='recompute'")
    check_choice("sequence_mask", sequence_mask, SEQUENCE_MASKS)
    check_choice("sequence_unit", sequence_unit, SEQUENCE_UNITS)
    check_choice("sequence_sides", sequence_sides, SEQUENCE_SIDES)
    sequence_delta = _sequence_delta(sequence_mask, sequence_delta)
    if loss == "drpo" and anchor != "rollout":
        raise ValueError("anchor: drpo has no mask, so only the 'rollout' anchor applies")
    if loss == "drpo" and is_weight != "policy":
        raise ValueError("is_weight: drpo has its own ratio term; only 'policy' applies")
    if loss == "drpo" and sequence_mask != "none":
        raise ValueError("sequence_mask: drpo has no mask to combine a sequence mask with; use sequence_mask='none'")
    return LossSpec(loss=loss, trust_region=trust_region, params=MappingProxyType(params), anchor=anchor,
                    is_cap=is_cap, is_weight=is_weight, aggregation=aggregation, sequence_mask=sequence_mask, sequence_delta=sequence_delta,
                    sequence_unit=sequence_unit, sequence_sides=sequence_sides, drpo_delta=drpo_delta)
