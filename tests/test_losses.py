"""Tests of dppo.losses: Eq. 23 against its formula, the IS cap, the four aggregation modes, micro-batch invariance,
metrics, fp32 vs bf16, DRPO, NaN handling and the bad-input table."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_trust_region import REQUIRED, REGIONS, STALENESS, divergence_for, flat_loss, make_batch
from torch.testing import assert_close

from dppo.losses import LOSSES as LOSS_FNS
from dppo.losses import AGGREGATIONS, aggregate, aggregation_denominator, drpo_loss, loss_spec, policy_loss
from dppo.trust_region import TRUST_REGIONS

F32, F64 = torch.float32, torch.float64
NAN, INF = float("nan"), float("inf")
PROPS = settings(max_examples=40, deadline=None)


def tensor(rows, dtype=F64):
    return torch.tensor(rows, dtype=dtype)


def extra(name: str) -> dict:
    """Required parameters (no default) of a trust region, and the extra tensors it reads (a version lag of 3)."""
    inputs = {k: STALENESS for k in TRUST_REGIONS[name].inputs} if name in TRUST_REGIONS else {}
    return {**{k: v for k, v in REQUIRED.items() if k in TRUST_REGIONS[name].defaults}, **inputs}


# ------------------------------------------------------------------------------------------------
# Eq. 23: value and gradient, IS cap
# ------------------------------------------------------------------------------------------------


def test_eq23_value_and_gradient_hand_case():
    # DPPO-Binary-TV, δ = 0.15, C = 10, token-mean over 3 tokens:
    #   (µ .25 -> π .50, Â 1.5): TV .25 > .15 and π moved up with Â > 0: masked, ℓ = 0;
    #   (µ .40 -> π .20, Â 1.5): moved back toward µ: kept, r = .5;
    #   (µ .30 -> π .35, Â −2):  TV .05: kept, r = 7/6.
    mu, pi = [0.25, 0.40, 0.30], [0.50, 0.20, 0.35]
    adv = [1.5, 1.5, -2.0]
    logp = tensor([[math.log(p) for p in pi]]).requires_grad_(True)
    loss, _ = policy_loss(logp, tensor([[math.log(m) for m in mu]]), tensor([adv]), torch.ones(1, 3, dtype=torch.bool),
                          loss_spec(aggregation="token-mean"))
    loss.backward()
    keep = [0.0, 1.0, 1.0]
    r = [p / m for p, m in zip(pi, mu)]
    want = sum(-k * ri * a * math.log(p) for k, ri, a, p in zip(keep, r, adv, pi)) / 3
    assert_close(loss, torch.tensor(want, dtype=F64))
    assert_close(logp.grad, tensor([[-k * ri * a / 3 for k, ri, a in zip(keep, r, adv)]]))


@pytest.mark.parametrize("is_cap, weights", [(10.0, [10.0, 0.5, 4.0]), (INF, [20.0, 0.5, 4.0]), (3.0, [3.0, 0.5, 3.0]),
                                             (5, [5.0, 0.5, 4.0])])
def test_is_cap(is_cap, weights):
    mu, pi = [0.01, 0.4, 0.1], [0.2, 0.2, 0.4]  # r = 20, 0.5, 4
    logp = tensor([[math.log(p) for p in pi]]).requires_grad_(True)
    loss, metrics = policy_loss(logp, tensor([[math.log(m) for m in mu]]), tensor([2.0]), torch.ones(1, 3, dtype=torch.bool),
                                loss_spec(trust_region="none", is_cap=is_cap, aggregation="token-mean"))
    loss.backward()
    frac = metrics["ratio_above_cap_frac"]
    assert_close(frac, torch.tensor(sum(r > is_cap for r in (20, 0.5, 4)) / 3, dtype=frac.dtype))
    assert_close(logp.grad, tensor([[-w * 2.0 / 3 for w in weights]]))


def test_log_ratio_clamped_before_exp():
    # log π − log µ = 25 is clamped to 20: with no cap the weight is e^20, finite.
    logp = tensor([[-1.0]]).requires_grad_(True)
    loss, m = policy_loss(logp, tensor([[-26.0]]), tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                          loss_spec(trust_region="none", is_cap=INF, aggregation="token-mean"))
    loss.backward()
    assert_close(logp.grad, tensor([[-math.exp(20.0)]]))
    assert_close(m["ratio_max"], torch.tensor(math.exp(20.0), dtype=F64))


def test_adv_per_sequence_equals_adv_broadcast_per_token():
    b = make_batch(5, spread=1.0)
    l1, _ = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"])
    l2, _ = policy_loss(b["logp"], b["rollout_logp"], b["adv"][:, None].expand_as(b["logp"]).clone(), b["mask"])
    assert_close(l1, l2)


# ------------------------------------------------------------------------------------------------
# Aggregation
# ------------------------------------------------------------------------------------------------

# Row 0: ℓ = 1, 2, 3 (+1 padding); row 1: ℓ = 4 (+3 padding); row 2: no active token. Padding holds NaN.
LOSS_TOK = tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, NAN, NAN], [NAN, NAN, NAN, NAN]])
MASK = tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()
HAND = {
    "token-mean": (1 + 2 + 3 + 4) / 4,             # 4 active tokens
    "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,    # 2 sequences: row 2 is left out of the count
    "seq-mean-token-sum": (6 + 4) / 2,
    "seq-mean-token-sum-norm": (6 / 4 + 4 / 4) / 2,  # divided by T = 4
}


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregation_hand_values(mode):
    assert_close(aggregate(LOSS_TOK, MASK, mode), torch.tensor(HAND[mode], dtype=F64))


def test_aggregation_options():
    assert_close(aggregate(LOSS_TOK, MASK, "seq-mean-token-sum-norm", max_response_len=8), torch.tensor((6 / 8 + 4 / 8) / 2, dtype=F64))
    assert_close(aggregate(LOSS_TOK, MASK, "token-mean", denominator=10.0), torch.tensor(1.0, dtype=F64))
    assert_close(aggregate(LOSS_TOK, MASK, "token-mean", denominator=torch.tensor(5.0)), torch.tensor(2.0, dtype=F64))
    assert aggregation_denominator(MASK, "token-mean").item() == 4
    assert all(aggregation_denominator(MASK, m).item() == 2 for m in AGGREGATIONS[1:])
    assert aggregate(LOSS_TOK, MASK, "seq-mean-token-sum-norm").item() == 1.25  # default mode
    for mode in AGGREGATIONS:  # all padding: 0, not NaN
        assert aggregate(LOSS_TOK, torch.zeros_like(MASK), mode).item() == 0.0


def test_all_padding_batch_gives_zero_loss_and_zero_gradient():
    b = make_batch(1)
    logp = b["logp"].clone().requires_grad_(True)
    loss, metrics = policy_loss(logp, b["rollout_logp"], b["adv"], torch.zeros_like(b["mask"]))
    loss.backward()
    assert loss.item() == 0.0 and (logp.grad == 0).all()
    assert metrics["masked_frac"].item() == 0.0 and metrics["n_tokens"].item() == 0.0


def _split_loss(loss_fn, b, cuts, mode, name):
    """Σ over micro-batches (row ranges, each trimmed to its own longest response) of the loss with the
    whole mini-batch's denominator and max response length; returns (loss, grad of logp)."""
    logp = b["logp"].clone().requires_grad_(True)
    B, T = logp.shape
    denom = aggregation_denominator(b["mask"], mode)
    lengths = b["mask"].sum(-1)
    total = 0.0
    for lo, hi in zip([0] + cuts, cuts + [B]):
        t_mb = max(int(lengths[lo:hi].max()), 1)
        sl = (slice(lo, hi), slice(0, t_mb))
        kwargs = dict(aggregation=mode, denominator=denom, max_response_len=T,
                      loss="drpo" if name == "drpo" else "masked_is")
        if name != "drpo":
            kwargs.update(trust_region=name, **extra(name))
            div = divergence_for(name, b)
            kwargs["divergence"] = None if div is None else div[sl]
        loss, _ = flat_loss(loss_fn, logp[sl], b["rollout_logp"][sl], b["adv"][lo:hi], b["mask"][sl], **kwargs)
        total = total + loss
    total.backward()
    return total, logp.grad


def _full_loss(loss_fn, b, mode, name):
    logp = b["logp"].clone().requires_grad_(True)
    kwargs = dict(aggregation=mode, loss="drpo" if name == "drpo" else "masked_is")
    if name != "drpo":
        kwargs.update(trust_region=name, divergence=divergence_for(name, b), **extra(name))
    loss, _ = flat_loss(loss_fn, logp, b["rollout_logp"], b["adv"], b["mask"], **kwargs)
    loss.backward()
    return loss, logp.grad


@PROPS
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 8), T=st.integers(1, 6), mode=st.sampled_from(AGGREGATIONS),
       name=st.sampled_from(["dppo_binary_tv", "dppo_topk_kl", "ppo_clip", "cppo", "none", "drpo"]), data=st.data())
def test_micro_batch_split_does_not_change_loss_or_gradient(seed, B, T, mode, name, data):
    b = make_batch(seed, B=B, T=T, spread=1.0)
    cuts = sorted(data.draw(st.sets(st.integers(1, B - 1)), label="cuts")) if B > 1 else []
    fn = LOSS_FNS["drpo"] if name == "drpo" else policy_loss
    full, grad_full = _full_loss(fn, b, mode, name)
    split, grad_split = _split_loss(fn, b, cuts, mode, name)
    assert_close(split, full)
    assert_close(grad_split, grad_full)


def test_micro_batch_split_without_the_shared_denominator_differs():
    # The test above can fail: per-micro-batch normalisers give a different loss.
    b = make_batch(7, B=6, T=5, spread=1.0)
    b["mask"][0] = True
    b["mask"][1:3, 1:] = False
    full, _ = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"],
                          loss_spec(trust_region="none", aggregation="token-mean"))
    spec = loss_spec(trust_region="none", aggregation="token-mean")
    parts = sum(policy_loss(b["logp"][s], b["rollout_logp"][s], b["adv"][s], b["mask"][s], spec)[0]
                for s in (slice(0, 3), slice(3, 6)))
    assert (parts - full).abs() > 1e-3


# ------------------------------------------------------------------------------------------------
# Metrics
# ------------------------------------------------------------------------------------------------


def test_metrics_hand_case():
    # PPO clip (ε 0.2/0.28), C = 3. Row 0 (Â = +1): r = 1, 4 -> the second masked. Row 1 (Â = −1): r = 0.9,
    # 1.5 -> both kept. Row 2 (Â = 0): r = 1. Padding has r = 100 and must count nowhere.
    mu = tensor([[0.2, 0.1, 0.01], [0.5, 0.2, 0.01], [0.3, 0.01, 0.01]])
    pi = tensor([[0.2, 0.4, 1.0], [0.45, 0.3, 1.0], [0.3, 1.0, 1.0]])
    mask = tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]]).bool()
    _, m = policy_loss(pi.log(), mu.log(), tensor([1.0, -1.0, 0.0]), mask,
                       loss_spec(trust_region="ppo_clip", is_cap=3.0))
    want = dict(masked_frac=1 / 5, masked_frac_pos=1 / 2, masked_frac_neg=0.0, ratio_mean=(1 + 4 + 0.9 + 1.5 + 1) / 5,
                ratio_max=4.0, ratio_above_cap_frac=1 / 5, n_tokens=5.0, n_pos=2.0, n_neg=2.0)
    assert set(m) == set(want) | {"keep"}
    assert m["keep"].dtype == torch.bool and not m["keep"].requires_grad
    assert m["keep"][mask].tolist() == [True, False, True, True, True]
    for key, value in want.items():
        assert_close(m[key], torch.tensor(value, dtype=m[key].dtype), msg=key)
        assert not m[key].requires_grad and m[key].dim() == 0


def test_drpo_metrics():
    mu, pi = tensor([[0.2, 0.1, 0.01]]), tensor([[0.2, 0.4, 1.0]])
    _, m = drpo_loss(pi.log(), mu.log(), tensor([1.0]), tensor([[1, 1, 0]]).bool())
    assert_close(m["ratio_mean"], torch.tensor(2.5, dtype=m["ratio_mean"].dtype))
    assert_close(m["ratio_max"], torch.tensor(4.0, dtype=m["ratio_max"].dtype))
    assert m["n_tokens"].item() == 2


# ------------------------------------------------------------------------------------------------
# Precision: fp32 vs bf16 log-probs
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dppo_binary_tv", "ppo_clip", "none"])
def test_bf16_logp_is_computed_in_float32(name):
    b = make_batch(11, B=6, T=8, spread=0.5, dtype=F32)
    lp16 = b["logp"].bfloat16().requires_grad_(True)
    lp32 = lp16.detach().float().requires_grad_(True)  # the same values, in float32
    kw = dict(trust_region=name, divergence=divergence_for(name, b))
    loss16, _ = flat_loss(policy_loss, lp16, b["rollout_logp"], b["adv"], b["mask"], **kw)
    loss32, _ = flat_loss(policy_loss, lp32, b["rollout_logp"], b["adv"], b["mask"], **kw)
    (loss16 + loss32).backward()
    assert loss16.dtype == F32
    assert_close(loss16, loss32)  # no extra rounding beyond the inputs'
    assert lp16.grad.dtype == torch.bfloat16
    assert_close(lp16.grad, lp32.grad.bfloat16())  # one rounding, to the input's dtype


def test_fp32_vs_bf16_logp_close():
    # Stated tolerance: bf16 keeps 8 significant bits, so log p (|log p| ≲ 6 here) moves by up to
    # 2^-9·|log p| ≈ 0.012; r = exp(log p − log µ) and the per-token term r·Â·log p move by about twice
    # that relatively, and the sum averages them: rtol 2e-2. No mask (a threshold could flip a token).
    b = make_batch(12, B=8, T=16, spread=0.3, dtype=F32)
    spec = loss_spec(trust_region="none", is_cap=INF)
    loss32, _ = policy_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"], spec)
    loss16, _ = policy_loss(b["logp"].bfloat16(), b["rollout_logp"], b["adv"], b["mask"], spec)
    assert_close(loss16, loss32, rtol=2e-2, atol=1e-4)
    drpo32, _ = drpo_loss(b["logp"], b["rollout_logp"], b["adv"], b["mask"])
    drpo16, _ = drpo_loss(b["logp"].bfloat16(), b["rollout_logp"], b["adv"], b["mask"])
    assert drpo16.dtype == F32
    assert_close(drpo16, drpo32, rtol=2e-2, atol=1e-4)


# ------------------------------------------------------------------------------------------------
# DRPO
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", AGGREGATIONS)
@pytest.mark.parametrize("delta", [0.05, 0.15])
def test_drpo_value_and_gradient(mode, delta):
    b = make_batch(13, B=5, T=6, spread=1.0)
    logp = b["logp"].clone().requires_grad_(True)
    loss, _ = drpo_loss(logp, b["rollout_logp"], b["adv"], b["mask"], delta=delta, aggregation=mode)
    loss.backward()
    # DRPO's objective (`drpo_loss`): Σ_t [r Â − |Â|/(2δ) · m · (r − 1)²], r = π/µ with gradient, no cap;
    # loss = −objective.
    r = torch.exp(b["logp"] - b["rollout_logp"])
    m, A = b["rollout_logp"].exp(), b["adv"][:, None]
    tok = -(r * A - A.abs() / (2 * delta) * m * (r - 1) ** 2)
    assert_close(loss, aggregate(tok, b["mask"], mode))
    dtok = -(r * A - A.abs() / delta * m * (r - 1) * r)  # d tok / d log π (dr/dlog π = r)
    dl = torch.zeros_like(tok).requires_grad_(True)  # d loss / d tok: the aggregation's weights
    aggregate(dl, b["mask"], mode).backward()
    assert_close(logp.grad, dtok * dl.grad)


def test_drpo_hand_case_uncapped():
    # One token, µ = 0.02 -> π = 0.5 (r = 25, above any IS cap), Â = 1, δ = 0.1:
    # objective = 25 − 1/0.2 · 0.02 · 24² = 25 − 57.6; gradient of the loss = −(25 − 1/0.1 · 0.02 · 24 · 25).
    logp = tensor([[math.log(0.5)]]).requires_grad_(True)
    loss, _ = drpo_loss(logp, tensor([[math.log(0.02)]]), tensor([1.0]), torch.ones(1, 1, dtype=torch.bool),
                        delta=0.1, aggregation="token-mean")
    loss.backward()
    assert_close(loss, torch.tensor(-(25 - 57.6), dtype=F64))
    assert_close(logp.grad, tensor([[-(25 - 0.2 * 24 * 25)]]))


# ------------------------------------------------------------------------------------------------
# NaN
# ------------------------------------------------------------------------------------------------

LOSSES = REGIONS + ["drpo"]


def _loss(name, logp, rollout_logp, adv, mask, divergence=None):
    if name == "drpo":
        return drpo_loss(logp, rollout_logp, adv, mask)[0]
    return flat_loss(policy_loss, logp, rollout_logp, adv, mask, trust_region=name, divergence=divergence,
                     **extra(name))[0]


def _nan_batch():
    b = make_batch(21, B=3, T=5, spread=0.5)
    b["mask"] = tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]).bool()
    b["adv"] = b["adv"].abs() + 0.5  # no zero advantage: every active token carries a term
    b["adv"][1] = -b["adv"][1]
    b["adv_tok"] = b["adv"][:, None].expand_as(b["logp"]).clone()
    return b


NAN_CASES = [(n, w) for n in LOSSES for w in ("logp", "rollout_logp", "adv_tok", "divergence")
             if w != "divergence" or TRUST_REGIONS.get(n, TRUST_REGIONS["none"]).divergence in ("topk_tv", "topk_kl")]


@pytest.mark.parametrize("name, where", NAN_CASES)
def test_nan_in_an_active_token_gives_a_nan_loss(name, where):
    b = _nan_batch()
    div = divergence_for(name, b) if name != "drpo" else None
    args = dict(logp=b["logp"].clone(), rollout_logp=b["rollout_logp"].clone(), adv_tok=b["adv_tok"], divergence=div)
    args[where] = args[where].clone()
    args[where][1, 2] = NAN
    loss = _loss(name, args["logp"], args["rollout_logp"], args["adv_tok"], b["mask"], args["divergence"])
    assert torch.isnan(loss)


@pytest.mark.parametrize("name", LOSSES)
def test_nan_and_inf_at_padding_do_not_leak(name):
    b = _nan_batch()
    div = divergence_for(name, b) if name != "drpo" else None
    pad = ~b["mask"]

    def run(poison, targets):
        x = dict(logp=b["logp"].clone(), roll=b["rollout_logp"].clone(), adv=b["adv_tok"].clone(),
                 div=None if div is None else div.clone())
        for key in targets:
            if x[key] is not None:
                x[key][pad] = poison
        logp = x["logp"].requires_grad_(True)
        loss = _loss(name, logp, x["roll"], x["adv"], b["mask"], x["div"])
        loss.backward()
        return loss, logp.grad

    clean_loss, clean_grad = run(0.0, ())
    # One input at a time, then all together (a NaN in one input can hide another's leak: a NaN log π at
    # padding, say, makes clamp's backward drop the gradient that a NaN Â there would otherwise poison).
    for targets in (("logp",), ("roll",), ("adv",), ("div",), ("logp", "roll", "adv", "div")):
        for poison in (NAN, INF, -INF):
            loss, grad = run(poison, targets)
            assert torch.isfinite(loss) and torch.isfinite(grad).all(), (targets, poison)
            assert_close(loss, clean_loss)
            assert_close(grad, clean_grad)
            assert (grad[pad] == 0).all()


# ------------------------------------------------------------------------------------------------
# Bad input: every ValueError names the argument and what was expected
# ------------------------------------------------------------------------------------------------

B_, T_ = 2, 3
LP = torch.zeros(B_, T_)
OK = dict(logp=LP, rollout_logp=torch.zeros(B_, T_), adv=torch.zeros(B_), response_mask=torch.ones(B_, T_, dtype=torch.bool))


def call(fn=policy_loss, **changes):
    args = {**OK, **changes}
    tensors = [args.pop(k) for k in ("logp", "rollout_logp", "adv", "response_mask")]
    if fn is not policy_loss:
        return lambda: fn(*tensors, **args)
    return lambda: flat_loss(policy_loss, *tensors, **args)


BAD = [
    ("logp 1-D", call(logp=torch.zeros(3)), r"logp: expected shape \[B, T\]"),
    ("logp int", call(logp=torch.zeros(B_, T_, dtype=torch.long)), r"logp: expected a floating-point tensor"),
    ("logp list", call(logp=[[0.0]]), r"logp: expected a torch.Tensor"),
    ("rollout shape", call(rollout_logp=torch.zeros(B_, T_ + 1)), r"rollout_logp: expected shape \(2, 3\)"),
    ("rollout int", call(rollout_logp=torch.zeros(B_, T_, dtype=torch.int32)), r"rollout_logp: expected a floating"),
    ("rollout device", call(rollout_logp=torch.zeros(B_, T_, device="meta")), r"rollout_logp: expected device cpu"),
    ("adv shape", call(adv=torch.zeros(B_ + 1)), r"adv: expected shape \[B\]"),
    ("adv int", call(adv=torch.zeros(B_, dtype=torch.long)), r"adv: expected a floating"),
    ("adv device", call(adv=torch.zeros(B_, device="meta")), r"adv: expected device cpu"),
    ("mask shape", call(response_mask=torch.ones(B_, T_ + 1, dtype=torch.bool)), r"response_mask: expected shape"),
    ("mask device", call(response_mask=torch.ones(B_, T_, dtype=torch.bool, device="meta")), r"response_mask: expected device"),
    ("trust region", call(trust_region="dppo"), r"trust_region: unknown value 'dppo'; valid: .*dppo_binary_tv"),
    ("aggregation", call(aggregation="mean"), r"aggregation: unknown value 'mean'; valid: .*token-mean"),
    ("anchor", call(anchor="old"), r"anchor: unknown value 'old'; valid: recompute, rollout"),
    ("delta_low 0", call(delta_low=0.0), r"delta_low: expected > 0"),
    ("delta_high < 0", call(delta_high=-0.1), r"delta_high: expected > 0"),
    ("delta nan", call(delta_high=NAN), r"delta_high: expected > 0"),
    ("eps_low 0", call(trust_region="ppo_clip", eps_low=0.0), r"eps_low: expected > 0"),
    ("is_cap 0", call(is_cap=0.0), r"is_cap: expected a number > 0"),
    ("topk without divergence", call(trust_region="dppo_topk_tv"), r"divergence: required by trust_region 'dppo_topk_tv'"),
    ("topk kl without divergence", call(trust_region="dppo_topk_kl"), r"divergence: required by trust_region 'dppo_topk_kl'"),
    ("divergence shape", call(trust_region="dppo_topk_tv", divergence=torch.zeros(B_)), r"divergence: expected shape \(2, 3\)"),
    ("recompute without old", call(anchor="recompute"), r"old_logp: required when anchor='recompute'"),
    ("old_logp shape", call(anchor="recompute", old_logp=torch.zeros(B_)), r"old_logp: expected shape \(2, 3\)"),
    ("relax without alpha", call(trust_region="ppo_clip_relax"), r"relax_alpha: required by trust_region 'ppo_clip_relax'"),
    ("relax side", call(trust_region="ppo_clip_relax", relax_alpha=0.1, relax_side="up"), r"relax_side: expected 'high', 'low' or 'both'"),
    ("cppo q", call(trust_region="cppo", cppo_q=1.5), r"cppo_q: expected in \[0, 1\]"),
    ("cppo w_min", call(trust_region="cppo", cppo_w_min=-0.1), r"cppo_w_min: expected in \[0, 1\]"),
    ("cppo delta_b_min", call(trust_region="cppo", cppo_delta_b_min=0.0), r"cppo_delta_b_min: expected > 0"),
    ("cppo k", call(trust_region="cppo", cppo_k=-1.0), r"cppo_k: expected >= 0"),
    ("max_response_len", call(max_response_len=0), r"max_response_len: expected a number > 0"),
    ("drpo delta", call(drpo_loss, delta=0.0), r"delta: expected a number > 0"),
    ("drpo aggregation", call(drpo_loss, aggregation="sum"), r"aggregation: unknown value 'sum'"),
    ("drpo adv shape", call(drpo_loss, adv=torch.zeros(T_, B_)), r"adv: expected shape"),
    ("aggregate mode", lambda: aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "x"), r"aggregation: unknown value 'x'"),
    ("aggregate mask", lambda: aggregate(torch.zeros(2, 3), torch.ones(3, 2, dtype=torch.bool)), r"response_mask: expected shape \(2, 3\)"),
    ("denominator mode", lambda: aggregation_denominator(torch.ones(2, 3, dtype=torch.bool), "sum"), r"aggregation: unknown value"),
]


@pytest.mark.parametrize("fn, match", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error_naming_the_argument(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()
