"""The field's mismatch corrections as dppo computes them, each checked against its source framework's formula written
out here by hand from that framework's code (file and line cited in `dppo.trust_region`, `dppo.sequence_mask` and
`dppo.loss_spec.IS_WEIGHTS`): token MIS / IcePop (TRL, slime, verl, SkyRL), token TIS in the rollout-correction form
(verl, TRL), GSPO (TRL, verl) and the geometric sequence mask (SkyRL). The comparisons are of gradients with respect to
log π, computed by autograd through each reference loss and through `policy_loss`, in float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from dppo.losses import TokenInputs, loss_spec, policy_loss
from dppo.train.presets import get_preset

F64 = torch.float64


def _batch(seed: int, B: int = 5, T: int = 7, spread: float = 0.3):
    """log µ, log π_old and log π at sampled tokens (π_old and π near µ), left-aligned responses, Â [B] of both signs."""
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    old = (mu + torch.randn(B, T, generator=g, dtype=F64) * spread).clamp(max=-1e-3)
    pi = (old + torch.randn(B, T, generator=g, dtype=F64) * spread).clamp(max=-1e-3)
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    adv = torch.randn(B, generator=g, dtype=F64)
    return mu, old, pi, mask, adv


def _grad(loss_fn, pi):
    logp = pi.clone().requires_grad_(True)
    loss_fn(logp).backward()
    return logp.grad


def _dppo_grad(pi, mu, adv, mask, old=None, **settings):
    spec = loss_spec(**settings)
    return _grad(lambda lp: policy_loss(lp, mu, adv, mask, spec, TokenInputs(old_logp=old))[0], pi)


def _token_mean(per_token, mask):
    return (per_token * mask).sum() / mask.sum()


def _seq_mean_token_mean(per_token, mask):  # TRL's loss_type="grpo", verl's "seq-mean-token-mean"
    return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()


def _ppo(logp, old, adv, eps_low, eps_high):
    """−min(ρÂ, clip(ρ)Â) per token, ρ = π/π_old (the sources' clipped surrogate, without verl's dual clip)."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    return -torch.min(ratio * a, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * a)


@pytest.mark.parametrize("seed", range(4))
def test_icepop_is_trl_and_slime_masked_importance_sampling(seed):
    """TRL `vllm_importance_sampling_mode="token_mask"` (grpo_trainer.py 1.16 L2660-2704, L3146-3147) and slime's
    `icepop_function` (loss.py L908-931): the weight q = π_old/µ inside [low, high], 0 outside, multiplies the
    clipped surrogate on π/π_old. In dppo: token_mis, the recompute anchor, is_weight "decoupled" with C ≥ high."""
    mu, old, pi, mask, adv = _batch(seed, spread=0.5)
    low, high, eps_low, eps_high = 0.5, 2.0, 0.2, 0.28

    def trl(logp):
        q = torch.exp(old - mu)
        q = q.masked_fill((q < low) | (q > high), 0.0)
        return _token_mean(_ppo(logp, old, adv, eps_low, eps_high) * q, mask)

    q = torch.exp(old - mu)[mask]
    assert ((q < low) | (q > high)).any() and ((q >= low) & (q <= high)).any()  # both kinds of token are present
    ours = _dppo_grad(pi, mu, adv, mask, old, trust_region="token_mis", anchor="recompute", is_weight="decoupled",
                      is_cap=high, aggregation="token-mean", mis_low=low, mis_high=high, eps_low=eps_low, eps_high=eps_high)
    assert_close(ours, _grad(trl, pi))


@pytest.mark.parametrize("seed", range(4))
def test_token_mis_is_skyrl_and_verl_rejection_mask(seed):
    """SkyRL `token_mask_is_threshold_low/high` (off_policy_correction_utils.py L170-179) and verl
    `rollout_rs="token_k1"` with symmetric bounds (rollout_corr_helper.py L221-222, L271-275): a 0/1 mask on π_old/µ,
    no IS weight, the PPO surrogate on π/π_old. In dppo: token_mis, recompute anchor, is_weight "anchor", C = inf.
    Under the rollout anchor (verl's bypass mode, π_old := µ) the same mask reads π/µ."""
    mu, old, pi, mask, adv = _batch(seed, spread=0.5)

    def skyrl(logp, old=old):
        q = torch.exp(old - mu)
        keep = ((q >= 0.5) & (q <= 2.0)).to(F64)
        return _token_mean(_ppo(logp, old, adv, 0.2, 0.28) * keep, mask)

    ours = _dppo_grad(pi, mu, adv, mask, old, trust_region="token_mis", anchor="recompute", is_weight="anchor",
                      is_cap=math.inf, aggregation="token-mean")
    assert_close(ours, _grad(skyrl, pi))
    bypass = _dppo_grad(pi, mu, adv, mask, trust_region="token_mis", is_cap=math.inf, aggregation="token-mean")

    def bypass_ref(logp):
        q = torch.exp(logp.detach() - mu)
        keep = ((q >= 0.5) & (q <= 2.0)).to(F64)
        return _token_mean(_ppo(logp, mu, adv, 0.2, 0.28) * keep, mask)

    assert_close(bypass, _grad(bypass_ref, pi))


def test_token_mis_masks_both_sides_whatever_the_advantage():
    """By hand, rollout anchor, ε = inf (no clip): q = π/µ of 0.4, 0.5, 2.0, 2.1 with Â > 0 and Â < 0 alike."""
    from dppo.trust_region import token_mis

    mu = torch.full((1, 8), 0.2, dtype=F64)
    pi = torch.tensor([[0.08, 0.1, 0.4, 0.42] * 2], dtype=F64)
    adv = torch.tensor([[1.0] * 4 + [-1.0] * 4], dtype=F64)
    keep = token_mis(pi.log(), mu.log(), adv, torch.ones(1, 8, dtype=torch.bool), None, rollout_logp=mu.log(),
                     old_logp=None, mis_low=0.5, mis_high=2.0, eps_low=math.inf, eps_high=math.inf)
    assert keep.tolist() == [[False, True, True, False] * 2]


@pytest.mark.parametrize("seed", range(4))
def test_decoupled_token_tis_is_verl_rollout_is_token(seed):
    """verl `rollout_is="token"` (rollout_corr_helper.py L530-534, L562-566; core_algos.py L1238-1239): the clipped
    surrogate on π/π_old times the detached min(π_old/µ, C); the same as TRL's "token_truncate" and SkyRL's/slime's
    token TIS. In dppo: ppo_clip, the recompute anchor, is_weight "decoupled" (the `tis` preset). Ratios stay below
    verl's dual clip (3), which dppo does not have."""
    mu, old, pi, mask, adv = _batch(seed, spread=0.3)
    C = 1.3  # (verl's default is 2.0; lower here so that the cap binds on some tokens of every seed)

    def verl(logp):
        w = torch.exp(old - mu).clamp(max=C).detach()
        return _token_mean(_ppo(logp, old, adv, 0.2, 0.28) * w, mask)

    assert float(torch.exp(pi - old)[mask].max()) < 3.0 and bool((torch.exp(old - mu)[mask] > C).any())
    ours = _dppo_grad(pi, mu, adv, mask, old, trust_region="ppo_clip", anchor="recompute", is_weight="decoupled",
                      is_cap=C, aggregation="token-mean")
    assert_close(ours, _grad(verl, pi))


def test_dppo_cap_equals_decoupled_tis_on_policy_and_differs_after_an_update():
    """On the first mini-batch (π = π_old) DPPO's min(π/µ, C) is the decoupled min(π_old/µ, C)·π/π_old; once π moved,
    a token with π_old/µ < C < π/µ is capped by DPPO and not by the decoupled form."""
    mu, old, pi, mask, adv = _batch(7, spread=0.4)
    settings = dict(trust_region="ppo_clip", anchor="recompute", is_cap=1.5, aggregation="token-mean")
    same = [_dppo_grad(old, mu, adv, mask, old, is_weight=w, **settings) for w in ("policy", "decoupled")]
    assert_close(same[0], same[1])
    moved = [_dppo_grad(pi, mu, adv, mask, old, is_weight=w, **settings) for w in ("policy", "decoupled")]
    between = mask & (torch.exp(old - mu) < 1.5) & (torch.exp(pi - mu) > 1.5) & (moved[1] != 0)
    assert between.any() and not torch.allclose(moved[0][between], moved[1][between])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.08)])
def test_gspo_is_trl_sequence_level_importance_sampling(seed, eps):
    """TRL `importance_sampling_level="sequence"` (grpo_trainer.py 1.16 L3083-3095, L3113-3120): s = exp(masked mean of
    log π − log π_old), −min(sÂ, clip(s)Â), loss_type "grpo" (seq-mean-token-mean); the gradient flows through s.
    verl's `compute_policy_loss_gspo` (core_algos.py L1286-1313) writes it as sg(s)·π_t/sg(π_t): the same gradient.
    In dppo: the gspo region (weight "sequence"), anchored at π_old (recompute) or at µ."""
    mu, old, pi, mask, adv = _batch(seed, spread=0.02)
    eps_low, eps_high = eps

    def trl(logp, old=old):
        s = torch.exp(((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1))[:, None]
        per_token = -torch.min(s * adv[:, None], torch.clamp(s, 1 - eps_low, 1 + eps_high) * adv[:, None])
        return _seq_mean_token_mean(per_token.expand_as(logp), mask)

    def verl(logp, old=old):
        kl_seq = ((logp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        s = torch.exp((logp - logp.detach() + kl_seq.detach()[:, None]).clamp(max=10.0))
        per_token = torch.maximum(-adv[:, None] * s, -adv[:, None] * torch.clamp(s, 1 - eps_low, 1 + eps_high))
        return _seq_mean_token_mean(per_token, mask)

    for anchor, ref_old in (("recompute", old), ("rollout", mu)):
        ours = _dppo_grad(pi, mu, adv, mask, old if anchor == "recompute" else None, trust_region="gspo",
                          anchor=anchor, is_cap=math.inf, aggregation="seq-mean-token-mean", eps_low=eps_low,
                          eps_high=eps_high)
        reference = _grad(lambda lp: trl(lp, ref_old), pi)
        assert_close(ours, reference)
        assert_close(_grad(lambda lp: verl(lp, ref_old), pi), reference)
        if eps == (0.05, 0.08):
            assert (ours != 0).any()  # some sequences are inside the clip range: the comparison is not of zeros


def test_gspo_per_turn_units_and_the_preset():
    """With sequence_unit "turn", each turn of an episode has its own s_u and clip: a turn that moved past 1 + ε is
    dropped, the other turn of the same response is not."""
    mu = torch.log(torch.full((1, 4), 0.5, dtype=F64))
    pi = torch.log(torch.tensor([[0.5, 0.5, 0.6, 0.6]], dtype=F64))  # turn 0 unmoved, turn 1 s = 1.2
    turns = torch.tensor([[0, 0, 1, 1]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    adv = torch.tensor([1.0], dtype=F64)
    spec = loss_spec(trust_region="gspo", sequence_unit="turn", eps_low=0.1, eps_high=0.1)
    _, metrics = policy_loss(pi, mu, adv, mask, spec, TokenInputs(turn_index=turns, n_turns=2))
    assert metrics["keep"].tolist() == [[True, True, False, False]]
    per_response = policy_loss(pi, mu, adv, mask, loss_spec(trust_region="gspo", eps_low=0.1, eps_high=0.1))[1]
    assert per_response["keep"].tolist() == [[True] * 4]  # s = sqrt(1.2) ≈ 1.095 for the whole response
    preset = get_preset("gspo").loss.spec()
    assert (preset.trust_region, preset.is_weight, preset.aggregation, dict(preset.params)) == \
        ("gspo", "sequence", "seq-mean-token-mean", {"eps_low": 3e-4, "eps_high": 4e-4})


@pytest.mark.parametrize("anchor", ["recompute", "rollout"])
def test_geometric_sequence_mask_is_skyrl_geo_mask(anchor):
    """SkyRL `sequence_mask_metric="geometric"` (off_policy_correction_utils.py L220-236): a response is dropped when
    exp(mean log(π_old/µ)) leaves [geo_mask_low, geo_mask_high] = [0.99, 1.01]; in dppo sequence_mask "geometric"
    with δ 0.01 (π/µ under the rollout anchor), composed with the PPO clip."""
    mu, old, pi, mask, adv = _batch(3, B=12, spread=0.025)
    num = old if anchor == "recompute" else pi
    geo = torch.exp(((num - mu) * mask).sum(-1) / mask.sum(-1))
    keep_seq = (geo >= 0.99) & (geo <= 1.01)
    assert keep_seq.any() and (~keep_seq).any(), geo

    def skyrl(logp):
        ref = old if anchor == "recompute" else mu
        return _token_mean(_ppo(logp, ref, adv, 0.2, 0.28) * keep_seq[:, None].to(F64), mask)

    ours = _dppo_grad(pi, mu, adv, mask, old if anchor == "recompute" else None, trust_region="ppo_clip",
                      anchor=anchor, is_weight="anchor", is_cap=math.inf, aggregation="token-mean",
                      sequence_mask="geometric")
    assert_close(ours, _grad(skyrl, pi))
    assert get_preset("geo-mask").loss.spec().sequence_delta == 0.01


def test_presets_and_refusals():
    assert get_preset("icepop").loss.spec().params["mis_low"] == 0.5
    tis = get_preset("tis").loss.spec()
    assert (tis.anchor, tis.is_weight, tis.is_cap) == ("recompute", "decoupled", 2.0)
    with pytest.raises(ValueError, match=r"^is_weight: 'decoupled' weighs by the truncated π_old/µ, which needs "
                                         r"π_old: set anchor='recompute'"):
        loss_spec(is_weight="decoupled")
    with pytest.raises(ValueError, match=r"^is_weight: unknown value 'seq'"):
        loss_spec(is_weight="seq")
    with pytest.raises(ValueError, match=r"^mis_low: expected > 0"):
        loss_spec(trust_region="token_mis", mis_low=0.0)
