"""Tests of dppo.advantages (App. C): each estimator on hand cases, properties shared by the registry,
zero-advantage groups, the RLOO identity and bad group sizes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dppo.advantages import ADVANTAGES, compute_advantages, group_mean, group_mean_batch_std, group_zscore, rloo

PROPS = settings(max_examples=60, deadline=None)
NAMES = sorted(ADVANTAGES)
EPS = 1e-6


def r(*values):
    return torch.tensor(values, dtype=torch.float32)


# Two prompts × G = 4: the first group mixed, the second all equal (0.1 is not exact in binary, so a naive
# "R − mean" could leave ±1 ulp there).
REWARDS = r(1.0, 0.0, 0.0, 1.0, 0.1, 0.1, 0.1, 0.1)


def test_group_mean_hand_case():
    adv, m = group_mean(REWARDS, 4)
    assert_close(adv, r(0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0))
    assert_close(m["zero_adv_group_frac"], torch.tensor(0.5))


def test_group_zscore_hand_case():
    # Group 1: mean 0.5, unbiased std sqrt(4 · 0.25 / 3) = 1/sqrt(3).
    adv, m = group_zscore(REWARDS, 4)
    z = 0.5 / (1 / math.sqrt(3) + EPS)
    assert_close(adv, r(z, -z, -z, z, 0, 0, 0, 0))
    assert_close(m["zero_adv_group_frac"], torch.tensor(0.5))


def test_rloo_hand_case():
    # 1 − mean(0, 0, 1) = 2/3; 0 − mean(1, 0, 1) = −2/3.
    adv, m = rloo(REWARDS, 4)
    assert_close(adv, r(2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0))
    adv, _ = rloo(r(3.0, 1.0), 2)  # G = 2: each minus the other
    assert_close(adv, r(2.0, -2.0))


def test_group_mean_batch_std_hand_case():
    # Centred: (.5, −.5, −.5, .5, 0, 0, 0, 0); batch std (unbiased, 8 values) = sqrt(4 · .25 / 7).
    adv, _ = group_mean_batch_std(REWARDS, 4)
    s = 0.5 / (math.sqrt(1 / 7) + EPS)
    assert_close(adv, r(s, -s, -s, s, 0, 0, 0, 0))


def test_compute_advantages_dispatches():
    for name in NAMES:
        assert_close(compute_advantages(name, REWARDS, 4)[0], ADVANTAGES[name](REWARDS, 4)[0])
    with pytest.raises(ValueError, match=r"unknown estimator 'grpo'; valid: .*group_mean"):
        compute_advantages("grpo", REWARDS, 4)


rewards_st = st.lists(st.sampled_from([0.0, 0.5, 1.0, -1.0, 0.1, 3.7]) | st.floats(-10, 10, width=32), min_size=1, max_size=24)


def _grouped(values, g):
    n = len(values) // g * g
    return torch.tensor(values[:n] or values[:g], dtype=torch.float32), g


@pytest.mark.parametrize("name", NAMES)
@PROPS
@given(values=rewards_st, g=st.integers(2, 6))
def test_registry_properties(name, values, g):
    if len(values) < g:
        values = values * g
    rewards, g = _grouped(values, g)
    adv, m = ADVANTAGES[name](rewards, g)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32 and torch.isfinite(adv).all()
    grouped, a = rewards.view(-1, g), adv.view(-1, g)
    flat = (grouped == grouped[:, :1]).all(-1)
    assert (a[flat] == 0).all()  # exactly zero, not merely small
    assert_close(m["zero_adv_group_frac"], flat.float().mean())
    assert_close(a.sum(-1), torch.zeros(a.shape[0]), atol=1e-4, rtol=0)  # centred per group (float32 sums)


@pytest.mark.parametrize("name", NAMES)
@PROPS
@given(values=st.lists(st.integers(-80, 80), min_size=2, max_size=24), g=st.integers(2, 6), shift=st.integers(-8, 8))
def test_registry_shift_invariance(name, values, g, shift):
    # Rewards on a 1/8 grid, so that the shift itself is exact in float32; the estimators then agree to
    # float32 rounding of the means (default tolerances).
    if len(values) < g:
        values = values * g
    rewards, g = _grouped([v / 8 for v in values], g)
    assert_close(ADVANTAGES[name](rewards + shift, g)[0], ADVANTAGES[name](rewards, g)[0])


@PROPS
@given(values=rewards_st, g=st.integers(2, 6))
def test_rloo_is_g_over_g_minus_one_times_group_mean(values, g):
    if len(values) < g:
        values = values * g
    rewards, g = _grouped(values, g)
    assert_close(rloo(rewards, g)[0], g / (g - 1) * group_mean(rewards, g)[0])


def test_single_response_groups():
    # G = 1: no baseline, the group is "all equal": zero advantage, counted. RLOO refuses.
    for name in ("group_mean", "group_zscore", "group_mean_batch_std"):
        adv, m = ADVANTAGES[name](r(1.0, 0.0, 2.0), 1)
        assert (adv == 0).all() and m["zero_adv_group_frac"].item() == 1.0
    with pytest.raises(ValueError, match=r"group_size: rloo needs >= 2"):
        rloo(r(1.0, 0.0), 1)


@pytest.mark.parametrize("name", NAMES)
def test_nan_reward_gives_nan_advantage(name):
    adv, _ = ADVANTAGES[name](r(1.0, float("nan"), 0.0, 1.0), 2)
    assert torch.isnan(adv[:2]).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "rewards, g, match",
    [
        (r(1.0, 0.0, 1.0), 2, r"group_size: 2 does not divide the number of rewards 3"),
        (r(1.0, 0.0), 0, r"group_size: expected an int >= 1, got 0"),
        (r(1.0, 0.0), -2, r"group_size: expected an int >= 1"),
        (r(1.0, 0.0), 2.0, r"group_size: expected an int >= 1, got 2.0"),
        (r(1.0, 0.0), "2", r"group_size: expected an int >= 1"),
        (torch.zeros(2, 2), 2, r"rewards: expected shape \[B\]"),
        (torch.zeros(4, dtype=torch.long), 2, r"rewards: expected a floating"),
        ([1.0, 0.0], 2, r"rewards: expected a torch.Tensor"),
    ],
)
def test_bad_input(name, rewards, g, match):
    with pytest.raises(ValueError, match=match):
        ADVANTAGES[name](rewards, g)
