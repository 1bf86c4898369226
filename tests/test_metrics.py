"""dppo.metrics: each statistic against a slow reference (python loops over tokens, float64 `math`), on hand-made
and random batches, zero-count cases, and exact aggregation over micro-batch splits (`merge` of the parts equals
the whole batch)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dppo.losses import loss_spec, policy_loss
from dppo.metrics import (MAXIMA, MU_BUCKETS, WEIGHTS, from_sums, masked_mu_histogram, masked_mu_shares, masked_shares,
                          merge, mismatch_stats, per_group_sums, ratio_stats, to_sums, token_mean, token_mismatch)

PROPS = settings(max_examples=30, deadline=None)


# --------------------------------------------------------------------------------------------------- batches
def make_batch(seed: int, B: int = 5, T: int = 7, V: int = 12, K: int = 3, dtype=torch.float64) -> dict:
    """A batch as the trainer sees it: µ and π full distributions over V, a token sampled from µ, µ's K+1 cells
    (top-K by µ, then the sampled token when outside them), a ragged response mask (one empty row when B > 2),
    one advantage per sequence (some 0), a random keep mask, NaN µ at the padding."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2, -1)
    pi = torch.softmax(mu.log() + torch.randn(B, T, V, generator=g, dtype=torch.float64) * 0.7, -1)
    tokens = torch.multinomial(mu.reshape(-1, V), 1, generator=g).reshape(B, T)
    top = mu.topk(K, -1).indices
    in_top = (top == tokens[..., None]).any(-1)
    ids = torch.cat([top, torch.where(in_top, 0, tokens)[..., None]], -1)
    valid = torch.cat([torch.ones_like(top, dtype=torch.bool), ~in_top[..., None]], -1)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    if B > 2:
        lengths[1] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rollout_logp = mu.gather(-1, tokens[..., None])[..., 0].log()
    return {
        "logp": pi.gather(-1, tokens[..., None])[..., 0].log().to(dtype),
        "rollout_logp": torch.where(mask, rollout_logp, float("nan")).to(dtype),
        "response_mask": mask,
        "logp_cells": pi.gather(-1, ids).log().to(dtype),
        "rollout_cells": torch.where(valid, mu.gather(-1, ids).log(), 0.0).to(dtype),
        "cells_valid": valid,
        "adv": torch.randint(-1, 2, (B,), generator=g).to(dtype),
        "keep": torch.rand(B, T, generator=g) < 0.6,
        "group_index": torch.randint(-1, 4, (B,), generator=g),
    }


def tokens(batch: dict):
    """(b, t) of every response token, the order of the references' loops."""
    B, T = batch["response_mask"].shape
    return [(b, t) for b in range(B) for t in range(T) if batch["response_mask"][b, t]]


# --------------------------------------------------------------------------------------------------- references
def ref_token(batch: dict, b: int, t: int) -> dict[str, float]:
    p, m = math.exp(float(batch["logp"][b, t])), math.exp(float(batch["rollout_logp"][b, t]))
    out = {"binary_tv": abs(m - p),
           "binary_kl": m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p)),
           "log_ratio_gt_log2": float(abs(math.log(p) - math.log(m)) > math.log(2))}
    cells = [(math.exp(float(batch["logp_cells"][b, t, j])), math.exp(float(batch["rollout_cells"][b, t, j])))
             for j in range(batch["cells_valid"].shape[-1]) if batch["cells_valid"][b, t, j]]
    other_p, other_m = 1 - sum(c[0] for c in cells), 1 - sum(c[1] for c in cells)
    cells.append((other_p, other_m))
    out["topk_tv"] = 0.5 * sum(abs(cm - cp) for cp, cm in cells)
    out["topk_kl"] = sum(cm * math.log(cm / cp) for cp, cm in cells if cm > 0)
    return out


def ref_mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def ref_mismatch(batch: dict) -> dict[str, float]:
    per = [ref_token(batch, b, t) for b, t in tokens(batch)]
    names = {"binary_tv": "binary_tv_mean", "binary_kl": "binary_kl_mean", "log_ratio_gt_log2": "log_ratio_gt_log2_frac",
             "topk_tv": "topk_tv_mean", "topk_kl": "topk_kl_mean"}
    return {**{new: ref_mean([x[old] for x in per]) for old, new in names.items()}, "n_tokens": float(len(per))}


def ref_shares(batch: dict) -> dict[str, float]:
    masked, pos, neg = [], [], []
    for b, t in tokens(batch):
        dropped = float(not batch["keep"][b, t])
        masked.append(dropped)
        if batch["adv"][b] > 0:
            pos.append(dropped)
        if batch["adv"][b] < 0:
            neg.append(dropped)
    return {"masked_frac": ref_mean(masked), "masked_frac_pos": ref_mean(pos), "masked_frac_neg": ref_mean(neg),
            "n_tokens": float(len(masked)), "n_pos": float(len(pos)), "n_neg": float(len(neg))}


def ref_ratio(batch: dict, is_cap: float) -> dict[str, float]:
    logs = [min(float(batch["logp"][b, t]) - float(batch["rollout_logp"][b, t]), 20.0) for b, t in tokens(batch)]
    ratios = [math.exp(x) for x in logs]
    return {"ratio_mean": ref_mean(ratios), "ratio_above_cap_frac": ref_mean([float(r > is_cap) for r in ratios]),
            "abs_log_ratio_mean": ref_mean([abs(x) for x in logs]), "ratio_max": max(ratios, default=0.0),
            "abs_log_ratio_max": max([abs(x) for x in logs], default=0.0), "n_tokens": float(len(logs))}


def ref_histogram(batch: dict, edges=MU_BUCKETS) -> list[float]:
    counts = [0.0] * (len(edges) + 1)
    for b, t in tokens(batch):
        if not batch["keep"][b, t]:
            mu = math.exp(float(batch["rollout_logp"][b, t]))
            counts[sum(mu > e for e in edges)] += 1
    return counts


def ref_groups(batch: dict, values, n_groups: int) -> tuple[list[float], list[float]]:
    sums, counts = [0.0] * n_groups, [0.0] * n_groups
    for b, t in tokens(batch):
        j = int(batch["group_index"][b])
        if 0 <= j < n_groups:
            sums[j] += float(values[b, t])
            counts[j] += 1
    return sums, counts


def assert_matches(got: dict, want: dict, **tol) -> None:
    assert set(got) == set(want)
    for key in want:
        torch.testing.assert_close(got[key].double(), torch.tensor(want[key], dtype=torch.float64), msg=key, **tol)


def mismatch_inputs(batch: dict, cells: bool = True) -> dict:
    keys = ("logp", "rollout_logp", "response_mask") + (("logp_cells", "rollout_cells", "cells_valid") if cells else ())
    return {k: batch[k] for k in keys}


def split(batch: dict, bounds: list[int]) -> list[dict]:
    """The batch cut along B at `bounds` (micro-batches; some may be empty of response tokens)."""
    edges = [0, *bounds, batch["response_mask"].shape[0]]
    return [{k: v[lo:hi] for k, v in batch.items()} for lo, hi in zip(edges, edges[1:])]


# --------------------------------------------------------------------------------------------------- per function
@pytest.mark.parametrize("seed", range(4))
def test_mismatch_stats_against_reference(seed):
    batch = make_batch(seed)
    assert_matches(mismatch_stats(**mismatch_inputs(batch)), ref_mismatch(batch))
    without = {k: v for k, v in ref_mismatch(batch).items() if not k.startswith("topk")}
    assert_matches(mismatch_stats(**mismatch_inputs(batch, cells=False)), without)


def test_mismatch_stats_float32_inputs():
    """float32 inputs (the trainer's): the float64 reference within float32's default tolerances."""
    batch = make_batch(7, dtype=torch.float32)
    got = mismatch_stats(**mismatch_inputs(batch))
    assert got["binary_tv_mean"].dtype == torch.float32
    assert_matches(got, ref_mismatch(batch))


def test_mismatch_hand_computed():
    """µ = 0.5, π = 0.2 on one token, the other token padding: TV 0.3, KL = .5 ln(.5/.2) + .5 ln(.5/.8), |log r| =
    ln 2.5 > ln 2."""
    logp = torch.tensor([[math.log(0.2), 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[math.log(0.5), float("nan")]], dtype=torch.float64)
    got = mismatch_stats(logp, rollout, torch.tensor([[True, False]]))
    kl = 0.5 * math.log(0.5 / 0.2) + 0.5 * math.log(0.5 / 0.8)
    assert_matches(got, {"binary_tv_mean": 0.3, "binary_kl_mean": kl, "log_ratio_gt_log2_frac": 1.0, "n_tokens": 1.0})


def test_token_mismatch_is_per_token():
    batch = make_batch(3)
    per = token_mismatch(batch["logp"], batch["rollout_logp"], logp_cells=batch["logp_cells"],
                         rollout_cells=batch["rollout_cells"], cells_valid=batch["cells_valid"])
    for b, t in tokens(batch):
        want = ref_token(batch, b, t)
        for key, value in want.items():
            torch.testing.assert_close(per[key][b, t], torch.tensor(value, dtype=torch.float64), msg=key)
    with pytest.raises(ValueError, match="logp_cells"):
        token_mismatch(batch["logp"], batch["rollout_logp"], logp_cells=batch["logp_cells"])


@pytest.mark.parametrize("seed", range(4))
def test_masked_shares_against_reference(seed):
    batch = make_batch(seed)
    assert_matches(masked_shares(batch["keep"], batch["adv"], batch["response_mask"]), ref_shares(batch))
    per_token_adv = batch["adv"][:, None].expand_as(batch["logp"])  # [B, T] advantages: the same
    assert_matches(masked_shares(batch["keep"], per_token_adv, batch["response_mask"]), ref_shares(batch))


def test_masked_shares_hand_computed():
    """Three tokens: Â>0 masked, Â>0 kept, Â<0 masked; a padding token (masked) and an Â=0 token (masked)."""
    keep = torch.tensor([[False, True, True], [False, False, False]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert_matches(masked_shares(keep, adv, mask), {"masked_frac": 0.75, "masked_frac_pos": 0.5, "masked_frac_neg": 1.0,
                                                    "n_tokens": 4.0, "n_pos": 2.0, "n_neg": 1.0})


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("is_cap", [1.2, math.inf])
def test_ratio_stats_against_reference(seed, is_cap):
    batch = make_batch(seed)
    assert_matches(ratio_stats(batch["logp"], batch["rollout_logp"], batch["response_mask"], is_cap=is_cap),
                   ref_ratio(batch, is_cap))


def test_ratio_clamped_before_exp():
    got = ratio_stats(torch.tensor([[0.0]]), torch.tensor([[-50.0]]), torch.tensor([[True]]), is_cap=10.0)
    assert_matches(got, {"ratio_mean": math.exp(20), "ratio_above_cap_frac": 1.0, "abs_log_ratio_mean": 20.0,
                         "ratio_max": math.exp(20), "abs_log_ratio_max": 20.0, "n_tokens": 1.0})


def test_losses_metrics_agree():
    """policy_loss's own masked shares and ratio statistics are the same quantities."""
    batch = make_batch(5, dtype=torch.float32)
    mu = batch["rollout_logp"].nan_to_num(0.0)
    _, stats = policy_loss(batch["logp"], mu, batch["adv"], batch["response_mask"],
                           loss_spec(trust_region="dppo_binary_tv", is_cap=1.5, delta_low=0.05, delta_high=0.05))
    shares = masked_shares(stats["keep"], batch["adv"], batch["response_mask"])
    ratio = ratio_stats(batch["logp"], mu, batch["response_mask"], is_cap=1.5)
    for key, value in {**shares, **ratio}.items():
        if key in stats:
            torch.testing.assert_close(value, stats[key], msg=key)


@pytest.mark.parametrize("seed", range(4))
def test_masked_mu_histogram_against_reference(seed):
    batch = make_batch(seed)
    got = masked_mu_histogram(batch["keep"], batch["rollout_logp"], batch["response_mask"])
    torch.testing.assert_close(got, torch.tensor(ref_histogram(batch)))
    edges = (0.05, 0.3)
    got = masked_mu_histogram(batch["keep"], batch["rollout_logp"], batch["response_mask"], edges)
    torch.testing.assert_close(got, torch.tensor(ref_histogram(batch, edges)))


def test_masked_mu_histogram_hand_computed():
    """µ on an edge goes to the bucket below it (edges[i−1] < µ ≤ edges[i])."""
    mu = torch.tensor([[1e-4, 1e-3, 0.05, 0.5, 0.9, 0.9]]).log()
    keep = torch.tensor([[False, False, False, False, False, True]])
    counts = masked_mu_histogram(keep, mu, torch.ones_like(keep))
    torch.testing.assert_close(counts, torch.tensor([2.0, 0.0, 1.0, 1.0, 1.0]))
    shares = masked_mu_shares(counts)
    assert list(shares) == ["masked_mu_0-0.001", "masked_mu_0.001-0.01", "masked_mu_0.01-0.1", "masked_mu_0.1-0.5",
                            "masked_mu_0.5-1"]
    torch.testing.assert_close(torch.stack(list(shares.values())), torch.tensor([0.4, 0.0, 0.2, 0.2, 0.2]))


@pytest.mark.parametrize("seed", range(4))
def test_per_group_sums_against_reference(seed):
    batch = make_batch(seed)
    tv = token_mismatch(batch["logp"], batch["rollout_logp"])["binary_tv"]  # NaN at padding: must not leak
    for values in (tv, ~batch["keep"]):
        sums, counts = per_group_sums(values, batch["response_mask"], batch["group_index"], 3)
        want_sums, want_counts = ref_groups(batch, values, 3)
        torch.testing.assert_close(sums.double(), torch.tensor(want_sums, dtype=torch.float64))
        torch.testing.assert_close(counts.double(), torch.tensor(want_counts, dtype=torch.float64))


# --------------------------------------------------------------------------------------------------- zero counts
def test_zero_counts():
    """No response token (or none with Â>0 / Â<0): every mean, count and maximum is 0, nothing is NaN."""
    batch = make_batch(0)
    batch["response_mask"] = torch.zeros_like(batch["response_mask"])
    results = {**mismatch_stats(**mismatch_inputs(batch)),
               **masked_shares(batch["keep"], batch["adv"], batch["response_mask"]),
               **ratio_stats(batch["logp"], batch["rollout_logp"], batch["response_mask"], is_cap=2.0)}
    for key, value in results.items():
        assert value.item() == 0.0, key
    assert token_mean(batch["logp"], batch["response_mask"])[0].item() == 0.0
    counts = masked_mu_histogram(batch["keep"], batch["rollout_logp"], batch["response_mask"])
    assert counts.tolist() == [0.0] * (len(MU_BUCKETS) + 1)
    assert all(v.item() == 0.0 for v in masked_mu_shares(counts).values())
    sums, n = per_group_sums(batch["logp"], batch["response_mask"], batch["group_index"], 4)
    assert sums.tolist() == n.tolist() == [0.0] * 4
    shares = masked_shares(torch.zeros(2, 2, dtype=torch.bool), torch.tensor([1.0, 0.0]), torch.ones(2, 2, dtype=torch.bool))
    assert (shares["masked_frac_neg"].item(), shares["n_neg"].item(), shares["masked_frac_pos"].item()) == (0.0, 0.0, 1.0)
    empty = torch.zeros(0, 3)
    assert ratio_stats(empty, empty, empty.bool(), is_cap=2.0)["ratio_max"].item() == 0.0


def test_group_outside_range_counts_nowhere():
    values, mask = torch.ones(3, 2), torch.ones(3, 2, dtype=torch.bool)
    sums, counts = per_group_sums(values, mask, torch.tensor([0, 2, -1]), 2)
    assert sums.tolist() == counts.tolist() == [2.0, 0.0]


# --------------------------------------------------------------------------------------------------- aggregation
def all_stats(batch: dict) -> dict:
    return {**mismatch_stats(**mismatch_inputs(batch)),
            **masked_shares(batch["keep"], batch["adv"], batch["response_mask"]),
            **ratio_stats(batch["logp"], batch["rollout_logp"], batch["response_mask"], is_cap=1.3)}


@PROPS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 8), data=st.data())
def test_merge_of_micro_batches_equals_whole(seed, B, data):
    """Means weighted by their counts, counts and sums added, maxima maxed: the parts give the whole batch's values,
    also for micro-batches without response tokens (or without Â>0 tokens)."""
    batch = make_batch(seed, B=B)
    bounds = sorted(data.draw(st.lists(st.integers(0, B), max_size=3)))
    parts = split(batch, bounds)
    torch.testing.assert_close(merge([all_stats(p) for p in parts]), all_stats(batch))
    hist = sum(masked_mu_histogram(p["keep"], p["rollout_logp"], p["response_mask"]) for p in parts)
    torch.testing.assert_close(hist, masked_mu_histogram(batch["keep"], batch["rollout_logp"], batch["response_mask"]))
    groups = [per_group_sums(~p["keep"], p["response_mask"], p["group_index"], 3) for p in parts]
    whole = per_group_sums(~batch["keep"], batch["response_mask"], batch["group_index"], 3)
    torch.testing.assert_close(sum(g[0] for g in groups), whole[0])
    torch.testing.assert_close(sum(g[1] for g in groups), whole[1])


def test_sums_round_trip():
    stats = all_stats(make_batch(2))
    torch.testing.assert_close(from_sums(to_sums(stats)), stats)
    assert set(WEIGHTS.values()) <= set(stats) and set(MAXIMA) <= set(stats)
    assert all(key in WEIGHTS or key in MAXIMA or key.startswith("n_") for key in stats)


def test_metric_names():
    """The keys callers log (the trainer as mismatch/<key>, trust_region/<key>, ratio/...) do not change."""
    batch = make_batch(1)
    assert set(mismatch_stats(**mismatch_inputs(batch))) == {
        "binary_tv_mean", "binary_kl_mean", "log_ratio_gt_log2_frac", "topk_tv_mean", "topk_kl_mean", "n_tokens"}
    assert set(masked_shares(batch["keep"], batch["adv"], batch["response_mask"])) == {
        "masked_frac", "masked_frac_pos", "masked_frac_neg", "n_tokens", "n_pos", "n_neg"}


def test_pass_at_k_matches_a_hand_computation_and_the_enumeration_of_every_k_subset():
    """Chen et al.'s unbiased estimator: n = 4 samples, c = 1 right, k = 2: 1 − C(3, 2)/C(4, 2) = 1 − 3/6 = 0.5 by
    hand; for every n ≤ 7, c ≤ n, k ≤ n it equals the share of the k-subsets of the n samples holding a right one."""
    import itertools

    from dppo.metrics import pass_at_k, pass_at_k_values

    assert pass_at_k(torch.tensor([1]), 4, 2).item() == 0.5
    assert pass_at_k(torch.tensor([2]), 4, 2).item() == pytest.approx(1 - 1 / 6, abs=1e-15)
    for n in range(1, 8):
        for k in range(1, n + 1):
            got = pass_at_k(torch.arange(n + 1), n, k)
            for c in range(n + 1):
                subsets = list(itertools.combinations([i < c for i in range(n)], k))
                assert got[c].item() == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12), (n, c, k)
    assert pass_at_k(torch.tensor([3, 0]), 8, 1).tolist() == pytest.approx([3 / 8, 0.0], abs=1e-15)  # the share right
    assert pass_at_k_values(8) == [1, 2, 4, 8] and pass_at_k_values(6) == [1, 2, 4, 6] and pass_at_k_values(1) == [1]
    with pytest.raises(ValueError, match="k: expected 1 <= k <= n"):
        pass_at_k(torch.tensor([1]), 4, 5)
    with pytest.raises(ValueError, match="correct: counts"):
        pass_at_k(torch.tensor([5]), 4, 2)
