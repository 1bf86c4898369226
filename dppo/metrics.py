"""Token statistics of a training step (logged under the names of `NAMES`), written once: mismatch between µ and
π, masked shares, the µ bucket of masked tokens, importance-ratio statistics and per-group (per-staleness) sums.

The trainer (`dppo.train.trainer`), the TRL adapter (`dppo.integrations.trl`) and `dppo diagnose` all read their
per-token statistics from here, so that a metric means the same thing wherever it is logged. Every function is
pure: tensors in, detached tensors out (no `.item()`, no logging, no collectives), computed under no_grad in at
least float32.

Aggregation over micro-batches (and ranks) must be exact, so every result is one of three kinds:
- a **mean with its weight**: a key of `WEIGHTS` (e.g. "masked_frac_pos") is a mean over the tokens counted by
  its weight key ("n_pos"); a mean over zero tokens is 0. `to_sums` turns means into sums, `from_sums` back;
  `merge` combines several micro-batches' dicts exactly (sum of mean·weight / sum of weights);
- a **count or sum** ("n_tokens", the histogram of `masked_mu_histogram`, the sums of `per_group_sums`): add them;
- a **maximum** (a key of `MAXIMA`, e.g. "ratio_max"): take the maximum (0 over zero tokens).

Shapes: B sequences, T response tokens, K+1 cells (µ's top-K, then the sampled token when it is not among them;
`dppo.rollout.base`). `response_mask` [B, T] bool, True = the token counts.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from dppo.divergence import binary_kl, binary_tv, topk_kl, topk_tv

__all__ = ["MAXIMA", "MU_BUCKETS", "NAMES", "SEQUENCE_WEIGHTS", "WEIGHTS", "WeightedMeans", "from_sums", "loss_terms", "maj_at_k",
           "pass_at_k", "pass_at_k_values",
           "masked_mu_histogram", "masked_mu_shares", "masked_shares",
           "merge", "mismatch_split", "mismatch_stats", "per_group_sums", "ratio_stats", "to_sums", "token_mean", "token_mismatch"]

MU_BUCKETS: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 0.5)
"""Inner edges of the µ(a_t) buckets of masked tokens: [0, 1e-3], (1e-3, 1e-2], (1e-2, 0.1], (0.1, 0.5], (0.5, 1]."""

WEIGHTS: dict[str, str] = {
    "binary_tv_mean": "n_tokens", "binary_kl_mean": "n_tokens", "log_ratio_gt_log2_frac": "n_tokens",
    "topk_tv_mean": "n_tokens", "topk_kl_mean": "n_tokens",
    "masked_frac": "n_tokens", "masked_frac_pos": "n_pos", "masked_frac_neg": "n_neg",
    "ratio_mean": "n_tokens", "ratio_above_cap_frac": "n_tokens", "abs_log_ratio_mean": "n_tokens",
}
"""Mean key -> the count key that weights it when micro-batches are combined."""

SEQUENCE_WEIGHTS: dict[str, str] = {
    "seq_removed_frac_pos": "seq_n_units_pos", "seq_removed_frac_neg": "seq_n_units_neg",
    "seq_removed_token_frac_pos": "seq_n_tokens_pos", "seq_removed_token_frac_neg": "seq_n_tokens_neg",
}
"""The same for the sequence mask's shares in a loss's metrics (`dppo.sequence_mask.unit_shares`, keys "seq_...")."""

NAMES: dict[str, str] = {
    "masked_frac": "trust_region/masked_frac", "ratio_mean": "ratio/mean", "ratio_above_cap_frac": "ratio/above_cap_frac",
    "masked_frac_pos": "trust_region/masked_frac_pos", "masked_frac_neg": "trust_region/masked_frac_neg",
    "seq_removed_frac_pos": "trust_region/seq_removed_frac_pos",
    "seq_removed_frac_neg": "trust_region/seq_removed_frac_neg",
    "seq_removed_token_frac_pos": "trust_region/seq_removed_token_frac_pos",
    "seq_removed_token_frac_neg": "trust_region/seq_removed_token_frac_neg",
    "ratio_max": "ratio/max",
    "binary_tv_mean": "mismatch/binary_tv_mean", "binary_kl_mean": "mismatch/binary_kl_mean",
    "log_ratio_gt_log2_frac": "mismatch/log_ratio_gt_log2_frac", "topk_tv_mean": "mismatch/topk_tv_mean",
    "topk_kl_mean": "mismatch/topk_kl_mean",
}
"""The one table of logged names: a statistic's key (of `dppo.losses.policy_loss`'s metrics, `masked_shares`,
`ratio_stats`, `mismatch_stats`) -> the name it is logged under. `dppo train` logs these names; the TRL adapter logs
them with the prefix "dppo/" (e.g. "dppo/trust_region/masked_frac"), so one quantity has one name everywhere."""


def loss_terms(stats: Mapping[str, Tensor], weights: Mapping[str, str] | None = None):
    """(logged name, mean, weight) of each mean of a loss's metrics `stats` that `NAMES` names, in `NAMES`' order:
    what an accumulator adds per micro-batch (sum of mean·weight, sum of weights). Maxima and counts are left out.
    weights: mean key -> weight key (default `WEIGHTS` and `SEQUENCE_WEIGHTS`)."""
    weights = {**WEIGHTS, **SEQUENCE_WEIGHTS} if weights is None else weights
    for key, name in NAMES.items():
        if key in stats and key in weights:
            yield name, stats[key], stats[weights[key]]

MAXIMA: tuple[str, ...] = ("ratio_max", "abs_log_ratio_max")
"""Keys combined by maximum."""

_MISMATCH_MEANS = {"binary_tv": "binary_tv_mean", "binary_kl": "binary_kl_mean",
                   "log_ratio_gt_log2": "log_ratio_gt_log2_frac", "topk_tv": "topk_tv_mean", "topk_kl": "topk_kl_mean"}
MAX_LOG_RATIO = 20.0  # log π − log µ is clamped at this before exp (as in dppo.losses)


def _acc(x: Tensor) -> Tensor:
    """x detached, in at least float32."""
    return x.detach().to(torch.promote_types(x.dtype, torch.float32))


def _on(x: Tensor, response_mask: Tensor) -> Tensor:
    """x at the response tokens, 0 elsewhere (so NaN/inf padding reaches no sum)."""
    return torch.where(response_mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _mean(x: Tensor, response_mask: Tensor, n: Tensor) -> Tensor:
    return _on(x, response_mask).sum() / n.clamp(min=1)


@torch.no_grad()
def token_mismatch(logp: Tensor, rollout_logp: Tensor, *, logp_cells: Tensor | None = None,
                   rollout_cells: Tensor | None = None, cells_valid: Tensor | None = None) -> dict[str, Tensor]:
    """Per-token mismatch estimates between µ and π (Eqs. 13–16), each shaped like `logp` (float32 or wider).

    logp, rollout_logp: log π and log µ of the sampled tokens, any shape [...]. logp_cells, rollout_cells,
    cells_valid: π's and µ's log-probs at µ's K+1 cells and which slots are used, [..., K+1] (give the two
    log-prob tensors together; cells_valid None = all used). Returns "binary_tv" |µ − π|, "binary_kl" KL(µ‖π)
    over {a_t, rest}, "log_ratio_gt_log2" 1.0 where |log π − log µ| > log 2 else 0.0, and with the cells "topk_tv",
    "topk_kl" (`dppo.divergence`). Values at padding are whatever the inputs give there: mask them.
    """
    if (logp_cells is None) != (rollout_cells is None):
        raise ValueError("logp_cells: give logp_cells and rollout_cells together (or neither)")
    p, m = _acc(logp), _acc(rollout_logp)
    out = {"binary_tv": binary_tv(p, m), "binary_kl": binary_kl(p, m),
           "log_ratio_gt_log2": ((p - m).abs() > math.log(2)).to(p.dtype)}
    if logp_cells is not None:
        out["topk_tv"] = topk_tv(_acc(logp_cells), _acc(rollout_cells), cells_valid)
        out["topk_kl"] = topk_kl(_acc(logp_cells), _acc(rollout_cells), cells_valid)
    return out


@torch.no_grad()
def mismatch_stats(logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, logp_cells: Tensor | None = None,
                   rollout_cells: Tensor | None = None, cells_valid: Tensor | None = None) -> dict[str, Tensor]:
    """Means over the response tokens of `token_mismatch` (inputs as there, [B, T] and [B, T, K+1]).

    Returns scalars "binary_tv_mean", "binary_kl_mean", "log_ratio_gt_log2_frac" and with the cells "topk_tv_mean",
    "topk_kl_mean" (the trainer logs them as "mismatch/<key>"), each weighted by "n_tokens", the number of response
    tokens (all 0 when there are none).
    """
    n = response_mask.float().sum()
    per_token = token_mismatch(logp, rollout_logp, logp_cells=logp_cells, rollout_cells=rollout_cells,
                               cells_valid=cells_valid)
    return {**{_MISMATCH_MEANS[k]: _mean(v, response_mask, n) for k, v in per_token.items()}, "n_tokens": n}


SPLIT_KEYS = ("mismatch/old_rollout_tv_mean", "mismatch/current_old_tv_mean",
              "trust_region/masked_frac_from_mismatch", "trust_region/masked_frac_from_update")
"""The keys of `mismatch_split` (each a mean over the active tokens, weight "n_tokens")."""


@torch.no_grad()
def mismatch_split(logp: Tensor, old_logp: Tensor, rollout_logp: Tensor, response_mask: Tensor,
                   keep: Tensor) -> dict[str, Tensor]:
    """The two factors of π/µ = (π_old/µ)·(π/π_old) ("Missing Old Logits in Asynchronous Agentic RL", arXiv
    2605.12070), per active token, with π_old the trainer's recomputed pre-update policy:
    - "mismatch/old_rollout_tv_mean": mean |π_old(a_t) − µ(a_t)| — the engine's numerics, plus with a stale or
      async source the drift of the versions between µ's weights and this step's;
    - "mismatch/current_old_tv_mean": mean |π(a_t) − π_old(a_t)| — what this step's updates moved (0 in its first
      mini-batch);
    - "trust_region/masked_frac_from_mismatch" / "_from_update": the share of active tokens that are masked and
      whose |log π_old − log µ| is ≥ / < |log π − log π_old| (which factor of log π − log µ is the larger); the
      two add up to the masked share.
    Means over zero tokens are 0; "n_tokens" weights them."""
    mask = response_mask.bool()
    logp, old_logp, rollout_logp = _acc(logp), _acc(old_logp), _acc(rollout_logp)
    n = mask.float().sum()
    mism = (old_logp - rollout_logp).abs()
    upd = (logp - old_logp).abs()
    masked = _on(~keep, mask)
    return {
        SPLIT_KEYS[0]: _mean(binary_tv(old_logp, rollout_logp), mask, n),
        SPLIT_KEYS[1]: _mean(binary_tv(logp, old_logp), mask, n),
        SPLIT_KEYS[2]: (masked & (mism >= upd)).float().sum() / n.clamp(min=1),
        SPLIT_KEYS[3]: (masked & (mism < upd)).float().sum() / n.clamp(min=1),
        "n_tokens": n,
    }


@torch.no_grad()
def token_mean(values: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(mean of `values` over the response tokens, their count): e.g. the policy entropy. Mean 0 over no token."""
    n = response_mask.float().sum()
    return _mean(_acc(values), response_mask, n), n


@torch.no_grad()
def masked_shares(keep: Tensor, adv: Tensor, response_mask: Tensor) -> dict[str, Tensor]:
    """Share of response tokens the trust region masked (keep False), overall and for Â > 0 / Â < 0.

    keep, response_mask: [B, T] bool; adv: [B, T] or [B] (one advantage per sequence). Returns scalars
    "masked_frac" (weight "n_tokens"), "masked_frac_pos" (weight "n_pos", the tokens with Â > 0), "masked_frac_neg"
    (weight "n_neg", Â < 0) and the three counts. Tokens with Â = 0 count only in the overall share.
    """
    adv = adv.detach()
    adv = adv[:, None].expand(response_mask.shape) if adv.dim() == 1 else adv
    dropped = _on(~keep, response_mask)
    pos, neg = _on(adv > 0, response_mask), _on(adv < 0, response_mask)
    n, n_pos, n_neg = response_mask.float().sum(), pos.float().sum(), neg.float().sum()
    return {
        "masked_frac": dropped.float().sum() / n.clamp(min=1),
        "masked_frac_pos": (dropped & pos).float().sum() / n_pos.clamp(min=1),
        "masked_frac_neg": (dropped & neg).float().sum() / n_neg.clamp(min=1),
        "n_tokens": n, "n_pos": n_pos, "n_neg": n_neg,
    }


@torch.no_grad()
def ratio_stats(logp: Tensor, rollout_logp: Tensor, response_mask: Tensor, *, is_cap: float) -> dict[str, Tensor]:
    """Importance ratio r = exp(min(log π − log µ, 20)) over the response tokens ([B, T] inputs).

    Returns "ratio_mean", "ratio_above_cap_frac" (share with r > is_cap), "abs_log_ratio_mean" (|log π − log µ|,
    the clamped log-ratio), each weighted by "n_tokens", and the maxima "ratio_max", "abs_log_ratio_max" (0 when
    there is no response token).
    """
    n = response_mask.float().sum()
    log_ratio = (_acc(logp) - _acc(rollout_logp)).clamp(max=MAX_LOG_RATIO)
    ratio, abs_log = _on(log_ratio.exp(), response_mask), _on(log_ratio.abs(), response_mask)
    peak = lambda x: x.max() if x.numel() else x.new_zeros(())  # noqa: E731
    above = _mean((ratio > is_cap).to(ratio.dtype), response_mask, n)
    return {"ratio_mean": ratio.sum() / n.clamp(min=1), "ratio_above_cap_frac": above,
            "abs_log_ratio_mean": abs_log.sum() / n.clamp(min=1), "ratio_max": peak(ratio),
            "abs_log_ratio_max": peak(abs_log), "n_tokens": n}


@torch.no_grad()
def masked_mu_histogram(keep: Tensor, rollout_logp: Tensor, response_mask: Tensor,
                        edges: Sequence[float] = MU_BUCKETS) -> Tensor:
    """Counts [len(edges) + 1] (float32) of masked response tokens (keep False) per µ(a_t) bucket: bucket i holds
    edges[i−1] < µ ≤ edges[i] (edges increasing, inside (0, 1); bucket 0 from 0, the last up to 1). Add them over
    micro-batches; `masked_mu_shares` turns the total into shares."""
    mu = _acc(rollout_logp).exp()
    bucket = torch.bucketize(mu, torch.tensor(edges, dtype=mu.dtype, device=mu.device))
    return torch.bincount(bucket[(~keep) & response_mask], minlength=len(edges) + 1).float()


def masked_mu_shares(counts: Tensor, edges: Sequence[float] = MU_BUCKETS) -> dict[str, Tensor]:
    """The histogram of `masked_mu_histogram` as shares of the masked tokens, keyed "masked_mu_<lo>-<hi>" (e.g.
    "masked_mu_0-0.001", ..., "masked_mu_0.5-1"; all 0 when nothing was masked). The trainer logs them under
    "trust_region/"."""
    bounds = (0.0, *edges, 1.0)
    shares = counts / counts.sum().clamp(min=1)
    return {f"masked_mu_{bounds[i]:g}-{bounds[i + 1]:g}": shares[i] for i in range(len(bounds) - 1)}


@torch.no_grad()
def per_group_sums(values: Tensor, response_mask: Tensor, group_index: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """Per-group sums of `values` over the response tokens, and the groups' response-token counts ([n_groups]
    each, float32 or wider): e.g. the Binary TV or the masked tokens of the responses of staleness 0..k.

    values: [B, T] (bool or float); response_mask: [B, T]; group_index: [B] integer group of each sequence, or
    [B, T] of each token (e.g. a multi-turn episode's turn index); a value outside 0..n_groups−1 counts in no
    group. Sums and counts add over micro-batches; a group's mean is sums / counts.clamp(min=1).
    """
    values = _acc(values.float() if values.dtype == torch.bool else values)
    groups = torch.arange(n_groups, device=group_index.device)
    if group_index.dim() == 2:  # per token: [B, T, n_groups]
        onehot = (group_index[..., None] == groups).to(values.dtype) * response_mask[..., None].to(values.dtype)
        return torch.einsum("bt,btg->g", _on(values, response_mask), onehot), onehot.sum((0, 1))
    onehot = (group_index[:, None] == groups[None, :]).to(values.dtype)
    return _on(values, response_mask).sum(-1) @ onehot, response_mask.to(values.dtype).sum(-1) @ onehot


class WeightedMeans:
    """Means accumulated over parts (micro-batches, mini-batches) as tensors, with no host sync: `add(key, mean,
    weight)` per part, `means()` at the end = Σ mean·weight / Σ weight per key (0 where the weights add to 0),
    `weight(key)` the total weight. The one weighted mean of the step's metrics and its ledger."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.weights: dict[str, Tensor] = {}

    def add(self, key: str, value: Tensor, weight: Tensor) -> None:
        self.sums[key] = self.sums.get(key, 0) + value.detach().float() * weight
        self.weights[key] = self.weights.get(key, 0) + weight

    def weight(self, key: str) -> Tensor:
        return torch.as_tensor(self.weights[key])

    def means(self) -> dict[str, Tensor]:
        return {k: self.sums[k] / self.weight(k).clamp(min=1e-12) for k in self.sums}


def to_sums(stats: Mapping[str, Tensor], weights: Mapping[str, str] = WEIGHTS) -> dict[str, Tensor]:
    """Each mean of `stats` (a key of `weights`) times its weight; counts and maxima unchanged."""
    return {k: v * stats[weights[k]] if k in weights else v for k, v in stats.items()}


def from_sums(sums: Mapping[str, Tensor], weights: Mapping[str, str] = WEIGHTS) -> dict[str, Tensor]:
    """The inverse of `to_sums`: each sum divided by its (token-count) weight, 0 where the weight is 0."""
    return {k: v / sums[weights[k]].clamp(min=1) if k in weights else v for k, v in sums.items()}


def merge(parts: Sequence[Mapping[str, Tensor]], weights: Mapping[str, str] = WEIGHTS) -> dict[str, Tensor]:
    """The dicts of several micro-batches (same keys) combined as if computed on their union: means weighted by
    their counts, counts and sums added, `MAXIMA` maxed."""
    sums = [to_sums(p, weights) for p in parts]
    total = {k: (torch.stack([s[k] for s in sums]).amax(0) if k in MAXIMA else sum(s[k] for s in sums))
             for k in sums[0]}
    return from_sums(total, weights)


def pass_at_k(correct: Tensor, n: int, k: int) -> Tensor:
    """The unbiased pass@k estimate per problem (Chen et al. 2021, "Evaluating Large Language Models Trained on
    Code", Eq. 1): 1 − C(n − c, k) / C(n, k) for c = `correct` successes among n samples of each problem ([P]
    integer counts), in the numerically stable product form 1 − Π_{i = n−c+1}^{n} (1 − k / i). float64 [P]."""
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= n = {n}, got {k}")
    c = correct.to(torch.float64)
    if bool(((c < 0) | (c > n)).any()):
        raise ValueError(f"correct: counts must lie in [0, n = {n}]")
    i = torch.arange(1, n + 1, dtype=torch.float64, device=c.device)
    factors = torch.where(i[None, :] > (n - c)[:, None], 1.0 - k / i[None, :], torch.ones((), dtype=torch.float64))
    return 1.0 - factors.prod(dim=1)


def pass_at_k_values(n: int) -> list[int]:
    """The k an evaluation with n samples per problem reports: the powers of two below n, and n."""
    return sorted({2 ** j for j in range(n.bit_length()) if 2 ** j < n} | {n})



def _majority_correct(votes: Sequence[tuple[str | None, float]]) -> float:
    """Whether the most frequent answer of `votes` ((answer, correct) pairs; answer None = no vote) is correct: the
    mean correctness of the samples that gave it, averaged over tied answers (a uniform tie-break); 0 with no vote."""
    counts = Counter(a for a, _ in votes if a is not None)
    if not counts:
        return 0.0
    top = max(counts.values())
    winners = [a for a, c in counts.items() if c == top]
    return sum(sum(c for a2, c in votes if a2 == a) / top for a in winners) / len(winners)


def maj_at_k(votes: Sequence[Sequence[tuple[str | None, float]]], k: int, *, max_subsets: int = 2000,
             draws: int = 2000, seed: int = 0) -> list[float]:
    """maj@k per problem: the expected correctness of a majority vote over k of its n samples drawn without
    replacement, every k-subset equally likely. `votes[p]`: problem p's n (answer, correct) pairs, answer the
    sample's canonical answer (`dppo.rewards.votes`; None = no vote) and correct in [0, 1]; the majority answer's
    correctness is that of the samples that gave it, ties broken uniformly (`_majority_correct`), no vote at all = 0.
    Exact (every k-subset) when there are at most `max_subsets` of them, else the mean over `draws` uniform
    k-subsets from a generator seeded with `seed` (standard error <= 0.5 / sqrt(draws) per problem). k = n is the
    plain majority of all samples."""
    out = []
    for p, pairs in enumerate(votes):
        n = len(pairs)
        if not 1 <= k <= n:
            raise ValueError(f"k: expected 1 <= k <= n = {n} (samples of problem {p}), got {k}")
        if math.comb(n, k) <= max_subsets:
            subsets = list(itertools.combinations(pairs, k))
        else:
            rng = random.Random(seed * 1_000_003 + p)
            subsets = [rng.sample(list(pairs), k) for _ in range(draws)]
        out.append(sum(_majority_correct(s) for s in subsets) / len(subsets))
    return out
