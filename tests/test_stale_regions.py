"""Trust regions for stale data (dppo.trust_region: dppo_stale_*, dppo_sat_*), the sequence masks
(dppo.sequence_mask, loss.sequence_mask) and the mismatch split (dppo.metrics.mismatch_split): hand-computed cases,
reductions to DPPO, loop references. The registry's shared tests (tests/test_trust_region.py) cover the new regions
too (no gradient through the mask, exact zero gradient where masked, never masking a move back toward µ)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dppo.divergence import binary_kl, binary_tv
from dppo.losses import (TokenInputs, aggregation_denominator, batch_stat_values, batch_statistics, loss_spec,
                         policy_loss)
from dppo.metrics import mismatch_split
from dppo.sequence_mask import sequence_keep, unit_shares
from dppo.trust_region import (TRUST_REGIONS, dppo_binary_kl, dppo_binary_tv, dppo_sat_kl, dppo_sat_tv, dppo_stale_kl,
                               dppo_stale_tv, sat_tail, stale_delta)
from test_trust_region import make_batch

F64 = torch.float64
PROPS = settings(max_examples=30, deadline=None)
batch_args = dict(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.1, 0.5, 1.5, 4.0]))


def _adv(b):
    return b["adv"][:, None].expand_as(b["logp"])


def _probs(mu, pi):
    mu, pi = torch.tensor([mu], dtype=F64), torch.tensor([pi], dtype=F64)
    return pi.log(), mu.log(), torch.ones_like(mu, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------ staleness-adaptive δ


@PROPS
@given(**batch_args)
def test_stale_regions_are_dppo_for_fresh_tokens_and_for_alpha_zero(seed, spread):
    b = make_batch(seed, spread=spread)
    args = (b["logp"], b["rollout_logp"], _adv(b), b["mask"], None)
    fresh = torch.zeros_like(b["staleness"])
    for stale, plain, delta in ((dppo_stale_tv, dppo_binary_tv, 0.15), (dppo_stale_kl, dppo_binary_kl, 0.05)):
        want = plain(*args, delta_low=delta, delta_high=delta)
        assert torch.equal(stale(*args, staleness=fresh, delta_low=delta, delta_high=delta, stale_alpha=0.7), want)
        assert torch.equal(stale(*args, staleness=b["staleness"], delta_low=delta, delta_high=delta, stale_alpha=0.0), want)


@PROPS
@given(**batch_args, alpha=st.sampled_from([0.1, 0.25, 1.0]))
def test_a_staler_token_is_never_kept_where_a_fresher_one_is_masked(seed, spread, alpha):
    b = make_batch(seed, spread=spread)
    args = (b["logp"], b["rollout_logp"], _adv(b), b["mask"], None)
    keep = [dppo_stale_tv(*args, staleness=torch.full_like(b["staleness"], tau), delta_low=0.15, delta_high=0.15,
                          stale_alpha=alpha) for tau in range(6)]
    for fresher, staler in zip(keep, keep[1:]):
        assert not (staler & ~fresher).any()


def test_stale_tv_hand_case():
    # δ = 0.15, α = 0.25: δ(0) = 0.15, δ(4) = 0.15 / 2 = 0.075, δ(8) = 0.05. Â > 0 throughout.
    # µ .5 -> π .60 (TV .10): kept fresh, masked at τ = 4;  µ .5 -> π .57 (TV .07): kept at τ = 4, masked at τ = 8;
    # µ .5 -> π .40 (moved back toward µ under Â > 0): kept at any τ.
    logp, mu, mask = _probs([0.5, 0.5, 0.5], [0.60, 0.57, 0.40])
    adv = torch.ones_like(logp)
    assert_close(stale_delta(0.15, torch.tensor([0.0, 4.0, 8.0], dtype=F64), 0.25),
                 torch.tensor([0.15, 0.075, 0.05], dtype=F64))
    got = {tau: dppo_stale_tv(logp, mu, adv, mask, None, staleness=torch.full_like(logp, tau), delta_low=0.15,
                              delta_high=0.15, stale_alpha=0.25).tolist()[0] for tau in (0, 4, 8)}
    assert got == {0: [True, True, True], 4: [False, True, True], 8: [False, False, True]}


def test_stale_kl_uses_binary_kl():
    # µ .9 -> π .8 under Â < 0: Binary-KL 0.0457 (computed below); δ = 0.05 keeps it fresh, δ(2) = 0.05/1.5 masks it.
    logp, mu, mask = _probs([0.9], [0.8])
    kl = float(binary_kl(logp, mu))
    assert kl == pytest.approx(0.9 * math.log(0.9 / 0.8) + 0.1 * math.log(0.1 / 0.2))
    adv = -torch.ones_like(logp)
    keep = lambda tau: dppo_stale_kl(logp, mu, adv, mask, None, staleness=torch.full_like(logp, tau), delta_low=0.05,  # noqa: E731
                                     delta_high=0.05, stale_alpha=0.25).item()
    assert keep(0) and not keep(2)


def test_policy_loss_needs_staleness_for_the_stale_regions():
    b = make_batch(3)
    with pytest.raises(ValueError, match=r"^staleness: required by trust_region 'dppo_stale_tv'"):
        policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"], loss_spec(trust_region="dppo_stale_tv"))
    with pytest.raises(ValueError, match=r"^staleness: expected shape \[B\] or \[B, T\]"):
        policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                    loss_spec(trust_region="dppo_stale_tv"),
                    TokenInputs(staleness=torch.zeros(2, 2)))
    # [B], [B, T] and one value give the same loss when they say the same thing
    per_row = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                          loss_spec(trust_region="dppo_stale_tv"),
                          TokenInputs(staleness=torch.full((4,), 2)))[0]
    per_token = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                            loss_spec(trust_region="dppo_stale_tv"),
                            TokenInputs(staleness=torch.full((4, 6), 2)))[0]
    one = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                      loss_spec(trust_region="dppo_stale_tv"),
                      TokenInputs(staleness=torch.tensor(2)))[0]
    assert per_row == per_token == one
    # regions that read no staleness ignore it
    plain = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"])[0]
    assert plain == policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                                loss_spec(),
                                TokenInputs(staleness=torch.full((4,), 9)))[0]


# ------------------------------------------------------------------------------------------------ SAT-like tail


def _sat_case():
    # ten tokens, µ = .5: nine move to .52 (|log r| .039, TV .02), one to .60 (|log r| .182, TV .10).
    # The 0.9-quantile of |log r| interpolates to .053: only the tenth token is in the tail.
    return _probs([0.5] * 10, [0.52] * 9 + [0.60])


def test_sat_tail_hand_case():
    logp, mu, mask = _sat_case()
    assert sat_tail(logp, mu, mask, 0.9).tolist() == [[False] * 9 + [True]]
    mask2 = mask.clone()
    mask2[0, 9] = False  # an inactive token is never in the tail, and the quantile is over active tokens only
    assert not sat_tail(logp, mu, mask2, 0.9).any()


def test_sat_tv_contracts_only_the_advantage_side_in_the_tail():
    logp, mu, mask = _sat_case()
    kw = dict(delta_low=0.15, delta_high=0.15, sat_quantile=0.9)
    pos = torch.ones_like(logp)
    # Â > 0, the tail token rose by TV .10: DPPO keeps it (.10 < .15), κ = .5 masks it (.10 > .075)
    assert dppo_sat_tv(logp, mu, pos, mask, None, sat_shrink=0.5, **kw).tolist() == [[True] * 9 + [False]]
    assert dppo_sat_tv(logp, mu, pos, mask, None, sat_shrink=0.7, **kw).all()  # .10 < .105
    # Â < 0: the rise is a move the update reverses (toward µ): never masked, whatever κ
    assert dppo_sat_tv(logp, mu, -pos, mask, None, sat_shrink=0.1, **kw).all()
    # Â < 0 and the tail token fell by .10 instead: the lower side is the one contracted
    down, mu2, _ = _probs([0.5] * 10, [0.48] * 9 + [0.40])
    assert dppo_sat_tv(down, mu2, -pos, mask, None, sat_shrink=0.5, **kw).tolist() == [[True] * 9 + [False]]


@PROPS
@given(**batch_args)
def test_sat_regions_are_dppo_with_no_contraction_or_no_tail(seed, spread):
    b = make_batch(seed, spread=spread)
    args = (b["logp"], b["rollout_logp"], _adv(b), b["mask"], None)
    for sat, plain, delta in ((dppo_sat_tv, dppo_binary_tv, 0.15), (dppo_sat_kl, dppo_binary_kl, 0.05)):
        want = plain(*args, delta_low=delta, delta_high=delta)
        assert torch.equal(sat(*args, delta_low=delta, delta_high=delta, sat_quantile=0.9, sat_shrink=1.0), want)
        # every token with the same |log r| (exactly: dyadic values): nothing is strictly above the quantile, no tail
        anchor = torch.round(b["rollout_logp"] * 1024) / 1024
        flat = (anchor + 0.0625, anchor, _adv(b), b["mask"], None)
        assert ((flat[0] - anchor) == 0.0625).all()
        assert torch.equal(sat(*flat, delta_low=delta, delta_high=delta, sat_quantile=0.9, sat_shrink=0.2),
                           plain(*flat, delta_low=delta, delta_high=delta))


@PROPS
@given(**batch_args, kappa=st.sampled_from([0.2, 0.5, 0.9]))
def test_sat_masks_a_superset_of_dppo_and_only_in_the_tail(seed, spread, kappa):
    b = make_batch(seed, spread=spread)
    args = (b["logp"], b["rollout_logp"], _adv(b), b["mask"], None)
    plain = dppo_binary_tv(*args, delta_low=0.15, delta_high=0.15)
    sat = dppo_sat_tv(*args, delta_low=0.15, delta_high=0.15, sat_quantile=0.8, sat_shrink=kappa)
    tail = sat_tail(b["logp"], b["rollout_logp"], b["mask"], 0.8)
    assert not (sat & ~plain).any()
    assert not ((plain & ~sat) & ~tail).any()


@pytest.mark.parametrize("region", ["dppo_sat_tv", "dppo_sat_kl"])
@pytest.mark.parametrize("cuts", [[1, 2, 3], [2]])
def test_sat_batch_statistic_makes_micro_batches_sum_to_the_batch(region, cuts):
    """With the batch statistic (the tail quantile) computed over the whole batch (`batch_stat_values` of each
    micro-batch, joined, then `batch_statistics`) and passed to every micro-batch, the micro-batches' losses sum to
    the whole batch's, gradient included; with each micro-batch's own quantile they do not (the split changes the
    tail). κ = 0: a tail token is masked once π moved with its advantage; a spread of 0.3 leaves most tokens inside
    DPPO's δ, so the tail decides (for this seed the per-micro-batch tail differs in every case)."""
    b = make_batch(0, B=4, T=6, spread=0.3)
    b["mask"][:, :2] = True
    spec = loss_spec(trust_region=region, sat_shrink=0.0, aggregation="token-mean")
    denom = aggregation_denominator(b["mask"], "token-mean")
    rows = list(zip([0] + cuts, cuts + [4]))
    values = [batch_stat_values(spec, b["logp"][lo:hi], b["rollout_logp"][lo:hi], b["mask"][lo:hi]) for lo, hi in rows]
    stats = batch_statistics(spec, {k: torch.cat([v[k].reshape(-1) for v in values]) for k in values[0]})
    assert set(stats) == {"sat_threshold"} and stats["sat_threshold"].dim() == 0

    def split_loss(batch_stats):
        logp = b["logp"].clone().requires_grad_(True)
        total = sum(policy_loss(logp[lo:hi], b["rollout_logp"][lo:hi], b["adv"][lo:hi], b["mask"][lo:hi], spec,
                                TokenInputs(batch_stats=batch_stats), denominator=denom)[0] for lo, hi in rows)
        total.backward()
        return total, logp.grad

    logp = b["logp"].clone().requires_grad_(True)
    whole, _ = policy_loss(logp, b["rollout_logp"], b["adv"], b["mask"], spec)  # the call is the batch
    whole.backward()
    split, grad = split_loss(stats)
    assert_close(split, whole)
    assert_close(grad, logp.grad)
    per_micro, grad_per_micro = split_loss(None)  # each micro-batch's own quantile: the bug this guards against
    assert not torch.allclose(grad_per_micro, logp.grad)


def test_policy_loss_names_a_missing_batch_statistic():
    b = make_batch(3)
    with pytest.raises(ValueError, match=r"^batch_stats: sat_threshold required by trust_region 'dppo_sat_tv'"):
        policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"], loss_spec(trust_region="dppo_sat_tv"),
                    TokenInputs(batch_stats={}))


# ------------------------------------------------------------------------------------------------ sequence masks


def _loop_sequence_keep(logp, anchor, adv, mask, statistic, delta, sides, turn_index=None):
    """Obviously-correct reference: per row, per unit, a Python loop over its active tokens."""
    B, T = logp.shape
    keep = torch.ones(B, T, dtype=torch.bool)
    for b in range(B):
        turns = [0] * T if turn_index is None else turn_index[b].tolist()
        for u in sorted(set(turns)):
            toks = [t for t in range(T) if turns[t] == u and mask[b, t]]
            if not toks:
                continue
            p = [math.exp(float(logp[b, t])) for t in toks]
            m = [math.exp(float(anchor[b, t])) for t in toks]
            lr = [float(logp[b, t] - anchor[b, t]) for t in toks]
            if statistic == "max_divergence":
                s = max(abs(pi - mi) for pi, mi in zip(p, m))
            elif statistic == "mean_k3":
                s = sum(math.exp(x) - 1 - x for x in lr) / len(lr)
            else:
                s = sum(-x for x in lr) / len(lr)
            if s > delta and (sides == "both" or float(adv[b, toks[0]]) < 0):
                for t in range(T):
                    if turns[t] == u:
                        keep[b, t] = False
    return keep


@PROPS
@given(**batch_args, statistic=st.sampled_from(["max_divergence", "mean_k3", "mean_k1"]),
       delta=st.sampled_from([0.02, 0.1, 0.3]), sides=st.sampled_from(["both", "negative"]), turns=st.booleans())
def test_sequence_keep_matches_a_loop_reference(seed, spread, statistic, delta, sides, turns):
    b = make_batch(seed, spread=spread)
    turn_index = (torch.arange(6)[None, :] // 2).expand(4, 6).contiguous() if turns else None
    keep, _ = sequence_keep(b["logp"], b["rollout_logp"], b["adv"], b["mask"], statistic=statistic, delta=delta,
                            sides=sides, turn_index=turn_index)
    want = _loop_sequence_keep(b["logp"], b["rollout_logp"], _adv(b), b["mask"], statistic, delta, sides, turn_index)
    assert torch.equal(keep & b["mask"], want & b["mask"])


def test_sequence_mask_hand_case_and_its_shares():
    # Row 0 (Â > 0): µ .5 .9 .9 -> π .5 .4 .9: largest TV .5; mean k1 = log(.9/.4)/3 = .270.
    # Row 1 (Â < 0): µ .5 .5 .45 -> π .5 .5 .5, its third token padding: largest TV 0, k1 0.
    logp = torch.tensor([[0.5, 0.4, 0.9], [0.5, 0.5, 0.5]], dtype=F64).log()
    mu = torch.tensor([[0.5, 0.9, 0.9], [0.5, 0.5, 0.45]], dtype=F64).log()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    keep, stat = sequence_keep(logp, mu, adv, mask, statistic="max_divergence", delta=0.3)
    assert keep.tolist() == [[False] * 3, [True] * 3]
    assert_close(stat[0], torch.full((3,), 0.5, dtype=F64))
    _, stat = sequence_keep(logp, mu, adv, mask, statistic="mean_k1", delta=0.1, sides="negative")
    assert_close(stat[0, 0], torch.tensor(math.log(0.9 / 0.4) / 3, dtype=F64))
    shares = unit_shares(keep, adv, mask)
    assert {k: float(v) for k, v in shares.items()} == {
        "removed_frac_pos": 1.0, "removed_token_frac_pos": 1.0, "n_units_pos": 1.0, "n_tokens_pos": 3.0,
        "removed_frac_neg": 0.0, "removed_token_frac_neg": 0.0, "n_units_neg": 1.0, "n_tokens_neg": 2.0}
    # sides "negative": row 0 (Â > 0) is kept whatever its statistic
    assert sequence_keep(logp, mu, adv, mask, statistic="mean_k1", delta=0.1, sides="negative")[0].all()
    # per turn: turn 0 = token 0, turn 1 = tokens 1-2 of row 0; only turn 1 holds the large move
    turns = torch.tensor([[0, 1, 1], [0, 0, 0]])
    keep, _ = sequence_keep(logp, mu, adv, mask, statistic="max_divergence", delta=0.3, turn_index=turns)
    assert keep.tolist() == [[True, False, False], [True] * 3]
    shares = unit_shares(keep, adv, mask, turns)
    assert float(shares["removed_frac_pos"]) == 0.5 and float(shares["removed_token_frac_pos"]) == pytest.approx(2 / 3)


def test_policy_loss_sequence_mask_drops_whole_responses_and_composes_with_the_region():
    b = make_batch(11, spread=1.5)
    logp = b["logp"].clone().requires_grad_(True)
    loss, stats = policy_loss(logp, b["rollout_logp"], b["adv"], b["mask"],
                              loss_spec(sequence_mask="max_divergence", sequence_delta=0.3))
    loss.backward()
    region = dppo_binary_tv(b["logp"], b["rollout_logp"], _adv(b), b["mask"], None, delta_low=0.15, delta_high=0.15)
    seq, _ = sequence_keep(b["logp"], b["rollout_logp"], b["adv"], b["mask"], statistic="max_divergence", delta=0.3)
    assert (~seq & b["mask"]).any() and (seq & b["mask"]).any()  # the case is not vacuous: some rows go, some stay
    keep = region & seq
    assert torch.equal(stats["keep"], keep)
    assert (logp.grad[~keep] == 0).all() and (logp.grad[keep & b["mask"] & (_adv(b) != 0)] != 0).all()
    for key in ("seq_removed_frac_pos", "seq_removed_frac_neg", "seq_removed_token_frac_pos", "seq_n_units_neg"):
        assert key in stats
    # the max_divergence of a KL region reads Binary-KL: the same δ removes less than with Binary-TV here
    _, kl_stats = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                              loss_spec(trust_region="dppo_binary_kl", sequence_mask="max_divergence", sequence_delta=0.3))
    kl_seq, _ = sequence_keep(b["logp"], b["rollout_logp"], b["adv"], b["mask"], statistic="max_divergence", delta=0.3,
                              divergence=binary_kl(b["logp"], b["rollout_logp"]))
    assert torch.equal(kl_stats["keep"] & ~kl_seq, torch.zeros_like(kl_seq))


def test_sequence_mask_errors_name_the_setting():
    b = make_batch(1)
    with pytest.raises(ValueError, match="^sequence_mask: "):
        policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"], loss_spec(sequence_mask="max"))
    with pytest.raises(ValueError, match="^sequence_delta: expected a finite number"):
        policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                    loss_spec(sequence_mask="mean_k3", sequence_delta=math.inf))
    with pytest.raises(ValueError, match="^sequence_unit: "):
        policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"], loss_spec(sequence_unit="episode"))


# ------------------------------------------------------------------------------------------------ mismatch split


def test_mismatch_split_hand_case():
    # µ .5 .5 .2; π_old .6 .5 .2 (the engine's numerics/staleness); π .6 .2 .5 (this step's updates).
    mu = torch.tensor([[0.5, 0.5, 0.2]], dtype=F64).log()
    old = torch.tensor([[0.6, 0.5, 0.2]], dtype=F64).log()
    pi = torch.tensor([[0.6, 0.2, 0.5]], dtype=F64).log()
    mask = torch.ones(1, 3, dtype=torch.bool)
    keep = torch.tensor([[False, False, True]])  # tokens 0 (mismatch-driven) and 1 (update-driven) masked
    out = mismatch_split(pi, old, mu, mask, keep)
    assert out["mismatch/old_rollout_tv_mean"] == pytest.approx(0.1 / 3)
    assert out["mismatch/current_old_tv_mean"] == pytest.approx((0.0 + 0.3 + 0.3) / 3)
    assert out["trust_region/masked_frac_from_mismatch"] == pytest.approx(1 / 3)
    assert out["trust_region/masked_frac_from_update"] == pytest.approx(1 / 3)


@PROPS
@given(**batch_args)
def test_the_two_attributed_shares_add_up_to_the_masked_share(seed, spread):
    b = make_batch(seed, spread=spread)
    keep = dppo_binary_tv(b["logp"], b["rollout_logp"], _adv(b), b["mask"], None, delta_low=0.15, delta_high=0.15)
    out = mismatch_split(b["logp"], b["old_logp"], b["rollout_logp"], b["mask"], keep)
    masked = (~keep & b["mask"]).float().sum() / b["mask"].float().sum()
    assert_close(out["trust_region/masked_frac_from_mismatch"] + out["trust_region/masked_frac_from_update"],
                 masked.float())
    assert_close(out["mismatch/old_rollout_tv_mean"],
                 (binary_tv(b["old_logp"], b["rollout_logp"]) * b["mask"]).sum() / b["mask"].sum())


def test_registry_entries():
    assert TRUST_REGIONS["dppo_stale_tv"].inputs == ("staleness",) and TRUST_REGIONS["dppo_sat_tv"].inputs == ()
    assert TRUST_REGIONS["dppo_stale_kl"].defaults == {"delta_low": 0.05, "delta_high": 0.05, "stale_alpha": 0.5}
