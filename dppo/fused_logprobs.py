"""Fused lm-head + log-softmax + gather: sampled-token log-probs with gradients, no [N, V] tensor.

The trainer needs log π(a_t|s_t) for every response token, differentiable w.r.t. the last hidden states and
the lm-head. The naive spec this matches (values and gradients), for hidden [N, H], weight [V, H]:

    logp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1).gather(-1, targets[:, None])[:, 0]

At V = 152k and N = 4096 that holds 2.4 GB of float32 logits plus as much again for log_softmax's output
and its gradient. Here a custom autograd Function works on (token chunk x vocabulary chunk) tiles of
~16M logits, reusing two tile buffers: the forward keeps one logsumexp per token and chunk, the backward
recomputes each tile's logits (one more lm-head matmul: four in all against the naive three; `cache_bytes`
lets the forward keep some tiles instead). Top-K log-probs and the entropy come out of the same pass.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

_TILE_ELEMENTS = 1 << 24
"""Default logits per tile: 16M (64 MB in float32), so that matmuls stay large and the per-tile
[T, H] work small next to them, while the tile buffers stay a small part of the naive footprint."""
_DEFAULT_CHUNK_SIZE = 4096
"""Tokens per tile when `chunk_size` is None."""
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class FusedLogprobs(NamedTuple):
    """What `fused_logprobs` returns. N = tokens, S = ids per token asked for in `topk_ids`."""

    logp: Tensor
    """[N] log-prob of each target; float32 (float64 for float64 inputs). Differentiable w.r.t. hidden,
    weight and bias."""
    topk_logp: Tensor | None
    """[N, S] log-probs at `topk_ids`, dtype of logp, detached; None when topk_ids is None."""
    entropy: Tensor | None
    """[N] entropy of each token's distribution, dtype of logp, detached; None unless with_entropy."""


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
    cache_bytes: int = 0,
) -> FusedLogprobs:
    """log softmax((hidden @ weight.T + bias) / temperature) at `targets` (and `topk_ids`), tile by tile.

    hidden [N, H], weight [V, H] (the lm-head), bias [V] or None, targets [N] int64, topk_ids [N, S] int64
    or None. A tile is `chunk_size` tokens (default 4096) by `vocab_chunk_size` vocabulary rows (default
    16M logits / token chunk, a multiple of 128). `cache_bytes` (default 0): memory the forward may spend
    keeping tiles' softmax for the backward, each kept tile sparing one tile matmul; 0 recomputes all.

    Dtypes: float32 and float64 are computed in their own precision and logp has that dtype (float64 in,
    float64 out). bfloat16/float16 do the matmuls in that dtype (as the naive spec does) and the softmax,
    logsumexp and gradient sums in float32; logp is float32; gradients have the inputs' dtypes.
    Gradients reach hidden, weight and bias through `logp` only; `topk_logp` and `entropy` are detached.
    Raises ValueError naming the argument on bad input (the id range check reads one bool from the device).
    """
    n_tokens, vocab = _validate(hidden, weight, targets, bias, topk_ids, temperature, chunk_size,
                                vocab_chunk_size, cache_bytes)
    token_chunk = min(max(n_tokens, 1), chunk_size or _DEFAULT_CHUNK_SIZE)
    if vocab_chunk_size is None:
        vocab_chunk_size = max(128, _TILE_ELEMENTS // token_chunk // 128 * 128)
    vocab_chunk = min(vocab, vocab_chunk_size)
    logp, topk_logp, entropy = _FusedLogprobsFn.apply(
        hidden, weight, bias, targets, topk_ids, float(temperature), bool(with_entropy), token_chunk,
        vocab_chunk, int(cache_bytes))
    return FusedLogprobs(logp, topk_logp, entropy)


def _validate(hidden, weight, targets, bias, topk_ids, temperature, chunk_size, vocab_chunk_size,
              cache_bytes) -> tuple[int, int]:
    """Check every argument of `fused_logprobs`; return (N, V)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 2:
        raise ValueError(f"hidden: expected a 2-D tensor [N, H], got shape {list(hidden.shape)}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"hidden: expected dtype float32, bfloat16, float16 or float64, got {hidden.dtype}")
    n_tokens, width = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != width or weight.shape[0] == 0:
        raise ValueError(f"weight: expected shape [V, H] = [V >= 1, {width}], got {list(weight.shape)}")
    vocab = weight.shape[0]
    _check_like("weight", weight, hidden)
    _check_ids("targets", targets, (n_tokens,), "[N]", vocab, hidden.device)
    if bias is not None:
        if not isinstance(bias, Tensor) or bias.shape != (vocab,):
            got = list(bias.shape) if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"bias: expected None or a tensor of shape [V] = [{vocab}], got {got}")
        _check_like("bias", bias, hidden)
    if topk_ids is not None:
        if not isinstance(topk_ids, Tensor) or topk_ids.dim() != 2:
            got = list(topk_ids.shape) if isinstance(topk_ids, Tensor) else type(topk_ids).__name__
            raise ValueError(f"topk_ids: expected None or a 2-D tensor [N, S], got {got}")
        _check_ids("topk_ids", topk_ids, (n_tokens, topk_ids.shape[1]), "[N, S]", vocab, hidden.device)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            0 < temperature < math.inf):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    for name, size in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name}: expected None or an int >= 1, got {size!r}")
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ValueError(f"cache_bytes: expected an int >= 0, got {cache_bytes!r}")
    return n_tokens, vocab


def _check_like(name: str, t: Tensor, hidden: Tensor) -> None:
    if t.dtype != hidden.dtype:
        raise ValueError(f"{name}: expected dtype {hidden.dtype} (that of hidden), got {t.dtype}")
    if t.device != hidden.device:
        raise ValueError(f"{name}: expected device {hidden.device} (that of hidden), got {t.device}")


def _check_ids(name: str, ids: Tensor, shape: tuple, shape_doc: str, vocab: int, device) -> None:
    if not isinstance(ids, Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(ids).__name__}")
    if ids.shape != shape:
        raise ValueError(f"{name}: expected shape {shape_doc} = {list(shape)}, got {list(ids.shape)}")
    if ids.dtype != torch.int64:
        raise ValueError(f"{name}: expected dtype torch.int64, got {ids.dtype}")
    if ids.device != device:
        raise ValueError(f"{name}: expected device {device} (that of hidden), got {ids.device}")
    if ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"{name}: expected ids in [0, V) = [0, {vocab}), got min {int(ids.min())}, "
                         f"max {int(ids.max())}")


class _Tiles:
    """Tile buffers reused through one pass (a fresh 64 MB tensor per tile would cost page faults).

    `low` receives the matmul (input dtype); `acc` is the float32 copy that a bfloat16/float16 tile is
    widened into when float32 math is needed (for float32/float64 inputs it is the same buffer). Each has
    one spare slot past the largest tile, see `zero_targets`.
    """

    def __init__(self, hidden: Tensor, token_chunk: int, vocab_chunk: int, acc: torch.dtype, widen: bool):
        size = min(hidden.shape[0], token_chunk) * vocab_chunk + 1
        self.low = hidden.new_empty(size)
        self.acc = hidden.new_empty(size, dtype=acc) if widen and acc != hidden.dtype else self.low

    def matmul(self, h: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
        """h @ w.T + b: [T, Vc] in h's dtype."""
        z = self.low[: h.shape[0] * w.shape[0]].view(h.shape[0], w.shape[0])
        return torch.mm(h, w.T, out=z) if b is None else torch.addmm(b, h, w.T, out=z)

    def widen(self, z: Tensor, temperature: float) -> Tensor:
        """z / temperature in the acc dtype (in place when z already has it)."""
        f = z if self.acc is self.low else self.acc[: z.numel()].view(z.shape).copy_(z)
        return f.div_(temperature) if temperature != 1.0 else f

    def zero_targets(self, x: Tensor, targets: Tensor, start: int) -> None:
        """x[i, targets[i] - start] = 0 where that id lies in this chunk (x: a tile of `low` or `acc`).

        Rows whose target lies in another chunk write the spare slot instead: no host sync, and a flat
        index_fill_ (scatter_ into a bfloat16 tile is ~1000x slower on CPU).
        """
        buf = self.low if x.dtype == self.low.dtype else self.acc
        local = targets - start
        flat = torch.arange(x.shape[0], device=x.device) * x.shape[1] + local
        inside = (local >= 0) & (local < x.shape[1])
        buf.index_fill_(0, torch.where(inside, flat, buf.numel() - 1), 0)


def _gather_in_chunk(f: Tensor, ids: Tensor, start: int, out: Tensor) -> None:
    """out[i, j] = f[i, ids[i, j] - start] where that id lies in this vocabulary chunk (no host sync)."""
    local = ids - start
    inside = (local >= 0) & (local < f.shape[1])
    picked = f.gather(1, local.clamp_(0, f.shape[1] - 1))
    out.copy_(torch.where(inside, picked, out))


class _FusedLogprobsFn(torch.autograd.Function):
    """Outer loop over vocabulary chunks (each weight row read once), inner over token chunks.

    Forward: log_softmax in place on each tile (a row-local kernel) gives the chunk's logsumexp lse_c;
    lse = logsumexp over chunks. Backward, with s = grad / temperature, p = softmax over the vocabulary:
    d logp / d z_v = s (onehot_v - p_v), and per chunk p = r q with q = softmax within the chunk (in place
    on the tile; for bf16/fp16 at temperature 1 directly in that dtype, float32 inside, rounded once) and
    r = exp(lse_c - lse) a per-row factor applied to the [T, H] matmul operands instead of the tile. The
    target column is zeroed in the tile and its term s (1 - p_target) added at the end in float32: exact
    even when p_target -> 1, where q_target rounded to bf16 would have lost 1 - p_target.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, topk_ids, temperature, with_entropy, token_chunk,
                vocab_chunk, cache_bytes):
        n_tokens, low = hidden.shape[0], hidden.dtype
        acc = torch.float64 if low == torch.float64 else torch.float32
        starts = range(0, weight.shape[0], vocab_chunk)
        tiles = _Tiles(hidden, token_chunk, vocab_chunk, acc, widen=True)
        lse_parts = hidden.new_empty(n_tokens, len(starts), dtype=acc)  # logsumexp within each chunk
        ent_parts = torch.empty_like(lse_parts) if with_entropy else None  # entropy within each chunk
        picked = hidden.new_zeros(n_tokens, 1, dtype=acc)
        topk = hidden.new_zeros(topk_ids.shape, dtype=acc) if topk_ids is not None else None
        cache, cache_left = {}, cache_bytes  # (chunk, first row) -> that tile's q, as the backward uses it
        for c, v0 in enumerate(starts):
            w_c = weight[v0:v0 + vocab_chunk]
            b_c = bias[v0:v0 + vocab_chunk] if bias is not None else None
            for t0 in range(0, n_tokens, token_chunk):
                rows = slice(t0, t0 + token_chunk)
                f = tiles.widen(tiles.matmul(hidden[rows], w_c, b_c), temperature)
                _gather_in_chunk(f, targets[rows, None], v0, picked[rows])
                if topk is not None:
                    _gather_in_chunk(f, topk_ids[rows], v0, topk[rows])
                top = f.amax(1, keepdim=True)
                torch._log_softmax(f, 1, False, out=f)  # in place
                # At the row's max, log_softmax = -log(sum exp(f - top)) exactly, so lse_c = top - max.
                lse_c = (top - f.amax(1, keepdim=True)).masked_fill_(top == -math.inf, -math.inf)
                lse_parts[rows, c] = lse_c.squeeze(1)
                if with_entropy:
                    p = f.exp()
                    ent_parts[rows, c] = torch.special.entr(p, out=p).sum(1)
                if f.numel() * low.itemsize <= cache_left:
                    cache_left -= f.numel() * low.itemsize
                    q = f.exp_()
                    if bias is not None:  # rows whose chunk is all -inf (masked by bias): q = nan, r = 0
                        q.masked_fill_(top == -math.inf, 0.0)
                    tiles.zero_targets(q, targets[rows], v0)
                    cache[c, t0] = q.to(low, copy=True)
        lse = torch.logsumexp(lse_parts, dim=1)
        logp = picked.squeeze(1) - lse
        topk_logp = topk - lse[:, None] if topk is not None else None
        entropy = None
        if with_entropy:  # mixture of the chunks: sum_c w_c (H_c + lse - lse_c), w_c = exp(lse_c - lse)
            shift = lse[:, None] - lse_parts
            entropy = ((-shift).exp() * (ent_parts + shift)).nan_to_num_(0.0).sum(1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse_parts, lse, logp)
        ctx.temperature, ctx.token_chunk, ctx.vocab_chunk, ctx.cache = (
            temperature, token_chunk, vocab_chunk, cache)
        ctx.mark_non_differentiable(*(t for t in (topk_logp, entropy) if t is not None))
        return logp, topk_logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, _grad_topk, _grad_entropy):
        hidden, weight, bias, targets, lse_parts, lse, logp = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, token_chunk, vocab_chunk = ctx.temperature, ctx.token_chunk, ctx.vocab_chunk
        n_tokens, width, low, acc = *hidden.shape, hidden.dtype, lse.dtype
        neg_s = grad_logp.to(acc) / -temperature
        ratio = (lse_parts - lse[:, None]).exp_()  # r, [N, chunks]
        widen = low != acc and temperature != 1.0  # bf16/fp16 at T != 1: divide and softmax in float32
        tiles = _Tiles(hidden, token_chunk, vocab_chunk, acc, widen)
        rows_max = min(n_tokens, token_chunk)
        grad_h = hidden.new_zeros(hidden.shape, dtype=acc) if need_h else None  # sum_c r (q @ W_c)
        part_h = hidden.new_empty(rows_max, width) if need_h else None
        part_h_acc = hidden.new_empty(rows_max, width, dtype=acc) if need_h and low != acc else None
        grad_w = weight.new_empty(weight.shape) if need_w else None  # contiguous, for mm(out=)
        scaled_h = hidden.new_empty(rows_max, width) if need_w else None
        one_block = n_tokens <= token_chunk  # else grad_w sums token chunks in acc dtype, rounds once
        part_w = weight.new_empty(vocab_chunk, width) if need_w and not one_block else None
        sum_w = weight.new_empty(vocab_chunk, width, dtype=acc) if need_w and not one_block else None
        grad_b = hidden.new_zeros(weight.shape[0], dtype=acc) if need_b else None
        for c, v0 in enumerate(range(0, weight.shape[0], vocab_chunk)):
            cols = slice(v0, v0 + vocab_chunk)
            w_c = weight[cols]
            gw = sum_w[: w_c.shape[0]].zero_() if sum_w is not None else None
            for t0 in range(0, max(n_tokens, 1), token_chunk):
                rows = slice(t0, t0 + token_chunk)
                x = ctx.cache.get((c, t0))
                if x is None:
                    x = _recompute_q(tiles, hidden[rows], w_c, bias, cols, temperature, widen,
                                     lse_parts[rows, c, None], targets[rows], v0)
                r = ratio[rows, c]
                if need_h:  # grad_h += r * (q @ W_c); times -s at the end
                    part = torch.mm(x, w_c, out=part_h[: x.shape[0]])
                    if part_h_acc is not None:
                        part = part_h_acc[: x.shape[0]].copy_(part)
                    grad_h[rows].addcmul_(part, r[:, None])
                rs = (r * neg_s[rows]).to(low)
                if need_w:  # grad_W_c += q.T @ (-s r h)
                    sh = torch.mul(hidden[rows], rs[:, None], out=scaled_h[: x.shape[0]])
                    if gw is None:
                        torch.mm(x.T, sh, out=grad_w[cols])
                    elif low == acc:
                        gw.addmm_(x.T, sh)
                    else:
                        gw += torch.mm(x.T, sh, out=part_w[: x.shape[1]])
                if need_b:
                    grad_b[cols] += rs @ x
            if gw is not None:
                grad_w[cols] = gw
        target_coef = neg_s * torch.expm1(logp.to(acc))  # the target column: s (1 - p_target)
        if need_h:
            grad_h = grad_h.mul_(neg_s[:, None]).addcmul_(weight[targets].to(acc), target_coef[:, None]).to(low)
        if need_w:
            grad_w.index_add_(0, targets, (hidden.to(acc) * target_coef[:, None]).to(low))
        if need_b:
            grad_b = grad_b.index_add_(0, targets, target_coef).to(low)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None, None


def _recompute_q(tiles: _Tiles, h: Tensor, w_c: Tensor, bias: Tensor | None, cols: slice, temperature: float,
                 widen: bool, lse_c: Tensor, targets: Tensor, start: int) -> Tensor:
    """The tile's softmax within its chunk, target column zeroed, in the matmul dtype."""
    z = tiles.matmul(h, w_c, bias[cols] if bias is not None else None)
    x = tiles.widen(z, temperature) if (widen or tiles.acc is tiles.low) else z
    torch._softmax(x, 1, False, out=x)  # in place
    if bias is not None:  # a chunk of -inf logits (masked by bias) has q = nan, and r = 0
        x.masked_fill_(lse_c == -math.inf, 0.0)
    tiles.zero_targets(x, targets, start)
    return x if x is z else z.copy_(x)
