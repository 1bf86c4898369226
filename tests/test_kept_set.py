"""dppo.kept_set: the replay of truncated sampling against a float64 reference over the full vocabulary.

The reference builds π_S and µ_S explicitly (the full distributions restricted to the kept set and renormalised,
−inf elsewhere) and takes the divergences by summing over the vocabulary; the fast path sees only what the trainer
has: µ's recorded cells (top-K sorted by µ, plus the sampled token's slot), the kept set as a size into them or, when
larger than K, as its ids. Cases: untruncated (size 0), a kept set of one token, of exactly K, and larger than K.
"""

from __future__ import annotations

import pytest
import torch

from dppo.divergence import binary_tv, full_kl, full_tv
from dppo.kept_set import check_kept_size, kept_topk_kl, kept_topk_tv, prefix_members, replay, set_log_mass

V, K, N = 12, 5, 64


def _case(n: int, seed: int):
    """N tokens over a vocabulary of V: full log π and log µ (float64), µ's kept set (its n most likely tokens; 0 =
    all), a_t sampled from µ_S, and µ's cells in the [N, K+1] layout."""
    g = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(N, V, generator=g, dtype=torch.float64) * 1.5, -1)
    logm = torch.log_softmax(logp + 0.3 * torch.randn(N, V, generator=g, dtype=torch.float64), -1)
    order = logm.argsort(-1, descending=True)
    in_set = torch.zeros(N, V, dtype=torch.bool)
    if n:
        in_set.scatter_(1, order[:, :n], True)
    else:
        in_set[:] = True
    mu_s = torch.where(in_set, logm, torch.full_like(logm, float("-inf")))
    a = torch.multinomial(torch.softmax(mu_s, -1), 1, generator=g)[:, 0]
    top = order[:, :K]
    out_of_top = ~(top == a[:, None]).any(-1)
    ids = torch.cat([top, torch.where(out_of_top, a, 0)[:, None]], -1)
    valid = torch.cat([torch.ones(N, K, dtype=torch.bool), out_of_top[:, None]], -1)
    return logp, logm, in_set, a, ids, valid, order


def _restricted(logq, in_set):
    masked = torch.where(in_set, logq, torch.full_like(logq, float("-inf")))
    return masked - torch.logsumexp(masked, -1, keepdim=True)


def _reference_topk(logp_s, logm_s, in_set, ids, valid):
    """Top-K TV and KL over the partition {cells ∩ S} ∪ {S \\ cells} of the kept set, summed in float64."""
    cell = torch.zeros_like(in_set)
    cell.scatter_(1, torch.where(valid, ids, ids[:, :1]), True)
    cell &= in_set
    bucket = in_set & ~cell
    p, m = logp_s.exp(), logm_s.exp()
    tv = 0.5 * (torch.where(cell, (m - p).abs(), 0).sum(-1) + (torch.where(bucket, m, 0).sum(-1)
                                                              - torch.where(bucket, p, 0).sum(-1)).abs())
    kl_cells = torch.where(cell & (m > 0), m * (logm_s - logp_s), 0).sum(-1)
    mb, pb = torch.where(bucket, m, 0).sum(-1), torch.where(bucket, p, 0).sum(-1)
    kl_bucket = torch.where(mb > 0, mb * (mb.log() - pb.log()), 0)
    return tv, kl_cells + kl_bucket


def _fast(logp, logm, in_set, ids, valid, order, n):
    """What the trainer computes, in float32: π and µ at the cells, the kept set as a size (n ≤ K) or its ids."""
    lp32, lm32 = logp.float(), logm.float()
    cells_p, cells_m = lp32.gather(1, ids), lm32.gather(1, ids)
    if n <= K:
        size = torch.full((N,), n, dtype=torch.int64)
        check_kept_size(size, K)
        members = torch.cat([prefix_members(size, K), torch.zeros(N, 1, dtype=torch.bool)], -1)
        mass_p, mass_m = set_log_mass(cells_p, members), set_log_mass(cells_m, members)
        set_size = None
    else:  # the set's ids (sorted by µ), as an engine records a set larger than its top-K
        kept_ids = order[:, :n]
        full = torch.ones(N, n, dtype=torch.bool)
        mass_p, mass_m = set_log_mass(lp32.gather(1, kept_ids), full), set_log_mass(lm32.gather(1, kept_ids), full)
        members = valid & in_set.gather(1, ids)
        set_size = torch.full((N,), n, dtype=torch.int64)
    return cells_p, cells_m, members, mass_p, mass_m, set_size


@pytest.mark.parametrize("n", [0, 1, K, K + 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replayed_logp_and_divergences_equal_the_float64_reference(n, seed):
    logp, logm, in_set, a, ids, valid, order = _case(n, seed)
    logp_s, logm_s = _restricted(logp, in_set), _restricted(logm, in_set)
    cells_p, cells_m, members, mass_p, mass_m, set_size = _fast(logp, logm, in_set, ids, valid, order, n)

    lp_a = replay(logp.float().gather(1, a[:, None])[:, 0], mass_p)
    lm_a = replay(logm.float().gather(1, a[:, None])[:, 0], mass_m)
    ref_p, ref_m = logp_s.gather(1, a[:, None])[:, 0], logm_s.gather(1, a[:, None])[:, 0]
    assert (lp_a.double() - ref_p).abs().max() < 1e-6 and (lm_a.double() - ref_m).abs().max() < 1e-6
    assert (binary_tv(lp_a, lm_a).double() - (ref_m.exp() - ref_p.exp()).abs()).abs().max() < 1e-6

    tv = kept_topk_tv(cells_p, cells_m, valid, members, mass_p, mass_m, set_size)
    kl = kept_topk_kl(cells_p, cells_m, valid, members, mass_p, mass_m, set_size)
    ref_tv, ref_kl = _reference_topk(logp_s, logm_s, in_set, ids, valid)
    assert (tv.double() - ref_tv).abs().max() < 2e-6
    assert (kl.double() - ref_kl).abs().max() < 2e-6
    if 0 < n <= K:  # the kept set lies inside the cells: Top-K over it is the exact divergence, no bucket
        assert (tv.double() - full_tv(logp_s, logm_s)).abs().max() < 2e-6
        assert (kl.double() - full_kl(logp_s, logm_s)).abs().max() < 2e-6
    else:  # a bucket is left (the untruncated other bucket, or the set's mass outside the cells): a lower bound
        assert bool((tv.double() <= full_tv(logp_s, logm_s) + 1e-6).all())
        assert bool((tv.double() < full_tv(logp_s, logm_s) - 1e-4).any())


def test_at_step_0_replay_removes_the_truncation_bias_and_without_it_every_ratio_is_low():
    """π = µ (trainer weights = engine weights): with replay log π_S(a) − log µ_S(a) is 0 to float noise; without,
    log π(a) − log µ_S(a) = log µ(S) < 0 on every truncated token: the ratio biased low by the tail's mass."""
    logp, _, in_set, a, ids, valid, order = _case(K, 3)
    _, cells_m, members, _, mass_m, _ = _fast(logp, logp, in_set, ids, valid, order, K)
    lm_a = replay(logp.float().gather(1, a[:, None])[:, 0], mass_m)
    lp_a = logp.float().gather(1, a[:, None])[:, 0]
    assert (replay(lp_a, mass_m) - lm_a).abs().max() == 0
    bias = lp_a - lm_a
    assert bool((bias < -1e-3).all()) and torch.allclose(bias, mass_m)


def test_sizes_outside_the_recorded_cells_are_refused():
    with pytest.raises(ValueError, match=r"kept_size: each value must be in \[0, 5\]"):
        check_kept_size(torch.tensor([1, 6]), K)
    with pytest.raises(ValueError, match="kept_size: expected dtype torch.int64"):
        check_kept_size(torch.tensor([1.0]), K)
