"""The trust-region ledger's terms (`dppo.ledger`) against hand computations on constructed batches: the drift's parts
add up, the masked mass by source and sign, Thm. 3.2's penalties on a known case, the surrogate, the group
statistics and the gradient SNR; and that micro-batches combine to the whole batch's values."""

from __future__ import annotations

import math

import pytest
import torch

from dppo import ledger
from dppo.metrics import merge

L = math.log


def test_drift_parts_by_hand():
    """Two rows: row 0 fresh (staleness 0), row 1 two steps stale; the padding of row 1 counts nowhere."""
    mu = torch.tensor([[0.5, 0.25, 0.1], [0.2, 0.4, 0.9]])
    old = torch.tensor([[0.5, 0.5, 0.1], [0.1, 0.4, 0.9]])
    pi = torch.tensor([[0.25, 0.5, 0.2], [0.1, 0.8, 0.3]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    out = ledger.drift_parts(pi.log(), old.log(), mu.log(), mask, torch.tensor([0, 2]))
    n = 5
    assert out["n_tokens"] == n
    assert out["ledger/drift_precision"] == pytest.approx(L(2) / n, rel=1e-6)  # row 0: |log .5 − log .25| at token 1
    assert out["ledger/drift_staleness"] == pytest.approx(L(2) / n, rel=1e-6)  # row 1: |log .1 − log .2|
    learning = L(2) + 0 + L(2) + 0 + L(2)  # |log π − log π_old|: tokens (0,0), (0,2), (1,1)
    assert out["ledger/drift_learning"] == pytest.approx(learning / n, rel=1e-6)
    net = abs(L(.25 / .5)) + abs(L(.5 / .25)) + abs(L(.2 / .1)) + abs(L(.1 / .2)) + abs(L(.8 / .4))
    assert out["ledger/drift_net"] == pytest.approx(net / n, rel=1e-6)
    shares = ledger.drift_shares(out)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
    assert shares["ledger/drift_learning_share"] == pytest.approx(3 / 5, rel=1e-6)


def test_the_parts_bound_the_net_drift_and_per_token_staleness_works():
    g = torch.Generator().manual_seed(0)
    pi, old, mu = (torch.rand(4, 6, generator=g).clamp(min=1e-3).log() for _ in range(3))
    mask = torch.rand(4, 6, generator=g) > 0.2
    stale = torch.randint(0, 3, (4, 6), generator=g)
    out = ledger.drift_parts(pi, old, mu, mask, stale)
    parts = sum(out[k] for k in ledger.DRIFT_KEYS)
    assert out["ledger/drift_net"] <= parts + 1e-6  # |a + b| <= |a| + |b|
    fresh = ledger.drift_parts(pi, old, mu, mask & (stale == 0), torch.zeros(4, dtype=torch.long))
    assert out["ledger/drift_precision"] * out["n_tokens"] == pytest.approx(
        float(fresh["ledger/drift_precision"] * fresh["n_tokens"]), rel=1e-6)


def test_masked_mass_by_source_and_sign():
    """Four masked tokens, one of each (source, sign), and an unmasked one; mass |Â|·π/µ."""
    mu = torch.tensor([[0.2, 0.2, 0.5, 0.5, 0.4]])
    old = torch.tensor([[0.4, 0.4, 0.5, 0.5, 0.4]])  # tokens 0, 1: the mismatch (×2) is the larger factor
    pi = torch.tensor([[0.5, 0.3, 0.9, 0.2, 0.4]])  # tokens 2, 3: the update (×1.8, ×0.4) is
    adv = torch.tensor([[1.0, -2.0, 0.5, -1.0, 3.0]])
    keep = torch.tensor([[False, False, False, False, True]])
    mask = torch.ones(1, 5, dtype=torch.bool)
    out = ledger.masked_mass(keep, pi.log(), mu.log(), adv, mask, old.log())
    r = pi / mu
    assert out["ledger/mass"] == pytest.approx(float((adv.abs() * r).sum()), rel=1e-6)
    assert out["ledger/masked_mass_mismatch_pos"] == pytest.approx(1.0 * 2.5, rel=1e-6)
    assert out["ledger/masked_mass_mismatch_neg"] == pytest.approx(2.0 * 1.5, rel=1e-6)
    assert out["ledger/masked_mass_update_pos"] == pytest.approx(0.5 * 1.8, rel=1e-6)
    assert out["ledger/masked_mass_update_neg"] == pytest.approx(1.0 * 0.4, rel=1e-6)
    shares = ledger.mass_shares(out)
    assert shares["ledger/masked_mass"] == pytest.approx((2.5 + 3.0 + 0.9 + 0.4) / (2.5 + 3.0 + 0.9 + 0.4 + 3.0))
    without = ledger.masked_mass(keep, pi.log(), mu.log(), adv, mask)  # no π_old: every masked token is "update"
    assert without["ledger/masked_mass_mismatch_pos"] == 0 and without["ledger/masked_mass_update_pos"] == \
        pytest.approx(2.5 + 0.9, rel=1e-6)


def test_the_bound_on_a_known_case():
    """Two responses of lengths 3 and 2 with token TVs (0.1, 0.2, 0.05) and (0.3, 0.1), rewards 1 and −2 (ξ = 2):
    4ξ E[Σ_t D_t] = 8 · (0.35 + 0.4) / 2 = 3.0; 2ξ T(T−1) D_max² = 4 · 3 · 2 · 0.09 = 2.16."""
    tv = torch.tensor([[0.1, 0.2, 0.05], [0.3, 0.1, 7.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    terms = ledger.bound_terms(tv, mask)
    assert terms["ledger/tv_sum_per_row"] == pytest.approx(0.375) and terms["n_rows"] == 2
    assert terms["ledger/tv_max"] == pytest.approx(0.3) and terms["ledger/len_max"] == 3
    pen = ledger.bound_penalties(terms["ledger/tv_sum_per_row"], terms["ledger/tv_max"], terms["ledger/len_max"],
                                 torch.tensor([1.0, -2.0]).abs().max())
    assert pen["ledger/bound_sum"] == pytest.approx(3.0, rel=1e-6)
    assert pen["ledger/bound_max"] == pytest.approx(2.16, rel=1e-6)


def test_the_surrogate_by_hand():
    """L′ = E[R Σ_t (r_t − 1)]: row 0 (R = 1) ratios 2 and 0.5 → 0.5; row 1 (R = −1) ratio 1.5 → −0.5; mean 0."""
    logp = torch.tensor([[L(0.4), L(0.1)], [L(0.3), 0.0]])
    mu = torch.tensor([[L(0.2), L(0.2)], [L(0.2), 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    out = ledger.surrogate_gain(logp, mu, torch.tensor([1.0, -1.0]), mask)
    assert out["ledger/surrogate"] == pytest.approx(0.0, abs=1e-6) and out["n_rows"] == 2
    out = ledger.surrogate_gain(logp, mu, torch.tensor([1.0, 1.0]), mask)
    assert out["ledger/surrogate"] == pytest.approx(0.5, rel=1e-6)


def test_group_stats_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])  # G = 4: std 0.5 and 0
    adv = torch.tensor([0.5, -0.5, 0.5, -0.5, 0, 0, 0, 0])
    out = ledger.group_stats(rewards, adv, 4)
    assert out["ledger/group_reward_std"] == pytest.approx(0.25)
    assert out["ledger/adv_std"] == pytest.approx(float(adv.std(unbiased=False)))


def test_grad_snr_against_its_definition():
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(50, generator=g) + 2.0 for _ in range(4)]
    mean = torch.stack(grads).mean(0)
    expected = mean.square().sum() / (torch.stack([(x - mean).square().sum() for x in grads]).mean() / 4)
    got = ledger.grad_snr(torch.stack(grads).sum(0).square().sum(), sum(x.square().sum() for x in grads), 4)
    assert got == pytest.approx(float(expected), rel=1e-5)
    assert math.isnan(float(ledger.grad_snr(torch.tensor(1.0), torch.tensor(1.0), 1)))
    assert math.isinf(float(ledger.grad_snr(torch.tensor(16.0), torch.tensor(4.0), 4)))  # four equal unit gradients


def test_micro_batches_combine_to_the_whole_batch():
    """Split a batch in two micro-batches: means merged by their weights and sums added equal the whole batch's."""
    g = torch.Generator().manual_seed(2)
    pi, old, mu = (torch.rand(6, 5, generator=g).clamp(min=1e-3).log() for _ in range(3))
    mask = torch.rand(6, 5, generator=g) > 0.3
    stale, adv = torch.randint(0, 2, (6,), generator=g), torch.randn(6, generator=g)
    keep, rewards = torch.rand(6, 5, generator=g) > 0.5, torch.randn(6, generator=g)
    parts = [slice(0, 2), slice(2, 6)]

    def each(s):
        return {**ledger.drift_parts(pi[s], old[s], mu[s], mask[s], stale[s])}

    whole = each(slice(None))
    merged = merge([each(s) for s in parts], {k: "n_tokens" for k in (*ledger.DRIFT_KEYS, "ledger/drift_net")})
    for k in whole:
        assert merged[k] == pytest.approx(float(whole[k]), rel=1e-6)
    mass = [ledger.masked_mass(keep[s], pi[s], mu[s], adv[s], mask[s], old[s]) for s in parts]
    whole_mass = ledger.masked_mass(keep, pi, mu, adv, mask, old)
    for k in whole_mass:
        assert float(sum(m[k] for m in mass)) == pytest.approx(float(whole_mass[k]), rel=1e-6)
    sur = merge([ledger.surrogate_gain(pi[s], mu[s], rewards[s], mask[s]) for s in parts],
                {"ledger/surrogate": "n_rows"})
    assert sur["ledger/surrogate"] == pytest.approx(float(ledger.surrogate_gain(pi, mu, rewards, mask)["ledger/surrogate"]),
                                                    rel=1e-5)
