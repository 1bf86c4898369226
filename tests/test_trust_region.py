"""Tests of dppo.trust_region (Eq. 12 and the baselines' rules). The shared tests are parametrised over `TRUST_REGIONS`,
so a new entry gets them for free (it only needs `REQUIRED` below if it has a parameter without default); each region
also has a hand-computed case."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dppo.divergence import binary_kl, topk_kl, topk_tv
from dppo.losses import AGGREGATIONS, TokenInputs, loss_spec, policy_loss
from dppo.sequence_mask import unit_index
from dppo.trust_region import (TRUST_REGIONS, cppo, dppo_binary_kl, dppo_binary_tv, dppo_topk_tv, ppo_clip,
                               ppo_clip_relax)

F64 = torch.float64
PROPS = settings(max_examples=40, deadline=None)
REGIONS = sorted(TRUST_REGIONS)
REQUIRED = {"relax_alpha": 0.1}
"""Values for the parameters some regions require (default None)."""
STALENESS = torch.tensor(3.0, dtype=F64)
"""The version lag the regions that read one (`TrustRegion.inputs`) get where a test gives none."""


_INPUT_FIELDS = {f.name for f in dataclasses.fields(TokenInputs)}
_CALL_FIELDS = ("max_response_len", "denominator")


def flat_loss(fn, logp, rollout_logp, adv, mask, **kwargs):
    """`fn` (a `LOSSES` entry) called with one flat dict of keyword arguments, as the parametrised tests build them:
    the settings go to `loss_spec`, the per-token tensors to `TokenInputs`, max_response_len/denominator to the call."""
    inputs = {k: kwargs.pop(k) for k in list(kwargs) if k in _INPUT_FIELDS}
    call = {k: kwargs.pop(k) for k in _CALL_FIELDS if k in kwargs}
    return fn(logp, rollout_logp, adv, mask, loss_spec(**kwargs), TokenInputs(**inputs), **call)


def region_params(name: str) -> dict:
    return {k: REQUIRED[k] if v is None else v for k, v in TRUST_REGIONS[name].defaults.items()}


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    # Not torch.log_softmax: on this 2-core machine its CPU kernel sometimes took ~15 ms per tiny call
    # inside pytest (thread contention), which made the property tests slow. Same values in float64.
    return x - x.logsumexp(-1, keepdim=True)


def make_batch(seed: int, B: int = 4, T: int = 6, *, V: int = 8, K: int = 3, spread: float = 1.0, dtype=F64) -> dict:
    """A batch built from real distributions: µ and π (and π_old) over V tokens at each position, the
    sampled token a ~ µ, log-probs at a, Top-K cells (µ's top-K ∪ {a}, an unused slot marked invalid) and
    their TV/KL. Responses are left-aligned with random lengths (row 0 may be empty); adv [B] of both signs
    and some zeros."""
    g = torch.Generator().manual_seed(seed)
    mu_logits = torch.randn(B, T, V, generator=g, dtype=F64) * 2
    lmu = log_softmax(mu_logits)
    lpi = log_softmax(mu_logits + torch.randn(B, T, V, generator=g, dtype=F64) * spread)
    lold = log_softmax(mu_logits + torch.randn(B, T, V, generator=g, dtype=F64) * spread)
    a = torch.multinomial(lmu.exp().reshape(-1, V), 1, generator=g).reshape(B, T)
    top = lmu.topk(K, -1).indices
    in_top = (top == a[..., None]).any(-1)
    ids = torch.cat([top, torch.where(in_top, top[..., 0], a)[..., None]], -1)
    valid = torch.cat([torch.ones_like(top, dtype=torch.bool), (~in_top)[..., None]], -1)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[1:] = lengths[1:].clamp(min=1)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g, dtype=F64)
    adv[torch.rand(B, generator=g) < 0.2] = 0.0
    staleness = torch.randint(0, 9, (B, T), generator=g)
    pick = lambda lq: lq.gather(-1, a[..., None])[..., 0].to(dtype)  # noqa: E731
    cells_mu, cells_pi = lmu.gather(-1, ids).to(dtype), lpi.gather(-1, ids).to(dtype)
    return dict(
        logp=pick(lpi), rollout_logp=pick(lmu), old_logp=pick(lold), adv=adv.to(dtype), mask=mask, staleness=staleness,
        topk_tv=topk_tv(cells_pi, cells_mu, valid), topk_kl=topk_kl(cells_pi, cells_mu, valid),
    )


def divergence_for(name: str, batch: dict):
    kind = TRUST_REGIONS[name].divergence
    return batch[kind] if kind in ("topk_tv", "topk_kl") else None


def inputs_for(name: str, batch: dict) -> dict:
    """The extra tensors a region reads (`TrustRegion.inputs`: the batch's per-token staleness)."""
    return {k: batch.get(k, STALENESS) for k in TRUST_REGIONS[name].inputs}


def reads_for(name: str, batch: dict, mask=None) -> dict:
    """What a region takes from the loss itself (`TrustRegion.reads`), as `policy_loss` gives it under the rollout
    anchor: µ's log-probs, no π_old, one unit per response."""
    mask = batch["mask"] if mask is None else mask
    have = {"rollout_logp": batch["rollout_logp"], "old_logp": None, "units": unit_index(mask)}
    return {k: have[k] for k in TRUST_REGIONS[name].reads}


def call_region(name: str, batch: dict, logp=None, anchor=None):
    logp = batch["logp"] if logp is None else logp
    anchor = batch["rollout_logp"] if anchor is None else anchor
    adv = batch["adv"][:, None].expand_as(logp)
    return TRUST_REGIONS[name].fn(logp, anchor, adv, batch["mask"], divergence_for(name, batch),
                                  **{k: v.expand_as(logp) for k, v in inputs_for(name, batch).items()},
                                  **reads_for(name, batch), **region_params(name))


batch_args = dict(seed=st.integers(0, 2**31 - 1), spread=st.sampled_from([0.1, 0.5, 1.5, 4.0]))


# ------------------------------------------------------------------------------------------------
# Shared tests, parametrised over the registry
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REGIONS)
def test_keep_is_bool_shaped_and_detached(name):
    batch = make_batch(0, spread=2.0)
    logp = batch["logp"].clone().requires_grad_(True)
    keep = call_region(name, batch, logp=logp)
    assert keep.dtype == torch.bool and keep.shape == logp.shape
    assert not keep.requires_grad and keep.grad_fn is None


@pytest.mark.parametrize("name", [n for n in REGIONS if not TRUST_REGIONS[n].masks_toward])
@PROPS
@given(**batch_args)
def test_never_masks_a_move_back_toward_the_anchor(name, seed, spread):
    batch = make_batch(seed, spread=spread)
    keep = call_region(name, batch)
    toward = batch["adv"][:, None] * (batch["logp"] - batch["rollout_logp"]) <= 0
    assert keep[toward & batch["mask"]].all()


@pytest.mark.parametrize("name", [n for n in REGIONS if n != "none"])
def test_region_masks_a_large_move_away(name):
    # Non-vacuity of the shared tests: every real trust region keeps µ = 0.3 -> π = 0.30003 (Â > 0; r − 1 = 1e-4,
    # inside even GSPO's ε of 4e-4), and
    # masks µ = 0.3 -> π = 0.95 with Â > 0 and µ = 0.7 -> π = 0.05 with Â < 0.
    # Each token is a one-token response, so sequence-level regions (GSPO) decide on it alone.
    mu, pi = torch.tensor([[0.3], [0.3], [0.7]], dtype=F64), torch.tensor([[0.30003], [0.95], [0.05]], dtype=F64)
    batch = dict(logp=pi.log(), rollout_logp=mu.log(), adv=torch.tensor([1.0, 1.0, -1.0], dtype=F64),
                 mask=torch.ones(3, 1, dtype=torch.bool))
    batch["topk_tv"] = (mu - pi).abs()  # a two-cell partition: TV = |µ − π|
    batch["topk_kl"] = binary_kl(pi.log(), mu.log())
    adv = batch["adv"][:, None]
    keep = TRUST_REGIONS[name].fn(pi.log(), mu.log(), adv, batch["mask"], divergence_for(name, batch),
                                  **{k: v.expand_as(adv) for k, v in inputs_for(name, batch).items()},
                                  **reads_for(name, batch), **region_params(name))
    negatives_only = name == "pg_is_neg_mask"  # Fig. 5's mask leaves positive samples alone by design
    assert keep.tolist() == [[True], [negatives_only], [False]]


def test_pg_is_neg_mask_by_hand():
    # masked iff Â < 0 and µ − π ≥ δ (0.5 by default): µ − π = 0.6 (masked), 0.4 (kept), 0.6 with Â > 0 (kept),
    # π above µ with Â < 0 (kept); δ = 0.3 masks the 0.4 drop too.
    mu, pi = torch.tensor([[0.7, 0.5, 0.7, 0.2]], dtype=F64), torch.tensor([[0.1, 0.1, 0.1, 0.9]], dtype=F64)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=F64)
    mask = torch.ones(1, 4, dtype=torch.bool)
    fn = TRUST_REGIONS["pg_is_neg_mask"].fn
    assert fn(pi.log(), mu.log(), adv, mask, None, neg_delta=0.5).tolist() == [[False, True, True, True]]
    assert fn(pi.log(), mu.log(), adv, mask, None, neg_delta=0.3).tolist() == [[False, False, True, True]]
    assert TRUST_REGIONS["pg_is_neg_mask"].defaults == {"neg_delta": 0.5}


def reference_weight(kind: str, logp, rollout_logp, anchor_logp, mask) -> torch.Tensor:
    """The uncapped importance weight of `kind` (dppo.loss_spec.IS_WEIGHTS) by hand, one token at a time and one
    response at a time (a float64 loop, the slow reference of dppo.losses._weight)."""
    B, T = logp.shape
    out = torch.zeros(B, T, dtype=F64)
    for b in range(B):
        active = [t for t in range(T) if mask[b, t]]
        seq = math.exp(sum(float(logp[b, t] - anchor_logp[b, t]) for t in active) / max(len(active), 1))
        for t in range(T):
            pi, mu, old = (math.exp(float(x[b, t])) for x in (logp, rollout_logp, anchor_logp))
            out[b, t] = {"policy": pi / mu, "anchor": pi / old, "decoupled": (old / mu) * (pi / old),
                         "sequence": seq}[kind]
    return out


def _expected_scale(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """d loss / d ℓ_t for each aggregation mode, by hand."""
    maskf = mask.to(F64)
    n_tok, n_seq = maskf.sum().clamp(min=1), mask.any(-1).sum().clamp(min=1)
    T = mask.shape[-1]
    if aggregation == "token-mean":
        return maskf / n_tok
    if aggregation == "seq-mean-token-mean":
        return maskf / maskf.sum(-1, keepdim=True).clamp(min=1) / n_seq
    if aggregation == "seq-mean-token-sum":
        return maskf / n_seq
    return maskf / T / n_seq


@pytest.mark.parametrize("name", REGIONS)
@PROPS
@given(**batch_args, aggregation=st.sampled_from(AGGREGATIONS), is_cap=st.sampled_from([2.0, 10.0, math.inf]))
def test_policy_gradient_is_zero_where_masked_and_weighted_where_kept(name, seed, spread, aggregation, is_cap):
    batch = make_batch(seed, spread=spread)
    logp = batch["logp"].clone().requires_grad_(True)
    loss, _ = flat_loss(policy_loss, logp, batch["rollout_logp"], batch["adv"], batch["mask"], trust_region=name,
                        divergence=divergence_for(name, batch), is_cap=is_cap, aggregation=aggregation,
                        **{k: v for k, v in REQUIRED.items() if k in TRUST_REGIONS[name].defaults},
                        **inputs_for(name, batch))
    loss.backward()
    keep = call_region(name, batch)
    mask = batch["mask"]
    w = reference_weight(loss_spec(trust_region=name, **{k: v for k, v in REQUIRED.items()
                                                          if k in TRUST_REGIONS[name].defaults}).is_weight,
                         batch["logp"], batch["rollout_logp"], batch["rollout_logp"], mask)
    expected = -torch.clamp(w, max=is_cap) * batch["adv"][:, None] * _expected_scale(mask, aggregation)
    expected = torch.where(keep & mask, expected, torch.zeros_like(expected))
    assert (logp.grad[~(keep & mask)] == 0).all()  # exactly zero, not merely small
    assert_close(logp.grad, expected)


# ------------------------------------------------------------------------------------------------
# DPPO (Eq. 12)
# ------------------------------------------------------------------------------------------------


def _tokens(mu, pi, adv):
    mu, pi = torch.tensor([mu], dtype=F64), torch.tensor([pi], dtype=F64)
    return pi.log(), mu.log(), torch.tensor([adv], dtype=F64), torch.ones_like(mu, dtype=torch.bool)


def test_dppo_binary_tv_hand_case():
    # Masked iff p − m > δ_high (Â > 0) or m − p > δ_low (Â < 0); δ_low = 0.10, δ_high = 0.20.
    cases = [  # (m, p, Â, keep)
        (1e-4, 1e-2, +1.0, True),   # spec example: r = 100, but TV 0.0099
        (0.99, 0.80, -1.0, False),  # spec example: r ≈ 0.81, TV 0.19 > δ_low
        (0.99, 0.80, +1.0, True),   # the same move with Â > 0 goes back toward µ: never masked
        (0.20, 0.45, +1.0, False),  # p − m = 0.25 > 0.20
        (0.20, 0.35, +1.0, True),   # 0.15 ≤ 0.20
        (0.50, 0.35, -1.0, False),  # m − p = 0.15 > 0.10
        (0.50, 0.45, -1.0, True),   # 0.05 ≤ 0.10
        (0.50, 0.80, -1.0, True),   # Â < 0 and π went up: toward µ's side for that sign
        (0.10, 0.90, 0.0, True),    # Â = 0: kept (its term is zero anyway)
    ]
    lp, lm, adv, mask = _tokens(*zip(*[c[:3] for c in cases]))
    keep = dppo_binary_tv(lp, lm, adv, mask, None, delta_low=0.10, delta_high=0.20)
    assert keep.tolist() == [[c[3] for c in cases]]
    # Plain PPO clip on the two spec examples does the opposite (r-based): masks the first, keeps the second.
    keep_ppo = ppo_clip(lp, lm, adv, mask, None, eps_low=0.2, eps_high=0.28)
    assert keep_ppo[0, :2].tolist() == [False, True]


@PROPS
@given(**batch_args, delta_low=st.floats(0.01, 0.5), delta_high=st.floats(0.01, 0.5))
def test_dppo_binary_tv_matches_the_probability_difference_rule(seed, spread, delta_low, delta_high):
    b = make_batch(seed, spread=spread)
    adv = b["adv"][:, None].expand_as(b["logp"])
    keep = dppo_binary_tv(b["logp"], b["rollout_logp"], adv, b["mask"], None, delta_low=delta_low, delta_high=delta_high)
    p, m = b["logp"].exp(), b["rollout_logp"].exp()
    masked = ((adv > 0) & (p - m > delta_high)) | ((adv < 0) & (m - p > delta_low))
    assert torch.equal(keep, ~masked)


def test_dppo_binary_kl_hand_case():
    kl = lambda m, p: m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p))  # noqa: E731
    cases = [(0.5, 0.7, +1.0), (0.5, 0.6, +1.0), (0.5, 0.3, -1.0), (0.5, 0.45, -1.0), (0.5, 0.3, +1.0)]
    assert [kl(m, p) > 0.05 for m, p, _ in cases] == [True, False, True, False, True]
    lp, lm, adv, mask = _tokens(*zip(*cases))
    keep = dppo_binary_kl(lp, lm, adv, mask, None, delta_low=0.05, delta_high=0.05)
    assert keep.tolist() == [[False, True, False, True, True]]  # the last moves toward µ


def test_dppo_topk_uses_the_given_divergence():
    lp, lm, adv, mask = _tokens([0.3, 0.3, 0.3, 0.3], [0.35, 0.25, 0.35, 0.25], [1.0, 1.0, 1.0, -1.0])
    div = torch.tensor([[0.2, 0.2, 0.1, 0.2]], dtype=F64)
    keep = dppo_topk_tv(lp, lm, adv, mask, div, delta_low=0.15, delta_high=0.15)
    assert keep.tolist() == [[False, True, True, False]]


@PROPS
@given(**batch_args)
def test_topk_masks_contain_binary_masks(seed, spread):
    # Top-K cells contain the sampled token, so D_topk ≥ D_binary (refinement) and every token masked by
    # DPPO-Binary is masked by DPPO-Top-K at the same δ.
    b = make_batch(seed, spread=spread)
    for binary, topk, kind in (("dppo_binary_tv", "dppo_topk_tv", "topk_tv"), ("dppo_binary_kl", "dppo_topk_kl", "topk_kl")):
        keep_b, keep_k = call_region(binary, b), call_region(topk, b)
        assert not (~keep_b & keep_k & b["mask"]).any(), kind


# ------------------------------------------------------------------------------------------------
# PPO clip, relax-α
# ------------------------------------------------------------------------------------------------


@PROPS
@given(
    seed=st.integers(0, 2**31 - 1), aggregation=st.sampled_from(AGGREGATIONS), per_token_adv=st.booleans(),
    eps_low=st.floats(0.05, 0.5), eps_high=st.floats(0.05, 0.5), scale=st.sampled_from([0.05, 0.3, 1.0]),
)
def test_ppo_clip_mask_gives_the_clipped_objective_gradient(seed, aggregation, per_token_adv, eps_low, eps_high, scale):
    g = torch.Generator().manual_seed(seed)
    B, T = 5, 7
    rollout_logp = -torch.rand(B, T, generator=g, dtype=F64) * 4
    logp0 = rollout_logp + torch.randn(B, T, generator=g, dtype=F64) * scale
    adv = torch.randn(B, T, generator=g, dtype=F64) if per_token_adv else torch.randn(B, generator=g, dtype=F64)
    mask = torch.rand(B, T, generator=g) < 0.8
    # Ours: detached ratio, mask, IS cap off.
    logp = logp0.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, rollout_logp, adv, mask, loss_spec(trust_region="ppo_clip", eps_low=eps_low,
                                                                   eps_high=eps_high, is_cap=math.inf,
                                                                   aggregation=aggregation))
    (grad,) = torch.autograd.grad(loss, logp)
    # Classic PPO: −min(r·A, clip(r, 1 − ε_low, 1 + ε_high)·A), r with gradient, same aggregation by hand.
    logp = logp0.clone().requires_grad_(True)
    r = torch.exp(logp - rollout_logp)
    A = adv if per_token_adv else adv[:, None]
    obj = -torch.minimum(r * A, torch.clamp(r, 1 - eps_low, 1 + eps_high) * A)
    classic = (torch.where(mask, obj, torch.zeros_like(obj)) * _expected_scale(mask, aggregation)).sum()
    (grad_classic,) = torch.autograd.grad(classic, logp)
    assert_close(grad, grad_classic)


@pytest.mark.parametrize("side", ["high", "low", "both"])
@PROPS
@given(**batch_args, alpha=st.sampled_from([0.05, 0.2, 0.5]))
def test_relax_never_masks_rare_tokens_on_the_relaxed_side(side, seed, spread, alpha):
    b = make_batch(seed, spread=spread)
    adv = b["adv"][:, None].expand_as(b["logp"])
    keep = ppo_clip_relax(b["logp"], b["rollout_logp"], adv, b["mask"], None, eps_low=0.2, eps_high=0.28,
                          relax_alpha=alpha, relax_side=side)
    keep_ppo = ppo_clip(b["logp"], b["rollout_logp"], adv, b["mask"], None, eps_low=0.2, eps_high=0.28)
    rare = b["rollout_logp"].exp() < alpha
    on_side = {"high": adv > 0, "low": adv < 0, "both": adv != 0}[side]
    assert keep[rare & on_side].all()
    assert torch.equal(keep[~(rare & on_side)], keep_ppo[~(rare & on_side)])


def test_relax_hand_case():
    # µ = 0.01 -> π = 0.05 (r = 5) with Â > 0, and µ = 0.02 -> π = 0.002 (r = 0.1) with Â < 0: both
    # masked by PPO clip, both rare for α = 0.1; µ = 0.4 -> π = 0.9 (Â > 0) is not rare.
    lp, lm, adv, mask = _tokens([0.01, 0.02, 0.4], [0.05, 0.002, 0.9], [1.0, -1.0, 1.0])
    expect = {"high": [True, False, False], "low": [False, True, False], "both": [True, True, False]}
    for side, want in expect.items():
        keep = ppo_clip_relax(lp, lm, adv, mask, None, eps_low=0.2, eps_high=0.28, relax_alpha=0.1, relax_side=side)
        assert keep.tolist() == [want], side
    with pytest.raises(ValueError, match="relax_side"):
        ppo_clip_relax(lp, lm, adv, mask, None, eps_low=0.2, eps_high=0.28, relax_alpha=0.1, relax_side="up")


# ------------------------------------------------------------------------------------------------
# CPPO
# ------------------------------------------------------------------------------------------------

CPPO = dict(delta_low=0.15, delta_high=0.15, cppo_w_min=0.8, cppo_delta_b_min=0.02, cppo_q=0.9, cppo_k=1.0)


def test_cppo_hand_case():
    nan = float("nan")
    mu = torch.tensor([[0.3, 0.3, 0.3, nan], [0.3, 0.3, 0.3, nan], [0.5, 0.5, 0.5, 0.5], [0.3, nan, nan, nan]], dtype=F64)
    pi = torch.tensor([[0.4, 0.42, 0.35, nan], [0.4, 0.42, 0.25, nan], [0.38, 0.38, 0.38, 0.38], [0.6, nan, nan, nan]], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0], dtype=F64)[:, None].expand(4, 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    keep = cppo(pi.log(), mu.log(), adv, mask, None, **CPPO)
    # Row 0: D = (.10, .12, .05), w = (1, .9, .8), δ_b = clamp(q0.9(D) = .116, .02, .04) = .04.
    #   t1: Z .100 ≤ c = .15 keep; t2: Z .108 > c = min(.15, .15 + .04·1 − .10) = .09 mask;
    #   t3: Z .040 > c = .15 + .04·1.9 − .208 = .018 mask.
    # Row 1: as row 0 but token 3 moves back toward µ (p < m with Â > 0): kept.
    # Row 2: D = .12 × 4, Â < 0 and p < m, w = (1, .933, .867, .8), δ_b = .04:
    #   t1 .12 ≤ .15; t2 .112 > .07; t3 .104 > −.005; t4 .096 > −.074.
    # Row 3: one token (w = 1), D = .30 > .15: masked.
    want = [[True, False, False], [True, False, True], [True, False, False, False], [False]]
    assert [keep[i][mask[i]].tolist() for i in range(4)] == want


def cppo_reference(m, p, adv, *, delta_low, delta_high, cppo_w_min, cppo_delta_b_min, cppo_q, cppo_k):
    """The spec formula, one sequence of active tokens, in plain Python loops (numpy's linear quantile,
    torch's default interpolation too). w_1 = 1 for a one-token sequence (the formula's t = 1 value)."""
    n = len(m)
    D = [abs(a - b) for a, b in zip(m, p)]
    delta_b = min(max(cppo_k * float(np.quantile(D, cppo_q)), cppo_delta_b_min), 2 * cppo_delta_b_min)
    S = W = 0.0
    keep = []
    for t in range(1, n + 1):
        w = cppo_w_min + (1 - cppo_w_min) * (n - t) / (n - 1) if n > 1 else 1.0
        z = w * D[t - 1]
        delta = delta_high if adv[t - 1] > 0 else delta_low
        c = min(delta, delta + delta_b * W - S)
        keep.append(adv[t - 1] * (p[t - 1] - m[t - 1]) <= 0 or z <= c)
        S, W = S + z, W + w
    return keep


@PROPS
@given(**batch_args, w_min=st.sampled_from([0.5, 0.8, 1.0]), q=st.sampled_from([0.5, 0.9]),
       delta_b_min=st.sampled_from([0.005, 0.02, 0.05]), delta=st.sampled_from([0.05, 0.15]))
def test_cppo_matches_a_loop_reference(seed, spread, w_min, q, delta_b_min, delta):
    b = make_batch(seed, B=4, T=8, spread=spread)
    params = dict(delta_low=delta, delta_high=delta * 1.5, cppo_w_min=w_min, cppo_delta_b_min=delta_b_min, cppo_q=q, cppo_k=1.0)
    adv = b["adv"][:, None].expand_as(b["logp"])
    keep = cppo(b["logp"], b["rollout_logp"], adv, b["mask"], None, **params)
    m, p = b["rollout_logp"].exp(), b["logp"].exp()
    for i in range(4):
        act = b["mask"][i]
        if act.any():
            want = cppo_reference(m[i][act].tolist(), p[i][act].tolist(), adv[i][act].tolist(), **params)
            assert keep[i][act].tolist() == want


# ------------------------------------------------------------------------------------------------
# Anchor switch
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dppo_binary_tv", "ppo_clip"])
def test_recompute_anchor_masks_against_old_logp_but_weights_by_pi_over_mu(name):
    # Token 0: µ = 0.1, π_old = 0.5, π = 0.55 (far from µ, near π_old); token 1: µ = 0.5, π_old = 0.2, π = 0.5.
    mu = torch.tensor([[0.1, 0.5]], dtype=F64)
    old = torch.tensor([[0.5, 0.2]], dtype=F64)
    pi = torch.tensor([[0.55, 0.5]], dtype=F64)
    adv, mask = torch.tensor([2.0], dtype=F64), torch.ones(1, 2, dtype=torch.bool)
    grads = {}
    for anchor in ("rollout", "recompute"):
        logp = pi.log().requires_grad_(True)
        loss, metrics = policy_loss(logp, mu.log(), adv, mask,
                                    loss_spec(trust_region=name, anchor=anchor, aggregation="token-mean", is_cap=10.0),
                                    TokenInputs(old_logp=old.log()))
        loss.backward()
        grads[anchor] = logp.grad
    r = (pi / mu)[0]  # 5.5 and 1.0: the weight is π/µ under both anchors
    assert_close(grads["rollout"], torch.tensor([[0.0, -r[1] * 2.0 / 2]], dtype=F64))
    assert_close(grads["recompute"], torch.tensor([[-r[0] * 2.0 / 2, 0.0]], dtype=F64))
