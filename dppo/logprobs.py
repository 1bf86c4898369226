"""Log-probabilities of sampled tokens without materialising float32 [N, V] tensors.

Plain helpers (`logprobs_from_logits`, `topk_logprobs_from_logits`, `entropy_from_logits`) are used by the
engines on logits they already hold; `fused_logprobs` (lm-head + log-softmax + gather, chunked, recomputed
in backward) is what the trainer uses. The naive spec every helper matches is
`torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids)`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def logprobs_from_logits(logits: Tensor, ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[..., ids] computed in float32.

    logits [..., V], ids [...] (one id per row) -> [...] float32.
    Equivalent to `torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids[..., None])[..., 0]`
    but only the gathered value and a logsumexp are formed in float32.
    """
    if ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids: expected shape {tuple(logits.shape[:-1])}, got {tuple(ids.shape)}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    picked = scaled.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)


def gather_logprobs_from_logits(logits: Tensor, ids: Tensor, *, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature) at several ids per row: logits [..., V], ids [..., S] -> [..., S]."""
    if ids.shape[:-1] != logits.shape[:-1]:
        raise ValueError(f"ids: expected leading shape {tuple(logits.shape[:-1])}, got {tuple(ids.shape)}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    return scaled.gather(-1, ids) - torch.logsumexp(scaled, dim=-1, keepdim=True)


def topk_logprobs_from_logits(logits: Tensor, k: int, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The k most likely ids of softmax(logits / temperature) and their log-probs, sorted descending.

    logits [..., V] -> (ids [..., k] int64, logp [..., k] float32).
    """
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"k: expected 1 <= k <= vocab size {logits.shape[-1]}, got {k}")
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    values, ids = scaled.topk(k, dim=-1, sorted=True)
    return ids, values - torch.logsumexp(scaled, dim=-1, keepdim=True)


def entropy_from_logits(logits: Tensor, *, temperature: float = 1.0) -> Tensor:
    """Entropy of softmax(logits / temperature) in float32: logits [..., V] -> [...]."""
    scaled = logits.float() / temperature if temperature != 1.0 else logits.float()
    logp = torch.log_softmax(scaled, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# --------------------------------------------------------------------------------------------------
# Fused lm-head + log-softmax + gather.
# --------------------------------------------------------------------------------------------------

_TILE_ELEMENTS = 1 << 23
"""Logits per (token chunk x vocabulary chunk) tile: 8M, i.e. 32 MB in float32."""
_DEFAULT_CHUNK_SIZE = 4096
"""Tokens per chunk when `chunk_size` is None."""
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class FusedLogprobs(NamedTuple):
    """What `fused_logprobs` returns. N = tokens, S = ids per token asked for in `topk_ids`."""

    logp: Tensor
    """[N] log-prob of each target; float32 (float64 for float64 inputs). Differentiable w.r.t. hidden/weight."""
    topk_logp: Tensor | None
    """[N, S] log-probs at `topk_ids`, same dtype as logp, detached; None when topk_ids is None."""
    entropy: Tensor | None
    """[N] entropy of each token's distribution, same dtype as logp, detached; None unless with_entropy."""


def fused_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    topk_ids: Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int | None = None,
    vocab_chunk_size: int | None = None,
) -> FusedLogprobs:
    """log softmax((hidden @ weight.T + bias) / temperature) at `targets`, without an [N, V] tensor.

    hidden [N, H], weight [V, H], bias [V] or None, targets [N] int64, topk_ids [N, S] int64 or None.
    Matches `torch.log_softmax((hidden @ weight.T).float() / temperature, -1).gather(-1, targets[:, None])`
    (values and gradients), but works tile by tile: `chunk_size` tokens (default 4096) by
    `vocab_chunk_size` vocabulary rows (default: about 8M logits per tile). The forward keeps one float
    logsumexp per token; the backward recomputes each tile's logits (one extra lm-head matmul in all).

    Dtypes: float32 and float64 are computed in their own precision; bfloat16/float16 do the matmuls in
    that dtype and the softmax, logsumexp and gradient accumulation in float32. `logp` is float32, or
    float64 for float64 inputs. Gradients reach hidden, weight and bias through `logp` only;
    `topk_logp` and `entropy` are detached. Raises ValueError naming the argument on bad input (the range
    check of ids reads one boolean back from the device).
    """
    n_tokens, vocab = _validate(hidden, weight, targets, bias, topk_ids, temperature, chunk_size,
                                vocab_chunk_size)
    token_chunk = min(max(n_tokens, 1), chunk_size or _DEFAULT_CHUNK_SIZE)
    if vocab_chunk_size is None:
        vocab_chunk_size = max(128, _TILE_ELEMENTS // token_chunk // 128 * 128)
    vocab_chunk = min(vocab, vocab_chunk_size)
    logp, topk_logp, entropy = _FusedLogprobsFn.apply(
        hidden, weight, bias, targets, topk_ids, float(temperature), bool(with_entropy), token_chunk,
        vocab_chunk)
    return FusedLogprobs(logp, topk_logp, entropy)


def _validate(hidden, weight, targets, bias, topk_ids, temperature, chunk_size, vocab_chunk_size):
    """Check every argument of `fused_logprobs`; return (N, V)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D tensor [N, H], got shape {tuple(hidden.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden: expected dtype float32, bfloat16, float16 or float64, got {hidden.dtype}")
    n_tokens, width = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != width or weight.shape[0] == 0:
        raise ValueError(f"weight: expected shape [V, {width}] with V >= 1, got {tuple(weight.shape)}")
    vocab = weight.shape[0]
    _check_like("weight", weight, hidden.dtype, hidden.device, "hidden")
    _check_ids("targets", targets, (n_tokens,), "[N]", vocab, hidden.device)
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (vocab,):
            shape = tuple(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"bias: expected a tensor of shape [{vocab}] (V) or None, got {shape}")
        _check_like("bias", bias, hidden.dtype, hidden.device, "hidden")
    if topk_ids is not None:
        if not isinstance(topk_ids, Tensor) or topk_ids.dim() != 2:
            shape = tuple(topk_ids.shape) if isinstance(topk_ids, Tensor) else type(topk_ids).__name__
            raise ValueError(f"topk_ids: expected a 2-D tensor [N, S] or None, got {shape}")
        _check_ids("topk_ids", topk_ids, (n_tokens, topk_ids.shape[1]), "[N, S]", vocab, hidden.device)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            0 < temperature < math.inf):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name}: expected a positive int or None, got {size!r}")
    return n_tokens, vocab


def _check_like(name: str, t: Tensor, dtype: torch.dtype, device: torch.device, other: str) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (same as {other}), got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (same as {other}), got {t.device}")


def _check_ids(name: str, ids: Tensor, shape: tuple, shape_doc: str, vocab: int, device) -> None:
    if ids.shape != shape:
        raise ValueError(f"{name}: expected shape {shape_doc} = {list(shape)}, got {list(ids.shape)}")
    if ids.dtype != torch.int64:
        raise ValueError(f"{name}: expected dtype torch.int64, got {ids.dtype}")
    if ids.device != device:
        raise ValueError(f"{name}: expected device {device} (same as hidden), got {ids.device}")
    if ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"{name}: expected ids in [0, {vocab}) (V = weight.shape[0]), got min "
                         f"{int(ids.min())}, max {int(ids.max())}")


def _tile_logits(h: Tensor, w: Tensor, b: Tensor | None, temperature: float, acc: torch.dtype) -> Tensor:
    """(h @ w.T + b) / temperature as a fresh [T, Vc] tensor of dtype `acc` (matmul in h's dtype)."""
    z = h @ w.T if b is None else torch.addmm(b, h, w.T)
    if z.dtype != acc:
        z = z.to(acc)
    return z.div_(temperature) if temperature != 1.0 else z


def _gather_in_chunk(z: Tensor, ids: Tensor, start: int, out: Tensor) -> None:
    """out[i, j] = z[i, ids[i, j] - start] where that id lies in this vocabulary chunk (no host sync)."""
    local = ids - start
    inside = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp_(0, z.shape[1] - 1))
    out.copy_(torch.where(inside, picked, out))


class _FusedLogprobsFn(torch.autograd.Function):
    """Tiles: outer loop over vocabulary chunks (each weight row read once), inner over token chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, topk_ids, temperature, with_entropy, token_chunk,
                vocab_chunk):
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        starts = range(0, vocab, vocab_chunk)
        lse_parts = hidden.new_empty(n_tokens, len(starts), dtype=acc)  # logsumexp of each vocab chunk
        mean_parts = torch.empty_like(lse_parts) if with_entropy else None  # E[z] under each chunk's softmax
        picked = hidden.new_zeros(n_tokens, 1, dtype=acc)
        topk = hidden.new_zeros(topk_ids.shape, dtype=acc) if topk_ids is not None else None
        for c, v0 in enumerate(starts):
            w_c = weight[v0:v0 + vocab_chunk]
            b_c = bias[v0:v0 + vocab_chunk] if bias is not None else None
            for t0 in range(0, n_tokens, token_chunk):
                rows = slice(t0, t0 + token_chunk)
                z = _tile_logits(hidden[rows], w_c, b_c, temperature, acc)
                _gather_in_chunk(z, targets[rows, None], v0, picked[rows])
                if topk is not None:
                    _gather_in_chunk(z, topk_ids[rows], v0, topk[rows])
                top = z.amax(1, keepdim=True)
                top.masked_fill_(top == -math.inf, 0.0)  # a chunk of -inf logits (bias): exp -> 0, not nan
                e = torch.sub(z, top).exp_() if with_entropy else z.sub_(top).exp_()
                total = e.sum(1, keepdim=True)
                lse_parts[rows, c] = (top + total.log()).squeeze(1)
                if with_entropy:
                    mean_parts[rows, c] = (e.mul_(z).sum(1, keepdim=True) / total).squeeze(1)
        lse = torch.logsumexp(lse_parts, dim=1)
        logp = picked.squeeze(1) - lse
        topk_logp = topk - lse[:, None] if topk is not None else None
        entropy = None
        if with_entropy:
            entropy = lse - ((lse_parts - lse[:, None]).exp_() * mean_parts).sum(1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.temperature, ctx.token_chunk, ctx.vocab_chunk = temperature, token_chunk, vocab_chunk
        ctx.mark_non_differentiable(*(t for t in (topk_logp, entropy) if t is not None))
        return logp, topk_logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_topk, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, token_chunk, vocab_chunk = ctx.temperature, ctx.token_chunk, ctx.vocab_chunk
        n_tokens, vocab = hidden.shape[0], weight.shape[0]
        low = hidden.dtype  # matmul dtype
        acc = lse.dtype
        # d logp / d z = (onehot - p) / temperature. Write x = p - onehot and s = -grad / temperature:
        # grad_z = s * x, so grad_h = s * (x @ W) (scale after the matmul) and grad_W = x.T @ (s * h).
        neg_s = grad_logp.to(acc) / -temperature
        scaled_h = (hidden.to(acc) * neg_s[:, None]).to(low) if need_w else None
        grad_h_acc = hidden.new_zeros(n_tokens, hidden.shape[1], dtype=acc) if need_h else None
        grad_w = torch.empty_like(weight) if need_w else None
        grad_b = hidden.new_empty(vocab, dtype=acc) if need_b else None
        one_block = n_tokens <= token_chunk
        for v0 in range(0, vocab, vocab_chunk):
            cols = slice(v0, v0 + vocab_chunk)
            w_c = weight[cols]
            b_c = bias[cols] if bias is not None else None
            gw_acc = None if (one_block or not need_w) else w_c.new_zeros(w_c.shape, dtype=acc)
            if need_b:
                grad_b[cols] = 0.0
            for t0 in range(0, max(n_tokens, 1), token_chunk):
                rows = slice(t0, t0 + token_chunk)
                x = _tile_logits(hidden[rows], w_c, b_c, temperature, acc)
                x.sub_(lse[rows, None]).exp_()  # softmax probabilities p of this tile
                local = targets[rows, None] - v0
                inside = (local >= 0) & (local < x.shape[1])
                x.scatter_add_(1, local.clamp_(0, x.shape[1] - 1), -inside.to(acc))  # p - onehot
                if need_b:
                    grad_b[cols] += neg_s[rows] @ x
                x = x.to(low)
                if need_h:
                    if low == acc:
                        grad_h_acc[rows].addmm_(x, w_c)
                    else:
                        grad_h_acc[rows] += x @ w_c
                if need_w:
                    if one_block:
                        torch.mm(x.T, scaled_h[rows], out=grad_w[cols])
                    elif low == acc:
                        gw_acc.addmm_(x.T, scaled_h[rows])
                    else:
                        gw_acc += x.T @ scaled_h[rows]
            if gw_acc is not None:
                grad_w[cols] = gw_acc
        grad_h = grad_h_acc.mul_(neg_s[:, None]).to(low) if need_h else None
        grad_b = grad_b.to(low) if need_b else None
        return grad_h, grad_w, grad_b, None, None, None, None, None, None
