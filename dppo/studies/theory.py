"""Exact enumeration for tabular autoregressive policies: the quantities of the paper's §3 theorems.

A tabular policy over a vocabulary of V tokens and a horizon of T tokens gives, for every prefix
s_t = (y_1, …, y_t) with t < T, a distribution over the next token. We store it as T tensors of
log-probabilities, ``logp[t]`` of shape [V]*(t+1), indexed (y_1, …, y_t, a) -> log p(a | y_1..y_t); every
sequence-level quantity is then a [V]*T tensor indexed by the full sequence y, and every expectation
is an exact sum over the V^T sequences (no sampling). Keep V^T small (tests, diagnostics, figures).

What it computes (µ = rollout policy, π = trained policy, r_t = π(y_t|s_t)/µ(y_t|s_t); the paper's §3):
- J(p) = Σ_y p(y) R(y), and the terms of the performance-difference identity (Thm 3.1)
  J(π) − J(µ) = L′ − Δ, L′ = E_µ[R Σ_t (r_t − 1)], Δ = E_µ[R Σ_t (r_t − 1)(1 − Π_{j>t} r_j)];
- per-state TV, its maximum over states and its µ-expected sum along a sequence (the two penalties of
  Thm 3.2: 2ξT(T−1)(D_TV^max)² and 4ξ E_µ[Σ_t D_TV(s_t)], ξ = max|R|);
- the TV between the distributions of the rest of the sequence given a prefix (the left side of the
  sequence-level TV lemma used in the proof of Thm 3.2) and its per-step bound.
π must be absolutely continuous w.r.t. µ (µ > 0 wherever π > 0) for r_t to exist; softmax policies are.

All functions are pure and keep the dtype of their inputs (use float64 for checks at 1e-12).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dppo.divergence import full_tv

__all__ = [
    "TabularPolicy",
    "random_policy",
    "perturb",
    "sequence_logp",
    "token_log_ratios",
    "expected_reward",
    "PerformanceDifference",
    "performance_difference",
    "state_tv",
    "max_tv",
    "expected_tv_sum",
    "improvement_penalties",
    "suffix_tv",
    "suffix_tv_bound",
]


class TabularPolicy(NamedTuple):
    logp: tuple[Tensor, ...]
    """logp[t]: [V]*(t+1), log p(a | y_1..y_t) indexed (y_1, …, y_t, a), for t = 0..T−1 (normalised over a)."""

    @property
    def vocab(self) -> int:
        return self.logp[0].shape[-1]

    @property
    def horizon(self) -> int:
        return len(self.logp)


def _check_pair(pi: TabularPolicy, mu: TabularPolicy) -> None:
    if pi.horizon != mu.horizon or pi.vocab != mu.vocab:
        raise ValueError(f"pi: expected vocab {mu.vocab} and horizon {mu.horizon} (as mu), got {pi.vocab} and {pi.horizon}")


def _expand(x: Tensor, horizon: int) -> Tensor:
    """A [V]*n tensor indexed by a prefix, as a [V]*n + [1]*(T−n) tensor that broadcasts over sequences."""
    return x.reshape(tuple(x.shape) + (1,) * (horizon - x.dim()))


def random_policy(
    vocab: int, horizon: int, *, generator: torch.Generator, scale: float = 1.0, dtype: torch.dtype = torch.float64
) -> TabularPolicy:
    """Softmax of N(0, scale²) logits at every prefix (larger scale = more peaked distributions)."""
    logp = []
    for t in range(horizon):
        logits = torch.randn((vocab,) * (t + 1), generator=generator, dtype=torch.float64) * scale
        logp.append((logits - logits.logsumexp(-1, keepdim=True)).to(dtype))
    return TabularPolicy(tuple(logp))


def perturb(policy: TabularPolicy, *, generator: torch.Generator, scale: float) -> TabularPolicy:
    """log p + N(0, scale²) noise, renormalised at every prefix: a policy `scale`-close in logit space."""
    out = []
    for lp in policy.logp:
        logits = lp + torch.randn(lp.shape, generator=generator, dtype=torch.float64).to(lp.dtype) * scale
        out.append(logits - logits.logsumexp(-1, keepdim=True))
    return TabularPolicy(tuple(out))


def sequence_logp(policy: TabularPolicy) -> Tensor:
    """log p(y) = Σ_t log p(y_{t+1} | y_1..y_t) for every full sequence y. Returns [V]*T."""
    return sum(_expand(lp, policy.horizon) for lp in policy.logp)


def token_log_ratios(pi: TabularPolicy, mu: TabularPolicy) -> Tensor:
    """log r_t(y) = log π(y_t|s_t) − log µ(y_t|s_t) at every position of every sequence. Returns [T] + [V]*T."""
    _check_pair(pi, mu)
    shape = (mu.vocab,) * mu.horizon
    return torch.stack([_expand(p - m, mu.horizon).expand(shape) for p, m in zip(pi.logp, mu.logp)])


def expected_reward(policy: TabularPolicy, reward: Tensor) -> Tensor:
    """J(p) = Σ_y p(y) R(y), reward: [V]*T. Returns a scalar tensor."""
    return (sequence_logp(policy).exp() * reward).sum()


class PerformanceDifference(NamedTuple):
    gap: Tensor
    """J(π) − J(µ) = Σ_y (π(y) − µ(y)) R(y), by direct enumeration."""
    surrogate: Tensor
    """L′ = E_{y~µ}[R(y) Σ_t (r_t − 1)]."""
    remainder: Tensor
    """Δ = E_{y~µ}[R(y) Σ_t (r_t − 1)(1 − Π_{j>t} r_j)]; Thm 3.1 says gap = surrogate − remainder."""


def performance_difference(pi: TabularPolicy, mu: TabularPolicy, reward: Tensor) -> PerformanceDifference:
    """The three terms of Thm 3.1, each computed from its own definition (the identity is not assumed)."""
    r = token_log_ratios(pi, mu).exp()  # [T] + [V]*T
    # Π_{j>t} r_j: reverse cumulative product, shifted by one (empty product = 1 at t = T).
    suffix = torch.flip(torch.cumprod(torch.flip(r, [0]), 0), [0])
    future = torch.cat([suffix[1:], torch.ones_like(suffix[:1])])
    weight = sequence_logp(mu).exp() * reward
    surrogate = (weight * (r - 1).sum(0)).sum()
    remainder = (weight * ((r - 1) * (1 - future)).sum(0)).sum()
    gap = expected_reward(pi, reward) - expected_reward(mu, reward)
    return PerformanceDifference(gap, surrogate, remainder)


def state_tv(pi: TabularPolicy, mu: TabularPolicy) -> tuple[Tensor, ...]:
    """D_TV(µ(·|s) ‖ π(·|s)) at every state: a tuple of T tensors, entry t of shape [V]*t (prefixes of length t)."""
    _check_pair(pi, mu)
    return tuple(full_tv(p, m) for p, m in zip(pi.logp, mu.logp))


def max_tv(pi: TabularPolicy, mu: TabularPolicy) -> Tensor:
    """D_TV^max = max over all states (every prefix of length < T) of the per-state TV."""
    return torch.stack([tv.max() for tv in state_tv(pi, mu)]).max()


def _prefix_prob(policy: TabularPolicy, start: int, stop: int) -> Tensor:
    """p(y_{start+1..stop} | y_1..y_start) as a [V]*stop tensor (1 when stop == start)."""
    out = torch.zeros((policy.vocab,) * stop, dtype=policy.logp[0].dtype)
    for t in range(start, stop):
        out = out + policy.logp[t].reshape(policy.logp[t].shape + (1,) * (stop - t - 1))
    return out.exp()


def expected_tv_sum(pi: TabularPolicy, mu: TabularPolicy) -> Tensor:
    """E_{y~µ}[Σ_{t=1}^T D_TV(µ(·|s_t) ‖ π(·|s_t))] = Σ_t Σ_{s_t} µ(s_t) D_TV(s_t)."""
    return sum((_prefix_prob(mu, 0, t) * tv).sum() for t, tv in enumerate(state_tv(pi, mu)))


def improvement_penalties(pi: TabularPolicy, mu: TabularPolicy, xi: float | Tensor) -> tuple[Tensor, Tensor]:
    """The penalties of Thm 3.2: (2ξ T(T−1) (D_TV^max)², 4ξ E_µ[Σ_t D_TV(s_t)]); J(π) − J(µ) ≥ L′ − each."""
    horizon = mu.horizon
    return 2 * xi * horizon * (horizon - 1) * max_tv(pi, mu) ** 2, 4 * xi * expected_tv_sum(pi, mu)


def suffix_tv(pi: TabularPolicy, mu: TabularPolicy, start: int) -> Tensor:
    """D_TV between µ(y_{start+1..T} | y_1..y_start) and π(· | same prefix), for every prefix. Returns [V]*start.

    start = 0 gives the TV between the two distributions of whole sequences.
    """
    _check_pair(pi, mu)
    horizon = mu.horizon
    diff = _prefix_prob(pi, start, horizon) - _prefix_prob(mu, start, horizon)
    return 0.5 * diff.abs().sum(dim=tuple(range(start, horizon))) if start < horizon else torch.zeros_like(diff)


def suffix_tv_bound(pi: TabularPolicy, mu: TabularPolicy, start: int) -> Tensor:
    """Σ_{t>start} E_{s_t~µ}[D_TV(µ(·|s_t) ‖ π(·|s_t)) | y_1..y_start]: the per-step bound of `suffix_tv`. [V]*start."""
    tvs = state_tv(pi, mu)
    total = torch.zeros((mu.vocab,) * start, dtype=mu.logp[0].dtype)
    for t in range(start, mu.horizon):
        weighted = _prefix_prob(mu, start, t) * tvs[t]  # [V]*t, indexed (y_1, …, y_t)
        if t > start:  # marginalise y_{start+1..t} (an empty dim tuple would sum over everything)
            weighted = weighted.sum(dim=tuple(range(start, t)))
        total = total + weighted
    return total
