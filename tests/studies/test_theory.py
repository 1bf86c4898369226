"""The paper's theory checked by exact enumeration on tabular autoregressive policies (the paper's §3, App. A and B).

A tabular policy (dppo.studies.theory) has a next-token distribution for every prefix of length < T over V tokens;
with V ≤ 4 and T ≤ 4 every expectation is an exact sum over ≤ 256 sequences, in float64. Statements
checked (µ = rollout policy, π = trained policy, r_t = π(y_t|s_t)/µ(y_t|s_t), ξ = max_y |R(y)|):

- Thm 3.1: J(π) − J(µ) = L′ − Δ, L′ = E_µ[R Σ_t (r_t − 1)], Δ = E_µ[R Σ_t (r_t − 1)(1 − Π_{j>t} r_j)].
  (It holds because Σ_t (r_t − 1) Π_{j>t} r_j telescopes to Π_j r_j − 1, and E_µ[R (Π_j r_j − 1)] = J(π) − J(µ).)
- Thm 3.2: J(π) − J(µ) ≥ L′ − 2ξT(T−1)(D_TV^max)² and J(π) − J(µ) ≥ L′ − 4ξ E_µ[Σ_t D_TV(s_t)],
  D_TV^max = max over all states of D_TV(µ(·|s) ‖ π(·|s)). The second is the paper's "tighter bound" of the
  appendix (the composite bound takes the min of the two penalties).
- Lemma A.1, the sequence-level TV bound used in the proof of Thm 3.2:
  D_TV(µ(y_{t+1..T}|s) ‖ π(y_{t+1..T}|s)) ≤ Σ_{k>t} E_{s_k~µ}[D_TV(µ(·|s_k) ‖ π(·|s_k)) | s], for the whole
  sequence (s = the empty prefix) and, as the proof uses it, from every prefix s.
  Source: the v3 text of Lemma A.1 was not retrievable here. Its statement is taken from two public notes
  on the paper that quote its LaTeX source (label `lem:sequence_tv_bound`, the first lemma of the proofs
  appendix; one note numbers it B.1, an earlier version's numbering); the proof of Thm 3.2 (sequence TV
  bounded by per-step TV, then by (T − t) D_TV^max) needs exactly this statement.
- Eq. 11: D_TV(µ(·|s) ‖ π(·|s)) = ½ E_{a~µ}|r(a) − 1|, at every state, and along sequences.
- App. B: any partition of the vocabulary gives TV and KL(µ‖π) no larger than the full ones. Here on every
  state of tabular pairs, for every sampled token and every K: Binary ≤ Top-K ≤ Full, with the gaps
  computed exactly (so equality holds exactly when µ − π has one sign, resp. π/µ is constant, in each cell).
- The paper's §3 over-clipping example (a rare token pushed up, a likely one pushed down) through the
  TRUST_REGIONS masks.
tests/test_divergence.py covers the partition properties on single random distributions; this file works on
whole tabular policies and on the theorems.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dppo.divergence import binary_kl, binary_tv, full_kl, full_tv, topk_kl, topk_tv
from dppo.studies.theory import (
    TabularPolicy,
    expected_reward,
    expected_tv_sum,
    improvement_penalties,
    max_tv,
    perturb,
    performance_difference,
    random_policy,
    sequence_logp,
    state_tv,
    suffix_tv,
    suffix_tv_bound,
    token_log_ratios,
)
from dppo.trust_region import TRUST_REGIONS

F64 = torch.float64
PROPS = settings(max_examples=60, deadline=None)

EXACT = dict(rtol=0.0, atol=1e-12)
"""Identities between sums of ≤ 256·4 terms, each a probability-weighted quantity bounded by max|R| ≤ 1 in
absolute value (e.g. µ(y)(r_t − 1)Π_{j>t} r_j = µ(y_<t)(π(y_t|s_t) − µ(y_t|s_t))π(y_>t|s_t+1)): float64 rounding
(2.2e-16 relative per operation) stays below 1e-13. 1e-12 leaves margin and still fails on any wrong term."""
SLACK = 1e-12
"""Inequalities that hold exactly in exact arithmetic and are attained (T = 1, equality cases): the same
float64 rounding bound as EXACT."""

# A pair regime is the logit-noise scale of π around µ: near pairs (1e-3, 0.03), where the quadratic
# bound is the tighter one, and far pairs (1, 3), where the linear one is.
REGIMES = [1e-3, 0.03, 0.3, 1.0, 3.0]


# ------------------------------------------------------------------------------------------------
# Tabular pairs and rewards
# ------------------------------------------------------------------------------------------------


def all_sequences(vocab: int, horizon: int) -> torch.Tensor:
    """[V^T, T] every sequence, in the row-major order of a [V]*T tensor."""
    return torch.tensor(list(itertools.product(range(vocab), repeat=horizon)), dtype=torch.long).reshape(-1, horizon)


def with_shared_tail(pi: TabularPolicy, mu: TabularPolicy, eos: int) -> TabularPolicy:
    """π equal to µ at every state whose prefix contains `eos`: after EOS both policies emit the same
    (arbitrary, full-support) padding, so r_t = 1 exactly there and a length-T enumeration models responses
    of variable length |y| ≤ T (T = the maximum length)."""
    out = []
    for t, (lp, lm) in enumerate(zip(pi.logp, mu.logp)):
        if t == 0:
            out.append(lp)
            continue
        prefixes = all_sequences(mu.vocab, t)
        ended = (prefixes == eos).any(-1).reshape((mu.vocab,) * t + (1,))
        out.append(torch.where(ended, lm, lp))
    return TabularPolicy(tuple(out))


def truncated_reward(reward: torch.Tensor, eos: int) -> torch.Tensor:
    """R(y) made a function of y up to its first EOS (tokens after it are replaced by EOS before lookup)."""
    vocab, horizon = reward.shape[0], reward.dim()
    seqs = all_sequences(vocab, horizon)
    ended = torch.cumsum((seqs == eos).long(), -1) > 0
    after = torch.cat([torch.zeros_like(ended[:, :1]), ended[:, :-1]], -1)
    canon = torch.where(after, torch.full_like(seqs, eos), seqs)
    flat_index = (canon * (vocab ** torch.arange(horizon - 1, -1, -1))).sum(-1)
    return reward.reshape(-1)[flat_index].reshape(reward.shape)


def remainder_integrand(pi: TabularPolicy, mu: TabularPolicy) -> torch.Tensor:
    """Σ_t (r_t − 1)(1 − Π_{j>t} r_j) per sequence, by a plain loop over t (independent of dppo.studies.theory)."""
    r = token_log_ratios(pi, mu).exp()
    total = torch.zeros_like(r[0])
    for t in range(r.shape[0]):
        future = torch.prod(r[t + 1 :], 0) if t + 1 < r.shape[0] else torch.ones_like(r[0])
        total = total + (r[t] - 1) * (1 - future)
    return total


def make_case(seed: int, vocab: int, horizon: int, regime: float, reward_kind: str, eos: bool):
    """(π, µ, R, ξ): µ = softmax of N(0, s²) logits (s ∈ {0.5, 1, 3}), π = µ with N(0, regime²) logit noise.
    reward_kind: "uniform" U(−1, 1); "binary" {0, 1}; "constant" 0.7; "adversarial" ±1 with the sign of Δ's
    integrand (maximises Δ for the pair, the case where the bounds are tightest)."""
    g = torch.Generator().manual_seed(seed)
    mu = random_policy(vocab, horizon, generator=g, scale=[0.5, 1.0, 3.0][seed % 3])
    pi = perturb(mu, generator=g, scale=regime)
    shape = (vocab,) * horizon
    if eos:
        pi = with_shared_tail(pi, mu, eos=vocab - 1)
    if reward_kind == "uniform":
        reward = torch.rand(shape, generator=g, dtype=F64) * 2 - 1
    elif reward_kind == "binary":
        reward = (torch.rand(shape, generator=g, dtype=F64) < 0.5).to(F64)
    elif reward_kind == "constant":
        reward = torch.full(shape, 0.7, dtype=F64)
    else:
        reward = torch.sign(remainder_integrand(pi, mu))
    if eos and reward_kind != "adversarial":  # the adversarial sign already depends on y up to EOS only
        reward = truncated_reward(reward, eos=vocab - 1)
    xi = reward.abs().max()
    return pi, mu, reward, xi


pair_args = dict(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 4),
    horizon=st.integers(1, 4),
    regime=st.sampled_from(REGIMES),
    eos=st.booleans(),
)
case_args = dict(**pair_args, reward_kind=st.sampled_from(["uniform", "binary", "constant", "adversarial"]))


# ------------------------------------------------------------------------------------------------
# The enumeration helpers against a loop reference
# ------------------------------------------------------------------------------------------------


def test_theory_helpers_match_a_loop_reference():
    # Slow reference: explicit Python loops over sequences and states, from the definitions.
    g = torch.Generator().manual_seed(7)
    V, T = 3, 3
    mu = random_policy(V, T, generator=g)
    pi = perturb(mu, generator=g, scale=0.7)
    reward = torch.rand((V,) * T, generator=g, dtype=F64) * 2 - 1
    P = {name: [lp.exp().tolist() for lp in pol.logp] for name, pol in (("pi", pi), ("mu", mu))}
    R = reward.tolist()

    def q(name, s, a):  # p(a | prefix s) from nested lists
        row = P[name][len(s)]
        for tok in s:
            row = row[tok]
        return row[a]

    def p(name, y):  # probability of the first len(y) tokens
        return math.prod(q(name, y[:t], y[t]) for t in range(len(y)))

    def rew(y):
        return R[y[0]][y[1]][y[2]]

    def ratio(y, t):
        return q("pi", y[:t], y[t]) / q("mu", y[:t], y[t])

    seqs = list(itertools.product(range(V), repeat=T))
    j_pi = sum(p("pi", y) * rew(y) for y in seqs)
    j_mu = sum(p("mu", y) * rew(y) for y in seqs)
    l_ref = sum(p("mu", y) * rew(y) * sum(ratio(y, t) - 1 for t in range(T)) for y in seqs)
    d_ref = sum(
        p("mu", y) * rew(y) * sum((ratio(y, t) - 1) * (1 - math.prod(ratio(y, j) for j in range(t + 1, T))) for t in range(T))
        for y in seqs
    )
    got = performance_difference(pi, mu, reward)
    assert_close(expected_reward(pi, reward), torch.tensor(j_pi, dtype=F64), **EXACT)
    assert_close(got.gap, torch.tensor(j_pi - j_mu, dtype=F64), **EXACT)
    assert_close(got.surrogate, torch.tensor(l_ref, dtype=F64), **EXACT)
    assert_close(got.remainder, torch.tensor(d_ref, dtype=F64), **EXACT)
    # Per-state TV, its max and its µ-expected sum; sequence TV from the root and from every prefix.
    states = [s for t in range(T) for s in itertools.product(range(V), repeat=t)]
    tv = {s: 0.5 * sum(abs(q("pi", s, a) - q("mu", s, a)) for a in range(V)) for s in states}
    assert_close(max_tv(pi, mu), torch.tensor(max(tv.values()), dtype=F64), **EXACT)
    assert_close(expected_tv_sum(pi, mu), torch.tensor(sum(p("mu", s) * tv[s] for s in states), dtype=F64), **EXACT)
    for start in range(T + 1):
        got_tv, got_bound = suffix_tv(pi, mu, start), suffix_tv_bound(pi, mu, start)
        for s in itertools.product(range(V), repeat=start):
            rests = list(itertools.product(range(V), repeat=T - start))
            cond = lambda name, z: p(name, s + z) / p(name, s)  # noqa: E731
            seq_tv = 0.5 * sum(abs(cond("pi", z) - cond("mu", z)) for z in rests)
            bound = sum(cond("mu", z[: t - start]) * tv[s + z[: t - start]] for t in range(start, T) for z in
                        itertools.product(range(V), repeat=t - start))
            assert abs(got_tv[s].item() - seq_tv) <= 1e-12 and abs(got_bound[s].item() - bound) <= 1e-12, (start, s)
    assert_close(sequence_logp(mu).exp().sum(), torch.tensor(1.0, dtype=F64), **EXACT)


# ------------------------------------------------------------------------------------------------
# Thm 3.1: performance-difference identity
# ------------------------------------------------------------------------------------------------


@PROPS
@given(**case_args)
def test_thm31_identity(seed, vocab, horizon, regime, reward_kind, eos):
    pi, mu, reward, _ = make_case(seed, vocab, horizon, regime, reward_kind, eos)
    pd = performance_difference(pi, mu, reward)
    assert_close(pd.gap, pd.surrogate - pd.remainder, **EXACT)
    # The telescoping step, per sequence: Σ_t (r_t − 1) Π_{j>t} r_j = Π_j r_j − 1.
    r = token_log_ratios(pi, mu).exp()
    tele = sum((r[t] - 1) * torch.prod(r[t + 1 :], 0) for t in range(horizon))
    prod = torch.prod(r, 0)
    assert_close(tele, prod - 1, rtol=1e-12, atol=1e-12)  # terms up to ~Π r (≤ e^{~40} for far pairs): relative


def test_thm31_remainder_is_zero_for_one_token_and_second_order_for_near_pairs():
    # T = 1: Π over an empty future is 1, so Δ = 0 and J(π) − J(µ) = L′ exactly.
    g = torch.Generator().manual_seed(3)
    mu = random_policy(4, 1, generator=g)
    pi = perturb(mu, generator=g, scale=1.0)
    reward = torch.rand(4, generator=g, dtype=F64)
    pd = performance_difference(pi, mu, reward)
    assert pd.remainder.item() == 0.0
    assert_close(pd.gap, pd.surrogate, **EXACT)
    # T = 3, π = µ + ε·noise in logits: L′ = O(ε), Δ = O(ε²); halving ε quarters Δ (ratio 4 ± 5%).
    mu = random_policy(3, 3, generator=g)
    noise = random_policy(3, 3, generator=g, scale=1.0)
    reward = torch.rand((3,) * 3, generator=g, dtype=F64) * 2 - 1

    def remainder(eps):
        logits = [m + eps * n for m, n in zip(mu.logp, noise.logp)]
        pi = TabularPolicy(tuple(x - x.logsumexp(-1, keepdim=True) for x in logits))
        return performance_difference(pi, mu, reward).remainder

    ratio = (remainder(2e-3) / remainder(1e-3)).item()
    assert abs(ratio - 4.0) < 0.2


# ------------------------------------------------------------------------------------------------
# Thm 3.2: the two policy-improvement lower bounds
# ------------------------------------------------------------------------------------------------


@PROPS
@given(**case_args)
def test_thm32_both_bounds_hold(seed, vocab, horizon, regime, reward_kind, eos):
    pi, mu, reward, xi = make_case(seed, vocab, horizon, regime, reward_kind, eos)
    pd = performance_difference(pi, mu, reward)
    quad, lin = improvement_penalties(pi, mu, xi)
    assert pd.gap >= pd.surrogate - quad - SLACK
    assert pd.gap >= pd.surrogate - lin - SLACK
    # The proof bounds |Δ|, so the bounds hold on both sides: J(π) − J(µ) ≤ L′ + penalty too.
    assert pd.gap <= pd.surrogate + torch.minimum(quad, lin) + SLACK


def test_thm32_sweep_reaches_tight_cases():
    # A seeded sweep over 300 pairs (V 2-4, T 2-4, all regimes, worst-case rewards, some with EOS): both bounds
    # always hold, and the sweep gets close to them (a bound with a much smaller constant would fail here).
    worst_quad = worst_lin = 0.0
    for seed in range(300):
        vocab, horizon = 2 + seed % 3, 2 + (seed // 3) % 3
        pi, mu, reward, xi = make_case(seed, vocab, horizon, REGIMES[seed % 5], "adversarial", eos=seed % 7 == 0)
        pd = performance_difference(pi, mu, reward)
        quad, lin = improvement_penalties(pi, mu, xi)
        assert pd.remainder <= quad + SLACK and pd.remainder <= lin + SLACK, seed
        worst_quad = max(worst_quad, (pd.remainder / quad).item())
        worst_lin = max(worst_lin, (pd.remainder / lin).item())
    assert worst_quad > 0.8, worst_quad  # measured 0.89
    assert worst_lin > 0.3, worst_lin  # measured 0.34 (the linear penalty's t = T term is always slack)


@pytest.mark.parametrize("seed, vocab, tv", [(0, 3, 0.05), (1, 3, 0.3), (2, 4, 0.24), (3, 4, 0.11)])
def test_thm32_quadratic_bound_is_attained_for_two_tokens(seed, vocab, tv):
    # T = 2, every state moves exactly `tv` of mass from µ's argmax to another token, R = ξ·sign((r_1−1)(1−r_2)):
    # then Δ = ξ·E|r_1 − 1|·2·TV = 4ξ·tv² = 2ξ·T(T−1)·(D_TV^max)², i.e. J(π) − J(µ) = L′ − penalty exactly.
    g = torch.Generator().manual_seed(seed)
    mu = random_policy(vocab, 2, generator=g)

    def shift(lm):
        m = lm.exp()
        j = m.argmax(-1, keepdim=True)
        i = (j + 1 + torch.randint(0, vocab - 1, j.shape, generator=g)) % vocab
        assert (m.gather(-1, j) > tv).all()  # max µ ≥ 1/V > tv: the move keeps π ≥ 0
        step = torch.full(j.shape, tv, dtype=F64)
        return m.scatter_add(-1, j, -step).scatter_add(-1, i, step).log()

    pi = TabularPolicy(tuple(shift(lm) for lm in mu.logp))
    xi = 1.5
    reward = xi * torch.sign(remainder_integrand(pi, mu))
    pd = performance_difference(pi, mu, reward)
    quad, lin = improvement_penalties(pi, mu, xi)
    assert_close(max_tv(pi, mu), torch.tensor(tv, dtype=F64), **EXACT)
    assert_close(pd.remainder, quad, **EXACT)
    assert_close(pd.gap, pd.surrogate - quad, **EXACT)
    assert lin > quad  # the linear penalty 4ξ·2·tv is looser here


def test_thm32_needs_the_true_tv_not_its_binary_lower_bound():
    # App. B makes Binary-TV a *lower* bound of TV, so plugging it into Thm 3.2 gives a smaller penalty that
    # is not a guarantee. V = 16, T = 2, µ uniform, π moves half the mass at every state: TV ≈ ½ but
    # Binary-TV at every token ≈ 1/16. With the worst-case reward, J(π) − J(µ) falls below both bounds
    # computed with Binary-TV, while the bounds with the true TV hold (the quadratic one exactly).
    vocab, eta = 16, 1e-3
    half = torch.tensor([2 * (1 - eta) / vocab] * (vocab // 2) + [2 * eta / vocab] * (vocab // 2), dtype=F64)
    uniform = torch.full((vocab,), 1 / vocab, dtype=F64).log()
    mu = TabularPolicy((uniform, uniform.expand(vocab, vocab)))
    pi = TabularPolicy((half.log(), half.log().expand(vocab, vocab)))
    reward = torch.sign(remainder_integrand(pi, mu))
    pd = performance_difference(pi, mu, reward)
    quad, lin = improvement_penalties(pi, mu, 1.0)
    assert_close(pd.remainder, quad, **EXACT)
    assert pd.remainder <= lin
    # The same penalties with Binary-TV (the sampled token's |µ − π|) in place of the per-state TV.
    bin0, bin1 = (binary_tv(p, m) for p, m in zip(pi.logp, mu.logp))  # [V], [V, V]
    mu1 = mu.logp[0].exp()
    bin_lin = 4 * ((mu1 * bin0).sum() + (mu1[:, None] * mu.logp[1].exp() * bin1).sum())  # 4ξ E_µ[Σ_t Binary-TV_t]
    bin_quad = 2 * 2 * 1 * torch.maximum(bin0.max(), bin1.max()) ** 2
    assert pd.gap < pd.surrogate - bin_lin - 0.4  # violated by a wide margin (Δ ≈ 1, bin_lin ≈ 0.5)
    assert pd.gap < pd.surrogate - bin_quad - 0.9


# ------------------------------------------------------------------------------------------------
# Lemma A.1: sequence-level TV ≤ sum of expected per-step TVs
# ------------------------------------------------------------------------------------------------


@PROPS
@given(**pair_args)
def test_lemma_a1_sequence_tv_bound_from_every_prefix(seed, vocab, horizon, regime, eos):
    pi, mu, _, _ = make_case(seed, vocab, horizon, regime, "constant", eos)
    r = token_log_ratios(pi, mu).exp()
    for start in range(horizon + 1):
        lhs, rhs = suffix_tv(pi, mu, start), suffix_tv_bound(pi, mu, start)
        assert (lhs <= rhs + SLACK).all(), start
        assert (lhs <= 1 + SLACK).all()
        # The step of the proof of Thm 3.2 that uses it: E_µ[|1 − Π_{j>t} r_j| | y_1..y_t] = 2·suffix TV.
        future = torch.prod(r[start:], 0)  # Π over positions start+1..T (empty product 1 when start = T)
        log_cond = torch.zeros((vocab,) * horizon, dtype=F64)  # log µ(y_{start+1..T} | y_1..y_start)
        for t in range(start, horizon):
            log_cond = log_cond + mu.logp[t].reshape(mu.logp[t].shape + (1,) * (horizon - t - 1))
        weighted = log_cond.exp() * (1 - future).abs()
        expect = weighted.sum(dim=tuple(range(start, horizon))) if start < horizon else weighted
        assert_close(expect, 2 * lhs, **EXACT)
    # From the root, with D_TV^max: sequence TV ≤ T·D_TV^max (the form the proof uses for the future).
    assert suffix_tv(pi, mu, 0) <= horizon * max_tv(pi, mu) + SLACK


@pytest.mark.parametrize("step", [0, 1, 2])
def test_lemma_a1_equality_when_only_one_step_differs(step):
    # π = µ everywhere except at position `step`: the sequence TV equals E_µ[D_TV(s_step)] exactly.
    g = torch.Generator().manual_seed(step)
    mu = random_policy(3, 3, generator=g)
    moved = perturb(mu, generator=g, scale=1.0)
    pi = TabularPolicy(tuple(moved.logp[t] if t == step else mu.logp[t] for t in range(3)))
    assert suffix_tv(pi, mu, 0) > 0.05
    assert_close(suffix_tv(pi, mu, 0), suffix_tv_bound(pi, mu, 0), **EXACT)


# ------------------------------------------------------------------------------------------------
# Eq. 11: D_TV = ½ E_µ|r − 1|
# ------------------------------------------------------------------------------------------------


@PROPS
@given(**pair_args)
def test_eq11_tv_is_half_the_expected_ratio_residual(seed, vocab, horizon, regime, eos):
    pi, mu, _, _ = make_case(seed, vocab, horizon, regime, "constant", eos)
    tvs = state_tv(pi, mu)
    for t in range(horizon):
        m, ratio = mu.logp[t].exp(), (pi.logp[t] - mu.logp[t]).exp()
        assert_close(0.5 * (m * (ratio - 1).abs()).sum(-1), tvs[t], **EXACT)
    # Along sequences: the PPO statistic |r_t − 1| is a one-sample estimate whose µ-mean is 2·TV, so
    # ½ E_µ[Σ_t |r_t − 1|] = E_µ[Σ_t D_TV(s_t)] (the quantity in the linear bound of Thm 3.2).
    r = token_log_ratios(pi, mu).exp()
    assert_close(0.5 * (sequence_logp(mu).exp() * (r - 1).abs().sum(0)).sum(), expected_tv_sum(pi, mu), **EXACT)


# ------------------------------------------------------------------------------------------------
# App. B: partitions (Binary, Top-K) on every state of tabular policies
# ------------------------------------------------------------------------------------------------


def state_table(policy: TabularPolicy) -> torch.Tensor:
    """[S, V] log-probs of every state (every prefix of length < T)."""
    return torch.cat([lp.reshape(-1, policy.vocab) for lp in policy.logp])


def topk_cells(lmu: torch.Tensor, lpi: torch.Tensor, k: int):
    """For every state [S] and every sampled token a [V]: the paper's Top-K cells S = µ's top-k ∪ {a}, as
    (cells_mu, cells_pi, valid) of shape [S, V, k+1] (slot k holds a, or an unused duplicate when a ∈ top-k),
    and `other` [S, V, V] True for the tokens in the "other" bucket."""
    S, V = lmu.shape
    top = lmu.topk(k, -1).indices[:, None, :].expand(S, V, k)
    a = torch.arange(V)[None, :, None].expand(S, V, 1)
    in_top = (top == a).any(-1, keepdim=True)
    ids = torch.cat([top, torch.where(in_top, top[..., :1], a)], -1)
    valid = torch.cat([torch.ones_like(top, dtype=torch.bool), ~in_top], -1)
    gather = lambda lq: lq[:, None, :].expand(S, V, V).gather(-1, ids)  # noqa: E731
    member = torch.zeros(S, V, V, dtype=torch.bool).scatter(-1, top, True) | (torch.arange(V)[None, None, :] == a)
    return gather(lmu), gather(lpi), valid, ~member


def cell_gaps(lmu: torch.Tensor, lpi: torch.Tensor, other: torch.Tensor):
    """Exact Full − partition gaps when the only non-singleton cell is `other` [S, V, V] (bool over tokens):
    TV gap = ½(Σ_O |µ − π| − |µ(O) − π(O)|) (zero iff µ − π has one sign on O), KL gap = µ(O)·KL(µ|_O ‖ π|_O)
    (the chain rule of KL; zero iff π/µ is constant on O)."""
    m, p = lmu.exp()[:, None, :], lpi.exp()[:, None, :]
    zero = torch.zeros_like(m.expand_as(other))
    mo, po = torch.where(other, m, zero), torch.where(other, p, zero)
    mass_m, mass_p = mo.sum(-1), po.sum(-1)
    tv_gap = 0.5 * ((mo - po).abs().sum(-1) - (mass_m - mass_p).abs())
    log_ratio_cond = (lmu - lpi)[:, None, :] - (mass_m / mass_p.clamp(min=1e-300)).log()[..., None]
    kl_gap = torch.where(other, mo * log_ratio_cond, zero).sum(-1)
    return tv_gap, kl_gap


def other_kl_tol(lmu: torch.Tensor, lpi: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-element float64 tolerance of a partition KL whose "other" mass is computed as 1 − Σ_cells (Top-K
    must: the engine gives only the cells' log-probs; Binary's 1 − q comes from log q): π(O) then carries an
    absolute rounding error of a few eps, so µ(O)·log(µ(O)/π(O)) is off by ≈ µ(O)·eps/π(O), which for far
    pairs (π(O) ~ 1e-5) reaches ~1e-12. Bound used: 1e-12 + 8·eps·(1 + µ(O)/π(O))."""
    m, p = lmu.exp()[:, None, :], lpi.exp()[:, None, :]
    mass_m = torch.where(other, m, torch.zeros_like(m.expand_as(other))).sum(-1)
    mass_p = torch.where(other, p, torch.zeros_like(p.expand_as(other))).sum(-1)
    return 1e-12 + 8 * torch.finfo(F64).eps * (1 + mass_m / mass_p.clamp(min=1e-300))


@PROPS
@given(seed=pair_args["seed"], vocab=st.integers(2, 5), horizon=st.integers(1, 3), regime=pair_args["regime"])
def test_app_b_binary_le_topk_le_full_on_every_state(seed, vocab, horizon, regime):
    pi, mu, _, _ = make_case(seed, vocab, horizon, regime, "constant", eos=False)
    lmu, lpi = state_table(mu), state_table(pi)  # [S, V]
    ftv, fkl = full_tv(lpi, lmu)[:, None], full_kl(lpi, lmu)[:, None]  # [S, 1]
    btv, bkl = binary_tv(lpi, lmu), binary_kl(lpi, lmu)  # [S, V]: one column per sampled token
    # Binary = the partition {a, rest}: its exact gaps to Full.
    rest = ~torch.eye(vocab, dtype=torch.bool)[None].expand(len(lmu), vocab, vocab)
    tv_gap, kl_gap = cell_gaps(lmu, lpi, rest)
    btol = other_kl_tol(lmu, lpi, rest)
    assert_close(ftv - btv, tv_gap, **EXACT)
    assert ((fkl - bkl - kl_gap).abs() <= btol).all()
    if vocab == 2:  # one token in "rest": no gap
        assert_close(btv, ftv.expand_as(btv), **EXACT)
        assert ((bkl - fkl).abs() <= btol).all()
    for k in range(1, vocab + 1):
        cm, cp, valid, other = topk_cells(lmu, lpi, k)
        ttv, tkl = topk_tv(cp, cm, valid), topk_kl(cp, cm, valid)  # [S, V]
        ttol = other_kl_tol(lmu, lpi, other)
        assert (btv <= ttv + SLACK).all() and (ttv <= ftv + SLACK).all(), k
        assert (bkl <= tkl + btol + ttol).all() and (tkl <= fkl + ttol).all(), k
        tv_gap, kl_gap = cell_gaps(lmu, lpi, other)
        assert_close(ftv - ttv, tv_gap, **EXACT)
        assert ((fkl - tkl - kl_gap).abs() <= ttol).all(), k
        if k >= vocab - 1:  # "other" holds at most one token: Top-K is the full divergence
            assert_close(ttv, ftv.expand_as(ttv), **EXACT)
            assert ((tkl - fkl).abs() <= ttol).all(), k


def test_app_b_equality_cases_constructed_on_every_state():
    # For every state of a tabular µ, sampled token a = µ's least likely token and K = 1 (so "other" has
    # V − 2 ≥ 2 tokens): (1) π/µ constant on "other" -> Top-K TV and KL both equal the full ones;
    # (2) µ − π of one sign on "other" but π/µ not constant -> TV equal, KL strictly below.
    vocab = 5
    g = torch.Generator().manual_seed(11)
    mu = random_policy(vocab, 3, generator=g)
    lmu = state_table(mu)
    S = len(lmu)
    m = lmu.exp()
    a = m.argmin(-1)
    top = m.argmax(-1)
    other = torch.ones(S, vocab, dtype=torch.bool)
    other[torch.arange(S), a] = False
    other[torch.arange(S), top] = False
    # (1) π takes new masses on the cells {top}, {a}, other; inside "other" it is µ rescaled.
    new = -torch.rand(S, 3, generator=g, dtype=F64).log()  # Exp(1) draws, normalised: Dirichlet(1, 1, 1)
    new = new / new.sum(-1, keepdim=True)
    scale = new[:, 2:] / torch.where(other, m, torch.zeros_like(m)).sum(-1, keepdim=True)
    p1 = torch.where(other, m * scale, torch.zeros_like(m))
    p1[torch.arange(S), top], p1[torch.arange(S), a] = new[:, 0], new[:, 1]
    # (2) move 0.3·µ(top) from the top token onto "other", spread with weights not proportional to µ.
    w = torch.where(other, torch.rand(S, vocab, generator=g, dtype=F64) + 0.1, torch.zeros_like(m))
    w = w / w.sum(-1, keepdim=True)
    moved = 0.3 * m[torch.arange(S), top]
    p2 = m + moved[:, None] * w
    p2[torch.arange(S), top] -= moved
    ids = torch.stack([top, a], -1)  # the Top-K cells for K = 1 with the sampled token a ∉ top-1
    for p, kl_equal in [(p1, True), (p2, False)]:
        lpi = p.log()
        assert_close(p.sum(-1), torch.ones(S, dtype=F64), **EXACT)
        ttv, tkl = topk_tv(lpi.gather(-1, ids), lmu.gather(-1, ids)), topk_kl(lpi.gather(-1, ids), lmu.gather(-1, ids))
        assert_close(ttv, full_tv(lpi, lmu), **EXACT)
        if kl_equal:
            assert_close(tkl, full_kl(lpi, lmu), **EXACT)
        else:  # log-sum inequality strict: π/µ varies on "other" (gap = µ(O)·KL(µ|_O ‖ π|_O) > 0)
            assert (full_kl(lpi, lmu) - tkl > 1e-6).all()
    # Binary partition {top}, rest in (2): µ − π ≤ 0 on the whole rest, so Binary-TV at the top token = TV.
    lpi2, at_top = p2.log(), top[:, None]
    assert_close(binary_tv(lpi2.gather(-1, at_top), lmu.gather(-1, at_top))[:, 0], full_tv(lpi2, lmu), **EXACT)


# ------------------------------------------------------------------------------------------------
# The paper's §3 examples through the trust-region masks
# ------------------------------------------------------------------------------------------------


def test_paper_section3_examples_ppo_vs_dppo_masks():
    # Token 0: µ = 1e-4 -> π = 1e-2 with Â > 0 (a rare token pushed up). Token 1: µ = 0.99 -> π = 0.80 with
    # Â < 0 (a likely token pushed down). PPO (ε_low 0.2, ε_high 0.28) masks the first (r = 100 > 1.28) and
    # keeps the second (r ≈ 0.808 ≥ 0.8); DPPO Binary-TV (δ = 0.15) keeps the first (D = 0.0099) and masks the
    # second (D = 0.19); Binary-KL (δ = 0.05) agrees with Binary-TV.
    m = torch.tensor([[1e-4, 0.99]], dtype=F64)
    p = torch.tensor([[1e-2, 0.80]], dtype=F64)
    lm, lp = m.log(), p.log()
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert_close(lp.sub(lm).exp(), torch.tensor([[100.0, 0.80 / 0.99]], dtype=F64), **EXACT)
    assert_close(binary_tv(lp, lm), torch.tensor([[0.0099, 0.19]], dtype=F64), **EXACT)

    def keep(name, **override):
        region = TRUST_REGIONS[name]
        return region.fn(lp, lm, adv, mask, None, **{**region.defaults, **override}).tolist()

    assert TRUST_REGIONS["ppo_clip"].defaults["eps_low"] == 0.2
    assert TRUST_REGIONS["dppo_binary_tv"].defaults == {"delta_low": 0.15, "delta_high": 0.15}
    assert keep("ppo_clip") == [[False, True]]
    assert keep("ppo_clip", eps_high=0.2) == [[False, True]]  # plain GRPO 0.2/0.2: same decisions
    assert keep("dppo_binary_tv") == [[True, False]]
    assert keep("dppo_binary_kl") == [[True, False]]
    # The true TV of full distributions with these token probabilities, the rest of the mass moving in
    # proportion (π/µ constant on the rest: the App. B equality case), is the Binary-TV: 0.0099 and 0.19.
    for mu_a, pi_a, tv in [(1e-4, 1e-2, 0.0099), (0.99, 0.80, 0.19)]:
        rest = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
        lmu = torch.cat([torch.tensor([mu_a], dtype=F64), (1 - mu_a) * rest]).log()
        lpi = torch.cat([torch.tensor([pi_a], dtype=F64), (1 - pi_a) * rest]).log()
        assert_close(full_tv(lpi, lmu), torch.tensor(tv, dtype=F64), **EXACT)
        assert_close(0.5 * (lmu.exp() * (lpi - lmu).exp().sub(1).abs()).sum(), torch.tensor(tv, dtype=F64), **EXACT)
