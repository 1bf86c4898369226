"""The trust-region ledger of a training step (`dppo.ledger`'s terms, issue 52): what each micro-batch of the update
adds (`micro_terms`), their sum over the step (`LedgerSums`), and the step's own terms (`step_terms`). The keys are
documented in docs/cli.md ("The ledger"); `dppo doctor` reads them.

What each term costs: every term is a few element-wise passes over the micro-batch's [B, T] log-probs the loss already
holds (no forward, no host sync). The drift's split into precision, staleness and learning, and the source of a
masked token (mismatch or update), need π_old, the trainer's recomputed pre-update policy: they are logged when the run
makes that forward anyway (loss.anchor recompute or loss.split_mismatch) and left out otherwise; the rest (masked
mass by sign, the bound, the surrogate, the groups) always.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dppo import ledger
from dppo.metrics import WeightedMeans
from dppo.divergence import binary_tv

TOKEN_MEANS = (*ledger.DRIFT_KEYS, "ledger/drift_net")
"""Means over the response tokens (weight "n_tokens")."""
ROW_MEANS = ("ledger/tv_sum_per_row", "ledger/surrogate")
"""Means over the rows (weight "n_rows")."""
SUMS = ("ledger/mass", *ledger.MASS_KEYS)
MAXIMA = ("ledger/tv_max", "ledger/len_max", "ledger/reward_abs_max")


def micro_terms(keep: Tensor, logp: Tensor, rollout_logp: Tensor, adv: Tensor, mask: Tensor, *,
                old_logp: Tensor | None, staleness: Tensor | None, rewards: Tensor | None) -> dict[str, Tensor]:
    """One micro-batch's ledger terms (see the module): `keep` the trust region's mask, `adv` [B] or [B, T], `old_logp`
    π_old's log-probs (None: no recompute), `staleness` [B] or [B, T] (None: all fresh), `rewards` [B] each row's
    episode reward (None: no surrogate)."""
    out: dict[str, Tensor] = dict(ledger.masked_mass(keep, logp, rollout_logp, adv, mask, old_logp))
    bound = ledger.bound_terms(binary_tv(logp.detach().float(), rollout_logp.float()), mask)
    out.update(bound)
    if old_logp is not None:
        stale = staleness if staleness is not None else torch.zeros(mask.shape[0], dtype=torch.long, device=mask.device)
        out.update(ledger.drift_parts(logp, old_logp, rollout_logp, mask, stale))
    if rewards is not None:
        out["ledger/surrogate"] = ledger.surrogate_gain(logp, rollout_logp, rewards, mask)["ledger/surrogate"]
        out["ledger/reward_abs_max"] = rewards.detach().float().abs().max() if rewards.numel() else \
            rewards.new_zeros(())
    return out


class LedgerSums:
    """The step's ledger: means added with their weights, sums added, maxima maxed (tensors; no host sync)."""

    def __init__(self) -> None:
        self.means = WeightedMeans()
        self.sums: dict[str, Tensor] = {}
        self.maxima: dict[str, Tensor] = {}

    def add(self, terms: dict[str, Tensor]) -> None:
        for key, value in terms.items():
            if key in TOKEN_MEANS or key in ROW_MEANS:
                self.means.add(key, value, terms["n_tokens" if key in TOKEN_MEANS else "n_rows"])
            elif key in SUMS:
                self.sums[key] = self.sums.get(key, 0) + value.float()
            elif key in MAXIMA:
                self.maxima[key] = torch.maximum(self.maxima[key], value.float()) if key in self.maxima else value.float()

    def result(self) -> dict[str, Tensor]:
        if "ledger/mass" not in self.sums:
            return {}
        out = self.means.means()
        out.update(ledger.mass_shares(self.sums))
        if all(k in out for k in ledger.DRIFT_KEYS):
            out.update(ledger.drift_shares(out))
        out["ledger/tv_max"] = self.maxima["ledger/tv_max"]
        if "ledger/reward_abs_max" in self.maxima:
            out.update(ledger.bound_penalties(out["ledger/tv_sum_per_row"], self.maxima["ledger/tv_max"],
                                              self.maxima["ledger/len_max"], self.maxima["ledger/reward_abs_max"]))
        return out


def step_terms(rewards: Tensor, adv: Tensor, group_size: int) -> dict[str, Any]:
    """The step's group statistics (`dppo.ledger.group_stats`): rewards [E] per episode, prompt-major in groups of
    `group_size`; adv each row's advantage."""
    if rewards.numel() % group_size:
        return {}
    return ledger.group_stats(rewards, adv, group_size)
