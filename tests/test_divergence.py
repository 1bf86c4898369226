"""Tests of dppo.divergence (Eqs. 13–16, App. B): hand values, float32 accuracy against an mpmath reference,
Top-K cells with the "other" bucket and unused slots, and the partition lower-bound properties."""

from __future__ import annotations

import math

import mpmath
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dppo.divergence import binary_kl, binary_tv, full_kl, full_tv, log1mexp, topk_kl, topk_tv

F32, F64 = torch.float32, torch.float64
NAN = float("nan")
PROPS = settings(max_examples=60, deadline=None)


def t(values, dtype=F32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def logs(probs, dtype=F32) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=dtype)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    # x − logsumexp rather than torch.log_softmax, whose CPU kernel was erratically slow (~15 ms per tiny
    # call) under thread contention on the 2-core test machine.
    return x - x.logsumexp(-1, keepdim=True)


def kl2(m: float, p: float) -> float:
    """Binary KL(m‖p) by its textbook formula in float64 (fine away from 0/1)."""
    return m * math.log(m / p) + (1 - m) * math.log((1 - m) / (1 - p))


# ------------------------------------------------------------------------------------------------
# Binary TV / KL: hand values
# ------------------------------------------------------------------------------------------------


def test_binary_paper_examples():
    # The paper's §3 example: µ = 1e-4 -> π = 1e-2 (r = 100, little mass moved); µ = 0.99 -> π = 0.80 (r ≈ 0.81,
    # 0.19 moved).
    m, p = [1e-4, 0.99], [1e-2, 0.80]
    assert_close(binary_tv(logs(p), logs(m)), t([0.0099, 0.19]))
    assert_close(binary_kl(logs(p), logs(m)), t([kl2(1e-4, 1e-2), kl2(0.99, 0.80)]))
    # The numbers themselves, computed by hand: 1e-4·ln(1e-2) + 0.9999·ln(0.9999/0.99) and
    # 0.99·ln(0.99/0.8) + 0.01·ln(0.01/0.2).
    assert_close(binary_kl(logs(p), logs(m)), t([0.0094890, 0.1810030]), rtol=1e-4, atol=0.0)


def test_binary_kl_zero_when_equal_and_nonnegative():
    lp = logs([1e-30, 1e-7, 0.3, 0.5, 0.999, 1 - 1e-7])
    assert torch.equal(binary_kl(lp, lp), torch.zeros(6))
    g = torch.Generator().manual_seed(0)
    a, b = -torch.rand(1000, generator=g) * 30, -torch.rand(1000, generator=g) * 30
    assert (binary_kl(a, b) >= 0).all()


def test_binary_kl_edge_probabilities():
    # µ = 0 (log µ = −inf): KL = −log(1 − p); µ = 1: KL = −log p; π = 0 with µ > 0: KL = inf (true value).
    p = 0.25
    assert_close(binary_kl(logs([p]), t([-math.inf])), t([-math.log(1 - p)]))
    assert_close(binary_kl(logs([p]), t([0.0])), t([-math.log(p)]))
    assert binary_kl(t([-math.inf]), logs([0.5])).item() == math.inf
    # π(a) = 1 exactly: the complement is clamped, so the value is large but finite (documented).
    v = binary_kl(t([0.0]), logs([0.5])).item()
    assert math.isfinite(v) and v > 40


def test_binary_tv_and_kl_direction():
    # KL(µ‖π) is not symmetric; swapping the arguments must change the value.
    m, p = logs([0.9]), logs([0.5])
    assert_close(binary_kl(p, m), t([kl2(0.9, 0.5)]))
    assert_close(binary_kl(m, p), t([kl2(0.5, 0.9)]))
    assert abs(kl2(0.9, 0.5) - kl2(0.5, 0.9)) > 0.05


# ------------------------------------------------------------------------------------------------
# Binary KL accuracy in float32 against an exact reference
# ------------------------------------------------------------------------------------------------

mpmath.mp.dps = 60
# Probabilities from 1e-30 to 1 − 1e-7. Log-probabilities are formed in float64 with log1p for p near 1
# (a float64 `1 − p` would itself lose p < 1e-16), then rounded to float32: the input the function sees.
GRID = [1e-30, 1e-20, 1e-10, 1e-7, 1e-4, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1 - 1e-4, 1 - 1e-6, 1 - 1e-7]


def _logprob(p: float) -> float:
    return math.log(p) if p < 0.5 else math.log1p(-(1 - p))


def mp_binary_kl(lm: float, lp: float) -> float:
    """Exact binary KL of the probabilities exp(lm), exp(lp) (the float inputs taken as exact)."""
    lm, lp = mpmath.mpf(lm), mpmath.mpf(lp)
    m = mpmath.exp(lm)
    log1m = lambda x: mpmath.log(-mpmath.expm1(x))  # noqa: E731  log(1 − e^x), exact in mpmath
    return float(m * (lm - lp) + (1 - m) * (log1m(lm) - log1m(lp)))


# Stated tolerance: float32 has eps ≈ 1.2e-7. Where µ and π differ the value is good to a few ulps
# (rtol 1e-5); where µ ≈ π the two terms of Eq. 14 cancel, which leaves an absolute error of order
# eps·|m − p| — atol 1e-7, far below any threshold δ (0.05). The naive formula fails this (checked below).
KL_RTOL, KL_ATOL = 1e-5, 1e-7


def _reference(lm32: torch.Tensor, lp32: torch.Tensor) -> torch.Tensor:
    return torch.tensor([mp_binary_kl(a, b) for a, b in zip(lm32.double().tolist(), lp32.double().tolist())], dtype=F64)


def test_binary_kl_float32_matches_mpmath_on_extremes():
    pairs = [(m, p) for m in GRID for p in GRID]
    lm = torch.tensor([_logprob(m) for m, _ in pairs], dtype=F32)
    lp = torch.tensor([_logprob(p) for _, p in pairs], dtype=F32)
    got = binary_kl(lp, lm)
    assert got.dtype == F32 and torch.isfinite(got).all()
    assert_close(got.double(), _reference(lm, lp), rtol=KL_RTOL, atol=KL_ATOL)


def test_binary_kl_float32_matches_mpmath_random():
    g = torch.Generator().manual_seed(1)
    n = 600
    lm = -torch.rand(n, generator=g, dtype=F64) * 70  # log µ in [−70, 0]
    lp = (lm + torch.randn(n, generator=g, dtype=F64) * torch.logspace(-6, 1, n, dtype=F64)).clamp(max=-1e-7)
    lm, lp = lm.float(), lp.float()
    assert_close(binary_kl(lp, lm).double(), _reference(lm, lp), rtol=KL_RTOL, atol=KL_ATOL)


def test_the_kl_tolerance_can_fail():
    # The naive float32 formula (1 − p formed in float32) misses the reference by more than the tolerance
    # near p = 1: the tolerance above is tight enough to catch an implementation that does this.
    m, p = 0.5, 1 - 1e-7
    lm, lp = torch.tensor([_logprob(m)], dtype=F32), torch.tensor([_logprob(p)], dtype=F32)
    mm, pp = lm.exp(), lp.exp()
    naive = mm * torch.log(mm / pp) + (1 - mm) * torch.log((1 - mm) / (1 - pp))
    ref = _reference(lm, lp)
    assert (naive.double() - ref).abs().item() > KL_RTOL * ref.abs().item() + KL_ATOL
    assert_close(binary_kl(lp, lm).double(), ref, rtol=KL_RTOL, atol=KL_ATOL)


def test_binary_finite_in_float32_everywhere():
    # Log-probs down to −1e4 (π underflows to 0 in float32 when exponentiated) and exactly 0 (prob 1).
    grid = torch.tensor([-1e4, -200.0, -100.0, -69.0, -20.0, -1.0, -1e-3, -1e-7, -1e-30, 0.0], dtype=F32)
    lp, lm = torch.meshgrid(grid, grid, indexing="ij")
    for fn in (binary_tv, binary_kl):
        out = fn(lp.reshape(-1), lm.reshape(-1))
        assert torch.isfinite(out).all(), fn.__name__


def test_binary_bf16_inputs_are_computed_in_float32():
    g = torch.Generator().manual_seed(2)
    lm = (-torch.rand(64, generator=g) * 10).bfloat16()
    lp = (-torch.rand(64, generator=g) * 10).bfloat16()
    for fn in (binary_tv, binary_kl):
        out = fn(lp, lm)
        assert out.dtype == F32
        assert_close(out, fn(lp.float(), lm.float()))  # same values, upcast first: same answer


def test_log1mexp_accuracy():
    x = torch.tensor([-1e-30, -1e-7, -0.1, -0.6931, -0.7, -5.0, -50.0, -math.inf], dtype=F64)
    ref = torch.tensor([float(mpmath.log(-mpmath.expm1(mpmath.mpf(v)))) for v in x.tolist()], dtype=F64)
    assert_close(log1mexp(x), ref)
    assert_close(log1mexp(x.float()), ref.float())
    assert torch.isfinite(log1mexp(torch.zeros(1))).all()  # x = 0 clamped: finite, very negative


def test_nan_propagates_in_binary():
    for fn in (binary_tv, binary_kl):
        assert torch.isnan(fn(t([NAN, -1.0]), t([-1.0, -1.0])))[0]
        assert torch.isnan(fn(t([-1.0, -1.0]), t([NAN, -1.0])))[0]
        assert torch.isfinite(fn(t([NAN, -1.0]), t([-1.0, -1.0])))[1]


# ------------------------------------------------------------------------------------------------
# Top-K: hand values, the "other" bucket, unused slots
# ------------------------------------------------------------------------------------------------

MU5 = [0.5, 0.2, 0.15, 0.1, 0.05]
PI5 = [0.4, 0.3, 0.1, 0.1, 0.1]


def test_topk_hand_sampled_token_outside_topk():
    # K = 2: µ's top-2 = {0, 1}; sampled token 3 is added (K+1 set). Other = {2, 4}: µ 0.2, π 0.2.
    cells = [0, 1, 3]
    lm, lp = logs([MU5[i] for i in cells]), logs([PI5[i] for i in cells])
    tv = 0.5 * (0.1 + 0.1 + 0.0 + 0.0)
    kl = 0.5 * math.log(0.5 / 0.4) + 0.2 * math.log(0.2 / 0.3) + 0.1 * math.log(1.0) + 0.2 * math.log(1.0)
    assert_close(topk_tv(lp, lm), t(tv))
    assert_close(topk_kl(lp, lm), t(kl))
    # Lower bounds of the full values: TV 0.15 = ½(0.1+0.1+0.05+0+0.05), KL by its formula.
    full_kl_ref = sum(m * math.log(m / p) for m, p in zip(MU5, PI5))
    assert_close(full_tv(logs(PI5), logs(MU5)), t(0.15))
    assert_close(full_kl(logs(PI5), logs(MU5)), t(full_kl_ref))
    assert tv < 0.15 and kl < full_kl_ref


def test_topk_unused_last_slot_is_ignored():
    # Sampled token 1 is in µ's top-2 = {0, 1}: the third slot is unused. Its content must not matter.
    lm_used, lp_used = logs([0.5, 0.2]), logs([0.4, 0.3])
    other_m, other_p = 0.3, 0.3
    tv = 0.5 * (0.1 + 0.1 + abs(other_m - other_p))
    kl = 0.5 * math.log(0.5 / 0.4) + 0.2 * math.log(0.2 / 0.3)
    valid = torch.tensor([True, True, False])
    for junk in (NAN, 0.0, math.log(0.4), -math.inf):  # NaN, a probability-1 slot, a duplicate, −inf
        lm = torch.cat([lm_used, t([junk])])
        lp = torch.cat([lp_used, t([junk])])
        assert_close(topk_tv(lp, lm, valid), t(tv))
        assert_close(topk_kl(lp, lm, valid), t(kl))
    assert_close(topk_tv(lp_used, lm_used), t(tv))  # valid=None means every slot is used


def test_topk_batched_shapes_and_valid_none():
    g = torch.Generator().manual_seed(3)
    lm = log_softmax(torch.randn(2, 3, 8, generator=g))[..., :5]
    lp = log_softmax(torch.randn(2, 3, 8, generator=g))[..., :5]
    for fn in (topk_tv, topk_kl):
        out = fn(lp, lm)
        assert out.shape == (2, 3)
        assert_close(out, fn(lp, lm, torch.ones(2, 3, 5, dtype=torch.bool)))


def test_topk_other_bucket_clamped_when_cells_sum_above_one():
    # π's cells sum to 1 + 1e-6 after rounding: other mass is clamped to ~0, the result stays finite.
    lm = logs([0.6, 0.3])  # µ other = 0.1
    lp = logs([0.6, 0.400001])
    assert_close(topk_tv(lp, lm), t(0.5 * (0.0 + 0.100001 + 0.1)))
    kl = topk_kl(lp, lm)
    assert torch.isfinite(kl) and kl > 0.1 * math.log(0.1 / 1e-30)


def test_topk_nan_propagates_from_used_slots_only():
    lm, lp = logs([0.5, 0.2, 0.1]), logs([0.4, 0.3, 0.1])
    valid = torch.tensor([True, True, False])
    for fn in (topk_tv, topk_kl):
        for which in ("mu", "pi"):
            a, b = lm.clone(), lp.clone()
            (a if which == "mu" else b)[0] = NAN
            assert torch.isnan(fn(b, a)), (fn.__name__, which)
            a, b = lm.clone(), lp.clone()
            (a if which == "mu" else b)[2] = NAN
            assert torch.isfinite(fn(b, a, valid)), (fn.__name__, which)


def test_full_kl_zero_mass_cells():
    # µ = 0 where π > 0 contributes 0; π = 0 where µ > 0 gives inf; NaN in µ gives NaN (not a silent 0).
    assert_close(full_kl(logs([0.5, 0.5]), t([0.0, -math.inf])), t(math.log(2.0)))
    assert full_kl(t([0.0, -math.inf]), logs([0.5, 0.5])).item() == math.inf
    assert torch.isnan(full_kl(logs([0.5, 0.5]), t([NAN, math.log(0.5)])))
    assert torch.isnan(full_tv(logs([0.5, 0.5]), t([NAN, math.log(0.5)])))


# ------------------------------------------------------------------------------------------------
# Partition properties (App. B): lower bounds, equality cases, Top-K refines Binary
# ------------------------------------------------------------------------------------------------


def _random_case(seed: int, vocab: int, k: int, spread: float, dtype=F64):
    """µ, π over `vocab` tokens; a sampled token; Top-K cells = µ's top-k ∪ {a} padded to k+1 slots."""
    g = torch.Generator().manual_seed(seed)
    mu_logits = torch.randn(vocab, generator=g, dtype=F64) * spread
    pi_logits = mu_logits + torch.randn(vocab, generator=g, dtype=F64) * spread
    lmu, lpi = log_softmax(mu_logits), log_softmax(pi_logits)
    a = int(torch.multinomial(lmu.exp(), 1, generator=g))
    top = torch.topk(lmu, k).indices.tolist()
    ids = top + ([a] if a not in top else [top[0]])  # unused slot holds a duplicate id
    valid = torch.tensor([True] * k + [a not in top])
    ids = torch.tensor(ids)
    # A log-prob rounded to exactly 0 hides 1 − q (see test_logprob_exactly_zero_loses_the_complement).
    assume(bool((lmu < 0).all() and (lpi < 0).all()))
    return (lmu.to(dtype), lpi.to(dtype), a, lmu[ids].to(dtype), lpi[ids].to(dtype), valid)


case_args = dict(
    seed=st.integers(0, 2**31 - 1), vocab=st.integers(2, 12), k=st.integers(1, 12), spread=st.sampled_from([0.3, 1.0, 3.0])
)


@PROPS
@given(**case_args)
def test_partition_estimates_never_exceed_full(seed, vocab, k, spread):
    k = min(k, vocab)
    lmu, lpi, a, cm, cp, valid = _random_case(seed, vocab, k, spread)
    tv, kl = full_tv(lpi, lmu), full_kl(lpi, lmu)
    btv, bkl = binary_tv(lpi[a], lmu[a]), binary_kl(lpi[a], lmu[a])
    ttv, tkl = topk_tv(cp, cm, valid), topk_kl(cp, cm, valid)
    slack = 1e-12  # float64 rounding; the inequalities hold exactly in exact arithmetic
    # The KL's "other" cell is computed from 1 − Σ cells: π(O) carries an absolute error of a few eps, so its
    # term is off by ≈ µ(O)·eps/π(O) (up to ~5e-10 when π(O) is tiny). Allow exactly that much more.
    mu_o = 1.0 - float(torch.where(valid, cm.exp(), torch.zeros_like(cm)).sum())
    pi_o = 1.0 - float(torch.where(valid, cp.exp(), torch.zeros_like(cp)).sum())
    eps = torch.finfo(torch.float64).eps
    kl_slack = slack + 8 * eps * (1 + max(mu_o, 0.0) / max(pi_o, 1e-300))
    # Binary's "rest" cell has the same form: 1 − q from log q carries ≈ eps·q absolute error.
    mu_r, pi_r = 1.0 - float(lmu[a].exp()), 1.0 - float(lpi[a].exp())
    bin_slack = slack + 8 * eps * (1 + max(mu_r, 0.0) / max(pi_r, 1e-300))
    assert btv <= tv + slack and ttv <= tv + slack
    assert bkl <= kl + bin_slack and tkl <= kl + kl_slack
    # Top-K cells contain the sampled token, so that partition refines {a, rest}: Top-K ≥ Binary.
    assert btv <= ttv + slack and bkl <= tkl + max(kl_slack, bin_slack)


@PROPS
@given(**case_args)
def test_partition_properties_hold_in_float32(seed, vocab, k, spread):
    k = min(k, vocab)
    lmu, lpi, a, cm, cp, valid = _random_case(seed, vocab, k, spread, dtype=F32)
    slack = 1e-5  # float32 rounding of sums of up to 13 terms
    # The "other" cell's π(O) = 1 − Σ cells carries a few float32 eps of absolute error, so its KL term is off by
    # ≈ µ(O)·eps/π(O) (the float64 test's bound at float32's eps; seed 12241152 needed it: π(O) ~ 1e-6).
    mu_o = 1.0 - float(torch.where(valid, cm.exp(), torch.zeros_like(cm)).double().sum())
    pi_o = 1.0 - float(torch.where(valid, cp.exp(), torch.zeros_like(cp)).double().sum())
    kl_slack = slack + 8 * torch.finfo(F32).eps * max(mu_o, 0.0) / max(pi_o, 1e-30)
    # When the cells hold (nearly) all the mass, µ(O) and π(O) are float32 rounding residues (≈ eps, however small the
    # true values) and π(O) is clamped at float32's tiny: the term µ(O) log(µ(O)/π(O)) then carries up to
    # ≈ eps·(1 + |log tiny|) (seed 2147483647, V = k = 6: µ(O) rounds to −1.9e-9 in float64, the term gave 1.07e-5).
    kl_slack += 8 * torch.finfo(F32).eps * (1 - math.log(torch.finfo(F32).tiny))
    assert topk_tv(cp, cm, valid) <= full_tv(lpi, lmu) + slack
    assert topk_kl(cp, cm, valid) <= full_kl(lpi, lmu) + kl_slack
    assert binary_tv(lpi[a], lmu[a]) <= topk_tv(cp, cm, valid) + slack
    assert binary_kl(lpi[a], lmu[a]) <= topk_kl(cp, cm, valid) + kl_slack


@PROPS
@given(**case_args)
def test_topk_equals_full_when_cells_cover_the_vocabulary(seed, vocab, k, spread):
    # k ≥ V − 1: the "other" bucket holds at most one token, so the partition is the whole vocabulary.
    k = max(vocab - 1, min(k, vocab))
    lmu, lpi, _, cm, cp, valid = _random_case(seed, vocab, k, spread)
    assert_close(topk_tv(cp, cm, valid), full_tv(lpi, lmu))
    assert_close(topk_kl(cp, cm, valid), full_kl(lpi, lmu))


def _two_token_logprobs(gap: torch.Tensor) -> torch.Tensor:
    """log softmax([gap, 0]) without rounding the likely token's log-prob to 0 (−softplus(∓gap))."""
    return torch.stack([-torch.nn.functional.softplus(-gap), -torch.nn.functional.softplus(gap)])


@PROPS
@given(gap_mu=st.floats(-60, 60), gap_pi=st.floats(-60, 60), a=st.integers(0, 1))
def test_binary_equals_full_when_vocab_is_two(gap_mu, gap_pi, a):
    lmu = _two_token_logprobs(torch.tensor(gap_mu, dtype=F64))
    lpi = _two_token_logprobs(torch.tensor(gap_pi, dtype=F64))
    assert_close(binary_tv(lpi[a], lmu[a]), full_tv(lpi, lmu))
    assert_close(binary_kl(lpi[a], lmu[a]), full_kl(lpi, lmu))


def test_logprob_exactly_zero_loses_the_complement():
    # Documented limitation: log π(a) = 0 exactly (π(a) rounded to 1, as log_softmax does when the top
    # logit leads by > ~36 in float64, ~17 in float32) carries no information about 1 − π(a); Binary-KL
    # then uses the clamped complement (dtype's smallest normal) and is finite but not the true value.
    lmu = _two_token_logprobs(torch.tensor(22.0, dtype=F64))
    lpi = log_softmax(torch.tensor([46.0, 0.0], dtype=F64))
    assert lpi[0].item() == 0.0
    got = binary_kl(lpi[0], lmu[0])
    assert torch.isfinite(got) and got > 10 * full_kl(lpi, lmu)


def test_topk_strictly_below_full_when_mass_hides_in_other():
    # Not an equality case: mass moves between two tokens both inside "other".
    lmu = logs([0.5, 0.1, 0.2, 0.2], F64)
    lpi = logs([0.5, 0.1, 0.3, 0.1], F64)
    cells = torch.tensor([0, 1])
    assert_close(topk_tv(lpi[cells], lmu[cells]), torch.tensor(0.0, dtype=F64))
    assert_close(full_tv(lpi, lmu), torch.tensor(0.1, dtype=F64))


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

BAD = [
    ("shape", lambda: binary_tv(torch.zeros(3), torch.zeros(4)), r"rollout_logp: expected shape \(3,\)"),
    ("dtype", lambda: binary_kl(torch.zeros(3), torch.zeros(3, dtype=F64)), r"rollout_logp: expected dtype torch.float32"),
    ("device", lambda: binary_kl(torch.zeros(3), torch.zeros(3, device="meta")), r"rollout_logp: expected device cpu"),
    ("int", lambda: binary_tv(torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)), r"logp: expected a floating"),
    ("not tensor", lambda: full_tv([0.0], torch.zeros(1)), r"logp: expected a torch.Tensor"),
    ("valid dtype", lambda: topk_tv(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3)), r"valid: expected dtype torch.bool"),
    ("valid shape", lambda: topk_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool)), r"valid: expected shape"),
    ("scalar cells", lambda: topk_tv(torch.zeros(()), torch.zeros(())), r"logp: expected shape \[\.\.\., S\]"),
]


@pytest.mark.parametrize("fn, match", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_value_error_naming_the_argument(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()
