"""Log-prob helpers and the fused lm-head kernel against the naive full-vocabulary one-liners.

Naive spec: `torch.log_softmax((hidden @ weight.T).float() / temperature, -1).gather(-1, ids)` (in float64
for float64 inputs); values and gradients to hidden, weight (and bias) are compared.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.testing import assert_close

from dppo.logprobs import (
    FusedLogprobs,
    entropy_from_logits,
    fused_logprobs,
    gather_logprobs_from_logits,
    logprobs_from_logits,
    topk_logprobs_from_logits,
)


def make(n, v, h, dtype=torch.float32, seed=0, bias=False):
    """hidden [n, h], weight [v, h] (leaves with grad), targets [n], bias [v] or None; logits of order 1."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / math.sqrt(h)).to(dtype)
    b = torch.randn(v, generator=gen, dtype=torch.float64).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight.requires_grad_(), targets, b


def naive_logits(hidden, weight, bias=None, temperature=1.0):
    z = hidden @ weight.T if bias is None else hidden @ weight.T + bias
    return (z if z.dtype == torch.float64 else z.float()) / temperature


def naive_logp(hidden, weight, targets, bias=None, temperature=1.0):
    return torch.log_softmax(naive_logits(hidden, weight, bias, temperature), -1).gather(-1, targets[:, None])[:, 0]


def value_and_grads(fn, hidden, weight, bias=None, seed=1):
    """fn(h, w, b) -> logp [N]; returns (logp, [grad_h, grad_w(, grad_b)]) for a random upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    logp = fn(*leaves) if bias is not None else fn(*leaves, None)
    g = torch.randn(logp.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(logp.dtype)
    return logp.detach(), list(torch.autograd.grad((logp * g).sum(), leaves))


def upcast(*tensors):
    return [t.detach().double() if t is not None else None for t in tensors]


# --- plain helpers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_plain_helpers_match_log_softmax_gather(dtype, temperature):
    logits = (torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    ref = torch.log_softmax(logits.float() / temperature, -1)
    ids = torch.randint(0, 50, (2, 3, 4), generator=torch.Generator().manual_seed(1))
    assert_close(logprobs_from_logits(logits, ids[..., 0], temperature=temperature),
                 ref.gather(-1, ids[..., :1])[..., 0])
    assert_close(gather_logprobs_from_logits(logits, ids, temperature=temperature), ref.gather(-1, ids))
    top_ids, top_logp = topk_logprobs_from_logits(logits, 5, temperature=temperature)
    assert_close(top_logp, ref.topk(5, -1).values)
    assert_close(top_logp, ref.gather(-1, top_ids))
    assert_close(entropy_from_logits(logits, temperature=temperature), -(ref.exp() * ref).sum(-1))


def test_plain_helpers_reject_bad_ids_and_k():
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="^ids:"):
        logprobs_from_logits(logits, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="^ids:"):
        gather_logprobs_from_logits(logits, torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="^k:"):
        topk_logprobs_from_logits(logits, 11)


# --- fused kernel: values and gradients ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, v, chunk_size, vocab_chunk_size, temperature",
    [
        (20, 37, None, None, 1.0),  # one tile
        (23, 50, 7, 16, 1.0),  # neither chunk size divides N or V
        (23, 50, 7, 16, 0.7),
        (9, 64, 4, 64, 1.8),  # several token chunks, one vocab chunk
        (16, 33, 100, 5, 1.0),  # chunks larger than N
    ],
)
def test_fp32_matches_naive(n, v, chunk_size, vocab_chunk_size, temperature):
    hidden, weight, targets, _ = make(n, v, 12)
    fused = value_and_grads(lambda h, w, b: fused_logprobs(
        h, w, targets, temperature=temperature, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size).logp,
        hidden, weight)
    naive = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, temperature=temperature), hidden, weight)
    assert fused[0].dtype == torch.float32
    assert_close(fused, naive)


def test_fp64_matches_naive_and_gradcheck():
    hidden, weight, targets, bias = make(11, 29, 6, torch.float64, bias=True)
    kw = dict(temperature=0.8, chunk_size=4, vocab_chunk_size=7)
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, bias=b, **kw).logp, hidden, weight, bias)
    naive = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, b, 0.8), hidden, weight, bias)
    assert fused[0].dtype == torch.float64  # float64 in, float64 out
    assert_close(fused, naive, rtol=1e-12, atol=1e-12)
    small = hidden[:4].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda h, w, b: fused_logprobs(h, w, targets[:4], bias=b, **kw).logp,
                                    (small, weight, bias))


# bf16/fp16: the matmul output (the logits) is rounded to 8 (bf16) / 11 (fp16) significant bits, and so is
# the gradient fed back into the backward matmuls; the naive one-liner in that dtype has the same error.
# Both are compared with float64 on the same (rounded) inputs; logits here are O(1) to O(5).
LOW_PRECISION_TOL = {torch.bfloat16: dict(value=1.5e-2, grad=2e-2), torch.float16: dict(value=2e-3, grad=2e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_matches_float64_reference(dtype):
    hidden, weight, targets, _ = make(40, 300, 32, dtype)
    kw = dict(temperature=0.9, chunk_size=16, vocab_chunk_size=64)  # several token chunks: grad_w summed
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, **kw).logp, hidden, weight)
    naive_low = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, temperature=0.9), hidden, weight)
    exact = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, temperature=0.9), *upcast(hidden, weight))
    assert fused[0].dtype == torch.float32 and [g.dtype for g in fused[1]] == [dtype, dtype]
    tol = LOW_PRECISION_TOL[dtype]
    for got in (fused, naive_low):  # the tolerance is one the naive computation also meets
        assert_close(got[0].double(), exact[0], rtol=0, atol=tol["value"])
        for g, ref in zip(got[1], exact[1]):
            assert (g.double() - ref).abs().max() <= tol["grad"] * ref.abs().max()


def test_bias_matches_naive():
    hidden, weight, targets, bias = make(13, 41, 8, bias=True)
    kw = dict(chunk_size=5, vocab_chunk_size=9)
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, bias=b, **kw).logp, hidden, weight, bias)
    naive = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, b), hidden, weight, bias)
    assert_close(fused, naive)


def test_minus_inf_bias_masks_vocabulary_rows():
    hidden, weight, targets, _ = make(6, 24, 8, torch.float64)
    bias = torch.zeros(24, dtype=torch.float64)
    bias[8:16] = -math.inf  # one whole vocab chunk below, plus a stray entry
    bias[3] = -math.inf
    targets = targets.remainder(8).clamp(min=4)
    out = fused_logprobs(hidden, weight, targets, bias=bias, with_entropy=True, vocab_chunk_size=8)
    probs = torch.softmax(naive_logits(hidden, weight, bias).detach(), -1)
    assert_close(out.entropy, torch.special.entr(probs).sum(-1))
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, bias=bias, vocab_chunk_size=8).logp,
                            hidden, weight)
    naive = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, bias), hidden, weight)
    assert_close(fused, naive)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_confident_tokens(dtype):
    # p_target in [0.977, 0.9996]: the gradient scales with 1 - p_target, which the kernel forms in float32
    # (rounding p_target to bf16 first would leave an error of ~2e-3 against 1 - p of ~4e-4).
    hidden, weight, _, _ = make(16, 300, 32, dtype)
    bias = torch.zeros(300, dtype=dtype)
    bias[5] = 12.0
    targets = torch.full((16,), 5)
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, bias=bias, vocab_chunk_size=64).logp,
                            hidden, weight)
    exact = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, bias.double()), *upcast(hidden, weight))
    row_error = (fused[1][0].double() - exact[1][0]).norm(dim=1) / exact[1][0].norm(dim=1)
    # Measured: bf16 0.030 (the naive one-liner: 0.029), fp16 0.0035 (naive: 0.0084); the bf16 logits' own
    # rounding sets these. A kernel that lost 1 - p_target would be off by more than 100% here.
    assert row_error.max() <= {torch.bfloat16: 0.06, torch.float16: 0.01}[dtype]


@pytest.mark.parametrize("temperature", [1.0, 0.8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cache_bytes_gives_the_same_result(dtype, temperature):
    hidden, weight, targets, bias = make(21, 50, 8, dtype, bias=True)
    bias = bias.detach().clone()
    bias[16:32] = -math.inf  # one whole chunk masked
    targets = targets.remainder(16)
    topk_ids = torch.randint(0, 50, (21, 3), generator=torch.Generator().manual_seed(5))
    kw = dict(bias=bias, topk_ids=topk_ids, with_entropy=True, temperature=temperature, chunk_size=8,
              vocab_chunk_size=16)
    two_tiles = 2 * 8 * 16 * dtype.itemsize  # of the 3 x 4 tiles
    outs, grads = [], []
    for cache_bytes in (0, two_tiles, 1 << 30):
        out = fused_logprobs(hidden, weight, targets, cache_bytes=cache_bytes, **kw)
        outs.append(out)
        grads.append(torch.autograd.grad((out.logp * torch.linspace(-1, 2, 21, dtype=out.logp.dtype)).sum(),
                                         [hidden, weight]))
    assert torch.isfinite(outs[0].logp).all() and torch.isfinite(outs[0].entropy).all()
    # Kept tiles take their softmax from the forward's float32 log_softmax, recomputed ones from softmax
    # in the input dtype: identical up to that dtype's rounding of the tile.
    tol = dict(rtol=2e-2, atol=1e-3) if dtype == torch.bfloat16 else {}
    for out, grad in zip(outs[1:], grads[1:]):
        assert_close(tuple(out), tuple(outs[0]), rtol=0, atol=0)
        assert_close(grad, grads[0], **tol)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_topk_and_entropy_match_plain_helpers_and_are_detached(temperature):
    hidden, weight, targets, _ = make(19, 70, 10)
    topk_ids = torch.randint(0, 70, (19, 5), generator=torch.Generator().manual_seed(3))
    out = fused_logprobs(hidden, weight, targets, topk_ids=topk_ids, with_entropy=True, temperature=temperature,
                         chunk_size=6, vocab_chunk_size=16)
    assert isinstance(out, FusedLogprobs)
    logits = (hidden @ weight.T).detach()
    assert_close(out.topk_logp, gather_logprobs_from_logits(logits, topk_ids, temperature=temperature))
    assert_close(out.entropy, entropy_from_logits(logits, temperature=temperature))
    assert out.logp.requires_grad and not out.topk_logp.requires_grad and not out.entropy.requires_grad
    plain = fused_logprobs(hidden, weight, targets, temperature=temperature)
    assert plain.topk_logp is None and plain.entropy is None


def test_extras_leave_gradients_unchanged():
    hidden, weight, targets, _ = make(15, 40, 8)
    topk_ids = torch.randint(0, 40, (15, 3), generator=torch.Generator().manual_seed(4))
    kw = dict(chunk_size=4, vocab_chunk_size=16)
    plain = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, **kw).logp, hidden, weight)
    extras = value_and_grads(lambda h, w, b: fused_logprobs(
        h, w, targets, topk_ids=topk_ids, with_entropy=True, **kw).logp, hidden, weight)
    assert_close(extras, plain, rtol=0, atol=0)


@pytest.mark.parametrize("vocab_chunk_size", [None, 32768])  # one vocab chunk; five, the last partial
def test_large_vocabulary_few_tokens(vocab_chunk_size):
    hidden, weight, targets, _ = make(8, 151_936, 64)
    topk_ids = torch.tensor([[0, 151_935]] * 8)
    fused = value_and_grads(lambda h, w, b: fused_logprobs(
        h, w, targets, vocab_chunk_size=vocab_chunk_size, topk_ids=topk_ids).logp, hidden, weight)
    naive = value_and_grads(lambda h, w, b: naive_logp(h, w, targets), hidden, weight)
    assert_close(fused, naive)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 12), v=st.integers(1, 40), h=st.integers(1, 8),
    chunk_size=st.integers(1, 15), vocab_chunk_size=st.integers(1, 50),
    temperature=st.floats(0.25, 4.0), seed=st.integers(0, 2**16),
)
def test_property_random_shapes_and_chunks(n, v, h, chunk_size, vocab_chunk_size, temperature, seed):
    hidden, weight, targets, _ = make(n, v, h, torch.float64, seed=seed)
    kw = dict(temperature=temperature, chunk_size=chunk_size, vocab_chunk_size=vocab_chunk_size)
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets, **kw).logp, hidden, weight)
    naive = value_and_grads(lambda h, w, b: naive_logp(h, w, targets, temperature=temperature), hidden, weight)
    assert_close(fused, naive, rtol=1e-10, atol=1e-10)


# --- edge cases ----------------------------------------------------------------------------------------------


def test_zero_tokens():
    hidden, weight, targets, _ = make(0, 30, 8)
    out = fused_logprobs(hidden, weight, targets, topk_ids=torch.zeros(0, 4, dtype=torch.long), with_entropy=True)
    assert out.logp.shape == (0,) and out.topk_logp.shape == (0, 4) and out.entropy.shape == (0,)
    grad_h, grad_w = torch.autograd.grad(out.logp.sum(), [hidden, weight])
    assert grad_h.shape == (0, 8) and torch.equal(grad_w, torch.zeros_like(weight))


def test_inputs_without_grad_and_no_grad_mode():
    hidden, weight, targets, _ = make(10, 20, 6)
    h, w = hidden.detach(), weight.detach()
    assert not fused_logprobs(h, w, targets).logp.requires_grad
    with torch.no_grad():
        assert not fused_logprobs(hidden, weight, targets).logp.requires_grad
    ref_h, ref_w = torch.autograd.grad(naive_logp(hidden, weight, targets).sum(), [hidden, weight])
    only_h = fused_logprobs(hidden, w, targets, chunk_size=3, vocab_chunk_size=7).logp.sum()
    assert_close(torch.autograd.grad(only_h, hidden)[0], ref_h)
    only_w = fused_logprobs(h, weight, targets, chunk_size=3, vocab_chunk_size=7).logp.sum()
    assert_close(torch.autograd.grad(only_w, weight)[0], ref_w)


def test_non_contiguous_inputs():
    hidden, weight, targets, _ = make(9, 50, 16)
    h_t = hidden.detach().T.contiguous().requires_grad_()  # [16, 9] storage, used as its [9, 16] transpose
    w_t = weight.detach().T.contiguous().requires_grad_()
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h.T, w.T, targets, chunk_size=4, vocab_chunk_size=16).logp,
                            h_t, w_t)
    naive = value_and_grads(lambda h, w, b: naive_logp(h.T, w.T, targets), h_t, w_t)
    assert_close(fused, naive)


def _bad(name):
    """Good arguments with one replaced: name -> (kwargs, argument the error must name)."""
    hidden, weight, targets, _ = make(4, 10, 3)
    good = dict(hidden=hidden, weight=weight, targets=targets)
    cases = {
        "hidden 1-D": ("hidden", dict(hidden=hidden[0])),
        "hidden int": ("hidden", dict(hidden=hidden.long())),
        "weight width": ("weight", dict(weight=weight[:, :2])),
        "weight dtype": ("weight", dict(weight=weight.double())),
        "weight device": ("weight", dict(weight=weight.to("meta"))),
        "targets shape": ("targets", dict(targets=targets[:3])),
        "targets dtype": ("targets", dict(targets=targets.int())),
        "targets too big": ("targets", dict(targets=torch.tensor([0, 1, 2, 10]))),
        "targets negative": ("targets", dict(targets=torch.tensor([0, -1, 2, 3]))),
        "topk shape": ("topk_ids", dict(topk_ids=torch.zeros(3, 2, dtype=torch.long))),
        "topk 1-D": ("topk_ids", dict(topk_ids=torch.zeros(4, dtype=torch.long))),
        "topk range": ("topk_ids", dict(topk_ids=torch.full((4, 2), 10))),
        "bias shape": ("bias", dict(bias=torch.zeros(9))),
        "bias dtype": ("bias", dict(bias=torch.zeros(10, dtype=torch.float64))),
        "temperature zero": ("temperature", dict(temperature=0.0)),
        "temperature negative": ("temperature", dict(temperature=-1.0)),
        "temperature nan": ("temperature", dict(temperature=float("nan"))),
        "temperature inf": ("temperature", dict(temperature=math.inf)),
        "chunk_size zero": ("chunk_size", dict(chunk_size=0)),
        "vocab_chunk_size float": ("vocab_chunk_size", dict(vocab_chunk_size=2.0)),
        "cache_bytes negative": ("cache_bytes", dict(cache_bytes=-1)),
    }
    arg, change = cases[name]
    return {**good, **change}, arg


BAD_CASES = ["hidden 1-D", "hidden int", "weight width", "weight dtype", "weight device", "targets shape",
             "targets dtype", "targets too big", "targets negative", "topk shape", "topk 1-D", "topk range",
             "bias shape", "bias dtype", "temperature zero", "temperature negative", "temperature nan",
             "temperature inf", "chunk_size zero", "vocab_chunk_size float", "cache_bytes negative"]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise_value_error_naming_the_argument(case):
    kwargs, arg = _bad(case)
    with pytest.raises(ValueError, match=f"^{arg}: expected"):
        fused_logprobs(kwargs.pop("hidden"), kwargs.pop("weight"), kwargs.pop("targets"), **kwargs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_matches_cpu_float64(dtype):
    hidden, weight, targets, _ = make(64, 5000, 64, dtype)
    cuda = [t.detach().cuda() for t in (hidden, weight)]
    fused = value_and_grads(lambda h, w, b: fused_logprobs(h, w, targets.cuda(), vocab_chunk_size=1024).logp, *cuda)
    exact = value_and_grads(lambda h, w, b: naive_logp(h, w, targets), *upcast(hidden, weight))
    tol = dict(value=1e-4, grad=1e-4) if dtype == torch.float32 else LOW_PRECISION_TOL[dtype]
    assert_close(fused[0].cpu().double(), exact[0], rtol=0, atol=tol["value"])
    for g, ref in zip(fused[1], exact[1]):
        assert (g.cpu().double() - ref).abs().max() <= tol["grad"] * ref.abs().max()
